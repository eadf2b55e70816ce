"""Fused joint-softmax attention over ``[state snapshot rows ; causal block window]`` for many query chunks.

Query chunk ``c`` (positions ``[c*C, (c+1)*C)``) attends to

* the first ``rows[b, kv head, c - c_first]`` rows of its *own* state snapshot (a count per batch row and kv
  head: a data-dependent budget grows heads apart), already read out (``LN_s`` keys, radius-scaled values),
  scores scaled by ``state_temp[h] * scale``;
* the window keys at positions ``[(c+1-n)*C, (c+1)*C)`` that exist (``>= k_start``), causally
  (key position <= query position), scores scaled by ``bswa_temp[h] * scale``;

with one online softmax (fp32 running max / sum, base-2 exponentials). This is exactly what
``chunk.plan.group_mask`` / ``chunk.attend.group_sdpa`` compute, without materialising the window per chunk
(window keys are indexed by position in one ``[B, Hkv, N, D]`` tensor), without repeating keys per
query head (GQA: the ``REP = H / Hkv`` query heads of a kv head are stacked as the rows of one tile,
so every key/value tile is loaded once per kv head), and without scaling keys by the temperatures
(they multiply the scores; their gradients are reductions over ``q . dq``).

Kernels (grids in brackets; ``G`` query chunks, ``REP = H // Hkv``):

* ``_fwd_kernel``       [cdiv(REP*C, BLOCK_M), G, B*Hkv]  output + base-2 log-sum-exp per query row;
* ``_bwd_dq_kernel``    same grid: recompute P from q, keys and the LSE (flash-attention-2), dq, and
  per-row ``q . dq_state`` / ``q . dq_window`` for the temperature gradients;
* ``_bwd_dkv_state_kernel`` [cdiv(M, BLOCK_N), G, B*Hkv]: d(state keys / values) of each snapshot
  (a snapshot is read only by its own chunk's queries: no atomics);
* ``_bwd_dkv_window_kernel`` [cdiv(N, BLOCK_N), B*Hkv]: d(window keys / values); a key is read by the
  queries of its own chunk (causally) and of the next ``n-1`` chunks: loop over those, no atomics.

:class:`ChunkAttention` wraps them as a ``torch.autograd.Function`` so the differentiable snapshot rebuild
in ``kvmeans.ops.chunk`` chains to it (gradients reach k, v, gate, LN_s affine through torch).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
_POS_ARGS = ["q_start", "q_lo", "q_hi", "k_start", "ca", "C", "NB", "NK"]   # positions: never specialise on 1

# tiles for the compiled kernels (autotuned per shape); the interpreter runs one small fixed tile
_FWD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                for m, n, w, s in [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3),
                                   (32, 64, 4, 2), (32, 32, 2, 3), (16, 64, 4, 2)]]
_BWD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                for m, n, w, s in [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 3),
                                   (128, 64, 8, 2), (16, 32, 2, 2)]]
INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 16}
FIXED_META = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def autotuned() -> bool:
    """Compiled kernels try their candidate tiles once per shape key unless ``KVMEANS_TRITON_AUTOTUNE=0``, which
    launches one fixed tile (the tests set it: they check values, and autotuning compiles every candidate for every
    new shape, minutes for the test files on a GPU)."""
    return os.environ.get("KVMEANS_TRITON_AUTOTUNE", "1") != "0"


@triton.jit
def _query_rows(pid_m, c, kvh, q_lo, q_hi, C, REP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of a query tile: the REP query heads of kv head ``kvh`` stacked, C queries of chunk c each."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = r // C
    qpos = c * C + r % C
    ok = (r < REP * C) & (qpos >= q_lo) & (qpos < q_hi)
    return kvh * REP + j, qpos, ok


@triton.jit
def _load_kv(k_ptr, v_ptr, idx, s_k, s_v, kmask, offs_d, offs_dv, dmask, dvmask):
    """Key and value tiles of rows ``idx`` (row strides ``s_k`` / ``s_v``); masked rows read as 0."""
    k = tl.load(k_ptr + idx[:, None] * s_k + offs_d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
    v = tl.load(v_ptr + idx[:, None] * s_v + offs_dv[None, :], mask=kmask[:, None] & dvmask[None, :], other=0.0)
    return k, v


@triton.jit
def _load_queries(Q, DO, LSE, DELTA, b, head, qpos, qm, q_start, s_qb, s_qh, s_qt, s_ob, s_oh, s_ot, HKV, TQ,
                  offs_d, offs_dv, dmask, dvmask, REP: tl.constexpr):
    """What a backward kernel reads of the queries at positions ``qpos`` of ``head`` (one head or one per row):
    q, dO, and the per-row LSE / delta; masked rows read as 0."""
    q = tl.load(Q + (b * s_qb + head * s_qh + (qpos - q_start) * s_qt)[:, None] + offs_d[None, :],
                mask=qm[:, None] & dmask[None, :], other=0.0)
    do = tl.load(DO + (b * s_ob + head * s_oh + (qpos - q_start) * s_ot)[:, None] + offs_dv[None, :],
                 mask=qm[:, None] & dvmask[None, :], other=0.0)
    row = (b * HKV * REP + head) * TQ + qpos - q_start
    lse = tl.load(LSE + row, mask=qm, other=0.0)
    delta = tl.load(DELTA + row, mask=qm, other=0.0)
    return q, do, lse, delta


@triton.jit
def _softmax_step(q, k, v, scale, valid, m_i, l_i, acc, PREC: tl.constexpr):
    """One key tile of the online softmax: scores ``q . k * scale`` (base 2, ``scale`` per query row),
    ``valid`` masks them; returns the updated running max, sum and output accumulator."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale[:, None]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _dq_step(q, k, v, do, lse, delta, scale, valid, PREC: tl.constexpr):
    """dS @ K of one key tile (flash-attention-2): P recomputed from the LSE, ``dS = P * (dO . V - delta)``."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale[:, None]
    p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def _dkv_step(k, v, q, do, lse, delta, scale, valid_t, PREC: tl.constexpr):
    """``(dV, dS^T @ Q)`` contributions of one query tile to a key tile, computed transposed
    (``valid_t [keys, queries]``); the caller applies the key's temperature to the second."""
    s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * scale
    p_t = tl.where(valid_t, tl.math.exp2(s_t - lse[None, :]), 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    return dv, tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)


