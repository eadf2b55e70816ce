"""State-update kernels: merge routing scores and fp32 scatter-accumulation.

* ``_route_scores_kernel`` [cdiv(N, BLOCK_T), B*Hkv]: for each overflow token j, over the state rows i
  (tiles of BLOCK_N rows): ``novelty_j = max_i k̄_j·LN_s(s_i)`` (all rows, sinks included: append ranking)
  and ``best_j, target_j = max / argmax_{i >= sink} k̄_j·LN_s(s_i)`` with the lowest row index on equal
  scores (within a tile the smallest index attaining the max, across tiles a strictly larger max wins),
  exactly :func:`kvmeans.ops.routing.route_overflow`'s rule.
* :func:`route_overflow_triton`: ``route_overflow``'s contract; the two scoring passes (old rows, then the
  rows appended in the same step) run in the kernel, the ranking of the C tokens (a stable sort) in torch.
* ``_scatter_add_kernel`` [cdiv(N, BLOCK_T), B*Hkv]: ``dst[b, h, dest[j]] += src[b, h, j]`` with fp32
  atomics (sums of a state row are accumulated in fp32 whatever the token dtype; the order of the atomic
  adds is not deterministic, so results match torch's ``scatter_add`` to rounding, not bitwise).

Used by the state updates under ``attn="triton"`` with an fp32 state (:func:`kvmeans.ops.state.absorb`: decode,
continuations, the chunked path's routing pass and its no-grad prefill): routes equal the torch routing's, and in
the interpreter (sequential atomics, in token order like ``scatter_add_``) the rows are bit-identical; on a GPU
the atomic order is not fixed, so the sums agree to rounding. How often bf16 rounding flips a near-tie route is
measured by :func:`kvmeans.ops.chunk.route.route_agreement`. See the README.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvmeans.ops.routing import route_overflow
from kvmeans.ops.triton.attention import INTERPRETED, _pow2, dot_precision, launch

_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_N": n}, num_warps=w)
            for t, n, w in [(64, 64, 4), (32, 64, 4), (64, 32, 4), (128, 64, 8), (16, 64, 2)]]
FIXED_META = {"BLOCK_T": 64, "BLOCK_N": 64, "num_warps": 4}   # KVMEANS_TRITON_AUTOTUNE=0
INTERPRET_META = {"BLOCK_T": 16, "BLOCK_N": 16}


@triton.jit
def _route_scores_kernel(SEL, ROWS, BEST, TARGET, NOVEL, s_sb, s_sh, s_st, s_rb, s_rh, s_rm,
                         HKV, N, M, SINK, D, PREC: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // HKV, bh % HKV
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < N
    offs_d, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    sel = tl.load(SEL + b * s_sb + h * s_sh + tok[:, None] * s_st + offs_d[None, :],
                  mask=tmask[:, None] & dmask[None, :], other=0.0)
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)
    novel = tl.full([BLOCK_T], float("-inf"), tl.float32)
    target = tl.zeros([BLOCK_T], tl.int32)
    for start in range(0, M, BLOCK_N):
        rows = start + offs_n
        rmask = rows < M
        k = tl.load(ROWS + b * s_rb + h * s_rh + rows[:, None] * s_rm + offs_d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        sc = tl.dot(sel, tl.trans(k), input_precision=PREC)
        novel = tl.maximum(novel, tl.max(tl.where(rmask[None, :], sc, float("-inf")), 1))
        cand = tl.where((rmask & (rows >= SINK))[None, :], sc, float("-inf"))
        tmax = tl.max(cand, 1)
        tidx = tl.min(tl.where(cand == tmax[:, None], rows[None, :], 2147483647), 1)
        upd = tmax > best
        best = tl.where(upd, tmax, best)
        target = tl.where(upd, tidx, target)
    out = b * HKV * N + h * N + tok
    tl.store(BEST + out, best, mask=tmask)
    tl.store(TARGET + out, target, mask=tmask)
    tl.store(NOVEL + out, novel, mask=tmask)


@triton.jit
def _scatter_add_kernel(DST, DEST, SRC, s_db, s_dh, s_dm, s_sb, s_sh, s_st, HKV, N, D,
                        BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // HKV, bh % HKV
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < N
    offs_d = tl.arange(0, BLOCK_D)
    mask = tmask[:, None] & (offs_d < D)[None, :]
    dest = tl.load(DEST + (b * HKV + h) * N + tok, mask=tmask, other=0)
    src = tl.load(SRC + b * s_sb + h * s_sh + tok[:, None] * s_st + offs_d[None, :], mask=mask, other=0.0)
    tl.atomic_add(DST + b * s_db + h * s_dh + dest[:, None] * s_dm + offs_d[None, :], src.to(tl.float32), mask=mask)


_TUNED_SCORES = triton.autotune(_CONFIGS, key=["BLOCK_D"])(_route_scores_kernel)


def route_scores(sel: Tensor, rows_hat: Tensor, sink_len: int):
    """``(best [B,Hkv,N] fp32, target [B,Hkv,N] long, novelty [B,Hkv,N] fp32)`` of tokens ``sel [B,Hkv,N,D]``
    against rows ``rows_hat [B,Hkv,M,D]``: merge max / argmax over rows ``>= sink_len`` (lowest index on ties),
    novelty = max over all rows."""
    B, Hkv, N, D = sel.shape
    M = rows_hat.shape[2]
    sel, rows_hat = (t if t.stride(-1) == 1 else t.contiguous() for t in (sel, rows_hat))
    best = torch.empty(B, Hkv, N, dtype=torch.float32, device=sel.device)
    novel = torch.empty_like(best)
    target = torch.empty(B, Hkv, N, dtype=torch.int32, device=sel.device)
    args = (sel, rows_hat, best, target, novel, *sel.stride()[:3], *rows_hat.stride()[:3], Hkv, N, M, sink_len, D)
    consts = dict(PREC=dot_precision(sel.dtype), BLOCK_D=_pow2(D))
    grid = lambda META: (triton.cdiv(N, META["BLOCK_T"]), B * Hkv)
    launch(_route_scores_kernel, _TUNED_SCORES, grid, args, consts, INTERPRET_META, FIXED_META)
    return best, target.long(), novel


def route_overflow_triton(rows_hat: Tensor, sel: Tensor, append_keys_hat: Tensor, n_append: int, sink_len: int):
    """:func:`kvmeans.ops.routing.route_overflow` with the scoring passes in :func:`route_scores`."""
    return route_overflow(rows_hat, sel, append_keys_hat, n_append, sink_len, scores=route_scores)


def scatter_add_rows(dst: Tensor, dest: Tensor, src: Tensor) -> Tensor:
    """In place ``dst[b, h, dest[b, h, j]] += src[b, h, j]`` (fp32 atomics; ``dst`` must be float32).
    ``dst [B, Hkv, R, D]``, ``dest [B, Hkv, N]`` integer, ``src [B, Hkv, N, D]``. Returns ``dst``."""
    if dst.dtype != torch.float32:
        raise TypeError(f"scatter_add_rows accumulates in float32, got dst {dst.dtype}")
    B, Hkv, N, D = src.shape
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError("dst and src need a contiguous last dimension")
    dest = dest.to(torch.int32).contiguous()
    block_t = 16 if INTERPRETED else 64
    _scatter_add_kernel[(triton.cdiv(N, block_t), B * Hkv)](
        dst, dest, src, *dst.stride()[:3], *src.stride()[:3], Hkv, N, D, BLOCK_D=_pow2(D), BLOCK_T=block_t)
    return dst

