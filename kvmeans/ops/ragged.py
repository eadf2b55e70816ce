"""Ragged decode: one new token for every row of a batch whose rows stand at different positions.

A :class:`~kvmeans.ops.state.KVMState` with a :class:`~kvmeans.ops.state.RowSchedule` (e.g. left-padded
prompts of distinct lengths, merged by :class:`~kvmeans.models.hf_cache.KVMCache`) advances all its rows in
one batched step, with the recurrent path's maths row by row:

* each row's token is written at its own window slot;
* rows still filling their first chunk copy the token as a state row (batched);
* a row whose window start moves (a chunk boundary: an update, then a slide) runs
  :func:`~kvmeans.ops.recurrent.absorb` on a one-row view of the buffers (once per ``chunk_len`` tokens a row);
* the attention reads every row's ``[state rows ; window]`` at once with per-row masks (state rows
  ``>= rows[b]``, all of them while row ``b``'s state is inactive, window slots ``>= window_len[b]``): a
  softmax over masked scores, or the Triton decode kernel with per-row lengths (``attn="triton"``).

The read-out state (LN_s keys, radius-scaled values) is cached per batch and recomputed for a row only after
its rows changed. Anything else (several tokens per call, autograd, a backend other than auto / recurrent /
triton, reference numerics) goes through :func:`split_call`: each group of rows at one position runs as a
plain state, and the states are stacked again.
"""
from __future__ import annotations

import math
from typing import Callable, List

import torch
from torch import Tensor

from .recurrent import absorb
from .routing import memory_keys, readout
from .schedule import bswa_begin
from .state import KVMState, RowSchedule

__all__ = ["ragged_kvm_attention", "split_call"]


@torch.no_grad()
def ragged_kvm_attention(q, k, v, gate, state: KVMState, *, budget, state_norm_weight, state_norm_bias,
                         state_norm_eps, state_temp, bswa_temp, scale, gate_keys=True, gate_values=True,
                         gate_appends=False, attn="torch"):
    """One token per row, ``q [B, H, 1, D]``, ``k [B, Hkv, 1, D]``, ``v [B, Hkv, 1, Dv]``, ``gate [B, Hkv, 1]``,
    continuing the ragged ``state`` in place; returns ``(y [B, H, 1, Dv], state)``."""
    C, n, B = state.chunk_len, state.n_bswa_chunks, q.shape[0]
    ln = (state_norm_weight, state_norm_bias, state_norm_eps)
    sched = state.schedule
    seen, rows, cov = list(sched.seen), list(sched.rows), list(sched.coverage)
    starts, ends = [bswa_begin(s, C, n) for s in seen], [s + 1 for s in seen]
    moving = [b for b in range(B) if bswa_begin(ends[b], C, n) > starts[b]]     # a block leaves the window
    filling = [b for b in range(B) if seen[b] < C]                               # the token becomes a row
    # capacity for the whole step up front: the one-row views below write into these buffers
    _reserve(state, max(rows) + (C if moving else 1), max(e - w for e, w in zip(ends, starts)))
    dev, every = q.device, torch.arange(B, device=q.device)
    slot = torch.tensor([s - w for s, w in zip(seen, starts)], device=dev)
    state.window_keys[every, :, slot] = k[:, :, 0]
    state.window_values[every, :, slot] = v[:, :, 0]
    state.window_gates[every, :, slot] = gate[:, :, 0]
    if filling:
        f = torch.tensor(filling, device=dev)
        at = torch.tensor([rows[b] for b in filling], device=dev)
        vals = v[f, :, 0]
        state.keys[f, :, at] = memory_keys(k[f, :, 0], state.rope_dim, *ln)
        state.values[f, :, at] = vals
        state.radii[f, :, at] = vals.norm(dim=-1) if state.value_radius else 1
        for b in filling:
            rows[b], cov[b] = rows[b] + 1, cov[b] + 1
    for b in moving:
        one = _row_view(state, b, seen[b], rows[b], cov[b])
        absorb(one, one.window_keys, one.window_values, one.window_gates, starts[b], ends[b], budget, ln,
               gate_keys, gate_values, gate_appends, attn=attn)
        drop = bswa_begin(ends[b], C, n) - starts[b]
        keep = ends[b] - starts[b] - drop
        for buf in (one.window_keys, one.window_values, one.window_gates):
            buf[:, :, :keep] = buf[:, :, drop:drop + keep].clone()
        rows[b], cov[b] = one.num_rows, one.coverage
    state.set_schedule(RowSchedule(tuple(ends), tuple(rows), tuple(cov)))
    win = [e - bswa_begin(e, C, n) for e in ends]
    visible = [r if bswa_begin(e, C, n) > 0 else 0 for r, e in zip(rows, ends)]   # inactive state: no rows
    k_hat, v_hat = _row_readout(state, ln, visible, filling + moving)
    W = max(win)
    if attn == "triton":
        from .triton.decode import decode_attention
        lengths = torch.tensor([visible, win], dtype=torch.int32, device=dev).T.contiguous()
        y = decode_attention(q, k_hat, v_hat, state.window_keys, state.window_values, lengths, state_temp,
                             bswa_temp, scale)
    else:
        y = _attend(q, k_hat, v_hat, state.window_keys[:, :, :W], state.window_values[:, :, :W], visible, win,
                    state_temp, bswa_temp, scale)
    return y, state