@triton.jit(do_not_specialize=_POS_ARGS)
def _fwd_kernel(Q, SK, SV, ROWS, WK, WV, STEMP, BTEMP, OUT, LSE,
                s_qb, s_qh, s_qt, s_ob, s_oh, s_ot,
                s_kb, s_kg, s_kh, s_km, s_vb, s_vg, s_vh, s_vm, s_rb, s_rh,
                s_wkb, s_wkh, s_wkt, s_wvb, s_wvh, s_wvt,
                HKV, D, DV, NK, TQ, q_start, q_lo, q_hi, k_start, ca, C, NB, sm_scale,
                REP: tl.constexpr, HAS_STATE: tl.constexpr, PREC: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, g, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = bh // HKV, bh % HKV
    c = ca + g
    head, qpos, ok = _query_rows(pid_m, c, kvh, q_lo, q_hi, C, REP, BLOCK_M)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    dmask, dvmask = offs_d < D, offs_dv < DV
    q = tl.load(Q + b * s_qb + head[:, None] * s_qh + (qpos - q_start)[:, None] * s_qt + offs_d[None, :],
                mask=ok[:, None] & dmask[None, :], other=0.0)
    log2_scale = sm_scale * 1.4426950408889634
    bt = tl.load(BTEMP + head, mask=ok, other=0.0).to(tl.float32) * log2_scale
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_STATE:
        st = tl.load(STEMP + head, mask=ok, other=0.0).to(tl.float32) * log2_scale
        n_rows = tl.load(ROWS + b * s_rb + kvh * s_rh + g)
        sk = SK + b * s_kb + g * s_kg + kvh * s_kh
        sv = SV + b * s_vb + g * s_vg + kvh * s_vh
        for start in range(0, n_rows, BLOCK_N):
            rows = start + offs_n
            kmask = rows < n_rows
            k, v = _load_kv(sk, sv, rows, s_km, s_vm, kmask, offs_d, offs_dv, dmask, dvmask)
            m_i, l_i, acc = _softmax_step(q, k, v, st, ok[:, None] & kmask[None, :], m_i, l_i, acc, PREC)
    # window: keys [(c+1-n)*C, (c+1)*C) that exist, causal (up to the tile's last query)
    lo = tl.maximum((c + 1 - NB) * C, k_start)
    hi = tl.minimum((c + 1) * C, tl.minimum(k_start + NK, q_hi))
    hi = tl.minimum(hi, tl.max(tl.where(ok, qpos, -1)) + 1)      # key tiles past the tile's last query: all masked
    wk = WK + b * s_wkb + kvh * s_wkh
    wv = WV + b * s_wvb + kvh * s_wvh
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        kmask = kpos < hi
        k, v = _load_kv(wk, wv, kpos - k_start, s_wkt, s_wvt, kmask, offs_d, offs_dv, dmask, dvmask)
        m_i, l_i, acc = _softmax_step(q, k, v, bt, ok[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None]),
                                      m_i, l_i, acc, PREC)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(OUT + b * s_ob + head[:, None] * s_oh + (qpos - q_start)[:, None] * s_ot + offs_dv[None, :],
             out.to(OUT.dtype.element_ty), mask=ok[:, None] & dvmask[None, :])
    tl.store(LSE + (b * HKV * REP + head) * TQ + qpos - q_start, m_i + tl.math.log2(l_safe), mask=ok)


