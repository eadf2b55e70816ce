"""Public entry point ``kvm_attention``: checks the inputs (:mod:`kvmeans.ops.checks`), picks an implementation
(:mod:`kvmeans.ops.backends`) and runs it on the carried state."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kvmeans.ops.backends import choose_implementation
from kvmeans.ops.budget import BudgetLike, StateBudget
from kvmeans.ops.checks import (
    BACKENDS,
    HALF,
    NUMERICS,
    cast,
    check_budget_against_state,
    check_gate,
    check_growth_numerics,
    check_initial_state,
    check_scalars,
    check_tensors,
    check_vec,
    ones,
)
from kvmeans.ops.ragged import split_call
from kvmeans.ops.state import KVMState

__all__ = ["kvm_attention", "BACKENDS", "NUMERICS"]


def kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Optional[Tensor] = None, *, chunk_len: int = 256,
                  n_bswa_chunks: int = 2, sink_len: int = 1, rope_dim: int = 0,
                  budget: BudgetLike = StateBudget.fixed(256), state_norm_weight: Optional[Tensor] = None,
                  state_norm_bias: Optional[Tensor] = None, state_norm_eps: float = 1e-5,
                  state_temp: Optional[Tensor] = None, bswa_temp: Optional[Tensor] = None,
                  value_radius: bool = True, scale: Optional[float] = None,
                  initial_state: Optional[KVMState] = None, return_state: bool = False,
                  gate_keys: bool = True, gate_values: bool = True, gate_appends: bool = False,
                  backend: str = "auto", numerics: str = "exact"):
    """Key-Value Means attention: exact block sliding window + compressed state, one softmax (docs/op.md).

    Args:
        q: ``[B, H, T, D]`` queries; k: ``[B, Hkv, T, D]`` keys (``H % Hkv == 0``); v: ``[B, Hkv, T, Dv]``.
        gate: ``[B, Hkv, T]`` merge gate ``g > 0`` (None: 1).
        chunk_len, n_bswa_chunks: C tokens per block, n blocks kept uncompressed (window L = n*C).
        sink_len: leading state rows never merged into, ``0 <= sink_len < chunk_len``.
        rope_dim: leading (rotary) key channels zeroed before a key enters the state.
        budget: state rows, a :class:`StateBudget`, an int ``n`` (``StateBudget.fixed(n)``, ``>= chunk_len``) or a
            callable ``ctx_len -> rows``; the state never shrinks.
        state_norm_weight, state_norm_bias: ``[D]`` affine of LN_s (None: none); state_norm_eps its eps.
        state_temp, bswa_temp: ``[H]`` inverse temperatures of state / window keys (None: 1).
        value_radius: False reads state values as running means (ablation).
        scale: softmax scale (None: ``1/sqrt(D)``).
        initial_state: a :class:`KVMState` returned earlier: the call continues it and advances it in place (a
            cache: ``clone()`` it to keep the old one); a ragged one (``KVMState.stack``) continues each row at its
            own position.
        return_state: also return the state.
        gate_keys, gate_values, gate_appends: what the gate multiplies (merged keys / values, appended rows).
        backend: ``"auto"``, ``"naive"``, ``"chunked"``, ``"recurrent"`` or ``"triton"`` (same results).
        numerics: ``"exact"``, ``"mixed"`` (half-precision attention dots) or ``"reference"`` (the authors'
            rounding points).
    Returns:
        ``y [B, H, T, Dv]`` in q's dtype, or ``(y, state)`` with ``return_state=True``. Masked tokens (future, out
        of the window) contribute exactly zero: a non-finite key or value makes only the outputs that see it NaN.
    """
    # the arguments as given, for a ragged state's split_call
    call = dict(locals()) if isinstance(initial_state, KVMState) and initial_state.schedule is not None else None
    B, H, T, D, Hkv, Dv = check_tensors(q, k, v)
    gate = check_gate(gate, q, B, Hkv, T)
    state_norm_eps, scale, value_radius, return_state, gate_keys, gate_values, gate_appends, budget = check_scalars(
        D, chunk_len, n_bswa_chunks, sink_len, rope_dim, backend, numerics, state_norm_eps, scale, value_radius,
        return_state, gate_keys, gate_values, gate_appends, budget)
    compute = torch.float32 if q.dtype in HALF else q.dtype
    if numerics == "reference":         # the authors' eager code computes in the model dtype
        compute = q.dtype
    state_temp = check_vec(state_temp, "state_temp", H, q, compute)
    bswa_temp = check_vec(bswa_temp, "bswa_temp", H, q, compute)
    ln_w = check_vec(state_norm_weight, "state_norm_weight", D, q, None)
    ln_b = check_vec(state_norm_bias, "state_norm_bias", D, q, None)
    geometry = dict(chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks, sink_len=sink_len, rope_dim=rope_dim,
                    value_radius=value_radius)
    state = _starting_state(initial_state, q.device, compute, numerics, (B, Hkv, D, Dv), geometry)
    check_budget_against_state(budget, state, chunk_len)
    if T == 0:
        y = q.new_zeros(B, H, 0, Dv)
        return (y, state) if return_state else y

    check_growth_numerics(budget, numerics)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, gate, ln_w, ln_b, state_temp, bswa_temp, *state.rows()))
    impl, options = choose_implementation(backend, numerics, budget=budget, state=state, q=q, compute=compute,
                                          needs_grad=needs_grad, op=kvm_attention)
    if impl is None:                    # a ragged batch this call cannot advance at once: by position groups
        return split_call(kvm_attention, call)
    if gate is None:                    # a one-token call (decode) shares one ones tensor per shape
        gate = ones((B, Hkv, 1), compute, q.device) if T == 1 else q.new_ones(B, Hkv, T, dtype=compute)
    y, new_state = impl(*(cast(t, compute) for t in (q, k, v, gate)), state, budget=budget, state_norm_weight=ln_w,
                        state_norm_bias=ln_b, state_norm_eps=state_norm_eps, state_temp=state_temp,
                        bswa_temp=bswa_temp, scale=scale, gate_keys=gate_keys, gate_values=gate_values,
                        gate_appends=gate_appends, **options)
    if new_state is not state and initial_state is not None:    # the carried state is a cache: advance it in place
        initial_state.__dict__.update(new_state.__dict__)
        new_state = initial_state
    y = cast(y, q.dtype)
    return (y, new_state) if return_state else y


def _starting_state(initial_state, device, compute, numerics, sizes, geometry) -> KVMState:
    """The state the call continues: ``initial_state`` once checked, else an empty one of ``sizes = (B, Hkv, D,
    Dv)`` computing in ``compute``."""
    B, Hkv, D, Dv = sizes
    if initial_state is not None:
        check_initial_state(initial_state, compute=compute, numerics=numerics, batch=B, kv_heads=Hkv, head_dim=D,
                            value_dim=Dv, device=device, **geometry)
        return initial_state
    state = KVMState.empty(B, Hkv, D, Dv, dtype=compute, device=device, **geometry)
    if numerics == "reference":
        state.radii = state.radii.float()   # radii stay fp32 (docs/reference-conventions.md §10)
    return state