def _reserve(state: KVMState, rows: int, window: int) -> None:
    """Room for ``rows`` state rows and ``window`` window tokens in every row (geometric growth). The first ragged
    step of a state object copies its buffers once, so in-place writes never reach buffers it may share."""
    first = state._row_readout is None
    if not first and rows <= state.row_capacity and window <= state.window_capacity:
        return
    grow = lambda need, cap: cap if need <= cap else max(need, 2 * cap)
    fresh = KVMState.empty(state.batch_size, state.keys.shape[1], state.keys.shape[3], state.values.shape[3],
                           dtype=state.dtype, device=state.device, chunk_len=state.chunk_len,
                           n_bswa_chunks=state.n_bswa_chunks, sink_len=state.sink_len, rope_dim=state.rope_dim,
                           value_radius=state.value_radius, row_capacity=grow(rows, state.row_capacity),
                           window_capacity=grow(window, state.window_capacity))
    m, w = state.num_rows, state.window_len
    for name, extent in zip(KVMState._TENSORS, (m, m, m, w, w, w)):
        getattr(fresh, name)[:, :, :extent] = getattr(state, name)[:, :, :extent]
        setattr(state, name, getattr(fresh, name))
    state._owned, state._readout = False, None       # not the recurrent path's own layout


def _row_view(state: KVMState, b: int, seen: int, rows: int, coverage: int) -> KVMState:
    """A plain one-row state whose buffers are views of row ``b``'s (writes land in ``state``)."""
    return KVMState(*(getattr(state, name)[b:b + 1] for name in KVMState._TENSORS), num_rows=rows,
                    seen_tokens=seen, coverage=coverage, chunk_len=state.chunk_len,
                    n_bswa_chunks=state.n_bswa_chunks, sink_len=state.sink_len, rope_dim=state.rope_dim,
                    value_radius=state.value_radius)


def _row_readout(state: KVMState, ln, visible: List[int], changed: List[int]):
    """``(k_hat, v_hat)`` ``[B, Hkv, max(visible), D|Dv]`` (None, None when no row's state is active): the read-out
    rows, cached on ``state``; rows of ``changed`` rows are read out again when they are next visible."""
    w, b, eps = ln
    key = (id(w), None if w is None else w._version, id(b), None if b is None else b._version, eps)
    held = state._row_readout
    stale = set(changed) | (held[3] if held is not None else set())
    M = max(visible)
    if held is None or held[0] != key or held[1].shape[2] < M:
        k_hat, v_hat = readout(*state.rows(), state.value_radius, *ln)            # every row, to the longest
        stale = set()
    else:
        k_hat, v_hat = held[1], held[2]
        for r in [r for r in stale if visible[r]]:
            m = visible[r]
            k_hat[r:r + 1, :, :m], v_hat[r:r + 1, :, :m] = readout(
                state.keys[r:r + 1, :, :m], state.values[r:r + 1, :, :m], state.radii[r:r + 1, :, :m],
                state.value_radius, *ln)
            stale.discard(r)
    state._row_readout = (key, k_hat, v_hat, stale)
    return (None, None) if M == 0 else (k_hat[:, :, :M], v_hat[:, :, :M])


def _beyond(lengths: List[int], size: int, device) -> Tensor:
    """``[B, 1, 1, size]`` bool: True at the slots past each row's length."""
    return torch.arange(size, device=device) >= torch.tensor(lengths, device=device).view(-1, 1, 1, 1)


def _attend(q: Tensor, k_hat, v_hat, wk: Tensor, wv: Tensor, visible: List[int], win: List[int], state_temp,
            bswa_temp, scale) -> Tensor:
    """One query per row and head over its visible state rows and window; returns ``[B, H, 1, Dv]``."""
    B, H, _, D = q.shape
    Hkv = wk.shape[1]
    group = lambda x: x.reshape(B, Hkv, H // Hkv, x.shape[-1])       # query heads of one kv head together
    scores = group(q * (bswa_temp * scale).view(1, H, 1, 1)) @ wk.transpose(-1, -2)     # [B, Hkv, rep, W]
    scores = scores.masked_fill(_beyond(win, wk.shape[2], q.device), -math.inf)
    if k_hat is None:                                                 # no row's state is active yet
        y = torch.softmax(scores, -1) @ wv
    else:
        s_scores = group(q * (state_temp * scale).view(1, H, 1, 1)) @ k_hat.transpose(-1, -2)
        s_scores = s_scores.masked_fill(_beyond(visible, k_hat.shape[2], q.device), -math.inf)
        p = torch.softmax(torch.cat([s_scores, scores], -1), -1)      # one softmax over [state ; window]
        m = k_hat.shape[2]
        y = p[..., :m] @ v_hat + p[..., m:] @ wv
    return y.view(B, H, 1, -1)


def split_call(kvm_attention: Callable, args: dict):
    """``kvm_attention(**args)`` for a ragged ``args["initial_state"]``: each group of rows at one position runs
    as a plain state; the state is then stacked again and advanced in place. Returns what the call returns."""
    state = args["initial_state"]
    order, ys, parts = [], [], []
    for rows, part in state.split():
        pick = lambda t: None if t is None else t[rows.to(t.device)]
        y, part = kvm_attention(**{**args, **{name: pick(args[name]) for name in ("q", "k", "v", "gate")},
                                   "initial_state": part, "return_state": True})
        order.append(rows)
        ys.append(y)
        parts.append(part)
    back = torch.argsort(torch.cat(order))
    y = torch.cat(ys)[back.to(ys[0].device)]
    new = KVMState.stack(parts).index_select(back)
    state.__dict__.update(new.__dict__)
    return (y, state) if args["return_state"] else y
