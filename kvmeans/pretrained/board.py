"""Novelty agreed across layers for the reserve of exact rows (``KVMSpec.exact_scope``, docs/pretrained.md).

Each converted layer scores the tokens of a block that leaves its window by their novelty in that layer
(``pretrained_reserve.block_scores``). Scored per layer, a 7-digit needle loses a few digits in some layers
and the model then misses it. With ``"model"`` a layer ranks by the mean of the scores the converted layers
so far (itself included) gave the same tokens, so later layers keep mostly the same tokens; the first layers,
which rank by fewer layers' scores, still differ. With ``"first"`` every layer ranks by the first converted
layer's scores, so every layer keeps exactly the same tokens (the same ranking of the same candidates from the
same start: empty slots fill in position order alike). Every converted layer
shares one chunk schedule, so a block leaves all windows in the same forward call, and the layers run in
order: when layer ``i`` scores a block, layers ``0..i-1`` have scored it in this call (prefill, decode,
crop's replay alike). The board holds a block's running sum only within that call: the first layer writes
it, the last one removes it.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

from torch import Tensor

BOARD_SCOPES = ("model", "first")     # the KVMSpec.exact_scope values a board serves ("layer" needs none)


class NoveltyBoard:
    """The running novelty of the blocks in flight, shared by the ``n_layers`` converted layers of one model."""

    def __init__(self, n_layers: int, scope: str = "model"):
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        if scope not in BOARD_SCOPES:
            raise ValueError(f"scope must be one of {BOARD_SCOPES}, got {scope!r}")
        self.n_layers, self.scope = n_layers, scope
        self.entries: Dict[Tuple[Hashable, int], Tuple[Tensor, int]] = {}

    def combine(self, layer_pos: int, start: int, score: Tensor, rows: Optional[Hashable] = None) -> Tensor:
        """``score [B, Hkv, C]`` (one value per token, the same in every kv head) of the block at ``start``
        in converted layer ``layer_pos`` (0-based among the converted layers) -> the mean over layers
        ``0..layer_pos`` of their scores of it (scope ``"first"``: layer 0's). ``rows`` names the batch rows of a
        padded batch's part."""
        key = (rows, start)
        head = score[:, :1]
        if layer_pos == 0 or key not in self.entries:
            total, n = head, 1
        elif self.scope == "first":
            total, n = self.entries[key]
        else:
            total, n = self.entries[key]
            total, n = total + head, n + 1
        if layer_pos >= self.n_layers - 1:
            self.entries.pop(key, None)
        else:
            self.entries[key] = (total, n)
        return (total / n).expand_as(score)

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)
