"""Backend choice of :func:`kvmeans.ops.kvm.kvm_attention`: which implementation runs a checked call.

``backend="auto"`` takes the Triton kernels for CUDA tensors once they passed a one-time self-check for the
(device, dtype, numerics) (:mod:`kvmeans.ops.triton.selfcheck`; a novelty budget stays on the torch paths), then
``recurrent`` for a no-grad continuation of at most one chunk and ``chunked`` otherwise. A ragged state
(:mod:`kvmeans.ops.ragged`) takes the batched ragged decode for one token without autograd. Reference numerics
run their own implementation (:mod:`kvmeans.ops.reference_numerics`) whatever ``backend`` says.
"""
from __future__ import annotations

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.checks import HALF
from kvmeans.ops.chunk import chunk_kvm_attention
from kvmeans.ops.naive import naive_kvm_attention
from kvmeans.ops.ragged import ragged_kvm_attention
from kvmeans.ops.recurrent import recurrent_kvm_attention


def choose_implementation(backend, numerics, *, budget, state, q, compute, needs_grad, op):
    """``(impl, options)``: the implementation of a checked call and its extra keyword arguments (``attn``,
    ``mma_dtype``), or ``(None, {})`` for a ragged state that this call cannot advance in one batch (split it by
    position: :func:`kvmeans.ops.ragged.split_call`). ``q [B, H, T, D]`` as given, ``compute`` the dtype the call
    computes in, ``op`` the public op (the Triton self-check runs it)."""
    if is_data_dependent(budget) and backend != "triton":   # the kernels' self-check covers positional budgets only
        attn = "torch"
    else:
        attn, backend = kernels(backend, q.device, q.dtype, compute, numerics, op)
    T = q.shape[2]
    if state.schedule is not None:      # a ragged batch (rows at different positions)
        if T > 1 or needs_grad or numerics == "reference" or backend not in ("auto", "recurrent"):
            return None, {}
        backend = "ragged"
    if backend == "auto":
        backend = "recurrent" if (not needs_grad and state.seen_tokens > 0 and T <= state.chunk_len) else "chunked"
    if backend == "recurrent" and needs_grad and numerics != "reference":
        raise ValueError("backend='recurrent' is an inference path (in-place buffers, no autograd); use "
                         "backend='chunked' or call it under torch.no_grad()")
    options = {}
    if attn == "triton" and numerics != "reference":
        options["attn"] = attn
    if numerics == "mixed" and q.dtype in HALF and backend == "chunked":
        options["mma_dtype"] = q.dtype
    if numerics == "reference":
        from kvmeans.ops.reference_numerics import reference_kvm_attention
        return reference_kvm_attention, options
    impl = {"ragged": ragged_kvm_attention, "naive": naive_kvm_attention, "chunked": chunk_kvm_attention}
    return impl.get(backend, recurrent_kvm_attention), options


def kernels(backend, device, dtype, compute, numerics, op):
    """``(attn, backend)``: the attention kernels of the chunked / recurrent paths ("torch" or "triton") and the
    path still to choose. ``"auto"`` takes Triton on CUDA only once its self-check passed for
    ``(device, dtype, numerics)`` (the check runs ``op``); ``"triton"`` forces it (or says why it cannot run)."""
    if backend == "triton" or (backend == "auto" and device.type == "cuda" and numerics != "reference"):
        from kvmeans.ops.triton import unavailable_reason  # cheap: does not import triton
        why = unavailable_reason(device, compute)
        if why is None and backend == "auto":
            from kvmeans.ops.triton.selfcheck import triton_verified
            why = None if triton_verified(device, dtype, numerics, op) else "self-check failed"
        if why is None:
            return "triton", "auto"
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run here: {why}")
    return "torch", backend
