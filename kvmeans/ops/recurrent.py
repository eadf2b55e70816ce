"""Recurrent KVM: continue a carried state with 1 (decode), a few, or many tokens; no autograd.

Buffers are preallocated and written in place (:func:`kvmeans.ops.state.own_buffers`): state rows grow
geometrically, the window buffer holds at most ``L`` tokens and slides by one chunk when a block leaves it (one
copy per C tokens): a block is absorbed (:func:`kvmeans.ops.state.absorb`) before the tokens that push it out are
written. The JIT-normalised state is cached between chunk boundaries, right before the window in one buffer per
keys / values (:func:`kvmeans.ops.state.joint_buffers`), so a one-token step reads ``[read-out rows ; window]``
with one matmul pair, costs O((rows + window) * D) per head and never grows with the tokens seen.
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

from kvmeans.ops.masking import finite_tokens, poison, rows_poison, window_poison
from kvmeans.ops.schedule import bswa_begin, coverage_after
from kvmeans.ops.state import KVMState, absorb, joint_buffers, own_buffers, readout_cached, write_window


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
        joint = joint_buffers(state)         # a step inside a chunk: no block leaves the window, nothing to absorb
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
            write_window(state, pos - w_old, k[:, :, new], v[:, :, new], gate[:, :, new])
            absorb(state, *wbuf(), w_old, e, budget, ln, gate_keys, gate_values, gate_appends, attn=attn)
        else:               # a block leaving the window lies before pos: absorb it, slide, then write (<= L tokens)
            absorb(state, *wbuf(), w_old, e, budget, ln, gate_keys, gate_values, gate_appends, attn=attn)
            drop, keep = w_new - w_old, pos - w_new
            if drop and keep:                             # slide the window by the block(s) that left it
                for buf in wbuf():
                    buf[:, :, :keep] = buf[:, :, drop:drop + keep].clone()
            write_window(state, pos - w_new, k[:, :, new], v[:, :, new], gate[:, :, new])
        state.seen_tokens = e
        if attn == "triton":
            outs.append(_attend_triton(state, q[:, :, new], pos, ln, state_temp, bswa_temp, scale))
        else:
            outs.append(_attend(state, q[:, :, new], pos, ln, state_temp, bswa_temp, scale))
        pos = e
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), state


def _attend_one(state: KVMState, q: Tensor, joint, ln, state_temp, bswa_temp, scale) -> Tensor:
    """One query ``[B, H, 1, D]`` (the last window token's position) over ``[state ; window]``: one matmul pair on
    the joint buffer, temperatures on the scores; ``[B, H, 1, Dv]``. Nothing is masked: a non-finite operand
    reaches the output through the products, as in :func:`_attend`."""
    B, H, _, D = q.shape
    kj, vj, cap = joint
    m = 0
    if state.window_start > 0:
        readout_cached(state, ln)
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
    joint = joint_buffers(state) if t == 1 else None
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
        k_hat, v_hat = readout_cached(state, ln)
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
