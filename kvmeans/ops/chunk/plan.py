"""Positions of a chunked call, known before it runs: the rows each query chunk sees, the groups of query chunks
that attend together, and each chunk's window.

Query chunk ``c`` holds the queries ``[c*C, (c+1)*C)``; block ``b`` (its tokens) enters the state when chunk
``b + n`` starts, so chunk ``c`` sees the state rows created by blocks ``< c - n + 1`` and, uncompressed, its own
chunk and the ``n - 1`` before it. A call covers the tokens ``[t0, t1)``; its window tokens start at ``w0``.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.schedule import plan_updates
from kvmeans.ops.state import KVMState


def rows_visible(state: KVMState, block_rows: dict, t1: int) -> List[int]:
    """Rows visible to each query chunk ``c < ceil(t1 / C)``: block b is in the state from chunk b + n on
    (0 while the state is inactive). ``block_rows``: block index -> rows once it entered."""
    rows_at, rows, n = [], state.num_rows, state.n_bswa_chunks
    for c in range((t1 - 1) // state.chunk_len + 1):
        rows = block_rows.get(c - n, rows)
        rows_at.append(rows if c >= n else 0)
    return rows_at


def planned_rows(state: KVMState, budget, t1: int) -> dict:
    """``block index -> rows once it entered`` for the blocks entering in a call ending at ``t1`` (positions only)."""
    C, m, cov = state.chunk_len, state.num_rows, state.coverage
    fill = max(0, min(t1, C) - cov)
    rows = {0: m + fill} if fill else {}
    for step in plan_updates(budget, cov + fill, m + fill, t1, C, state.n_bswa_chunks):
        rows[step.start // C] = step.rows_after
    return rows


def groups(c_first, c_last, rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn, kind=None):
    """Split query chunks ``[c_first, c_last]`` into runs ``[(ca, cb)]`` whose attention working set fits
    ``group_bytes``. Only whole chunks share a run: a partial first or last chunk attends alone, with just its
    queries; ``kind(c)`` (if given) must also be equal within a run."""
    def fits(ca, cb):
        window = 0 if attn == "triton" else window_geometry(ca, cb, C, n, t0, t1, w0)[3]
        return (cb - ca) * (rows_at[cb - 1] + window) * per_row <= group_bytes
    whole = lambda c: t0 <= c * C and (c + 1) * C <= t1
    runs, ca = [], c_first
    while ca <= c_last:
        cb = ca + 1
        while cb <= c_last and whole(ca) and whole(cb) and fits(ca, cb + 1) and (kind is None or kind(cb) == kind(ca)):
            cb += 1
        runs.append((ca, cb))
        ca = cb
    return runs


def whole_window(c: int, C: int, n: int, w0: int) -> bool:
    """Chunk ``c``'s n - 1 previous chunks all exist (from position ``w0`` on)."""
    return (c + 1 - n) * C >= w0


def window_geometry(ca, cb, C, n, t0, t1, w0):
    """``(qa, qb, e0, W)`` of query chunks ``[ca, cb)``, sized by the tokens present (never by C or n*C alone):
    the group's queries are the positions ``[qa, qb)`` (``Cq = (qb - qa) / G`` per chunk: only a group of one
    chunk may be partial), chunk ``ca + g`` sees the ``W`` window positions ending at ``e0 + g*C``."""
    qa, qb = max(ca * C, t0), min(cb * C, t1)
    return qa, qb, qb - (cb - 1 - ca) * C, qb - max(w0, (cb - n) * C)


def windows(x: Tensor, origin: int, qb: int, e0: int, W: int, C: int) -> Tensor:
    """``[B, Hkv, G, D, W]`` windows (see :func:`window_geometry`) of ``x``, whose token 0 is at ``origin``."""
    return _time_slice(x, e0 - W - origin, qb - origin).unfold(2, W, C)


def group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, device) -> Tensor:
    """``[G, Cq, M + W]`` bool (see :func:`window_geometry`): state rows that exist for each chunk, then the
    causal window."""
    qa, qb, e0, W = window_geometry(ca, cb, C, n, t0, t1, w0)
    G = cb - ca
    q_pos = (qa + C * torch.arange(G, device=device)).view(G, 1, 1) + \
        torch.arange((qb - qa) // G, device=device).view(1, -1, 1)
    k_pos = (e0 - W + C * torch.arange(G, device=device)).view(G, 1, 1) + torch.arange(W, device=device)
    mask = (k_pos <= q_pos) & (k_pos >= w0)
    if not M:
        return mask
    visible = torch.arange(M, device=device) < torch.tensor(rows_at[ca:cb], device=device).view(G, 1, 1)
    return torch.cat([visible.expand(G, mask.shape[1], M), mask], 2)


def _time_slice(x: Tensor, start: int, end: int) -> Tensor:
    """``x[:, :, start:end]`` with zeros where the range leaves ``[0, x.shape[2])``."""
    lo, hi = max(start, 0), min(end, x.shape[2])
    core = x[:, :, lo:max(hi, lo)]
    pad = [0, 0] * (x.dim() - 3) + [lo - start, end - max(hi, lo)]
    return F.pad(core, pad) if any(pad) else core
