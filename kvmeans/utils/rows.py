"""Batch rows held in groups (one state per group of rows): where a row selection takes each row from."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor


def split_selection(group_rows: Sequence[Tensor], idx: Tensor) -> List[Tuple[int, Tensor, Tensor]]:
    """``group_rows[g]``: the batch rows group ``g`` holds, in its order; ``idx [N]``: new row ``j`` is old row
    ``idx[j]``. Returns ``(g, new_rows, local)`` per group that supplies rows, groups in order: new rows
    ``new_rows`` are the group's rows at positions ``local``."""
    owner = {r: (g, local) for g, rows in enumerate(group_rows) for local, r in enumerate(rows.tolist())}
    picks: dict = {}
    for j, r in enumerate(idx.tolist()):
        g, local = owner[r]
        picks.setdefault(g, ([], []))[0].append(j)
        picks[g][1].append(local)
    return [(g, torch.tensor(js), torch.tensor(ls)) for g, (js, ls) in sorted(picks.items())]
