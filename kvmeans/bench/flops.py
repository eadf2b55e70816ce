"""Useful FLOPs per benchmark arm and the matmul rate they are measured against (the FLOP bound).

Useful FLOPs count the matmuls the arm cannot avoid, not what its kernels happen to compute:
  attention: ``4*B*H*D * (keys seen per query, summed over the queries)`` (``q.k`` and ``p.v``, 2 FLOPs per
             multiply-add, ``Dv = D``). SDPA's causal query ``p`` sees ``p + 1`` keys; a KVM query in chunk ``c``
             sees its window ``[max(0, (c + 1 - n)*C), p]`` plus the state rows that exist for chunk ``c``.
  routing (KVM): ``2*B*Hkv*D * (tokens routed) * (rows each is scored against)``: every overflow block scores
             its C tokens against the rows before it, and against its own appended rows when it both appends
             and merges.
  backward: twice the forward attention (the four gradient matmuls ``dV, dP, dQ, dK``); routing has no gradient.
  decode: per token, averaged over the timed steps (a step that routes a block carries that block).
The fraction of the bound is ``useful FLOPs / time / matmul rate``: 1.0 would be an arm doing only its useful
matmuls at the rate of one large matmul.

A decode step reads far more bytes than it computes (two FLOPs per value read), so its bound is a read rate:
``useful_bytes`` the keys and values each token's query reads (once per kv head), against :func:`read_rate` of
that many bytes (a working set that fits a cache is read faster than one that streams from memory).
"""
from __future__ import annotations

import time

import torch

from kvmeans.ops.schedule import plan_updates


def useful_flops(arm: str, mode: str, T: int, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                 chunk_len: int, n_bswa_chunks: int, decode_steps: int, budget=None) -> float:
    """Useful FLOPs of one measurement: the whole prefill / backward of ``T`` tokens, or one decode token (mean
    over ``decode_steps`` steps after ``T``). ``arm`` "sdpa" or a KVM arm with its ``budget``."""
    C, n = chunk_len, n_bswa_chunks
    first, last = (0, T) if mode != "decode" else (T, T + decode_steps)
    attend = 4 * batch * heads * head_dim
    keys, steps = _keys_seen(arm, first, last, C, n, budget)
    if arm == "sdpa":
        return attend * keys * (2 if mode == "backward" else 1) / (decode_steps if mode == "decode" else 1)
    if mode == "backward":
        return float(2 * attend * keys)
    # block [s, s + C) is routed by the call that reaches position s + n*C (a prefill routes all it covers)
    routed = sum(C * (s.rows_before + (s.n_append if 0 < s.n_append < C else 0)) for s in steps
                 if mode != "decode" or first <= s.start + n * C < last)
    route = 2 * batch * kv_heads * head_dim * routed
    return (attend * keys + route) / (decode_steps if mode == "decode" else 1)


def useful_bytes(arm: str, T: int, *, batch: int, kv_heads: int, head_dim: int, chunk_len: int, n_bswa_chunks: int,
                 decode_steps: int, elem: int, budget=None) -> float:
    """Bytes of keys and values one decode token reads (mean over ``decode_steps`` steps after ``T``): every key
    its query sees, read once per kv head (``2 * B * Hkv * D * elem`` per key; routing reads are not counted)."""
    keys, _ = _keys_seen(arm, T, T + decode_steps, chunk_len, n_bswa_chunks, budget)
    return 2 * batch * kv_heads * head_dim * elem * keys / decode_steps


def _keys_seen(arm: str, first: int, last: int, C: int, n: int, budget):
    """``(keys, steps)``: keys seen summed over the queries at positions ``[first, last)`` and, for KVM, the state
    updates of a sequence of ``last`` tokens."""
    if arm == "sdpa":
        return _series(first + 1, last), []                              # query p sees p + 1 keys
    rows_by_block = {0: C}                       # block b's rows once it entered the state (block 0: the first C)
    steps = plan_updates(budget, C, C, last, C, n)
    for step in steps:
        rows_by_block[step.start // C] = step.rows_after
    keys = 0
    for c in range(first // C, -(-last // C)):
        lo, hi = max(first, c * C), min(last, (c + 1) * C)
        start = max(0, (c + 1 - n) * C)                                  # chunk c's window begins here
        keys += _series(lo - start + 1, hi - start) + (hi - lo) * (rows_by_block[c - n] if c >= n else 0)
    return keys, steps


def _series(a: int, b: int) -> int:
    """``a + (a + 1) + ... + b`` (0 when ``b < a``)."""
    return (a + b) * (b - a + 1) // 2 if b >= a else 0


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 0, repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` ``[n, n] @ [n, n]`` matmuls (``n`` 0: 8192 on a GPU, 2048 on CPU, 512 for
    half dtypes on CPU, which often lack a fast path)."""
    n = n or (8192 if device.type == "cuda" else 2048 if dtype in (torch.float32, torch.float64) else 512)
    x, y = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    x @ y                                   # warm-up (allocator, threads, kernel selection)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x @ y
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def read_rate(device: torch.device, nbytes: float, repeats: int = 5) -> float:
    """Bytes/s of the best of ``repeats`` reads (a ``sum``) of an fp32 tensor of ``nbytes`` bytes, read once before
    (warm, cached where it fits: the rate a decode step that reads as many bytes could reach)."""
    x = torch.ones(max(1, int(nbytes) // 4), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    x.sum()
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