@triton.jit(do_not_specialize=_POS_ARGS)
def _bwd_dq_kernel(Q, SK, SV, ROWS, WK, WV, STEMP, BTEMP, DO, LSE, DELTA, DQ, TS, TW,
                   s_qb, s_qh, s_qt, s_ob, s_oh, s_ot,
                   s_kb, s_kg, s_kh, s_km, s_vb, s_vg, s_vh, s_vm, s_rb, s_rh,
                   s_wkb, s_wkh, s_wkt, s_wvb, s_wvh, s_wvt,
                   HKV, D, DV, NK, TQ, q_start, q_lo, q_hi, k_start, ca, C, NB, sm_scale,
                   REP: tl.constexpr, HAS_STATE: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq (q's layout; DO shares OUT's strides) and per-row ``scale * q . dq_state`` (TS), ``... window`` (TW)."""
    pid_m, g, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = bh // HKV, bh % HKV
    c = ca + g
    head, qpos, ok = _query_rows(pid_m, c, kvh, q_lo, q_hi, C, REP, BLOCK_M)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    dmask, dvmask = offs_d < D, offs_dv < DV
    q, do, lse, delta = _load_queries(Q, DO, LSE, DELTA, b, head, qpos, ok, q_start, s_qb, s_qh, s_qt, s_ob, s_oh,
                                      s_ot, HKV, TQ, offs_d, offs_dv, dmask, dvmask, REP)
    row = (b * HKV * REP + head) * TQ + qpos - q_start
    log2_scale = sm_scale * 1.4426950408889634
    bt = tl.load(BTEMP + head, mask=ok, other=0.0).to(tl.float32)
    dq_s = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq_w = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    st = tl.zeros([BLOCK_M], tl.float32)
    if HAS_STATE:
        st = tl.load(STEMP + head, mask=ok, other=0.0).to(tl.float32)
        n_rows = tl.load(ROWS + b * s_rb + kvh * s_rh + g)
        sk = SK + b * s_kb + g * s_kg + kvh * s_kh
        sv = SV + b * s_vb + g * s_vg + kvh * s_vh
        for start in range(0, n_rows, BLOCK_N):
            rows = start + offs_n
            kmask = rows < n_rows
            k, v = _load_kv(sk, sv, rows, s_km, s_vm, kmask, offs_d, offs_dv, dmask, dvmask)
            dq_s += _dq_step(q, k, v, do, lse, delta, st * log2_scale, ok[:, None] & kmask[None, :], PREC)
    lo = tl.maximum((c + 1 - NB) * C, k_start)
    hi = tl.minimum((c + 1) * C, tl.minimum(k_start + NK, q_hi))
    hi = tl.minimum(hi, tl.max(tl.where(ok, qpos, -1)) + 1)      # key tiles past the tile's last query: all masked
    wk = WK + b * s_wkb + kvh * s_wkh
    wv = WV + b * s_wvb + kvh * s_wvh
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        kmask = kpos < hi
        k, v = _load_kv(wk, wv, kpos - k_start, s_wkt, s_wvt, kmask, offs_d, offs_dv, dmask, dvmask)
        valid = ok[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        dq_w += _dq_step(q, k, v, do, lse, delta, bt * log2_scale, valid, PREC)
    qf = q.to(tl.float32)
    tl.store(TS + row, tl.sum(qf * dq_s, 1) * sm_scale, mask=ok)
    tl.store(TW + row, tl.sum(qf * dq_w, 1) * sm_scale, mask=ok)
    dq = (dq_s * st[:, None] + dq_w * bt[:, None]) * sm_scale
    tl.store(DQ + (b * s_qb + head * s_qh + (qpos - q_start) * s_qt)[:, None] + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=ok[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=_POS_ARGS)
def _bwd_dkv_state_kernel(Q, SK, SV, ROWS, STEMP, DO, LSE, DELTA, DSK, DSV,
                          s_qb, s_qh, s_qt, s_ob, s_oh, s_ot,
                          s_kb, s_kg, s_kh, s_km, s_vb, s_vg, s_vh, s_vm, s_rb, s_rh,
                          HKV, D, DV, TQ, q_start, q_lo, q_hi, ca, C, sm_scale,
                          REP: tl.constexpr, PREC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """d(state keys / values) of snapshot g, read by chunk ``ca + g``'s queries of all REP heads.
    DSK / DSV are contiguous like SK / SV (same strides); rows past ``ROWS[b, kvh, g]`` are left untouched (zeros)."""
    pid_n, g, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = bh // HKV, bh % HKV
    n_rows = tl.load(ROWS + b * s_rb + kvh * s_rh + g)
    if pid_n * BLOCK_N < n_rows:
        c = ca + g
        offs_d, offs_dv, offs_m = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_M)
        dmask, dvmask = offs_d < D, offs_dv < DV
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = rows < n_rows
        k_off = b * s_kb + g * s_kg + kvh * s_kh + rows[:, None] * s_km + offs_d[None, :]
        v_off = b * s_vb + g * s_vg + kvh * s_vh + rows[:, None] * s_vm + offs_dv[None, :]
        k = tl.load(SK + k_off, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(SV + v_off, mask=kmask[:, None] & dvmask[None, :], other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        lo = tl.maximum(c * C, q_lo)
        hi = tl.minimum((c + 1) * C, q_hi)
        for jj in tl.static_range(REP):
            head = kvh * REP + jj
            st = tl.load(STEMP + head).to(tl.float32) * sm_scale
            for start in range(lo, hi, BLOCK_M):
                qpos = start + offs_m
                qm = qpos < hi
                q, do, lse, delta = _load_queries(Q, DO, LSE, DELTA, b, head, qpos, qm, q_start, s_qb, s_qh, s_qt,
                                                  s_ob, s_oh, s_ot, HKV, TQ, offs_d, offs_dv, dmask, dvmask, REP)
                dv_t, dk_t = _dkv_step(k, v, q, do, lse, delta, st * 1.4426950408889634,
                                       kmask[:, None] & qm[None, :], PREC)
                dv += dv_t
                dk += dk_t * st
        tl.store(DSK + k_off, dk.to(DSK.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])
        tl.store(DSV + v_off, dv.to(DSV.dtype.element_ty), mask=kmask[:, None] & dvmask[None, :])


@triton.jit(do_not_specialize=_POS_ARGS)
def _bwd_dkv_window_kernel(Q, WK, WV, BTEMP, DO, LSE, DELTA, DWK, DWV,
                           s_qb, s_qh, s_qt, s_ob, s_oh, s_ot,
                           s_wkb, s_wkh, s_wkt, s_wvb, s_wvh, s_wvt,
                           HKV, D, DV, NK, TQ, q_start, q_lo, q_hi, k_start, C, NB, sm_scale,
                           REP: tl.constexpr, PREC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """d(window keys / values) of a key tile: the queries that see key p are those at positions
    ``[p, (p // C + n) * C)`` (its own chunk causally, the next n-1 chunks fully). DWK / DWV share WK / WV strides."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, kvh = bh // HKV, bh % HKV
    offs_d, offs_dv, offs_m = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_M)
    dmask, dvmask = offs_d < D, offs_dv < DV
    kfirst = k_start + pid_n * BLOCK_N
    kend = tl.minimum(kfirst + BLOCK_N, k_start + NK)
    kpos = kfirst + tl.arange(0, BLOCK_N)
    kmask = kpos < kend
    k_off = b * s_wkb + kvh * s_wkh + (kpos - k_start)[:, None] * s_wkt + offs_d[None, :]
    v_off = b * s_wvb + kvh * s_wvh + (kpos - k_start)[:, None] * s_wvt + offs_dv[None, :]
    k = tl.load(WK + k_off, mask=kmask[:, None] & dmask[None, :], other=0.0)
    v = tl.load(WV + v_off, mask=kmask[:, None] & dvmask[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = tl.maximum(kfirst, q_lo)
    hi = tl.minimum(q_hi, ((kend - 1) // C + NB) * C)
    for jj in tl.static_range(REP):
        head = kvh * REP + jj
        bt = tl.load(BTEMP + head).to(tl.float32) * sm_scale
        for start in range(lo, hi, BLOCK_M):
            qpos = start + offs_m
            qm = qpos < hi
            q, do, lse, delta = _load_queries(Q, DO, LSE, DELTA, b, head, qpos, qm, q_start, s_qb, s_qh, s_qt,
                                              s_ob, s_oh, s_ot, HKV, TQ, offs_d, offs_dv, dmask, dvmask, REP)
            first = ((qpos // C) + 1 - NB) * C                     # window start of each query's chunk
            valid = kmask[:, None] & qm[None, :] & (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] >= first[None, :])
            dv_t, dk_t = _dkv_step(k, v, q, do, lse, delta, bt * 1.4426950408889634, valid, PREC)
            dv += dv_t
            dk += dk_t * bt
    tl.store(DWK + k_off, dk.to(DWK.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])
    tl.store(DWV + v_off, dv.to(DWV.dtype.element_ty), mask=kmask[:, None] & dvmask[None, :])


_KEYS = ["C", "REP", "BLOCK_D", "BLOCK_DV", "HAS_STATE"]
_TUNED = {
    "fwd": triton.autotune(_FWD_CONFIGS, key=_KEYS)(_fwd_kernel),
    "dq": triton.autotune(_BWD_CONFIGS, key=_KEYS)(_bwd_dq_kernel),
    "dkv_state": triton.autotune(_BWD_CONFIGS, key=["C", "REP", "BLOCK_D", "BLOCK_DV"])(_bwd_dkv_state_kernel),
    "dkv_window": triton.autotune(_BWD_CONFIGS, key=["C", "REP", "BLOCK_D", "BLOCK_DV"])(_bwd_dkv_window_kernel),
}
_PLAIN = {"fwd": _fwd_kernel, "dq": _bwd_dq_kernel, "dkv_state": _bwd_dkv_state_kernel,
          "dkv_window": _bwd_dkv_window_kernel}


#: the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported)
INTERPRETED = not isinstance(_fwd_kernel, triton.runtime.JITFunction)


def launch(plain, tuned, grid, args, consts, interpret_meta, fixed_meta) -> None:
    """Run a kernel: ``tuned`` (its autotuned wrapper) on a GPU; ``plain`` with ``fixed_meta`` when
    ``KVMEANS_TRITON_AUTOTUNE=0``; ``plain`` with the small ``interpret_meta`` tile under the interpreter
    (autotuning there only burns time). ``grid(meta)`` gives the launch grid."""
    if INTERPRETED:
        plain[grid(interpret_meta)](*args, **consts, **interpret_meta)
    elif not autotuned():
        plain[grid(fixed_meta)](*args, **consts, **fixed_meta)
    else:
        tuned[grid](*args, **consts)


def _launch(name, grid, *args, **consts):
    launch(_PLAIN[name], _TUNED[name], grid, args, consts, INTERPRET_META, FIXED_META)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow torch's matmul setting (TF32 only if ``torch.backends.cuda.matmul.allow_tf32``)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _last_dim_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _geometry(q, sk, wk, q_lo, q_hi, C):
    B, H, TQ, D = q.shape
    Hkv = wk.shape[1]
    ca = q_lo // C
    G = (q_hi - 1) // C - ca + 1
    if sk is not None:
        assert sk.shape[1] == G, f"state snapshots {sk.shape[1]} != query chunks {G}"
    return B, H, TQ, D, Hkv, H // Hkv, ca, G


def _fwd(q, sk, sv, rows, wk, wv, state_temp, bswa_temp, geo):
    q_start, q_lo, q_hi, k_start, C, NB, scale = geo
    B, H, TQ, D, Hkv, REP, ca, G = _geometry(q, sk, wk, q_lo, q_hi, C)
    DV = wv.shape[-1]
    o = q.new_zeros(B, H, TQ, DV)
    lse = torch.zeros(B, H, TQ, dtype=torch.float32, device=q.device)
    has_state = sk is not None
    ssk, ssv, srow = (sk.stride(), sv.stride(), rows.stride()) if has_state else ((0,) * 5, (0,) * 5, (0,) * 3)
    grid = lambda META: (triton.cdiv(REP * C, META["BLOCK_M"]), G, B * Hkv)
    _launch("fwd", grid, q, sk if has_state else q, sv if has_state else q, rows if has_state else q, wk, wv,
            state_temp if has_state else bswa_temp, bswa_temp, o, lse,
            *q.stride()[:3], *o.stride()[:3], *ssk[:4], *ssv[:4], *srow[:2], *wk.stride()[:3], *wv.stride()[:3],
            Hkv, D, DV, wk.shape[2], TQ, q_start, q_lo, q_hi, k_start, ca, C, NB, scale,
            REP=REP, HAS_STATE=has_state, PREC=dot_precision(q.dtype), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV))
    return o, lse


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


class ChunkAttention(torch.autograd.Function):
    """Differentiable fused attention; see :func:`chunk_attention` for the arguments."""

    @staticmethod
    def forward(ctx, q, sk, sv, wk, wv, state_temp, bswa_temp, rows, geo, saved=None):
        # saved: (o, base-2 lse) of an earlier identical forward (the backward of kvmeans.ops.chunk.reconstruct
        # differentiates a group again without re-running the kernel)
        o, lse = _fwd(q, sk, sv, rows, wk, wv, state_temp, bswa_temp, geo) if saved is None else \
            (saved[0].detach(), saved[1])
        ctx.save_for_backward(q, sk, sv, wk, wv, state_temp, bswa_temp, rows, o, lse)
        ctx.geo = geo
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, sk, sv, wk, wv, state_temp, bswa_temp, rows, o, lse = ctx.saved_tensors
        q_start, q_lo, q_hi, k_start, C, NB, scale = ctx.geo
        B, H, TQ, D, Hkv, REP, ca, G = _geometry(q, sk, wk, q_lo, q_hi, C)
        DV = wv.shape[-1]
        # gradients are written with their operand's strides: dense operands (group slices are views)
        q, sk, sv, wk, wv, do = (None if t is None else t.contiguous() for t in (q, sk, sv, wk, wv, do))
        delta = (o.float() * do.float()).sum(-1)                         # rowsum(O * dO)  [B, H, TQ]
        has_state = sk is not None
        prec, bd, bdv = dot_precision(q.dtype), _pow2(D), _pow2(DV)
        dq = torch.zeros_like(q)
        ts = torch.zeros(B, H, TQ, dtype=torch.float32, device=q.device)
        tw = torch.zeros_like(ts)
        ssk, ssv, srow = (sk.stride(), sv.stride(), rows.stride()) if has_state else ((0,) * 5, (0,) * 5, (0,) * 3)
        grid = lambda META: (triton.cdiv(REP * C, META["BLOCK_M"]), G, B * Hkv)
        _launch("dq", grid, q, sk if has_state else q, sv if has_state else q, rows if has_state else q, wk, wv,
                state_temp if has_state else bswa_temp, bswa_temp, do, lse, delta, dq, ts, tw,
                *q.stride()[:3], *do.stride()[:3], *ssk[:4], *ssv[:4], *srow[:2], *wk.stride()[:3],
                *wv.stride()[:3],
                Hkv, D, DV, wk.shape[2], TQ, q_start, q_lo, q_hi, k_start, ca, C, NB, scale,
                REP=REP, HAS_STATE=has_state, PREC=prec, BLOCK_D=bd, BLOCK_DV=bdv)
        dwk, dwv = torch.zeros_like(wk), torch.zeros_like(wv)
        assert dq.stride() == q.stride() and dwk.stride() == wk.stride() and dwv.stride() == wv.stride()
        grid = lambda META: (triton.cdiv(wk.shape[2], META["BLOCK_N"]), B * Hkv)
        _launch("dkv_window", grid, q, wk, wv, bswa_temp, do, lse, delta, dwk, dwv,
                *q.stride()[:3], *do.stride()[:3], *wk.stride()[:3], *wv.stride()[:3],
                Hkv, D, DV, wk.shape[2], TQ, q_start, q_lo, q_hi, k_start, C, NB, scale,
                REP=REP, PREC=prec, BLOCK_D=bd, BLOCK_DV=bdv)
        dsk = dsv = dst = None
        if has_state:
            dsk, dsv = torch.zeros_like(sk), torch.zeros_like(sv)
            assert dsk.stride() == sk.stride() and dsv.stride() == sv.stride()
            grid = lambda META: (triton.cdiv(sk.shape[3], META["BLOCK_N"]), G, B * Hkv)
            _launch("dkv_state", grid, q, sk, sv, rows, state_temp, do, lse, delta, dsk, dsv,
                    *q.stride()[:3], *do.stride()[:3], *sk.stride()[:4], *sv.stride()[:4], *rows.stride()[:2],
                    Hkv, D, DV, TQ, q_start, q_lo, q_hi, ca, C, scale,
                    REP=REP, PREC=prec, BLOCK_D=bd, BLOCK_DV=bdv)
            dst = ts.sum((0, 2)).to(state_temp.dtype)
        dbt = tw.sum((0, 2)).to(bswa_temp.dtype)
        return dq, dsk, dsv, dwk, dwv, dst, dbt, None, None, None


def chunk_attention(q: Tensor, state_keys: Optional[Tensor], state_values: Optional[Tensor],
                    rows: Optional[Tensor], window_keys: Tensor, window_values: Tensor, state_temp: Tensor,
                    bswa_temp: Tensor, *, q_start: int, q_lo: int, q_hi: int, k_start: int, chunk_len: int,
                    n_bswa_chunks: int, scale: float, return_lse: bool = False, saved=None):
    """Joint-softmax KVM attention of the queries at positions ``[q_lo, q_hi)`` (one launch for all their chunks).

    Args:
        q: ``[B, H, TQ, D]``, row t at position ``q_start + t``; rows outside ``[q_lo, q_hi)`` get output 0.
        state_keys, state_values: ``[B, G, Hkv, M, D|Dv]`` read-out state snapshot of each query chunk
            ``c = q_lo // C + g`` (``LN_s`` keys without temperature, radius-scaled values), or None
            (no chunk sees a state).
        rows: rows of its snapshot each chunk sees (0 = none; the rest are never read), ``[G]`` (the same for
            every batch row and kv head) or ``[B, Hkv, G]`` (per batch row and kv head: states whose row count
            differs per head), integers; None without snapshots.
        window_keys, window_values: ``[B, Hkv, N, D|Dv]``, row t is the token at position ``k_start + t``.
        state_temp, bswa_temp: ``[H]`` inverse temperatures; scale: softmax scale.
        saved: ``(o, lse2)`` from :func:`chunk_attention_fwd` on the same inputs: returned as the output
            without launching the forward kernel (backward still works: it needs only o and the LSE).
    Returns:
        ``o [B, H, TQ, Dv]`` (and the natural-log LSE ``[B, H, TQ]`` fp32 with ``return_lse``).
        Differentiable in q, the snapshots, the window keys / values and both temperatures.
    """
    q, state_keys, state_values, rows, window_keys, window_values, geo = _operands(
        q, state_keys, state_values, rows, window_keys, window_values, q_start, q_lo, q_hi, k_start, chunk_len,
        n_bswa_chunks, scale)
    o, lse = ChunkAttention.apply(q, state_keys, state_values, window_keys, window_values,
                                  state_temp.contiguous(), bswa_temp.contiguous(), rows, geo, saved)
    return (o, lse * math.log(2.0)) if return_lse else o


@torch.no_grad()
def chunk_attention_fwd(q, state_keys, state_values, rows, window_keys, window_values, state_temp, bswa_temp, *,
                        q_start, q_lo, q_hi, k_start, chunk_len, n_bswa_chunks, scale):
    """The forward kernel only (arguments as :func:`chunk_attention`): ``(o, lse2)`` with the base-2 LSE
    ``[B, H, TQ]`` fp32 that ``chunk_attention(..., saved=(o, lse2))`` takes."""
    q, state_keys, state_values, rows, window_keys, window_values, geo = _operands(
        q, state_keys, state_values, rows, window_keys, window_values, q_start, q_lo, q_hi, k_start, chunk_len,
        n_bswa_chunks, scale)
    return _fwd(q, state_keys, state_values, rows, window_keys, window_values, state_temp.contiguous(),
                bswa_temp.contiguous(), geo)


def _operands(q, state_keys, state_values, rows, window_keys, window_values, *geo):
    """The kernels' operands: last dims contiguous, ``rows`` an int32 ``[B, Hkv, G]`` view (``[G]`` broadcast with
    stride 0) or None without snapshots, and the geometry as a tuple of Python numbers."""
    q, state_keys, state_values, window_keys, window_values = (
        _last_dim_contiguous(t) for t in (q, state_keys, state_values, window_keys, window_values))
    if state_keys is None:
        rows = None
    elif rows is None:
        raise ValueError("rows is required with state snapshots: pass the rows each chunk sees, [G] or [B, Hkv, G]")
    else:
        B, G, Hkv = state_keys.shape[:3]
        if tuple(rows.shape) not in ((G,), (B, Hkv, G)):
            raise ValueError(f"rows has shape {tuple(rows.shape)}; pass [G] = [{G}] or [B, Hkv, G] = [{B}, {Hkv}, {G}] "
                             f"(G query chunks, like state_keys [B, G, Hkv, M, D])")
        rows = rows.to(device=q.device, dtype=torch.int32).contiguous().expand(B, Hkv, G)
    q_start, q_lo, q_hi, k_start, chunk_len, n_bswa_chunks, scale = geo
    geo = (int(q_start), int(q_lo), int(q_hi), int(k_start), int(chunk_len), int(n_bswa_chunks), float(scale))
    return q, state_keys, state_values, rows, window_keys, window_values, geo
