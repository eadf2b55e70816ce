"""Ragged decode: one new token for every row of a batch whose rows stand at different positions.

A :class:`~kvmeans.ops.state.KVMState` with a :class:`~kvmeans.ops.state.RowSchedule` (e.g. left-padded
prompts of distinct lengths, merged by :class:`~kvmeans.models.hf_cache.KVMCache`) advances all its rows in
one batched step, with the recurrent path's maths row by row:

* each row's token is written at its own window slot;
* rows still filling their first chunk copy the token as a state row (batched);
* a row whose window start moves (a chunk boundary: an update, then a slide) runs
  :func:`~kvmeans.ops.state.absorb` on a one-row view of the buffers (once per ``chunk_len`` tokens a row);
* the attention reads every row's ``[state rows ; window]`` at once with per-row masks (state rows
  ``>= rows[b]``, all of them while row ``b``'s state is inactive, window slots ``>= window_len[b]``): a
  softmax over masked scores, or the Triton decode kernel with per-row lengths (``attn="triton"``). A
  novelty budget (``state.row_count``) masks per (row, kv head): rows ``>= row_count[b, h]`` as well.

The read-out state (LN_s keys, radius-scaled values) is cached per batch and recomputed for a row only after
its rows changed. Anything else (several tokens per call, autograd, a backend other than auto / recurrent /
triton, reference numerics) goes through :func:`split_call`: each group of rows at one position runs as a
plain state, and the states are stacked again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, List, Set, Tuple

import torch
from torch import Tensor

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.routing import memory_keys, readout
from kvmeans.ops.schedule import bswa_begin
from kvmeans.ops.state import KVMState, RowSchedule, absorb

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
    after = [bswa_begin(e, C, n) for e in ends]                                  # window starts after the step
    moving = [b for b in range(B) if after[b] > starts[b]]                      # a block leaves the window
    filling = [b for b in range(B) if seen[b] < C]                               # the token becomes a row
    # capacity for the whole step up front: the one-row views below write into these buffers
    _reserve(state, max(rows) + (C if moving else 1), max(e - w for e, w in zip(ends, starts)))
    if is_data_dependent(budget) and state.row_count is None:       # rows per (row, kv head) from now on
        state.row_count = torch.tensor(rows, device=q.device).view(B, 1).repeat(1, k.shape[1])
    every, slot = _slots(sched.seen, C, n, q.device)
    state.window_keys[every, :, slot] = k[:, :, 0]
    state.window_values[every, :, slot] = v[:, :, 0]
    state.window_gates[every, :, slot] = gate[:, :, 0]
    if filling:
        f = torch.tensor(filling, device=q.device)
        at = torch.tensor([rows[b] for b in filling], device=q.device)
        vals = v[f, :, 0]
        state.keys[f, :, at] = memory_keys(k[f, :, 0], state.rope_dim, *ln)
        state.values[f, :, at] = vals
        state.radii[f, :, at] = vals.norm(dim=-1) if state.value_radius else 1
        for b in filling:
            rows[b], cov[b] = rows[b] + 1, cov[b] + 1
        if state.row_count is not None:
            state.row_count[f] += 1
    for b in moving:
        one = _row_view(state, b, seen[b], rows[b], cov[b])
        absorb(one, one.window_keys, one.window_values, one.window_gates, starts[b], ends[b], budget, ln,
               gate_keys, gate_values, gate_appends, attn=attn)
        drop = after[b] - starts[b]
        keep = ends[b] - after[b]
        for buf in (one.window_keys, one.window_values, one.window_gates):
            buf[:, :, :keep] = buf[:, :, drop:drop + keep].clone()
        rows[b], cov[b] = one.num_rows, one.coverage
        if state.row_count is not None:                 # absorb replaces the view's counts
            state.row_count[b:b + 1] = one.row_count
    state.set_schedule(RowSchedule(tuple(ends), tuple(rows), tuple(cov)))
    win = tuple(e - a for e, a in zip(ends, after))
    visible = tuple(r if a > 0 else 0 for r, a in zip(rows, after))             # an inactive state: no rows
    j = _read_out(state, ln, visible, filling + moving)
    R, M, W = j.R, j.M, max(win)
    per_head = None         # novelty growth: rows visible per (row, kv head), [B, Hkv]
    if state.row_count is not None:
        active = torch.tensor(visible, device=q.device).view(B, 1) > 0
        per_head = torch.where(active, state.row_count, 0).to(torch.int32)
    if attn == "triton":
        from kvmeans.ops.triton.decode import decode_attention
        lengths = torch.tensor([visible, win], dtype=torch.int32, device=q.device).T.contiguous()     # [B, 2]
        if per_head is not None:
            lengths = torch.stack([per_head, lengths[:, 1:].expand_as(per_head)], -1)     # [B, Hkv, 2]
        y = decode_attention(q, j.keys[:, :, R - M:R] if M else None, j.values[:, :, R - M:R] if M else None,
                             state.window_keys, state.window_values, lengths, state_temp, bswa_temp, scale)
    else:
        y = _attend(q, j.keys[:, :, R - M:R + W], j.values[:, :, R - M:R + W], M, visible, win, state_temp,
                    bswa_temp, scale, per_head)
    return y, state


@dataclass
class _Joint:
    """The ragged path's ``[read-out rows ; window]`` buffers (one per keys / values), so a step reads both with one
    matmul pair: ``keys [B, Hkv, R + window_capacity, D]`` whose slots from ``R`` on are the state's window buffer,
    and the read-out rows (LN_s keys, radius-scaled values) of the first ``M`` state rows at ``[R - M, R)``."""
    keys: Tensor
    values: Tensor
    R: int
    M: int = -1                     # -1: nothing read out yet
    key: tuple = ()                 # the LN_s parameters the read-out was computed with
    stale: Set[int] = field(default_factory=set)     # batch rows whose state rows changed since

    def holds(self, state: KVMState) -> bool:
        return self.keys[:, :, self.R:].data_ptr() == state.window_keys.data_ptr()


def _grow(need: int, cap: int) -> int:
    return cap if need <= cap else max(need, 2 * cap)


def _reserve(state: KVMState, rows: int, window: int) -> None:
    """Room for ``rows`` state rows and ``window`` window tokens in every row (geometric growth). A state whose
    buffers the ragged path does not hold yet (its first ragged step) is copied once, so in-place writes never
    reach buffers it may share."""
    j = state._row_readout
    fresh = j is None or not j.holds(state)
    if fresh or rows > state.row_capacity:
        m, cap = state.num_rows, _grow(rows, state.row_capacity)
        for name in ("keys", "values", "radii"):
            old = getattr(state, name)
            new = old.new_zeros(*old.shape[:2], cap, *old.shape[3:])
            new[:, :, :m] = old[:, :, :m]
            setattr(state, name, new)
    if fresh or window > state.window_capacity:     # fresh: read-out slots for every row the step may leave
        _joint(state, rows if fresh else j.R, _grow(window, state.window_capacity))
    state._owned, state._readout = False, None       # not the recurrent path's own layout


def _joint(state: KVMState, R: int, window_capacity: int) -> _Joint:
    """New joint buffers with ``R`` read-out slots, holding the state's window (the read-out is rewritten)."""
    w, wk, wv, wg = state.window_len, state.window_keys, state.window_values, state.window_gates
    j = _Joint(wk.new_zeros(*wk.shape[:2], R + window_capacity, wk.shape[3]),
               wv.new_zeros(*wv.shape[:2], R + window_capacity, wv.shape[3]), R)
    state.window_keys, state.window_values = j.keys[:, :, R:], j.values[:, :, R:]
    state.window_gates = wg.new_zeros(*wg.shape[:2], window_capacity)
    for name, old in (("window_keys", wk), ("window_values", wv), ("window_gates", wg)):
        getattr(state, name)[:, :, :w] = old[:, :, :w]
    state._row_readout = j
    return j


