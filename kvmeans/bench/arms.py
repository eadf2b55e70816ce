"""The three benchmark arms and one timed measurement per mode.

Arms: ``sdpa`` (``F.scaled_dot_product_attention``, causal, full attention; GQA via ``enable_gqa``),
``kvm-fixed256`` (``StateBudget.fixed(256)``) and ``kvm-sqrt16`` (``StateBudget.power_law(16, 0.5, min_len=256)``).
The KVM arms run ``a.kvm_impl``: "auto" (the Triton kernels on CUDA when Triton is installed, the torch paths
otherwise), "triton" or "torch".
Tensors (``make_inputs``): ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``, ``g [B, Hkv, T]`` (``1 + elu(randn)``),
``dy [B, H, T, D]``, and one-token-per-step decode inputs ``qd [B, H, S, D]``, ``kd, vd [B, Hkv, S, D]``,
``gd [B, Hkv, S]`` (S = ``decode_steps``). ``a`` is the parsed config of :mod:`kvmeans.bench.ops`.
Each ``measure_*`` returns seconds: ``{"time": ...}`` plus mode-specific extras.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Dict

import torch
import torch.nn.functional as F

from kvmeans import StateBudget, kvm_attention
from kvmeans.ops import chunk
from kvmeans.ops.state import own_buffers

ARMS = ("sdpa", "kvm-fixed256", "kvm-sqrt16")
BUDGETS = {"kvm-fixed256": StateBudget.fixed(256), "kvm-sqrt16": StateBudget.power_law(16, 0.5, min_len=256)}
MODES = ("prefill", "backward", "decode")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def clock(dev: torch.device) -> float:
    """``time.perf_counter()`` after the device finished its queued work."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def sdpa(q, k, v, causal: bool):
    """Full attention ``[B, H, t, D]`` over ``k, v [B, Hkv, s, D]``."""
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:                      # torch < 2.5: repeat the kv heads
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=causal)


def kvm_backend(a, decode_step: bool) -> str:
    """``kvm_attention``'s backend for ``a.kvm_impl``: "auto" (Triton on CUDA when installed, torch otherwise),
    "triton", or "torch" (the chunked path, the recurrent one for decode steps)."""
    impl = getattr(a, "kvm_impl", "auto")
    if impl == "torch":
        return "recurrent" if decode_step else "chunked"
    return impl


def kvm(a, arm, q, k, v, g, backward=None, **kw):
    """``kvm_attention`` with the arm's budget, the geometry of ``a`` and its ``kvm_impl``; ``backward`` (under
    autograd) the chunked path's backward, ``kvmeans.ops.chunk.BACKWARD`` for this call."""
    if backward is not None:
        previous, chunk.BACKWARD = chunk.BACKWARD, backward
        try:
            return kvm(a, arm, q, k, v, g, **kw)
        finally:
            chunk.BACKWARD = previous
    backend = kvm_backend(a, kw.get("initial_state") is not None)
    return kvm_attention(q, k, v, g, chunk_len=a.chunk_len, n_bswa_chunks=a.n_bswa_chunks, sink_len=a.sink_len,
                         rope_dim=a.rope_dim, budget=BUDGETS[arm], backend=backend,
                         numerics=getattr(a, "numerics", "exact"), **kw)


def resolved_kvm_impl(a) -> str:
    """What the KVM arms run: "triton" or "torch"."""
    impl = getattr(a, "kvm_impl", "auto")
    if impl != "auto":
        return impl
    from kvmeans.ops.triton import available
    return "triton" if a.dev.type == "cuda" and available(a.dev, torch.float32) else "torch"


def make_inputs(a, T: int) -> SimpleNamespace:
    """q/k/v/g/dy for T tokens plus qd/kd/vd/gd for ``decode_steps`` more, on the device in ``a.dtype``."""
    dev, dt, B, H, Hkv, D, S = a.dev, DTYPES[a.dtype], a.batch, a.heads, a.kv_heads, a.head_dim, a.decode_steps
    torch.manual_seed(a.seed * 1_000_003 + T)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)
    gate = lambda n: 1 + F.elu(r(B, Hkv, n))
    return SimpleNamespace(q=r(B, H, T, D), k=r(B, Hkv, T, D), v=r(B, Hkv, T, D), g=gate(T), dy=r(B, H, T, D),
                           qd=r(B, H, S, D), kd=r(B, Hkv, S, D), vd=r(B, Hkv, S, D), gd=gate(S))


