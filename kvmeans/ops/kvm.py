"""Public entry point ``kvm_attention``: validates inputs and dispatches to a path."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from kvmeans.ops.budget import BudgetLike, StateBudget, as_budget, is_data_dependent
from kvmeans.ops.chunk import chunk_kvm_attention
from kvmeans.ops.naive import naive_kvm_attention
from kvmeans.ops.ragged import ragged_kvm_attention, split_call
from kvmeans.ops.recurrent import recurrent_kvm_attention
from kvmeans.ops.state import KVMState

BACKENDS = ("auto", "naive", "chunked", "recurrent", "triton")
NUMERICS = ("exact", "mixed", "reference")
HALF = (torch.float16, torch.bfloat16)


def kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor] = None, *, chunk_len: int = 256,
                  n_bswa_chunks: int = 2, sink_len: int = 1, rope_dim: int = 0,
                  budget: BudgetLike = StateBudget.fixed(256), state_norm_weight: Optional[Tensor] = None,
                  state_norm_bias: Optional[Tensor] = None, state_norm_eps: float = 1e-5,
                  state_temp: Optional[Tensor] = None, bswa_temp: Optional[Tensor] = None,
                  value_radius: bool = True, scale: Optional[float] = None,
                  initial_state: Optional[KVMState] = None, return_state: bool = False,
                  gate_keys: bool = True, gate_values: bool = True, gate_appends: bool = False,
                  backend: str = "auto", numerics: str = "exact"):
    """Key-Value Means attention: exact block sliding window + compressed state, one softmax.

    Args:
        q: ``[B, H, T, D]`` queries (after q-norm / RoPE).
        k: ``[B, Hkv, T, D]`` keys (after k-norm / RoPE); ``H % Hkv == 0`` (GQA: head h reads kv head h // (H/Hkv)).
        v: ``[B, Hkv, T, Dv]`` values.
        gate: ``[B, Hkv, T]`` merge gate ``g > 0`` (already ``1 + ELU``); None means 1.
        chunk_len: C, tokens per block.  n_bswa_chunks: n, blocks kept uncompressed (L = n*C).
        sink_len: leading state rows never merged into (attention sinks); ``0 <= sink_len < chunk_len``.
        rope_dim: leading key channels (the rotary ones) zeroed before a key enters the state.
        budget: state size schedule, a :class:`StateBudget`, an int ``n`` (exactly ``StateBudget.fixed(n)``;
            a fixed budget must be ``>= chunk_len``, the rows of the initial chunk) or a callable
            ``ctx_len -> rows`` (a finite int; values below the current rows keep them: the state never shrinks).
            ``StateBudget.novelty(threshold, cap)`` grows the rows by the data, per sequence and kv head
            (``state.row_count``; cap ``>= chunk_len``): ``backend="auto"`` takes the torch paths on every device,
            ``"triton"`` forces the kernels (verified in Triton's CPU interpreter only), ``numerics="reference"``
            raises.
        state_norm_weight, state_norm_bias: ``[D]`` affine of LN_s (None: no affine). state_norm_eps: its eps.
        state_temp, bswa_temp: ``[H]`` inverse temperatures of state keys / window keys (None: 1).
        value_radius: False is the ablation that reads state values as running means.
        scale: softmax scale, default ``1/sqrt(D)``.
        initial_state: a :class:`KVMState` returned earlier; the call continues that sequence and
            **advances the object in place** (it is a cache; ``clone()`` it to keep the old one). A ragged state
            (rows at different positions, ``KVMState.stack``) continues each row at its own position
            (:mod:`kvmeans.ops.ragged`).
        return_state: also return the state.
        gate_keys, gate_values: multiply merged keys / values by the gate.
        gate_appends: also gate the rows created by appends (the authors' ``kvm_apply_merge_gate_to_appends``).
        backend: ``"auto"`` | ``"naive"`` (the spec) | ``"chunked"`` (prefill/training) | ``"recurrent"``
            (no-grad continuation / decode) | ``"triton"`` (the chunked / recurrent paths with the fused Triton
            attention and decode kernels; CUDA, float32 / half compute). ``"auto"`` picks Triton when q is on CUDA,
            Triton is installed and the kernels passed a one-time self-check against the torch path for this
            (device, dtype, numerics) (:mod:`kvmeans.ops.triton.selfcheck`; on failure it warns once and
            uses the torch paths), the torch paths otherwise. All give the same result.
        numerics: ``"exact"`` (default: fp32 compute for half inputs, ungated routing key, readout in the
            compute dtype); ``"mixed"``: as exact, except that with half inputs the prefill / training attention
            (chunked path and its Triton kernels) multiplies q, the window and the read-out state in the input
            dtype with fp32 softmax statistics and accumulation, as flash attention does (the state, its routing
            and sums are those of exact; naive and the recurrent decode compute as exact; float32 inputs: exact);
            or ``"reference"``: the rounding points of the authors' eager code (model-dtype
            state sums and routing, gated merge key, bf16 readout values; see
            :mod:`kvmeans.ops.reference_numerics`). Reference mode computes in q's dtype, runs one dedicated
            chunk-by-chunk implementation whatever ``backend`` says (for fidelity, not speed; autograd works)
            and keeps the state's sums in q's dtype (radii fp32).
    Returns:
        ``y [B, H, T, Dv]`` in q's dtype, or ``(y, state)`` with ``return_state=True``. Masked tokens (future,
        out of the window) contribute exactly zero: a non-finite key or value reaches only the outputs that see
        it, which are NaN (:mod:`kvmeans.ops.masking`). Buffers are sized by the tokens present, not by
        ``chunk_len`` / ``n_bswa_chunks``.
    """
    # the arguments as given, for a ragged state's split_call
    call = dict(locals()) if isinstance(initial_state, KVMState) and initial_state.schedule is not None else None
    B, H, T, D, Hkv, Dv = _check_tensors(q, k, v)
    gate = _check_gate(gate, q, B, Hkv, T)
    state_norm_eps, scale, value_radius, return_state, gate_keys, gate_values, gate_appends, budget_fn = _scalars(
        D, chunk_len, n_bswa_chunks, sink_len, rope_dim, backend, numerics, state_norm_eps, scale, value_radius,
        return_state, gate_keys, gate_values, gate_appends, budget)
    compute = torch.float32 if q.dtype in HALF else q.dtype
    if numerics == "reference":         # the authors' eager code computes in the model dtype
        compute = q.dtype
    state_temp = _check_vec(state_temp, "state_temp", H, q, compute)
    bswa_temp = _check_vec(bswa_temp, "bswa_temp", H, q, compute)
    ln_w = _check_vec(state_norm_weight, "state_norm_weight", D, q, None)
    ln_b = _check_vec(state_norm_bias, "state_norm_bias", D, q, None)
    geometry = dict(chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks, sink_len=sink_len, rope_dim=rope_dim,
                    value_radius=value_radius)
    if initial_state is None:
        state = KVMState.empty(B, Hkv, D, Dv, dtype=compute, device=q.device, **geometry)
        if numerics == "reference":
            state.radii = state.radii.float()   # radii stay fp32 (reference-semantics 10)
    else:
        if not isinstance(initial_state, KVMState):
            raise TypeError(f"initial_state must be a KVMState returned by kvm_attention, got {type(initial_state).__name__}")
        initial_state.check_compatible(batch=B, kv_heads=Hkv, head_dim=D, value_dim=Dv, device=q.device, **geometry)
        if initial_state.dtype != compute:
            raise ValueError(f"initial_state is {initial_state.dtype} but this call computes in {compute} "
                             f"(numerics={numerics!r}); continue a sequence with the numerics that started it, "
                             f"or convert it with state.to({compute})")
        state = initial_state
    _check_budget_against_state(budget_fn, state, chunk_len)

    if T == 0:
        y = q.new_zeros(B, H, 0, Dv)
        return (y, state) if return_state else y
    kwargs = dict(budget=budget_fn, state_norm_weight=ln_w, state_norm_bias=ln_b, state_norm_eps=state_norm_eps,
                  state_temp=state_temp, bswa_temp=bswa_temp, scale=scale, gate_keys=gate_keys,
                  gate_values=gate_values, gate_appends=gate_appends)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, gate, ln_w, ln_b, state_temp, bswa_temp, *state.rows()))
    if is_data_dependent(budget_fn):     # auto: the torch paths (the kernels' self-check covers positional budgets)
        _check_novelty_numerics(numerics)
        attn, backend = ("torch", backend) if backend != "triton" else _kernels(backend, q.device, q.dtype, compute,
                                                                               numerics)
    else:
        attn, backend = _kernels(backend, q.device, q.dtype, compute, numerics)
    if state.schedule is not None:      # a ragged batch (rows at different positions): kvmeans.ops.ragged
        if T > 1 or needs_grad or numerics == "reference" or backend not in ("auto", "recurrent"):
            return split_call(kvm_attention, call)
        backend = "ragged"
    if backend == "auto":
        backend = "recurrent" if (not needs_grad and state.seen_tokens > 0 and T <= chunk_len) else "chunked"
    if backend == "recurrent" and needs_grad and numerics != "reference":
        raise ValueError("backend='recurrent' is an inference path (in-place buffers, no autograd); use "
                         "backend='chunked' or call it under torch.no_grad()")
    if gate is None:                    # a one-token call (decode) shares one ones tensor per shape
        gate = _ones((B, Hkv, 1), compute, q.device) if T == 1 else q.new_ones(B, Hkv, T, dtype=compute)
    args = [_cast(t, compute) for t in (q, k, v, gate)]
    if attn == "triton" and numerics != "reference":
        kwargs["attn"] = attn
    if numerics == "mixed" and q.dtype in HALF and backend == "chunked":
        kwargs["mma_dtype"] = q.dtype
    if numerics == "reference":
        from kvmeans.ops.reference_numerics import reference_kvm_attention as impl
    else:
        impl = {"ragged": ragged_kvm_attention, "naive": naive_kvm_attention,
                "chunked": chunk_kvm_attention}.get(backend, recurrent_kvm_attention)
    y, new_state = impl(*args, state, **kwargs)
    if new_state is not state:          # the carried state object is a cache: advance it in place
        if initial_state is not None:
            initial_state.__dict__.update(new_state.__dict__)
            new_state = initial_state
    y = _cast(y, q.dtype)
    return (y, new_state) if return_state else y


def _kernels(backend, device, dtype, compute, numerics):
    """``(attn, backend)``: the attention kernels of the chunked / recurrent paths ("torch" or "triton") and the
    path still to choose. ``"auto"`` takes Triton on CUDA only once its self-check passed for
    ``(device, dtype, numerics)``; ``"triton"`` forces it (or says why it cannot run)."""
    if backend == "triton" or (backend == "auto" and device.type == "cuda" and numerics != "reference"):
        from kvmeans.ops.triton import unavailable_reason  # cheap: does not import triton
        why = unavailable_reason(device, compute)
        if why is None and backend == "auto":
            from kvmeans.ops.triton.selfcheck import triton_verified
            why = None if triton_verified(device, dtype, numerics) else "self-check failed"
        if why is None:
            return "triton", "auto"
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run here: {why}")
    return "torch", backend


def _check_novelty_numerics(numerics):
    """Data-dependent growth has no reference-numerics path (the backend choice is made by the caller)."""
    if numerics == "reference":
        raise ValueError("numerics='reference' does not support a novelty budget; use numerics='exact' or 'mixed'")


def _check_tensors(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "[B, H, T, D]" if name == "q" else ("[B, Hkv, T, D]" if name == "k" else "[B, Hkv, T, Dv]")
            raise ValueError(f"{name} must be 4-D {want}, got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.is_meta:
            raise ValueError(f"{name} is a meta tensor (shape only, no data); kvm_attention needs real tensors: "
                             f"materialise the model first (e.g. module.to_empty(device=...) and load weights)")
    dtype, device = q.dtype, q.device
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {dtype}; cast q, k, v to one dtype")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; put q, k, v on one device")
    (B, H, T, D), (kB, Hkv, kT, kD), (vB, vH, vT, Dv) = q.shape, k.shape, v.shape
    if kB != B or vB != B:
        raise ValueError(f"batch sizes differ: q {B}, k {kB}, v {vB}")
    if kT != T or vT != T:
        raise ValueError(f"sequence lengths differ: q has T={T}, k has {kT}, v has {vT}; "
                         f"q, k, v must cover the same tokens")
    if kD != D:
        raise ValueError(f"k has head dim {kD} but q has {D}; q and k must share D")
    if not (B and H and Hkv and D and Dv):
        for name, size in (("B (batch)", B), ("H (q heads)", H), ("Hkv (kv heads)", Hkv), ("D (head dim)", D),
                           ("Dv (value dim)", Dv)):
            if size == 0:
                raise ValueError(f"{name} is 0 (q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}); only "
                                 f"the sequence length T may be 0")
    if vH != Hkv:
        raise ValueError(f"v has {vH} heads but k has {Hkv}; k and v must have the same Hkv")
    if H % Hkv:
        raise ValueError(f"q has H={H} heads, not a multiple of k's Hkv={Hkv} (GQA needs H % Hkv == 0)")
    return B, H, T, D, Hkv, Dv


def _check_gate(gate, q, B, Hkv, T):
    if gate is None:
        return None
    if not isinstance(gate, Tensor):
        raise TypeError(f"gate must be a tensor [B, Hkv, T] or None, got {type(gate).__name__}")
    if gate.dim() == 4 and gate.shape[-1] == 1:
        gate = gate.squeeze(-1)
    if tuple(gate.shape) != (B, Hkv, T):
        raise ValueError(f"gate must be [B, Hkv, T] = {[B, Hkv, T]}, got shape {list(gate.shape)}")
    if gate.device != q.device:
        raise ValueError(f"gate is on {gate.device} but q is on {q.device}")
    return gate


def _check_scalars(D, chunk_len, n_bswa_chunks, sink_len, rope_dim, backend, numerics, state_norm_eps, scale,
                   value_radius, return_state, gate_keys, gate_values, gate_appends, budget):
    """Check the scalar settings; ``(state_norm_eps, scale, value_radius, return_state, gate_keys, gate_values,
    gate_appends, budget_fn)`` as the op uses them."""
    _check_config(chunk_len, n_bswa_chunks, sink_len, rope_dim, D, backend)
    _check_numerics(numerics)
    state_norm_eps = _positive_real("state_norm_eps", state_norm_eps)
    scale = 1.0 / math.sqrt(D) if scale is None else _positive_real("scale", scale)
    flags = (_flag(name, x) for name, x in (("value_radius", value_radius), ("return_state", return_state),
                                            ("gate_keys", gate_keys), ("gate_values", gate_values),
                                            ("gate_appends", gate_appends)))
    return (state_norm_eps, scale, *flags, as_budget(budget))


# keyed by each value and its type (1, 1.0 and True are three keys); only a setting that passed is stored, so a
# refused one is checked, and refused, on every call
_checked_scalars = functools.lru_cache(maxsize=256, typed=True)(_check_scalars)


def _scalars(*args):
    """:func:`_check_scalars` once per distinct setting (a decode step re-checks nothing); the budget returned is
    the one given (``StateBudget.fixed(n)`` for an int ``n``), never an equal one from an earlier call."""
    try:
        checked = _checked_scalars(*args)
    except TypeError:               # an unhashable setting (or a refused one: checked again below, it raises)
        checked = None
    if checked is None:
        checked = _check_scalars(*args)
    budget = args[-1]
    return checked if isinstance(budget, int) else (*checked[:-1], budget)


def _cast(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def _check_config(chunk_len, n_bswa_chunks, sink_len, rope_dim, D, backend):
    _int("chunk_len", chunk_len, 1, "a positive int (tokens per block)")
    _int("n_bswa_chunks", n_bswa_chunks, 1, "an int >= 1 (blocks kept uncompressed)")
    _int("sink_len", sink_len, 0, f"an int in [0, chunk_len={chunk_len})")
    if sink_len >= chunk_len:
        raise ValueError(f"sink_len={sink_len!r} leaves no mergeable state row: it must satisfy "
                         f"0 <= sink_len < chunk_len={chunk_len}")
    _int("rope_dim", rope_dim, 0, f"an int in [0, D={D}]")
    if rope_dim > D:
        raise ValueError(f"rope_dim must be an int in [0, D={D}], got {rope_dim!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _int(name, x, low, want):
    """Refuse bools, floats and other non-integers, and values below ``low``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low:
        raise ValueError(f"{name} must be {want}, got {x!r}")


def _positive_real(name, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return float(x)


def _flag(name, x) -> bool:
    """A bool, or 0 / 1 (the authors' configs store flags as ints); a string or None is refused."""
    if isinstance(x, bool) or (isinstance(x, numbers.Integral) and x in (0, 1)):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {x!r}")


def _check_numerics(numerics):
    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS} ('exact': kvmeans' default; 'mixed': half-precision "
                         f"attention dots like flash attention; 'reference': the authors' eager rounding points), "
                         f"got {numerics!r}")


def _check_budget_against_state(budget, state, chunk_len):
    """A fixed budget (an int ``n`` is ``StateBudget.fixed(n)``) must hold the rows that already exist: the
    initial chunk (``chunk_len`` rows) or the carried state; the state never shrinks. A novelty budget's cap
    must hold the initial chunk; a state it grew (rows per kv head) continues only under a novelty budget."""
    if is_data_dependent(budget):
        if budget.n < chunk_len:
            raise ValueError(f"budget={budget!r}: cap={budget.n} is below the initial state of chunk_len={chunk_len} "
                             f"rows; use a cap >= {chunk_len}")
        return
    if state.row_count is not None:
        raise ValueError(f"initial_state was grown by a novelty budget (rows per kv head) but this call uses "
                         f"budget={budget!r}; continue it with a StateBudget.novelty budget")
    if isinstance(budget, StateBudget) and budget.kind == "fixed":
        floor = max(state.num_rows, chunk_len)
        if budget.n < floor:
            what = f"the carried state's {state.num_rows} rows" if state.num_rows > chunk_len else \
                f"the initial state of chunk_len={chunk_len} rows"
            raise ValueError(f"budget={budget.n} (fixed) would shrink the state below {what}; the state never "
                             f"shrinks: use budget={floor} or more")


@functools.lru_cache(maxsize=64)
def _ones(size, dtype, device):
    """The default temperatures and one-token gates ``ones(size)``, one read-only tensor per (size, dtype,
    device); made outside inference mode so that a later call under autograd may use it."""
    with torch.inference_mode(False):
        return torch.ones(size, dtype=dtype, device=device)


def _check_vec(t, name, size, q, dtype):
    if t is None:
        return None if dtype is None else _ones(size, dtype, q.device)
    if not isinstance(t, Tensor) or tuple(t.shape) != (size,):
        shape = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [{size}], got {shape}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return t if dtype is None else _cast(t, dtype)