def _read_out(state: KVMState, ln, visible: Tuple[int, ...], changed: List[int]) -> _Joint:
    """Bring the joint buffers' read-out up to date for ``visible`` rows per batch row: all rows when their number
    ``M = max(visible)`` or the LN_s parameters changed, else the rows of ``changed`` batch rows (once visible)."""
    w, b, eps = ln
    key = (id(w), None if w is None else w._version, id(b), None if b is None else b._version, eps)
    j, M = state._row_readout, max(visible)
    if M > j.R:
        j = _joint(state, _grow(M, j.R), state.window_capacity)
    j.stale.update(changed)
    if j.M != M or j.key != key:
        k_hat, v_hat = readout(*state.rows(), state.value_radius, *ln)
        j.keys[:, :, j.R - M:j.R], j.values[:, :, j.R - M:j.R] = k_hat[:, :, :M], v_hat[:, :, :M]
        j.M, j.key, j.stale = M, key, set()
    for r in sorted(r for r in j.stale if visible[r]):
        m, at = visible[r], slice(j.R - M, j.R - M + visible[r])
        j.keys[r:r + 1, :, at], j.values[r:r + 1, :, at] = readout(
            state.keys[r:r + 1, :, :m], state.values[r:r + 1, :, :m], state.radii[r:r + 1, :, :m],
            state.value_radius, *ln)
        j.stale.discard(r)
    return j


