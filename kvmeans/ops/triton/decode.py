"""Decode attention: a few new queries per head over ``[cached readout state rows ; window buffer]``.

One program per (kv head, tile of query rows): the ``REP = H / Hkv`` query heads of a kv head and their
``t`` new queries are stacked as the rows of one tile, so every state / window key tile is loaded once
per GQA group and multiplied with MMA (``tl.dot``), not elementwise. The new queries are the last ``t``
tokens of the window (the recurrent path writes them there first), so the causal mask only needs the
window length.

CUDA-graph friendly: the active state rows and the window length are read from device int32 tensors
(``lengths = [rows, window_len]``, one pair or one per batch row or per (batch row, kv head)), not Python ints,
so one compiled kernel with fixed buffer pointers serves every step between chunk-boundary updates (the buffers
are the state's preallocated ones; rows ``>= lengths[0]`` and window slots ``>= lengths[1]`` are never read).
A state that is not active yet (``window_start == 0``) is ``lengths[0] = 0``: no separate kernel variant. The
recurrent path passes one persistent ``lengths`` per state (``state._lengths``, see
``kvmeans.ops.recurrent._decode_lengths``), advanced in place on the device between chunk boundaries.
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from kvmeans.ops.triton.attention import _load_kv, _pow2, _softmax_step, dot_precision, launch

_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w, s in [(64, 4, 2), (128, 4, 2), (32, 2, 2), (64, 2, 3), (128, 8, 3)]]
FIXED_META = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}   # KVMEANS_TRITON_AUTOTUNE=0
INTERPRET_META = {"BLOCK_N": 16}


@triton.jit
def _decode_kernel(Q, SK, SV, WK, WV, LENGTHS, s_lb, s_lh, STEMP, BTEMP, OUT,
                   s_qb, s_qh, s_qt, s_ob, s_oh, s_ot, s_kb, s_kh, s_km, s_vb, s_vh, s_vm,
                   s_wkb, s_wkh, s_wkt, s_wvb, s_wvh, s_wvt,
                   HKV, D, DV, T, sm_scale,
                   REP: tl.constexpr, PREC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, kvh = bh // HKV, bh % HKV
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    i = r % T
    ok = r < REP * T
    head = kvh * REP + r // T
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    dmask, dvmask = offs_d < D, offs_dv < DV
    q = tl.load(Q + b * s_qb + head[:, None] * s_qh + i[:, None] * s_qt + offs_d[None, :],
                mask=ok[:, None] & dmask[None, :], other=0.0)
    log2_scale = sm_scale * 1.4426950408889634
    st = tl.load(STEMP + head, mask=ok, other=0.0).to(tl.float32) * log2_scale
    bt = tl.load(BTEMP + head, mask=ok, other=0.0).to(tl.float32) * log2_scale
    n_rows = tl.load(LENGTHS + b * s_lb + kvh * s_lh)
    w_len = tl.load(LENGTHS + b * s_lb + kvh * s_lh + 1)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    sk = SK + b * s_kb + kvh * s_kh
    sv = SV + b * s_vb + kvh * s_vh
    for start in range(0, n_rows, BLOCK_N):
        rows = start + offs_n
        kmask = rows < n_rows
        k, v = _load_kv(sk, sv, rows, s_km, s_vm, kmask, offs_d, offs_dv, dmask, dvmask)
        m_i, l_i, acc = _softmax_step(q, k, v, st, ok[:, None] & kmask[None, :], m_i, l_i, acc, PREC)
    wk = WK + b * s_wkb + kvh * s_wkh
    wv = WV + b * s_wvb + kvh * s_wvh
    last = w_len - T + i                      # window slot of each query: the t new tokens end the window
    for start in range(0, w_len, BLOCK_N):
        w = start + offs_n
        kmask = w < w_len
        k, v = _load_kv(wk, wv, w, s_wkt, s_wvt, kmask, offs_d, offs_dv, dmask, dvmask)
        m_i, l_i, acc = _softmax_step(q, k, v, bt, ok[:, None] & kmask[None, :] & (w[None, :] <= last[:, None]),
                                      m_i, l_i, acc, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + b * s_ob + head[:, None] * s_oh + i[:, None] * s_ot + offs_dv[None, :],
             out.to(OUT.dtype.element_ty), mask=ok[:, None] & dvmask[None, :])


_TUNED = triton.autotune(_CONFIGS, key=["T", "REP", "BLOCK_D", "BLOCK_DV", "BLOCK_M"])(_decode_kernel)


def decode_attention(q: Tensor, state_keys: Optional[Tensor], state_values: Optional[Tensor], window_keys: Tensor,
                     window_values: Tensor, lengths: Tensor, state_temp: Tensor, bswa_temp: Tensor, scale: float,
                     out: Optional[Tensor] = None) -> Tensor:
    """``t`` new queries per head over the state rows and the window; returns ``[B, H, t, Dv]``.

    Args:
        q: ``[B, H, t, D]``, the queries of the last ``t`` window tokens.
        state_keys, state_values: ``[B, Hkv, >= rows, D|Dv]`` read-out state (``LN_s`` keys, radius-scaled
            values; the recurrent path's readout cache), or None while the state is inactive.
        window_keys, window_values: ``[B, Hkv, capacity, D|Dv]`` window buffers (slot 0 = window start).
        lengths: int32 ``[2]`` on q's device: ``[rows visible (0 while inactive), window length]``, ``[B, 2]``
            per batch row (a ragged batch, :mod:`kvmeans.ops.ragged`) or ``[B, Hkv, 2]`` per batch row and kv
            head (row counts that differ per head: a data-dependent budget).
        state_temp, bswa_temp: ``[H]``; scale: softmax scale; out: optional preallocated output.
    """
    B, H, t, D = q.shape
    Hkv, DV = window_keys.shape[1], window_values.shape[-1]
    REP = H // Hkv
    if state_keys is None:      # never read (lengths[0] must be 0): any valid pointer
        state_keys, state_values = window_keys, window_values
    q, state_keys, state_values, window_keys, window_values = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q, state_keys, state_values, window_keys, window_values))
    if out is None:
        out = q.new_empty(B, H, t, DV)
    block_m = min(64, _pow2(REP * t))
    grid = lambda META: (triton.cdiv(REP * t, block_m), B * Hkv)
    args = (q, state_keys, state_values, window_keys, window_values, lengths, *_length_strides(lengths, B, Hkv),
            state_temp, bswa_temp, out,
            *q.stride()[:3], *out.stride()[:3], *state_keys.stride()[:3], *state_values.stride()[:3],
            *window_keys.stride()[:3], *window_values.stride()[:3], Hkv, D, DV, t, float(scale))
    consts = dict(REP=REP, PREC=dot_precision(q.dtype), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV), BLOCK_M=block_m)
    launch(_decode_kernel, _TUNED, grid, args, consts, INTERPRET_META, FIXED_META)
    return out


def _length_strides(lengths: Tensor, B: int, Hkv: int):
    """``(batch, kv head)`` strides of ``lengths`` (0 where one entry serves them all)."""
    shapes = {(2,): (0, 0), (B, 2): (lengths.stride(0), 0), (B, Hkv, 2): tuple(lengths.stride()[:2])}
    if tuple(lengths.shape) not in shapes or lengths.stride(-1) != 1:
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}; pass a contiguous int32 [2], [B, 2] = [{B}, 2] "
                         f"or [B, Hkv, 2] = [{B}, {Hkv}, 2] of [rows, window length]")
    return shapes[tuple(lengths.shape)]
