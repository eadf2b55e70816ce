"""Masked tokens contribute exactly zero, in every path.

A masked score is excluded from the softmax, but its value still enters ``P @ V`` (``0 * NaN = NaN``) and an
SDPA mask is *added* to the scores (``NaN - inf = NaN``): a NaN in a future token would reach earlier outputs.
So the attention operands are taken with every non-finite token (key or value) zeroed, and the outputs of
the queries that do see such a token (window tokens by position, a state snapshot as a whole) are set to NaN.
Masks are ``None`` when nothing is flagged (the common case: no copy, no extra pass).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def finite_tokens(k: Tensor, v: Tensor):
    """``(k, v, bad)``: ``k [..., N, D]``, ``v [..., N, Dv]`` with the tokens that hold a non-finite entry zeroed,
    and ``bad [..., N]`` flagging them; ``(k, v, None)``, uncopied, when all are finite (one host sync)."""
    acc = torch.promote_types(k.dtype, torch.float32)
    if bool((k.sum(dtype=acc) + v.sum(dtype=acc)).isfinite()):   # one read, no temporary (~10x cheaper than below);
        return k, v, None                                        # a sum that overflows falls through, still exact
    bad = ((k * 0).sum(-1) + (v * 0).sum(-1)).isnan()     # 0 * x: 0 if x is finite, else NaN (and no overflow)
    if not bool(bad.any()):
        return k, v, None
    return k.masked_fill(bad.unsqueeze(-1), 0), v.masked_fill(bad.unsqueeze(-1), 0), bad


def window_poison(bad: Optional[Tensor], origin: int, t0: int, t1: int, chunk_len: int,
                  n_bswa_chunks: int) -> Optional[Tensor]:
    """``[..., t1 - t0]`` bool: the query at position ``p`` sees a flagged window token. ``bad [..., N]`` flags the
    tokens from position ``origin``; the window of ``p`` is ``[max(origin, (p // C + 1 - n) * C), p]``."""
    if bad is None:
        return None
    seen = F.pad(bad.to(torch.int32).cumsum(-1), (1, 0))        # seen[..., i]: flagged tokens before origin + i
    p = torch.arange(t0, t1, device=bad.device)
    lo = ((p // chunk_len + 1 - n_bswa_chunks) * chunk_len).clamp_min(origin) - origin
    return seen.index_select(-1, p - origin + 1) > seen.index_select(-1, lo)


def rows_poison(bad_rows: Optional[Tensor]) -> Optional[Tensor]:
    """``[..., 1]``: a query sees every row of its state, so one flagged row (``bad_rows [..., M]``) reaches it."""
    return None if bad_rows is None else bad_rows.any(-1, keepdim=True)


def poison(y: Tensor, *seen_bad: Optional[Tensor]) -> Tensor:
    """``y [B, H, t, Dv]`` with NaN rows where any of ``seen_bad`` (``[B, Hkv, t or 1]``, None: nothing) is set;
    query head h reads kv head h // (H/Hkv)."""
    masks = [s for s in seen_bad if s is not None]
    if not masks:
        return y
    seen = masks[0] if len(masks) == 1 else masks[0] | masks[1]
    seen = seen.repeat_interleave(y.shape[1] // seen.shape[1], 1)
    return y.masked_fill(seen.unsqueeze(-1), float("nan"))
