"""Batch rows held in groups (one state per group of rows), shared by the native ``KVMCache``
(:mod:`kvmeans.models.hf_cache`) and a converted layer's ``ConvertedBatchState`` (:mod:`kvmeans.pretrained.batch`):
which rows run together (:func:`by_count`), their real tokens in and out (:func:`take_real`, :func:`put_real`), and
where a row selection takes each row from (:func:`split_selection`)."""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def by_count(group_rows: Sequence[Tensor], counts: Tensor) -> Iterator[Tuple[int, int, Tensor, Tensor]]:
    """The rows of each group split by their count of new real tokens (rows at different counts cannot run
    as one batch). ``group_rows[g]``: the batch rows group ``g`` holds, in its order; ``counts [B]``: new real
    tokens per batch row. Yields ``(g, n, local, rows)`` per group in order and per distinct count ``n`` of its
    rows (ascending): the group's rows at positions ``local`` are batch rows ``rows``, each with ``n`` tokens."""
    for g, rows in enumerate(group_rows):
        c = counts[rows]
        for n in c.unique().tolist():
            local = (c == n).nonzero().flatten()
            yield g, n, local, rows[local]


def take_real(x: Tensor, rows: Tensor, mask: Optional[Tensor], n: int, axis: int) -> Tensor:
    """Batch rows ``rows`` of ``x`` (batch axis 0; a batch of 1 is broadcast) and, with ``mask [B, T]``
    (1 = token, 0 = pad), per row its ``n`` real tokens along ``axis`` (the ``T`` tokens' axis of ``x``)."""
    x = x[rows.to(x.device)] if x.shape[0] > 1 else x.expand(len(rows), *x.shape[1:])
    if mask is None:
        return x
    moved = x.movedim(axis, 1)                                          # [g, T, ...]
    picked = moved[mask[rows.to(mask.device)].bool().to(x.device)]     # [g * n, ...], row-major
    return picked.reshape(len(rows), n, *moved.shape[2:]).movedim(1, axis)


def put_real(out: Tensor, rows: Tensor, mask: Optional[Tensor], x: Tensor, axis: int) -> None:
    """Write ``x`` (rows ``rows``' real tokens along ``axis``, as :func:`take_real` gives them) into ``out`` at
    those batch rows and, with ``mask``, at their real tokens' columns; pad columns keep what ``out`` holds."""
    dev = rows.to(out.device)
    if mask is None:
        out[dev] = x
        return
    block = out[dev].movedim(axis, 1)                                   # [g, T, ...]
    block[mask[rows.to(mask.device)].bool().to(out.device)] = x.movedim(axis, 1).reshape(-1, *block.shape[2:])
    out[dev] = block.movedim(1, axis)


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
