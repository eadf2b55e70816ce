"""Position bookkeeping shared by every KVM path: window geometry and the state-size plan.

All of it depends only on positions (never on data), so it is plain Python on the host.
Notation: C = chunk_len, n = n_bswa_chunks, L = n*C (the BSWA span).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, List


def bswa_begin(total: int, chunk_len: int, n_bswa_chunks: int) -> int:
    """First uncompressed token once ``total`` tokens exist: the current (partial) chunk
    plus the n-1 full chunks before it (docs/reference-conventions.md §1.5)."""
    c = chunk_len
    return max(0, -(-total // c) * c - n_bswa_chunks * c)


def coverage_after(total: int, chunk_len: int, n_bswa_chunks: int) -> int:
    """Tokens summarised by the state once ``total`` tokens exist: the initial chunk fills
    first, then whole chunks as they leave the window (updates are lazy)."""
    return max(min(total, chunk_len), bswa_begin(total, chunk_len, n_bswa_chunks))


def desired_rows(budget: Callable[[int], int], block_start: int, rows: int, chunk_len: int,
                 n_bswa_chunks: int) -> int:
    """Rows after the update that absorbs the overflow block ``[block_start, block_start + C)``.

    The queries that just attended saw ``ctx_len = block_start + L`` tokens; the state can hold
    at most the ``block_start + C`` tokens it will cover; it never shrinks (paper:
    ``M* = max(m, min(B(e), m + C))``, docs/reference-conventions.md §1.4).
    """
    ctx_len = block_start + n_bswa_chunks * chunk_len
    target = budget(ctx_len)
    try:
        finite = isinstance(target, numbers.Integral) or math.isfinite(float(target))
    except (TypeError, ValueError):
        finite = False
    finite = finite and not isinstance(target, bool)
    if not finite:
        raise TypeError(f"budget({ctx_len}) returned {target!r}; a budget must return a finite int row count")
    target = int(target)
    if target < 0:
        raise ValueError(f"budget({ctx_len}) returned {target} rows; a budget must return >= 0 rows")
    target = min(target, block_start + chunk_len)
    return max(target, rows)


@dataclass(frozen=True)
class UpdateStep:
    """One state update: the overflow block ``[start, start + C)`` enters a state of ``rows_before`` rows."""
    start: int
    rows_before: int
    n_append: int

    @property
    def rows_after(self) -> int:
        return self.rows_before + self.n_append


def plan_updates(budget: Callable[[int], int], coverage: int, rows: int, total: int, chunk_len: int,
                 n_bswa_chunks: int) -> List[UpdateStep]:
    """Every update needed to bring a state covering ``coverage`` tokens (``rows`` rows) up to
    date after ``total`` tokens. Initial-chunk filling is not an update and is not listed."""
    steps = []
    target_cov = bswa_begin(total, chunk_len, n_bswa_chunks)
    start = max(coverage, chunk_len)
    while start < target_cov:
        want = desired_rows(budget, start, rows, chunk_len, n_bswa_chunks)
        n_append = min(want - rows, chunk_len)
        steps.append(UpdateStep(start, rows, n_append))
        rows += n_append
        start += chunk_len
    return steps


def rows_after(budget: Callable[[int], int], total: int, chunk_len: int, n_bswa_chunks: int) -> int:
    """State rows after a fresh sequence of ``total`` tokens (the paper's Figure 1 curve); under a novelty budget,
    whose ``budget(t)`` is its cap, the most rows it can reach (every token novel)."""
    rows = min(total, chunk_len)
    for step in plan_updates(budget, rows, rows, total, chunk_len, n_bswa_chunks):
        rows = step.rows_after
    return rows