def measure_prefill(a, arm, x, ctx=None) -> Dict[str, float]:
    """Forward of T tokens under no_grad (KVM: ``return_state=False``)."""
    with torch.no_grad():
        t0 = clock(a.dev)
        sdpa(x.q, x.k, x.v, True) if arm == "sdpa" else kvm(a, arm, x.q, x.k, x.v, x.g)
        return {"time": clock(a.dev) - t0}


def saved_bytes(fn):
    """``(bytes, fn())``: what autograd keeps for backward while ``fn`` runs (distinct storages)."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(kept.values()), out


def measure_backward(a, arm, x, ctx=None) -> Dict[str, float]:
    """``(y * dy).sum().backward()`` alone (``time``); the forward with grad is ``fwd_grad``; ``saved_bytes``
    what autograd keeps for backward (distinct storages, the inputs q, k, v, g included when kept). KVM takes the
    chunked path's backward ``a.kvm_backward`` ("auto", "graph" or "reconstruct"; see :mod:`kvmeans.ops.chunk`)."""
    q, k, v, g = (t.detach().requires_grad_() for t in (x.q, x.k, x.v, x.g))
    mode = getattr(a, "kvm_backward", "auto")
    t0 = clock(a.dev)
    kept, y = saved_bytes(lambda: sdpa(q, k, v, True) if arm == "sdpa" else kvm(a, arm, q, k, v, g, backward=mode))
    t1 = clock(a.dev)
    loss = (y * x.dy).sum()
    t2 = clock(a.dev)
    loss.backward()
    return {"time": clock(a.dev) - t2, "fwd_grad": t1 - t0, "saved_bytes": float(kept)}


def prepare_decode(a, arm, x):
    """SDPA: a preallocated ``(k_cache, v_cache)`` [B, Hkv, T + steps, D] holding T keys; KVM: the state of T tokens."""
    T = x.k.shape[2]
    if arm == "sdpa":
        caches = [t.new_empty(*t.shape[:2], T + a.decode_steps, t.shape[3]) for t in (x.k, x.v)]
        caches[0][:, :, :T], caches[1][:, :, :T] = x.k, x.v
        return caches
    with torch.no_grad():
        return kvm(a, arm, x.q, x.k, x.v, x.g, return_state=True)[1]


def measure_decode(a, arm, x, ctx) -> Dict[str, float]:
    """``decode_steps`` one-token steps after ``ctx`` (from :func:`prepare_decode`): mean, median, max per step."""
    steps, out, T = [], {}, x.k.shape[2]
    with torch.no_grad():
        if arm == "sdpa":
            kc, vc = ctx
            for i in range(a.decode_steps):
                t0 = clock(a.dev)
                kc[:, :, T + i], vc[:, :, T + i] = x.kd[:, :, i], x.vd[:, :, i]
                sdpa(x.qd[:, :, i:i + 1], kc[:, :, :T + i + 1], vc[:, :, :T + i + 1], False)
                steps.append(clock(a.dev) - t0)
        else:
            state = ctx.clone()                # every repeat continues the same T-token state,
            own_buffers(state)                 # in buffers of its own, as the prefill left them
            for i in range(a.decode_steps):
                s = slice(i, i + 1)
                t0 = clock(a.dev)
                kvm(a, arm, x.qd[:, :, s], x.kd[:, :, s], x.vd[:, :, s], x.gd[:, :, s], initial_state=state)
                steps.append(clock(a.dev) - t0)
            out["state_bytes_decode"] = state.nbytes
    return {"time": statistics.fmean(steps), "step_median": statistics.median(steps), "step_max": max(steps), **out}


MEASURE = {"prefill": measure_prefill, "backward": measure_backward, "decode": measure_decode}


def is_oom(e: BaseException) -> bool:
    """True for CUDA / CPU allocation failures (those are recorded as ``oom``, others re-raised)."""
    msg = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in msg or "can't allocate memory" in msg
