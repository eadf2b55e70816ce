"""The chunked path without autograd (inference prefill): the state advances in place, chunk by chunk.

The recurrent path's buffers and cached read-out are used (:mod:`kvmeans.ops.state`: one LN_s per state version,
shared by routing and attention), while all chunks of a group attend in one call: masked SDPA, the joined read
of whole chunks on CPU (:func:`kvmeans.ops.chunk.flash.joined_attention`) or the Triton kernel.
"""
from __future__ import annotations

import torch

from kvmeans.ops.chunk import attend, flash, plan
from kvmeans.ops.masking import finite_tokens, poison, window_poison
from kvmeans.ops.schedule import bswa_begin
from kvmeans.ops.state import KVMState, absorb, own_buffers, readout_cached


@torch.no_grad()
def prefill_no_grad(q, kk, vv, gg, state: KVMState, *, budget, ln, state_temp, bswa_temp, scale, group_bytes, gates,
                    attn="torch", mma_dtype=None):
    """Advance ``state`` in place over the queries ``q [B, H, T, D]`` and return ``(y [B, H, T, Dv], state)``.
    ``kk, vv, gg`` hold tokens ``[window_start, t1)``; ``ln = (weight, bias, eps)`` of LN_s; ``gates`` the flags
    ``(gate_keys, gate_values, gate_appends)``."""
    C, n = state.chunk_len, state.n_bswa_chunks
    B, H, T, _ = q.shape
    Hkv, t0, w0 = kk.shape[1], state.seen_tokens, state.window_start
    t1 = t0 + T
    rows_at = plan.rows_visible(state, plan.planned_rows(state, budget, t1), t1)
    own_buffers(state, rows=max(rows_at + [state.num_rows]), window=t1 - bswa_begin(t1, C, n))
    c_first, c_last = t0 // C, (t1 - 1) // C
    tri = attn == "triton"      # snapshots [B, G, Hkv, 1, M, D] without temperature; the window is read from kk/vv
    per_row = B * H * (C + q.shape[3] + vv.shape[3]) * q.element_size()
    if tri:                 # snapshot rows per chunk only (read-out keys and values per kv head)
        per_row = B * Hkv * (q.shape[3] + vv.shape[3]) * q.element_size()
    split = not tri and flash.available(q, vv)
    kind = (lambda c: (rows_at[c] > 0, plan.whole_window(c, C, n, w0))) if split else None
    groups = plan.groups(c_first, c_last, rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn, kind)
    ka, va, bad = finite_tokens(kk, vv)         # attention operands: masked tokens must contribute exactly zero
    qa, ka, va = (x.to(mma_dtype) for x in (q, ka, va)) if mma_dtype else (q, ka, va)
    temp = state_temp.view(1, Hkv, H // Hkv, 1, 1)
    y = q.new_empty(B, H, T, vv.shape[3])
    for ca, cb in groups:
        M, G = rows_at[cb - 1], cb - ca
        lo, hi = max(ca * C, t0) - t0, min(cb * C, t1) - t0
        qg = qa[:, :, lo:hi]
        joined = split and hi - lo == G * C and plan.whole_window(ca, C, n, w0)
        if tri or joined:       # snapshots per kv head: the temperature goes with the queries
            keys, values = (qa.new_empty(B, G, Hkv, 1, M, x.shape[-1]) for x in (kk, vv))
        else:
            kw, vw = (plan.windows(x, w0, *plan.window_geometry(ca, cb, C, n, t0, t1, w0)[1:], C) for x in (ka, va))
            keys, values = attend.group_operands(qg, kw, vw, bswa_temp, M)
        stale = None        # [B, G, Hkv]: the chunk's snapshot holds a non-finite row (None: none does)
        for g, c in enumerate(range(ca, cb) if M else ()):
            m = 0
            if c >= n:      # bring the state to what chunk c sees, then read it out once
                absorb(state, kk, vv, gg, w0, (c + 1) * C, budget, ln, *gates, attn=attn)
                k_hat, v_hat, bad_rows = finite_tokens(*readout_cached(state, ln))
                if bad_rows is not None:
                    stale = q.new_zeros(B, G, Hkv, dtype=torch.bool) if stale is None else stale
                    stale[:, g] = bad_rows.any(-1)
                m = state.num_rows
                if tri or joined:
                    keys[:, g, :, 0, :m] = k_hat
                else:
                    torch.mul(k_hat.unsqueeze(2), temp, out=keys[:, g, :, :, :m])   # written once, no temporary
                values[:, g, :, :, :m] = v_hat.unsqueeze(2)
            keys[:, g, :, :, m:M] = 0                   # hidden by the mask, but must be finite
            values[:, g, :, :, m:M] = 0
        if joined:
            out = flash.joined_attention(y[:, :, lo:hi], qg, keys, values, rows_at[ca:cb], ka, va, ca * C - w0,
                                         state_temp, bswa_temp, C=C, n=n, scale=scale)
        elif tri:
            out = attend.triton_group(ca, cb, qg, keys.squeeze(3) if M else None, values.squeeze(3) if M else None,
                                      ka, va, w0, state_temp, bswa_temp, C=C, n=n, t0=t0, t1=t1, rows_at=rows_at,
                                      scale=scale)
        else:
            mask = plan.group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, q.device)
            out = attend.group_sdpa(qg, keys, values, mask, scale)
        if not joined or stale is not None:
            y[:, :, lo:hi] = attend.poison_chunks(out, stale)
    y = poison(y, window_poison(bad, w0, t0, t1, C, n))
    absorb(state, kk, vv, gg, w0, t1, budget, ln, *gates, attn=attn)          # the lazy final coverage
    ws, wl = bswa_begin(t1, C, n) - w0, t1 - bswa_begin(t1, C, n)
    state.window_keys[:, :, :wl] = kk[:, :, ws:]
    state.window_values[:, :, :wl] = vv[:, :, ws:]
    state.window_gates[:, :, :wl] = gg[:, :, ws:]
    state.seen_tokens = t1
    return y, state
