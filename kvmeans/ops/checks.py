"""Input checks of :func:`kvmeans.ops.kvm.kvm_attention`: every argument is refused with a one-line error naming
it (a wrong type, shape, device or dtype, a non-finite or out-of-range scalar, a bool where an int is meant, a
state that cannot continue the call). The scalar settings are checked once per distinct setting, so a decode
step re-checks nothing."""
from __future__ import annotations

import functools
import math
import numbers

import torch
from torch import Tensor

from kvmeans.ops.budget import StateBudget, as_budget, is_data_dependent
from kvmeans.ops.state import KVMState

BACKENDS = ("auto", "naive", "chunked", "recurrent", "triton")
NUMERICS = ("exact", "mixed", "reference")
HALF = (torch.float16, torch.bfloat16)


def check_tensors(q, k, v):
    """``(B, H, T, D, Hkv, Dv)`` of ``q [B, H, T, D]``, ``k [B, Hkv, T, D]``, ``v [B, Hkv, T, Dv]``."""
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


def check_gate(gate, q, B, Hkv, T):
    """The gate ``[B, Hkv, T]`` (a trailing singleton dimension is dropped), or None."""
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


def check_scalars(*args):
    """The scalar settings ``(D, chunk_len, n_bswa_chunks, sink_len, rope_dim, backend, numerics, state_norm_eps,
    scale, value_radius, return_state, gate_keys, gate_values, gate_appends, budget)`` checked once per distinct
    setting; returns ``(state_norm_eps, scale, value_radius, return_state, gate_keys, gate_values, gate_appends,
    budget)`` as the op uses them. The budget returned is the one given (``StateBudget.fixed(n)`` for an int
    ``n``), never an equal one from an earlier call."""
    try:
        checked = _checked_scalars(*args)
    except TypeError:               # an unhashable setting (or a refused one: checked again below, it raises)
        checked = None
    if checked is None:
        checked = _check_scalars(*args)
    budget = args[-1]
    return checked if isinstance(budget, int) else (*checked[:-1], budget)


def check_vec(t, name, size, q, dtype):
    """A per-head / per-channel parameter of shape ``[size]`` on q's device, cast to ``dtype`` (None: as given);
    None becomes the shared ones (or stays None when ``dtype`` is None)."""
    if t is None:
        return None if dtype is None else ones(size, dtype, q.device)
    if not isinstance(t, Tensor) or tuple(t.shape) != (size,):
        shape = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [{size}], got {shape}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return t if dtype is None else cast(t, dtype)


def check_initial_state(state, *, compute, numerics, **expected) -> None:
    """``initial_state`` can continue this call: a :class:`KVMState` of the call's sizes, device and configuration
    (``expected``: :meth:`KVMState.check_compatible`'s arguments), computing in ``compute``."""
    if not isinstance(state, KVMState):
        raise TypeError(f"initial_state must be a KVMState returned by kvm_attention, got {type(state).__name__}")
    state.check_compatible(**expected)
    if state.dtype != compute:
        raise ValueError(f"initial_state is {state.dtype} but this call computes in {compute} "
                         f"(numerics={numerics!r}); continue a sequence with the numerics that started it, "
                         f"or convert it with state.to({compute})")


def check_budget_against_state(budget, state, chunk_len):
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


def check_growth_numerics(budget, numerics):
    """Data-dependent growth has no reference-numerics path."""
    if is_data_dependent(budget) and numerics == "reference":
        raise ValueError("numerics='reference' does not support a novelty budget; use numerics='exact' or 'mixed'")


@functools.lru_cache(maxsize=64)
def ones(size, dtype, device):
    """The default temperatures and one-token gates ``ones(size)``, one read-only tensor per (size, dtype,
    device); made outside inference mode so that a later call under autograd may use it."""
    with torch.inference_mode(False):
        return torch.ones(size, dtype=dtype, device=device)


def cast(t, dtype):
    """``t`` in ``dtype`` (itself when it already is)."""
    return t if t.dtype == dtype else t.to(dtype)


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
