"""Novelty-preserving routing of a converted layer at a full budget (``KVMSpec.novel_rows``, docs/pretrained.md).

KVM's plan (``schedule.plan_updates``) appends rows only while the budget grows; once it is full, every token
that leaves the window merges into its most similar row, so a few novel tokens (a needle's digits) are averaged
with many others. With ``novel_rows = k`` a block that would append fewer than ``k`` tokens first frees rows by
merging the most similar pairs of non-sink rows, then its ``k`` most novel tokens (lowest max-cosine to every
row, sinks included) take rows of their own and the others merge into their most similar existing non-sink row.
The row count still follows the budget plan; the swap waits until the state holds more than ``2 * k``
non-sink rows. Ties go to the lowest index (row-major for pairs), so routing is
deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.routing import merge_scores


def merge_closest_pairs(key_sum: Tensor, value_sum: Tensor, count: Tensor, n: int, sink_len: int):
    """Merge ``n`` times the two non-sink rows whose key sums have the highest cosine (the later row joins the
    earlier one; a merged row can merge again). ``[B, Hkv, m, D]``, ``[B, Hkv, m, Dv]``, ``[B, Hkv, m]`` ->
    the same with ``m - n`` rows, the survivors in their order. New tensors: the inputs are not modified."""
    B, H, M, _ = key_sum.shape
    key_sum, value_sum, count = key_sum.clone(), value_sum.clone(), count.clone()
    unit = F.normalize(key_sum.detach(), dim=-1)                                    # decisions carry no gradient
    sim = unit @ unit.transpose(-1, -2)
    idx = torch.arange(M, device=key_sum.device)
    body = idx >= sink_len
    pair = (idx[:, None] < idx[None, :]) & body[:, None] & body[None, :]          # i < j, both non-sink
    alive = torch.ones(B, H, M, dtype=torch.bool, device=key_sum.device)
    b, h = torch.meshgrid(torch.arange(B, device=key_sum.device), torch.arange(H, device=key_sum.device),
                          indexing="ij")
    for _ in range(n):
        ok = pair & alive.unsqueeze(-1) & alive.unsqueeze(-2)
        flat = sim.masked_fill(~ok, float("-inf")).flatten(-2).argmax(-1)         # first max: lowest (i, j)
        i, j = flat // M, flat % M
        key_sum[b, h, i] += key_sum[b, h, j]
        value_sum[b, h, i] += value_sum[b, h, j]
        count[b, h, i] += count[b, h, j]
        alive[b, h, j] = False
        unit[b, h, i] = F.normalize(key_sum[b, h, i].detach(), dim=-1)
        s_i = torch.einsum("bhd,bhmd->bhm", unit[b, h, i], unit)                  # the merged row vs every row
        sim[b, h, i] = s_i
        sim[b, h, :, i] = s_i
    keep = torch.sort((~alive).to(torch.int8), dim=-1, stable=True).indices[..., :M - n]
    return (key_sum.gather(-2, keep.unsqueeze(-1).expand(-1, -1, -1, key_sum.shape[-1])),
            value_sum.gather(-2, keep.unsqueeze(-1).expand(-1, -1, -1, value_sum.shape[-1])),
            count.gather(-1, keep))


@torch.no_grad()
def route_novel(rows_sum: Tensor, sel: Tensor, n_new: int, sink_len: int) -> Tensor:
    """``dest [B, Hkv, C]``: the ``n_new`` most novel tokens of ``sel [B, Hkv, C, D]`` (normalised keys) take
    new rows ``m, m+1, ...`` in token order; every other token joins its most similar non-sink row of
    ``rows_sum [B, Hkv, m, D]`` (cosine)."""
    m = rows_sum.shape[-2]
    _, target, novelty = merge_scores(sel, F.normalize(rows_sum, dim=-1), min(sink_len, m))
    order = torch.sort(novelty, dim=-1, stable=True).indices[..., :n_new]
    appended = torch.zeros_like(novelty, dtype=torch.bool).scatter_(-1, order, True)
    return torch.where(appended, m + appended.cumsum(-1) - 1, target)
