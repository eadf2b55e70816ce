"""The KVM spec in code: a readable chunk-by-chunk loop, out-of-place and differentiable.

Every fast path is tested against this file. It follows the paper's Method section and
Algorithm 1 (pseudocode appendix), with the conventions of the authors' eager reference
(docs/reference-conventions.md §1 and §11). Slow on purpose.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.masking import finite_tokens, poison, rows_poison, window_poison
from kvmeans.ops.routing import memory_keys, readout, route_novelty, route_overflow, state_layer_norm, token_streams
from kvmeans.ops.schedule import bswa_begin, plan_updates
from kvmeans.ops.state import KVMState


def naive_kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, state: KVMState, *, budget,
                        state_norm_weight, state_norm_bias, state_norm_eps: float, state_temp: Tensor,
                        bswa_temp: Tensor, scale: float, gate_keys: bool = True, gate_values: bool = True,
                        gate_appends: bool = False):
    """Continue the sequence held by ``state`` with T new tokens; return ``(y [B,H,T,Dv], new_state)``.

    Inputs are already validated and in the compute dtype: q ``[B,H,T,D]``, k ``[B,Hkv,T,D]``,
    v ``[B,Hkv,T,Dv]``, gate ``[B,Hkv,T]``, temperatures ``[H]``. A fresh sequence is an empty state.
    """
    C, n, S, r = state.chunk_len, state.n_bswa_chunks, state.sink_len, state.rope_dim
    ln = (state_norm_weight, state_norm_bias, state_norm_eps)
    t0, T = state.seen_tokens, q.shape[2]
    K, V, R = state.rows()                    # s^K, s^V, rho  (raw sums, radii)
    wk, wv, wg = state.window()               # uncompressed tokens [window_start, t0)
    w_start, cov = state.window_start, state.coverage
    count = state.row_count                   # rows in use per (sequence, kv head); None: all K.shape[2]
    outs = []
    pos = t0
    while pos < t0 + T:
        e = min(t0 + T, (pos // C + 1) * C)   # queries [pos, e) lie in one chunk
        new = slice(pos - t0, e - t0)
        wk = torch.cat([wk, k[:, :, new]], 2)
        wv = torch.cat([wv, v[:, :, new]], 2)
        wg = torch.cat([wg, gate[:, :, new]], 2)

        # 1. Initial state = the first chunk, copied: s^K_i = k_bar_i, s^V_i = v_i, rho_i = |v_i|.
        if cov < min(e, C):
            idx = slice(cov - w_start, min(e, C) - w_start)
            K = torch.cat([K, memory_keys(wk[:, :, idx], r, *ln)], 2)
            V = torch.cat([V, wv[:, :, idx]], 2)
            R = torch.cat([R, wv[:, :, idx].norm(dim=-1) if state.value_radius else torch.ones_like(wg[:, :, idx])], 2)
            cov = min(e, C)

        # 2. Each block that left the window enters the state: append the least redundant tokens,
        #    merge the rest into their most similar non-sink row (paper "Append", "Merge").
        for step in plan_updates(budget, cov, K.shape[2], e, C, n):
            blk = slice(step.start - w_start, step.start + C - w_start)
            kbar = memory_keys(wk[:, :, blk], r, *ln)
            dummy = torch.zeros_like(wg[:, :, blk], dtype=torch.bool)
            ak, _, _ = token_streams(kbar, wv[:, :, blk], wg[:, :, blk], ~dummy, gate_keys=gate_keys,
                                     gate_values=gate_values, gate_appends=gate_appends)
            K_hat, ak_hat = state_layer_norm(K, *ln).detach(), state_layer_norm(ak, *ln).detach()
            if is_data_dependent(budget):    # novel tokens appended per (sequence, kv head), within the cap
                count = torch.full(K.shape[:2], K.shape[2], device=K.device) if count is None else count
                dest, appended, count = route_novelty(K_hat, count, kbar.detach(), ak_hat, budget.threshold,
                                                      budget.n, S)
                pad = int(count.max()) - K.shape[2]
            else:
                dest, appended = route_overflow(K_hat, kbar.detach(), ak_hat, step.n_append, S)
                pad = step.n_append
            dk, dv, rad = token_streams(kbar, wv[:, :, blk], wg[:, :, blk], appended, gate_keys=gate_keys,
                                        gate_values=gate_values, gate_appends=gate_appends)
            K = torch.cat([K, K.new_zeros(*K.shape[:2], pad, K.shape[3])], 2)
            V = torch.cat([V, V.new_zeros(*V.shape[:2], pad, V.shape[3])], 2)
            K = K.scatter_add(2, dest.unsqueeze(-1).expand_as(dk), dk)       # s_new = s_+ + sum of merged
            V = V.scatter_add(2, dest.unsqueeze(-1).expand_as(dv), dv)
            if state.value_radius:   # rho of a new row = |its appended value|; merges leave rho unchanged
                R = torch.cat([R, R.new_zeros(*R.shape[:2], pad)], 2).scatter_add(2, dest,
                                                                                 torch.where(appended, rad, 0))
            else:                    # ablation: count tokens per row
                R = torch.cat([R, R.new_zeros(*R.shape[:2], pad)], 2).scatter_add(2, dest, torch.ones_like(rad))
            cov = step.start + C

        # 3. Tokens that left the window are dropped from it.
        drop = bswa_begin(e, C, n) - w_start
        wk, wv, wg = wk[:, :, drop:], wv[:, :, drop:], wg[:, :, drop:]
        w_start += drop

        # 4. One softmax over [tau_state * LN_s(s^K) ; tau_bswa * k_window] (state only once active).
        outs.append(_attend(q[:, :, new], K, V, R, wk, wv, pos, w_start, state.value_radius, ln, state_temp,
                            bswa_temp, scale, use_state=w_start > 0, geometry=(C, n), count=count))
        pos = e

    out_state = KVMState(K, V, R, wk, wv, wg, num_rows=K.shape[2], seen_tokens=t0 + T, coverage=cov,
                         chunk_len=C, n_bswa_chunks=n, sink_len=S, rope_dim=r, value_radius=state.value_radius,
                         extras=state.extras, row_count=count)
    return torch.cat(outs, 2), out_state


def _attend(q, K, V, R, wk, wv, q_start, w_start, value_radius, ln, state_temp, bswa_temp, scale, use_state, geometry,
            count=None):
    """Queries ``[B,H,t,D]`` at positions ``q_start...`` over ``[state ; window]``, causal in the window.
    Masked tokens contribute exactly zero; an output that sees a non-finite key or value is NaN
    (:mod:`kvmeans.ops.masking`). ``geometry = (C, n)``; ``count [B, Hkv]``: state rows in use (None: all)."""
    H, Hkv = q.shape[1], wk.shape[1]
    rep = lambda x: x.repeat_interleave(H // Hkv, dim=1)       # query head h reads kv head h // (H/Hkv)
    tq, tw = q.shape[2], wk.shape[2]
    wk, wv, bad = finite_tokens(wk, wv)
    seen_bad = window_poison(bad, w_start, q_start, q_start + tq, *geometry)
    q_pos = torch.arange(q_start, q_start + tq, device=q.device)
    k_pos = torch.arange(w_start, w_start + tw, device=q.device)
    scores = (q @ (rep(wk) * bswa_temp.view(1, H, 1, 1)).transpose(-1, -2)) * scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    values = rep(wv)
    state_bad = None
    if use_state:
        k_hat, v_hat, bad_rows = finite_tokens(*readout(K, V, R, value_radius, *ln))
        state_bad = rows_poison(bad_rows)
        s_scores = (q @ (rep(k_hat) * state_temp.view(1, H, 1, 1)).transpose(-1, -2)) * scale
        if count is not None:       # rows not in use for this (sequence, kv head) are hidden
            unused = torch.arange(K.shape[2], device=q.device) >= rep(count).view(*count.shape[:1], H, 1, 1)
            s_scores = s_scores.masked_fill(unused, -math.inf)
        scores = torch.cat([s_scores, scores], -1)
        values = torch.cat([rep(v_hat), values], 2)
    return poison(torch.softmax(scores, -1) @ values, seen_bad, state_bad)