def _row_view(state: KVMState, b: int, seen: int, rows: int, coverage: int) -> KVMState:
    """A plain one-row state whose buffers are views of row ``b``'s (writes land in ``state``)."""
    return KVMState(*(getattr(state, name)[b:b + 1] for name in KVMState._TENSORS), num_rows=rows,
                    seen_tokens=seen, coverage=coverage, chunk_len=state.chunk_len,
                    n_bswa_chunks=state.n_bswa_chunks, sink_len=state.sink_len, rope_dim=state.rope_dim,
                    value_radius=state.value_radius,
                    row_count=None if state.row_count is None else state.row_count[b:b + 1])


@lru_cache(maxsize=8)
def _slots(seen: Tuple[int, ...], chunk_len: int, n_bswa_chunks: int, device) -> Tuple[Tensor, Tensor]:
    """``(rows [B], slots [B])``: the window slot of each row's next token (shared by the layers of a step)."""
    slot = [s - bswa_begin(s, chunk_len, n_bswa_chunks) for s in seen]
    return torch.arange(len(seen), device=device), torch.tensor(slot, device=device)


@lru_cache(maxsize=8)
def _bias(visible: Tuple[int, ...], win: Tuple[int, ...], M: int, W: int, dtype, device) -> Tensor:
    """``[B, 1, 1, M + W]``: 0 at each row's visible read-out rows and window tokens, -inf elsewhere."""
    slots = torch.arange(M + W, device=device)
    seen_rows = slots < torch.tensor(visible, device=device).view(-1, 1)
    seen_window = (slots >= M) & (slots - M < torch.tensor(win, device=device).view(-1, 1))
    bias = torch.zeros(len(win), M + W, dtype=dtype, device=device)
    return bias.masked_fill_(~(seen_rows | seen_window), -math.inf).view(len(win), 1, 1, M + W)


def _attend(q: Tensor, keys: Tensor, values: Tensor, M: int, visible, win, state_temp, bswa_temp, scale,
            per_head=None) -> Tensor:
    """One query per row and head over ``keys / values [B, Hkv, M + W, D|Dv]`` (``M`` read-out rows, then the
    window) with each row's visible rows and window (``per_head [B, Hkv]``: visible rows per row and kv head);
    returns ``[B, H, 1, Dv]``."""
    B, H, _, D = q.shape
    Hkv = keys.shape[1]
    group = lambda x: x.view(1, Hkv, H // Hkv, 1)                       # per head, query heads of a kv head together
    scores = (q.reshape(B, Hkv, H // Hkv, D) * scale) @ keys.transpose(-1, -2)     # [B, Hkv, rep, M + W]
    scores[..., :M] *= group(state_temp)                                 # temperatures on the scores
    scores[..., M:] *= group(bswa_temp)
    scores += _bias(visible, win, M, keys.shape[2] - M, scores.dtype, q.device)
    if per_head is not None:
        scores[..., :M].masked_fill_((torch.arange(M, device=q.device) >= per_head.unsqueeze(-1)).unsqueeze(2),
                                     -math.inf)
    return (torch.softmax(scores, -1) @ values).view(B, H, 1, -1)   # one softmax over [state ; window]


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
