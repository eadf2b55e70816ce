"""The state maths shared by every path: memory keys, readout, and the discrete routing.

Routing decisions (which overflow tokens are appended, which row each merged token joins) carry
no gradient (paper Sec. 3.2). They are computed here, once, with deterministic tie-breaking:
append ranking is a stable sort (lower token index first on equal scores), merge targets take the
lowest row index on equal scores. Both use the *ungated* memory key: ``argmax_i g*k.s_i`` equals
``argmax_i k.s_i`` for ``g > 0`` (paper eq. for pi_e(j)), and the ungated form cannot flip under
rounding of ``g``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

RADIUS_EPS = 1e-12  # epsilon_norm of the readout (F.normalize's default, as the reference)


def state_layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """LN_s over the last dim (the affine LayerNorm shared by all heads of a layer)."""
    w = None if weight is None else weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def memory_keys(k: Tensor, rope_dim: int, weight, bias, eps: float) -> Tensor:
    """k_bar = LN_s(k with its first ``rope_dim`` (rotary) channels zeroed). ``[..., D] -> [..., D]``.

    After the LayerNorm the zeroed channels are no longer zero; they are not re-zeroed (as the reference).
    """
    if rope_dim:
        k = F.pad(k[..., rope_dim:], (rope_dim, 0))
    return state_layer_norm(k, weight, bias, eps)


def readout(keys: Tensor, values: Tensor, radii: Tensor, value_radius: bool, weight, bias, eps: float):
    """JIT-normalised state (paper "Readout"): ``(LN_s(s^K), rho * s^V / max(|s^V|, eps))``.

    With ``value_radius=False`` (ablation) ``radii`` holds per-row token counts and values are read
    out as running means ``s^V / count`` (the intent of the reference's buggy flag, section 1.9).
    Shapes ``[..., m, D]``, ``[..., m, Dv]``, ``[..., m]``.
    """
    k_hat = state_layer_norm(keys, weight, bias, eps)
    if value_radius:
        norm = values.norm(dim=-1, keepdim=True).clamp_min(RADIUS_EPS)
        v_hat = values * (radii.unsqueeze(-1) / norm)
    else:
        v_hat = values / radii.unsqueeze(-1).clamp_min(1)
    return k_hat, v_hat


def merge_scores(sel: Tensor, rows_hat: Tensor, s: int):
    """Scores of tokens ``sel [..., N, D]`` against rows ``rows_hat [..., M, D]``: ``(best, target, novelty)``,
    each ``[..., N]``: max / argmax of ``k_bar_j . LN_s(s_i)`` over the non-sink rows ``i >= s`` (lowest index
    on ties) and the novelty ``max`` over all rows, sinks included."""
    logits = sel @ rows_hat.transpose(-1, -2)                  # k_bar_j . LN_s(s_i)   [..., N, M]
    cand = logits[..., s:]                                      # merge candidates: non-sink rows
    best, target = first_max(cand)
    target = target + s
    novelty = torch.maximum(best, logits[..., :s].amax(-1)) if s else best
    return best, target, novelty


def first_max(x: Tensor, block: int = 64):
    """``x.max(-1)``: the maxima and the first index holding each (torch.max's documented tie rule, NaN first as
    there). Rows of ``8 * block`` or more go in two passes, the maxima of blocks of ``block`` (a vectorised
    reduction) then the first max inside the first block that holds it: ~2x faster on CPU at 1-2K rows, where
    ``max(-1)``, one element per ns, cost as much as the scoring matmul."""
    M = x.shape[-1]
    if M < 8 * block:
        return x.max(-1)
    full = M // block * block
    peaks = x[..., :full].unflatten(-1, (-1, block)).amax(-1)
    if full < M:
        peaks = torch.cat([peaks, x[..., full:].amax(-1, keepdim=True)], -1)
    best, b = peaks.max(-1)
    cols = (b.unsqueeze(-1) * block + torch.arange(block, device=x.device)).clamp_max_(M - 1)
    return best, b * block + x.gather(-1, cols).argmax(-1)


@torch.no_grad()
def route_overflow(rows_hat: Tensor, sel: Tensor, append_keys_hat: Tensor, n_append: int, sink_len: int,
                   scores=merge_scores):
    """Decide the fate of one overflow block (paper "Append" and "Merge").

    Args:
        rows_hat: ``[B, Hkv, m, D]`` LN_s of the current state keys.
        sel: ``[B, Hkv, C, D]`` memory keys k_bar of the overflow tokens (ungated).
        append_keys_hat: ``[B, Hkv, C, D]`` LN_s of the key each token would get as a new row (read only when
            the block both appends and merges; None when ``n_append <= 0``).
        n_append: tokens to append (the same for every sequence and head: the schedule is positional).
        sink_len: leading rows that are never merge targets.
        scores: the scoring pass, ``scores(sel, rows_hat, s) -> (best, target, novelty)`` (see
            :func:`merge_scores`; the Triton backend passes its kernel, same rule and ties).
    Returns:
        ``dest [B, Hkv, C]`` long, the row each token joins (appended tokens get new rows
        ``m, m+1, ...`` in token order), and ``appended [B, Hkv, C]`` bool.
    """
    m, n_tok = rows_hat.shape[-2], sel.shape[-2]
    s = min(sink_len, m)
    best, target, novelty = scores(sel, rows_hat, s)
    if n_append >= n_tok:
        appended = torch.ones(sel.shape[:-1], dtype=torch.bool, device=sel.device)
    elif n_append <= 0:             # every token merges (a full fixed budget): no ranking, no host sync
        return target, torch.zeros(sel.shape[:-1], dtype=torch.bool, device=sel.device)
    else:
        # the least redundant tokens (lowest novelty: max over all rows, sinks included) are appended
        order = torch.sort(novelty, dim=-1, stable=True).indices[..., :n_append]
        appended = torch.zeros(sel.shape[:-1], dtype=torch.bool, device=sel.device).scatter_(-1, order, True)
    new_rows = m + appended.cumsum(-1) - 1
    if bool(appended.all()):
        return new_rows, appended
    n_new = min(max(n_append, 0), n_tok)
    if n_new:
        # merge targets include the rows appended in this same step (rows m, m+1, ... in token order);
        # on equal scores the lower row index wins, as torch.max does within each part
        token_idx = torch.sort(appended.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :n_new]
        added = append_keys_hat.gather(-2, token_idx.unsqueeze(-1).expand(-1, -1, -1, sel.shape[-1]))
        best_new, idx_new, _ = scores(sel, added, 0)
        take_new = best_new > best if m > s else torch.ones_like(appended)
        target = torch.where(take_new, idx_new + m, target)
    return torch.where(appended, new_rows, target), appended


@torch.no_grad()
def route_novelty(rows_hat: Tensor, row_count: Tensor, sel: Tensor, append_keys_hat: Tensor, threshold: float,
                  cap: int, sink_len: int):
    """Data-dependent growth (``StateBudget.novelty``): decide the fate of one overflow block per (sequence, kv head).

    A token is novel when ``1 - max_i cos(sel_j, rows_hat_i)`` over the rows in use (sinks included) exceeds
    ``threshold``; the novel tokens become new rows while ``row_count < cap``, the most novel first (ties: lower
    token index), the new rows in token order from ``row_count`` on. Every other token merges by argmax of
    ``sel_j . row`` over the non-sink rows in use and the rows appended in this block (lower row index on ties),
    as :func:`route_overflow`.

    Args: ``rows_hat [B, Hkv, M, D]`` (rows ``>= row_count`` ignored), ``row_count [B, Hkv]`` long,
    ``sel, append_keys_hat [B, Hkv, C, D]``. Returns ``(dest [B, Hkv, C] long, appended [B, Hkv, C] bool,
    row_count [B, Hkv] after the block)``.
    """
    M, N = rows_hat.shape[-2], sel.shape[-2]
    in_use = torch.arange(M, device=sel.device) < row_count.unsqueeze(-1)             # [B, Hkv, M]
    cos = F.normalize(sel, dim=-1) @ F.normalize(rows_hat, dim=-1).transpose(-1, -2)   # [B, Hkv, C, M]
    novelty = 1 - cos.masked_fill(~in_use.unsqueeze(-2), -math.inf).amax(-1)
    novel = novelty > threshold
    order = torch.sort(novelty.masked_fill(~novel, -math.inf), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=sel.device).expand_as(order))
    appended = novel & (rank < (cap - row_count).clamp_min(0).unsqueeze(-1))
    new_rows = row_count.unsqueeze(-1) + appended.cumsum(-1) - 1
    mergeable = in_use & (torch.arange(M, device=sel.device) >= sink_len)
    logits = (sel @ rows_hat.transpose(-1, -2)).masked_fill(~mergeable.unsqueeze(-2), -math.inf)
    best, target = first_max(logits)
    new_logits = (sel @ append_keys_hat.transpose(-1, -2)).masked_fill(~appended.unsqueeze(-2), -math.inf)
    best_new, idx_new = first_max(new_logits)          # the first appended token = the lowest new row
    target = torch.where(best_new > best, new_rows.gather(-1, idx_new), target)
    return torch.where(appended, new_rows, target), appended, row_count + appended.sum(-1)


def token_streams(kbar: Tensor, v: Tensor, gate: Tensor, appended: Tensor, *, gate_keys: bool,
                  gate_values: bool, gate_appends: bool):
    """What each overflow token adds to its row: gated k/v if merged (and if appended with
    ``gate_appends``), raw k_bar / v otherwise. Returns ``(dk [...,D], dv [...,Dv], radius [...])``
    where ``radius = |dv|`` is the radius a newly created row gets."""
    gated = torch.ones_like(appended) if gate_appends else ~appended
    g = gate.to(kbar.dtype)
    one = torch.ones_like(g)
    dk = kbar * torch.where(gated, g, one).unsqueeze(-1) if gate_keys else kbar
    dv = v * torch.where(gated, g, one).unsqueeze(-1) if gate_values else v
    return dk, dv, dv.norm(dim=-1)
