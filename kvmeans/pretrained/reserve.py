"""A reserve of exact rows for the most novel tokens of a converted layer (``KVMSpec.exact_rows``, docs/pretrained.md).

Once the budget is full, KVM's routing merges every token that leaves the window into its most similar row,
so a few novel tokens (a needle's digits) are averaged with many others. With ``exact_rows = R`` the state
is a mean pool (KVM's rows, on the budget plan less R) plus R slots, each holding one token exactly. When a
block leaves the window, each of its tokens is scored by its novelty, minus its highest cosine to every pool
row and every filled slot, averaged over the layer's kv heads (one score per token and batch row: per-head
scores recalled less); a slot keeps the score its token had on arrival. The R highest scores among the slots
and the block's tokens hold the slots, the others go to the pool by KVM's routing. Empty slots score -inf
and are filled first, in position order, so which slots are filled depends on positions only.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# key sums [B, Hkv, n, D], value sums [B, Hkv, n, Dv], counts [B, Hkv, n], scores [B, Hkv, n]
Rows = Tuple[Tensor, Tensor, Tensor, Tensor]


@torch.no_grad()
def block_scores(sel: Tensor, pool_key_sum: Tensor, slot_key: Tensor, slot_score: Tensor,
                 pool_hat: Optional[Tensor] = None, slot_hat: Optional[Tensor] = None,
                 filled: Optional[bool] = None) -> Tensor:
    """``[B, Hkv, C]``: minus the highest cosine of each block token ``sel [B, Hkv, C, D]`` (normalised keys) to
    the pool rows ``[B, Hkv, m, D]`` and the filled slots ``[B, Hkv, R, D]``, averaged over the kv heads.
    ``pool_hat`` / ``slot_hat``: those rows normalised already (the caller's, reused for routing); ``filled``:
    whether every slot holds a token, when the caller knows (None: checked here; a slot whose score is -inf is
    empty and one at +inf dead, both hidden, so a caller hides slots by passing their scores as -inf)."""
    pool_hat = F.normalize(pool_key_sum, dim=-1) if pool_hat is None else pool_hat
    slot_hat = F.normalize(slot_key, dim=-1) if slot_hat is None else slot_hat
    rows = torch.cat((pool_hat, slot_hat), -2)          # normalising is row-wise: as normalising the join
    sim = sel @ rows.transpose(-1, -2)
    if not filled:
        empty = slot_score.isinf()     # -inf: empty; +inf: dead (past the kv head's cap, exact_caps)
        # slots fill first: once all are full nothing is masked (a CPU check; on a GPU the mask costs less than a sync)
        if empty.device.type != "cpu" or bool(empty.any()):
            sim = sim.masked_fill(F.pad(empty, (pool_hat.shape[-2], 0)).unsqueeze(-2), float("-inf"))
    return (-sim.amax(-1)).mean(1, keepdim=True).expand(sel.shape[:-1])


def join_runs(score: Tensor, alone: Tensor, tail_held: Tensor) -> Tensor:
    """The block's scores ``[B, Hkv, n]`` with its leading run scored as within the block before: ``alone`` the
    scores without the slots that block filled, ``tail_held [B, Hkv, 1]`` whether the slots hold that block's last
    token. The run is the block's first tokens, each scoring higher without those slots (the slots of the run
    they continue are what made them look known); the first token that does not ends it."""
    run = ((alone > score) & tail_held).cumprod(-1).bool()
    return torch.where(run, alone, score)


def keep_most_novel(slots: Tuple[Tensor, ...], block: Tuple[Tensor, ...], n_out: int
                    ) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]]:
    """The ``R`` highest scores among ``slots`` (``R`` of them) and ``block`` hold the slots (a stable sort:
    ties to the lower index, slots first); returns ``(slots, out)``, ``out`` the ``n_out`` filled candidates
    left, in candidate order (the empty ones, last in the sort, are dropped). Both tuples hold ``Rows`` (the
    score fourth) and may carry further per-candidate fields (``[B, Hkv, n(, D)]``), taken alike."""
    cand = [torch.cat(pair, -2 if pair[0].dim() == 4 else -1) for pair in zip(slots, block)]
    R = slots[3].shape[-1]
    order = torch.sort(cand[3], dim=-1, descending=True, stable=True).indices
    keep, out = order[..., :R], order[..., R:R + n_out].sort(-1).values
    def take(i):                        # a gather per field and part: the slots must not be views of a larger one
        return tuple(t.gather(-1, i) if t.dim() == 3 else t.gather(-2, i.unsqueeze(-1).expand(*i.shape, t.shape[-1]))
                     for t in cand)
    return take(keep), take(out)
