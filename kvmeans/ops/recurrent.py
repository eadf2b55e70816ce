"""Recurrent KVM: continue a carried state with 1 (decode), a few, or many tokens; no autograd.

Buffers are preallocated and written in place: state rows grow geometrically, the window buffer
holds at most ``L`` tokens and slides by one chunk when a block leaves it (one copy per C tokens): a block is
absorbed before the tokens that push it out are written. The JIT-normalised state is cached between chunk
boundaries, right before the window in one buffer per keys / values (``state._joint``), so a one-token step
reads ``[read-out rows ; window]`` with one matmul pair, costs O((rows + window) * D) per head and never grows
with the tokens seen.
Deviation from ``naive.py``: temperatures are applied to the query (or, for one query, to its scores) instead of
the keys (same product).

``attn="triton"``: the attention of a step runs :func:`kvmeans.ops.triton.decode.decode_attention` and a
chunk-boundary update routes with :func:`kvmeans.ops.triton.update.route_overflow_triton` and accumulates
with :func:`kvmeans.ops.triton.update.scatter_add_rows` (same routes and, on fp32 sums, the same rows as
the torch update). The decode kernel reads ``[rows, window_len]`` from ``state._lengths``, an int32 device
tensor allocated with the buffers and updated in place (a device-side ``add_`` between chunk boundaries),
so a steady-state step builds no tensor on the host and launches with the same shapes and pointers.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.masking import finite_tokens, poison, rows_poison, window_poison
from kvmeans.ops.routing import memory_keys, readout, route_novelty, route_overflow, state_layer_norm, token_streams
from kvmeans.ops.schedule import bswa_begin, coverage_after, plan_updates
from kvmeans.ops.state import KVMState


@torch.no_grad()
def recurrent_kvm_attention(q, k, v, gate, state: KVMState, *, budget, state_norm_weight, state_norm_bias,
                            state_norm_eps, state_temp, bswa_temp, scale, gate_keys=True, gate_values=True,
                            gate_appends=False, attn="torch"):
    """Same contract as :func:`kvmeans.ops.naive.naive_kvm_attention`, but advances ``state`` in place
    and returns ``(y, state)``. ``attn="triton"``: the attention of each step runs the Triton decode kernel."""
    C, n = state.chunk_len, state.n_bswa_chunks
    ln = (state_norm_weight, state_norm_bias, state_norm_eps)
    own_buffers(state)
    t0, T = state.seen_tokens, q.shape[2]
    if T == 1 and attn == "torch" and t0 % C and t0 > C and state.coverage == coverage_after(t0, C, n):
        joint = _joint(state)         # a step inside a chunk: no block leaves the window, nothing to absorb
        at = t0 - state.window_start
        if joint is not None and at < state.window_capacity:
            for buf, x in ((state.window_keys, k), (state.window_values, v), (state.window_gates, gate)):
                buf.narrow(2, at, 1).copy_(x)
            state.seen_tokens = t0 + 1
            return _attend_one(state, q, joint, ln, state_temp, bswa_temp, scale), state
    outs, pos = [], t0
    while pos < t0 + T:
        e = min(t0 + T, (pos // C + 1) * C)              # queries [pos, e) lie in one chunk
        w_old, w_new = state.window_start, bswa_begin(e, C, n)
        new = slice(pos - t0, e - t0)
        wbuf = lambda: (state.window_keys, state.window_values, state.window_gates)
        if pos < C:         # the first chunk: its tokens become rows, so they are written first (w_new = 0)
            _write_window(state, pos - w_old, k[:, :, new], v[:, :, new], gate[:, :, new])
            absorb(state, *wbuf(), w_old, e, budget, ln, gate_keys, gate_values, gate_appends, attn=attn)
        else:               # a block leaving the window lies before pos: absorb it, slide, then write (<= L tokens)
            absorb(state, *wbuf(), w_old, e, budget, ln, gate_keys, gate_values, gate_appends, attn=attn)
            drop, keep = w_new - w_old, pos - w_new
            if drop and keep:                             # slide the window by the block(s) that left it
                for buf in wbuf():
                    buf[:, :, :keep] = buf[:, :, drop:drop + keep].clone()
            _write_window(state, pos - w_new, k[:, :, new], v[:, :, new], gate[:, :, new])
        state.seen_tokens = e
        if attn == "triton":
            outs.append(_attend_triton(state, q[:, :, new], pos, ln, state_temp, bswa_temp, scale))
        else:
            outs.append(_attend(state, q[:, :, new], pos, ln, state_temp, bswa_temp, scale))
        pos = e
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state


def _write_window(state: KVMState, at: int, k: Tensor, v: Tensor, g: Tensor) -> None:
    """Write tokens ``k, v, g`` (``[B, Hkv, t, ...]``) into the window buffers from slot ``at``."""
    _reserve_window(state, at + k.shape[2])
    sl = slice(at, at + k.shape[2])
    state.window_keys[:, :, sl], state.window_values[:, :, sl], state.window_gates[:, :, sl] = k, v, g


def own_buffers(state: KVMState, rows: int = 0, window: int = 0) -> None:
    """Make the state's buffers its own (detached, preallocated) so they can be written in place,
    with room for at least ``rows`` rows and ``window`` window tokens (both grow geometrically on demand:
    sized by the tokens present, never by the configured maximum)."""
    if state._owned:
        _reserve_rows(state, rows)
        _reserve_window(state, window)
        return
    _alloc(state, max(state.num_rows, rows, 1), max(state.window_len, window, 1), *state.rows(), *state.window())


def _alloc(state, rows_cap, win_cap, keys, values, radii, wk, wv, wg):
    B, Hkv, D, Dv = keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]
    fresh = KVMState.empty(B, Hkv, D, Dv, dtype=keys.dtype, device=keys.device, chunk_len=state.chunk_len,
                           n_bswa_chunks=state.n_bswa_chunks, sink_len=state.sink_len, rope_dim=state.rope_dim,
                           value_radius=state.value_radius, row_capacity=rows_cap, window_capacity=0)
    # [read-out rows (right-aligned, written by _readout_cached) ; window]: the window buffers are views of these
    joint = [keys.new_zeros(B, Hkv, rows_cap + win_cap, d) for d in (D, Dv)]
    fresh.window_keys, fresh.window_values = (j[:, :, rows_cap:] for j in joint)
    fresh.window_gates = wg.new_zeros(B, Hkv, win_cap)
    m, w = keys.shape[2], wk.shape[2]
    fresh.keys[:, :, :m], fresh.values[:, :, :m], fresh.radii[:, :, :m] = keys, values, radii
    fresh.window_keys[:, :, :w], fresh.window_values[:, :, :w], fresh.window_gates[:, :, :w] = wk, wv, wg
    for name in ("keys", "values", "radii", "window_keys", "window_values", "window_gates"):
        setattr(state, name, getattr(fresh, name))
    state._joint = joint
    # the decode kernel's [rows, window_len] (int32, on the device; _decode_lengths keeps it current): kept when
    # an owned state grows its rows, new for a state that is not owned yet (a copy must not share it)
    if not state._owned or getattr(state, "_lengths", None) is None:
        state._lengths = (torch.zeros(2, dtype=torch.int32, device=keys.device), [0, 0])
    state._owned, state._readout = True, None


def _reserve_rows(state: KVMState, rows: int) -> None:
    if rows > state.row_capacity:                    # geometric growth: amortised O(1) copies per row
        _alloc(state, max(rows, 2 * state.row_capacity), state.window_capacity, *state.rows(),
               state.window_keys, state.window_values, state.window_gates)


def _reserve_window(state: KVMState, tokens: int) -> None:
    """Room for ``tokens`` window tokens (this module asks for at most ``L``; the cap ``L + C`` serves callers that
    write a chunk before absorbing the block it pushes out)."""
    if tokens > state.window_capacity:
        most = (state.n_bswa_chunks + 1) * state.chunk_len
        _alloc(state, state.row_capacity, min(max(tokens, 2 * state.window_capacity), most), *state.rows(),
               *state.window())


def absorb(state: KVMState, keys: Tensor, values: Tensor, gates: Tensor, origin: int, total: int, budget, ln,
           gate_keys=True, gate_values=True, gate_appends=False, attn="torch") -> list:
    """Bring the state rows up to date for a sequence of ``total`` tokens, in place: copy the first
    chunk, then absorb every block that has left the window. Token ``p`` is read from
    ``keys/values/gates[:, :, p - origin]`` (``[B, Hkv, N, D]``, ``[B, Hkv, N, Dv]``, ``[B, Hkv, N]``).

    Returns what happened, ``[(start, n_tokens, dest, appended)]``: ``dest [B, Hkv, n]`` rows the tokens
    joined and ``appended [B, Hkv, n]`` which created them (both None for the initial copy, whose
    tokens become rows ``rows_before, ...`` in order). ``attn="triton"``: the updates use the Triton
    routing / scatter kernels (:func:`_update`).
    """
    C, cov, records = state.chunk_len, state.coverage, []
    fill = min(total, C) - cov
    if fill > 0:                                     # the first chunk is copied: rows k_bar, v, |v|
        _reserve_rows(state, state.num_rows + fill)
        m, loc = state.num_rows, slice(cov - origin, cov + fill - origin)
        vals = values[:, :, loc]
        state.keys[:, :, m:m + fill] = memory_keys(keys[:, :, loc], state.rope_dim, *ln)
        state.values[:, :, m:m + fill] = vals
        state.radii[:, :, m:m + fill] = vals.norm(dim=-1) if state.value_radius else 1
        state.num_rows, state.coverage, state._readout = m + fill, cov + fill, None
        records.append((cov, fill, None, None))
    for step in plan_updates(budget, state.coverage, state.num_rows, total, C, state.n_bswa_chunks):
        loc = slice(step.start - origin, step.start + C - origin)
        dest, app = _update(state, step, keys[:, :, loc], values[:, :, loc], gates[:, :, loc], ln, gate_keys,
                            gate_values, gate_appends, attn, budget if is_data_dependent(budget) else None)
        records.append((step.start, C, dest, app))
    return records


def _update(state: KVMState, step, kb, vb, gb, ln, gate_keys, gate_values, gate_appends, attn="torch", growth=None):
    """The overflow block ``[step.start, step.start + C)`` (raw keys ``kb``, values, gates) enters the state;
    returns its routing ``(dest, appended)``, each ``[B, Hkv, C]``. ``attn="triton"`` (fp32 state): routing by
    ``route_overflow_triton`` (same rule and ties as ``route_overflow``), sums by ``scatter_add_rows``.
    ``growth``: a novelty budget (``route_novelty``, rows per kv head in ``state.row_count``; torch only)."""
    kbar = memory_keys(kb, state.rope_dim, *ln)
    append_hat = None                                # LN_s of the key each token would get as a new row
    if step.n_append > 0 or growth is not None:
        everyone = torch.ones_like(gb, dtype=torch.bool)
        ak, _, _ = token_streams(kbar, vb, gb, everyone, gate_keys=gate_keys, gate_values=gate_values,
                                 gate_appends=gate_appends)
        append_hat = state_layer_norm(ak, *ln)
    rows_hat, _ = _readout_cached(state, ln)         # LN_s of the state: shared with the attention readout
    fused = attn == "triton" and state.keys.dtype == torch.float32 and state.radii.dtype == torch.float32
    if fused:
        from kvmeans.ops.triton import update as tri
        route = tri.route_overflow_triton
    else:
        route = route_overflow
    if growth is not None:
        dest, app, state.row_count = route_novelty(rows_hat, state.rows_in_use(), kbar, append_hat, growth.threshold,
                                                   growth.n, state.sink_len)
        m1 = max(state.num_rows, int(state.row_count.max()))
    else:
        dest, app = route(rows_hat, kbar, append_hat, step.n_append, state.sink_len)
        m1 = step.rows_after
    dk, dv, rad = token_streams(kbar, vb, gb, app, gate_keys=gate_keys, gate_values=gate_values,
                                gate_appends=gate_appends)
    _reserve_rows(state, m1)
    if fused:                                        # fp32 atomics into the preallocated buffers
        d32 = dest.to(torch.int32)
        tri.scatter_add_rows(state.keys, d32, dk)
        tri.scatter_add_rows(state.values, d32, dv)
        radius = torch.where(app, rad, 0) if state.value_radius else torch.ones_like(rad)
        tri.scatter_add_rows(state.radii.unsqueeze(-1), d32, radius.unsqueeze(-1))
    else:
        state.add_rows_(dest, dk, dv, torch.where(app, rad, 0) if state.value_radius else torch.ones_like(rad))
    state.num_rows, state.coverage, state._readout = m1, step.start + state.chunk_len, None
    return dest, app


def _readout_cached(state: KVMState, ln):
    w, b, eps = ln
    key = (state.num_rows, id(w), None if w is None else w._version, id(b), None if b is None else b._version, eps)
    if state._readout is None or state._readout[0] != key:
        k_hat, v_hat = readout(*state.rows(), state.value_radius, *ln)
        joint = _joint(state)
        if joint is not None:           # kept right before the window (see _attend_one)
            kj, vj, cap = joint
            m = state.num_rows
            k_hat, v_hat = kj[:, :, cap - m:cap].copy_(k_hat), vj[:, :, cap - m:cap].copy_(v_hat)
        state._readout = (key, k_hat, v_hat)
    return state._readout[1], state._readout[2]


def _joint(state: KVMState):
    """``(keys, values, cap)``: the buffers ``[B, Hkv, cap + window_capacity, D|Dv]`` whose slots from ``cap`` on are
    the state's window buffers (:func:`_alloc`), or None when the state's buffers are not laid out so."""
    joint = getattr(state, "_joint", None) if state._owned else None
    if joint is None or state.window_keys._base is not joint[0] or state.window_values._base is not joint[1]:
        return None
    cap = joint[0].shape[2] - state.window_capacity
    return (*joint, cap) if state.num_rows <= cap else None


def _attend_one(state: KVMState, q: Tensor, joint, ln, state_temp, bswa_temp, scale) -> Tensor:
    """One query ``[B, H, 1, D]`` (the last window token's position) over ``[state ; window]``: one matmul pair on
    the joint buffer, temperatures on the scores; ``[B, H, 1, Dv]``. Nothing is masked: a non-finite operand
    reaches the output through the products, as in :func:`_attend`."""
    B, H, _, D = q.shape
    kj, vj, cap = joint
    m = 0
    if state.window_start > 0:
        _readout_cached(state, ln)
        m = state.num_rows
    w, Hkv = state.window_len, kj.shape[1]
    s = (q.reshape(B, Hkv, H // Hkv, D) * scale) @ kj[:, :, cap - m:cap + w].transpose(-1, -2)   # [B, Hkv, rep, m+w]
    s[..., :m].mul_(state_temp.view(1, Hkv, -1, 1))
    s[..., m:].mul_(bswa_temp.view(1, Hkv, -1, 1))
    if m and state.row_count is not None:
        s[..., :m].masked_fill_(_unused_rows(state), -math.inf)
    return (torch.softmax(s, -1) @ vj[:, :, cap - m:cap + w]).view(B, H, 1, -1)


def _attend(state: KVMState, q: Tensor, q_start: int, ln, state_temp, bswa_temp, scale) -> Tensor:
    """Queries ``[B, H, t, D]`` at positions ``q_start...`` over ``[state ; window]``; returns ``[B, H, t, Dv]``."""
    B, H, t, D = q.shape
    joint = _joint(state) if t == 1 else None
    if joint is not None:
        return _attend_one(state, q, joint, ln, state_temp, bswa_temp, scale)
    Hkv = state.keys.shape[1]
    rep = H // Hkv
    group = lambda x: x.reshape(B, Hkv, rep * t, x.shape[-1])          # query heads of one kv head together
    wk, wv, k_hat, v_hat, seen_bad = _operands(state, ln, q_start, t, *state.window()[:2])
    scores = group(q * (bswa_temp * scale).view(1, H, 1, 1)) @ wk.transpose(-1, -2)   # [B, Hkv, rep*t, w]
    if t > 1:   # causal inside the window: window token j sits at position window_start + j
        q_pos = torch.arange(q_start, q_start + t, device=q.device).repeat(rep).view(rep * t, 1)
        k_pos = torch.arange(state.window_start, state.seen_tokens, device=q.device)
        scores = scores.masked_fill(k_pos > q_pos, -math.inf)
    if k_hat is None:                                                   # the state is not active yet
        y = torch.softmax(scores, -1) @ wv
    else:
        s_scores = group(q * (state_temp * scale).view(1, H, 1, 1)) @ k_hat.transpose(-1, -2)
        if state.row_count is not None:
            s_scores.masked_fill_(_unused_rows(state), -math.inf)
        p = torch.softmax(torch.cat([s_scores, scores], -1), -1)    # one softmax over [state ; window]
        m = k_hat.shape[2]
        y = p[..., :m] @ v_hat + p[..., m:] @ wv                       # [B, Hkv, rep*t, Dv]; no copy of the state
    y = y.view(B, H, t, -1)
    return poison(y, *seen_bad)


def _unused_rows(state: KVMState) -> Tensor:
    """``[B, Hkv, 1, num_rows]`` bool: rows beyond each (sequence, kv head)'s ``row_count`` (hidden from the read)."""
    return (torch.arange(state.num_rows, device=state.device) >= state.row_count.unsqueeze(-1)).unsqueeze(2)


def _attend_triton(state: KVMState, q: Tensor, q_start: int, ln, state_temp, bswa_temp, scale) -> Tensor:
    """:func:`_attend` with :func:`kvmeans.ops.triton.decode.decode_attention` (queries = last window tokens)."""
    from kvmeans.ops.triton.decode import decode_attention
    t = q.shape[2]
    wk, wv, k_hat, v_hat, seen_bad = _operands(state, ln, q_start, t, state.window_keys, state.window_values)
    lengths = _decode_lengths(state, 0 if k_hat is None else state.num_rows, state.window_len, t)
    if k_hat is not None and state.row_count is not None:   # novelty growth: [B, Hkv, 2], rows per (b, kv head)
        lengths = torch.stack([state.row_count.to(torch.int32), lengths[1].expand(state.row_count.shape)], -1)
    y = decode_attention(q, k_hat, v_hat, wk, wv, lengths, state_temp, bswa_temp, scale)
    return poison(y, *seen_bad)


def _operands(state: KVMState, ln, q_start: int, t: int, wk: Tensor, wv: Tensor):
    """``(wk, wv, k_hat, v_hat, seen_bad)`` for the queries ``[q_start, q_start + t)``: the window keys / values
    (``wk, wv`` hold the window from its first token), the read-out state (None while inactive) and which
    queries see a non-finite token (masks for :func:`kvmeans.ops.masking.poison`). A single query masks
    nothing: its operands are used as they are, with no extra pass per decode step."""
    k_hat = v_hat = None
    if state.window_start > 0:
        k_hat, v_hat = _readout_cached(state, ln)
    if t == 1:
        return wk, wv, k_hat, v_hat, ()
    wk, wv, bad = finite_tokens(wk, wv)
    seen_bad = [window_poison(None if bad is None else bad[:, :, :state.window_len], state.window_start, q_start,
                              q_start + t, state.chunk_len, state.n_bswa_chunks)]
    if k_hat is not None:
        k_hat, v_hat, bad_rows = finite_tokens(k_hat, v_hat)
        seen_bad.append(rows_poison(bad_rows))
    return wk, wv, k_hat, v_hat, seen_bad


def _decode_lengths(state: KVMState, rows: int, window_len: int, t: int) -> Tensor:
    """The persistent int32 ``[rows, window_len]`` device tensor of the decode kernel, brought up to date in
    place. Between chunk boundaries (rows unchanged, the window grown by the ``t`` new tokens) that is one
    device-side ``lengths[1:] += t``: no host tensor, no host-to-device copy, and the same tensor (pointer)
    every step, so a steady-state step could be replayed from a CUDA graph. At a boundary (absorb, slide,
    a state another path advanced) both entries are rewritten with ``fill_``."""
    held = getattr(state, "_lengths", None)
    if held is None or held[0].device != state.device:   # an owned state from before this buffer existed
        held = state._lengths = (torch.zeros(2, dtype=torch.int32, device=state.device), [0, 0])
    buf, host = held                                     # host: what buf holds, mirrored without a sync
    if host[0] == rows and host[1] + t == window_len:
        buf[1:].add_(t)
    elif host != [rows, window_len]:
        buf[0].fill_(rows)
        buf[1].fill_(window_len)
    host[0], host[1] = rows, window_len
    return buf
