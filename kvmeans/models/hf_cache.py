"""``KVMCache``: a ``transformers.Cache`` holding :class:`ModelCache` states for ``generate()``.

A KVM layer's state is not a list of keys and values that can be appended to or cut: it is a
compressed state (``KVMState``), a window cache (SWA/BSWA), a full KV cache or an OVQ codebook, and
all of them depend on the absolute position of every real token (chunk boundaries, sinks). So this
cache does not implement ``update(key, value, layer_idx)``; the model advances it as a whole through
:meth:`KVMCache.advance`.

Padding. The batch is partitioned into *groups* of rows, each owning one batched :class:`ModelCache`
(one group = the whole batch in the common case). When the new columns contain pads, every group is
split by its rows' count of new real tokens, each row's pads are stripped, and the pieces run
separately; pads never enter a state and their outputs are zeros. A call whose attention mask has no
padding first merges the groups back into one when every layer is a KVM layer: rows that have seen
different numbers of tokens then share one ragged state per layer (``KVMState.schedule``: each row's
chunk boundaries, state rows and window; :mod:`kvmeans.ops.ragged`), so a left-padded prompt batch is
prefilled with one call per distinct prompt length and then decodes with one call per step, each row
equal to its solo run. RWKV-7 models merge too (their states do not depend on positions). Models with
other mixers (full, SWA, BSWA, OVQ) keep one group per distinct length (one call per group per step).

Beam search (``reorder_cache``), ``batch_select_indices`` and ``batch_repeat_interleave`` gather rows
(and so every layer's state) across groups.

Rollback (assisted and prompt-lookup decoding). A KVM state cannot be un-merged, so ``crop`` restores a
snapshot instead: after ``activate_past_recording()`` (``generate`` calls it for assisted decoding, on
both caches) a call with no snapshot held clones the state first (:attr:`KVMCache.snapshot_nbytes`: the
size of the cache), and the input ids of every call since are kept. ``crop`` to any length at least the
snapshot's restores a copy of it, and the kept ids up to that length are fed again in front of the next
call's (one backbone run: the state equals one that was fed them with that call): every mixer (kvm,
full, swa, bswa, ovq) rolls back exactly. Once more than :attr:`KVMCache.replay_limit` ids would be fed
again, the next call feeds them alone and snapshots afresh (so replays stay short). Cost per rejected
draft: one copy of the snapshot and the kept ids fed again. ``generate`` sends the prompt with the first
draft, so a recording cache's first call of more than ``replay_limit`` ids runs in two, snapshotting
before the last ``replay_limit``: a rejection there does not feed the prompt again (one further back
does, from the start). Cropping before the snapshot, or without recording, raises ``ValueError``.

The cache that ``generate(num_beams=k, return_dict_in_generate=True)`` returns holds ``batch * k`` rows:
the beams beam search was running (in its order), each without its last token. They need not include
the state of ``out.sequences`` (the best finished hypotheses; seen on transformers 5.23). Continue some
of them with ``cache.select(rows)``, a copy holding those rows; a call whose batch does not match the
cache raises, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvmeans.models.cache import ModelCache
from kvmeans.utils.rows import by_count, put_real, split_selection, take_real

__all__ = ["KVMCache", "KVMCacheLayer", "format_bytes"]

Backbone = Callable[[Tensor, Optional[ModelCache]], Tuple[Tensor, ModelCache]]


def format_bytes(n: int) -> str:
    """``1536 -> "1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class _Group:
    rows: Tensor                    # [G] long, batch rows (ascending) sharing one state
    cache: Optional[ModelCache]     # batched over those rows; None before their first real token


@dataclass
class _Snapshot:
    """The cache before the calls since the last crop, and those calls' input ids (for ``crop``)."""
    columns: int
    lengths: Optional[Tensor]
    groups: List[_Group]            # cloned states
    ids: List[Tensor]               # [B, T] per call since
    masks: List[Tensor]             # [B, T] per call since (1 = token, 0 = pad)


class KVMCacheLayer(CacheLayerMixin):
    """Read-only per-layer view of a :class:`KVMCache` (so generic ``Cache`` code sees one layer per
    model layer). It stores nothing: ``update`` raises, sizes come from the parent cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, parent: "KVMCache", layer_idx: int):
        super().__init__()
        self.parent, self.layer_idx = parent, layer_idx

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("KVM layers keep their own state; the model advances KVMCache as a whole")

    def get_seq_length(self, *args) -> int:
        return self.parent.get_seq_length()

    def get_mask_sizes(self, query_length, *args) -> Tuple[int, int]:
        q = query_length.shape[0] if isinstance(query_length, Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length      # name used by transformers < 5.x deprecation of it

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:  # the parent reorders all layers at once
        pass

    @property
    def nbytes(self) -> int:
        return self.parent.layer_nbytes(self.layer_idx)


class KVMCache(Cache):
    """Carried states of a :class:`KVMForCausalLM` batch, usable as ``cache`` (``past_key_values`` before 5.24).

    Args:
        mixers: per layer the mixer name (``"kvm"``, ``"swa"``, ...); sets ``len(cache)``.

    Attributes:
        groups: partition of the batch rows into groups with a shared :class:`ModelCache`.
        columns: input columns consumed so far, pads included (what ``get_seq_length`` returns, so
            ``generate`` slices ``input_ids`` / ``attention_mask`` correctly).
        lengths: ``[B]`` real (unpadded) tokens each row has seen.
    """

    is_compileable = False
    replay_limit = 32       # most ids fed again in front of a call before the snapshot moves up to them

    def __init__(self, mixers: Optional[List[str]] = None):
        self.mixers = list(mixers or [])
        super().__init__(layers=[KVMCacheLayer(self, i) for i in range(len(self.mixers))])
        self.groups: List[_Group] = []
        self.columns = 0
        self.lengths: Optional[Tensor] = None
        self.record_past = False
        self._snapshot: Optional[_Snapshot] = None
        self._head: Optional[_Snapshot] = None       # the empty cache and the ids before the first snapshot
        self._pending: Optional[Tuple[Tensor, Tensor]] = None   # ids, mask [B, n] kept by crop, fed first

    def bind(self, mixers: List[str]) -> "KVMCache":
        """Give a cache built without layer info (``KVMCache()``) its per-layer views; check others."""
        if not self.mixers:
            self.mixers = list(mixers)
            self.layers = [KVMCacheLayer(self, i) for i in range(len(self.mixers))]
        elif self.mixers != list(mixers):
            raise ValueError(f"this KVMCache was built for layers {self.mixers}, the model has {list(mixers)}")
        return self

    # ---- running the model ---------------------------------------------------------------------
    def advance(self, backbone: Backbone, input_ids: Tensor, mask: Optional[Tensor] = None) -> Optional[Tensor]:
        """Run ``backbone`` on the new columns, advancing every row's state by its real tokens.

        Args:
            backbone: ``(ids [G, n], ModelCache | None) -> (hidden [G, n, d], ModelCache)``.
            input_ids: ``[B, T]`` new columns.
            mask: ``[B, T]`` 1 = real token, 0 = pad; None = all real.
        Returns:
            ``hidden [B, T, d]``, zeros at pad positions; None when every new column is a pad.
        """
        if mask is not None and bool(mask.all()):
            mask = None
        if self._pending is not None:
            (ids, held), self._pending = self._pending, None
            if self._snapshot is None:                  # replayed alone; the next lines snapshot after it
                self._run(backbone, ids, None if bool(held.all()) else held)
            else:                                       # fed in front of this call (already recorded)
                self._record(input_ids, mask)
                new = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
                both = torch.cat((held, new), 1)
                hidden = self._run(backbone, torch.cat((ids, input_ids), 1), None if bool(both.all()) else both)
                return None if hidden is None else hidden[:, ids.shape[1]:]
        if self.record_past:
            head = input_ids.shape[1] - self.replay_limit
            if self.lengths is None and mask is None and head > 0:     # the prompt and a first draft
                first = input_ids[:, :head]
                hidden = self._run(backbone, first, None)
                self._head = _Snapshot(0, None, [], [first.clone()], [torch.ones_like(first, dtype=torch.bool)])
                self._record(input_ids[:, head:], None)
                return torch.cat((hidden, self._run(backbone, input_ids[:, head:], None)), 1)
            self._record(input_ids, mask)
        return self._run(backbone, input_ids, mask)

    def _record(self, input_ids: Tensor, mask: Optional[Tensor]) -> None:
        snap = self._snapshot
        if snap is None:
            snap = self._snapshot = _Snapshot(self.columns, self.lengths, [
                _Group(g.rows, None if g.cache is None else g.cache.clone()) for g in self.groups], [], [])
        snap.ids.append(input_ids.clone())
        snap.masks.append(torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool())

    def _run(self, backbone: Backbone, input_ids: Tensor, mask: Optional[Tensor]) -> Optional[Tensor]:
        B, T = input_ids.shape
        if self.lengths is None:
            self.groups = [_Group(torch.arange(B), None)]
            self.lengths = torch.zeros(B, dtype=torch.long)
        elif B != self.batch_size:
            raise ValueError(f"KVMCache holds {self.batch_size} sequences but input_ids has batch {B}; a cache "
                             "returned by beam search holds every beam: continue some of them with "
                             "cache.select(rows) (a copy holding those rows, in that order)")
        counts = torch.full((B,), T, dtype=torch.long) if mask is None else mask.long().sum(1).cpu()
        if mask is None and len(self.groups) > 1:
            self._merge()
        if mask is None and len(self.groups) == 1:      # common case: one batched call, no copies
            g = self.groups[0]                          # (a single group holds rows 0..B-1 in order)
            hidden, g.cache = backbone(input_ids, g.cache)
            self._finish(T, counts)
            return hidden
        out: Optional[Tensor] = None
        new_groups: List[_Group] = []
        for gi, n, local, rows in by_count([g.rows for g in self.groups], counts):
            g = self.groups[gi]
            sub = g.cache if (len(local) == len(g.rows) or g.cache is None) else g.cache.index_select(local)
            if n > 0:
                hidden, sub = backbone(take_real(input_ids, rows, mask, n, 1), sub)
                if out is None:
                    out = hidden.new_zeros(B, T, hidden.shape[-1])
                put_real(out, rows, mask, hidden, 1)
            new_groups.append(_Group(rows, sub))
        self.groups = new_groups
        self._finish(T, counts)
        return out

    def _merge(self) -> None:
        """Join the groups into one batched cache in batch order when every layer state can be stacked
        (KVM layers: rows at different positions make a ragged state); else leave them."""
        caches = [g.cache for g in self.groups]
        if any(c is None for c in caches) or not ModelCache.stackable(caches):
            return
        rows = torch.cat([g.rows for g in self.groups])
        self.groups = [_Group(torch.arange(len(rows)), ModelCache.stack(caches).index_select(torch.argsort(rows)))]

    @staticmethod
    def _in_order(g: _Group) -> bool:
        return bool((g.rows == torch.arange(len(g.rows))).all())

    def _finish(self, T: int, counts: Tensor) -> None:
        self.columns += T
        self.lengths = self.lengths + counts

    # ---- transformers Cache API ----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns consumed so far (pads included, and ids a crop kept for replay); see :attr:`lengths`
        for real tokens per row in the states."""
        return self.columns + (0 if self._pending is None else self._pending[0].shape[1])

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> Tuple[int, int]:
        q = query_length.shape[0] if isinstance(query_length, Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    get_max_cache_shape = get_max_length

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else int(self.lengths.shape[0])

    @property
    def is_initialized(self) -> bool:
        return self.lengths is not None

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def snapshot_nbytes(self) -> int:
        """Bytes of the snapshot held for ``crop`` (0 when none)."""
        snap = self._snapshot
        return 0 if snap is None else sum(g.cache.nbytes for g in snap.groups if g.cache is not None)

    def activate_past_recording(self) -> None:
        """Keep what ``crop`` needs from the next call on (see the module docstring)."""
        self.record_past = True

    def reset(self) -> None:
        """Forget every sequence (the next call starts new ones at position 0)."""
        self.groups, self.columns, self.lengths = [], 0, None
        self._snapshot = self._head = self._pending = None

    def crop(self, max_length: int) -> None:
        """Drop the last columns: ``max_length > 0`` keeps that many, ``<= 0`` removes ``-max_length``
        (transformers 5.2x's convention). Rolls back to any length at least the snapshot's (see the module
        docstring)."""
        total = self.get_seq_length()
        keep = min(max_length, total) if max_length > 0 else total + max_length
        if keep < 0:
            raise ValueError(f"KVMCache.crop({max_length}): the cache holds {total} columns; remove at most that many")
        snap = self._snapshot
        if keep == total:                               # nothing removed: snapshot afresh if far behind
            if snap is not None and keep - snap.columns > self.replay_limit:
                self._snapshot = self._head = None
            return
        if snap is not None and keep < snap.columns and self._head is not None:   # from the start
            ids, masks = (torch.cat(t + u, 1)[:, :keep] for t, u in ((self._head.ids, snap.ids),
                                                                    (self._head.masks, snap.masks)))
            self.groups, self.columns, self.lengths = [], 0, None
            self._pending, self._snapshot, self._head = (ids, masks) if keep else None, None, None
            return
        if not self.record_past:
            why = "past recording is off: call cache.activate_past_recording() before the calls to undo"
        elif snap is None or keep < snap.columns:
            why = (f"it can restore {self.columns if snap is None else snap.columns} columns at the least (the "
                   "length when the snapshot was taken)")
        else:
            why = None
        if why is not None and keep < self.columns:
            raise ValueError(f"KVMCache.crop({max_length}): cannot roll {total} columns back to {keep}: {why}")
        if snap is not None:                            # the record now ends where the sequence ends
            n = keep - snap.columns
            snap.ids, snap.masks = [torch.cat(snap.ids, 1)[:, :n]], [torch.cat(snap.masks, 1)[:, :n]]
        if keep >= self.columns:                        # only ids not fed yet are dropped
            n = keep - self.columns
            self._pending = tuple(t[:, :n] for t in self._pending) if n else None
            return
        if n > self.replay_limit:                       # replay alone next call, then snapshot there
            self.groups, self._snapshot, self._head = snap.groups, None, None
        else:
            self.groups = [_Group(g.rows, None if g.cache is None else g.cache.clone()) for g in snap.groups]
        self.columns, self.lengths = snap.columns, snap.lengths
        self._pending = (snap.ids[0], snap.masks[0]) if n else None

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row ``j`` becomes old row ``beam_idx[j]`` in every layer's state."""
        self._gather(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._gather(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._gather(torch.arange(self.batch_size).repeat_interleave(repeats))

    def select(self, rows) -> "KVMCache":
        """A new cache holding batch rows ``rows`` (``[B']`` ints, in that order; e.g. some beams of a
        cache returned by beam search); this cache is left unchanged."""
        src = torch.as_tensor(rows, dtype=torch.long).cpu().flatten()
        if self.lengths is None or len(src) == 0 or not bool(((src >= 0) & (src < self.batch_size)).all()):
            raise ValueError(f"select: rows must be a non-empty list of batch rows in [0, {self.batch_size}), "
                             f"got {src.tolist()}" + ("; this cache is empty" if self.lengths is None else ""))
        out = KVMCache(self.mixers)
        out.groups = [_Group(g.rows, g.cache) for g in self.groups]
        out.columns, out.lengths, out._pending = self.columns, self.lengths, self._pending
        out._gather(src, copy=True)
        return out

    def _gather(self, src: Tensor, copy: bool = False) -> None:
        """Row ``j`` becomes old row ``src[j]``; ``copy``: never reorder a group's states in place."""
        if self.lengths is None:
            return
        src = torch.as_tensor(src, dtype=torch.long).cpu()
        self._snapshot = self._head = None              # rows changed: crop can undo only later calls
        if self._pending is not None:
            self._pending = tuple(t[src.to(t.device)] for t in self._pending)
        if len(self.groups) == 1 and self._in_order(self.groups[0]):     # common case: one batched state
            g = self.groups[0]
            if g.cache is not None:
                if len(src) == len(g.rows) and not copy:
                    g.cache.reorder_(src)
                else:
                    g.cache = g.cache.index_select(src)
            g.rows = torch.arange(len(src))
        else:
            self.groups = [
                _Group(js, None if self.groups[gi].cache is None else self.groups[gi].cache.index_select(ps))
                for gi, js, ps in split_selection([g.rows for g in self.groups], src)]
        self.lengths = self.lengths[src]

    # ---- inspection ----------------------------------------------------------------------------
    def to_model_cache(self) -> ModelCache:
        """The single batched :class:`ModelCache` (rows in batch order; rows at different positions hold ragged
        ``KVMState``s); raises while padding keeps the rows split into groups."""
        if len(self.groups) != 1 or not self._in_order(self.groups[0]) or self.groups[0].cache is None:
            raise ValueError(f"the batch is split into {len(self.groups)} group(s) (padding); "
                             "read .groups for the per-group ModelCaches")
        return self.groups[0].cache

    def layer_nbytes(self, i: int) -> int:
        return sum(g.cache.layer_nbytes(i) for g in self.groups if g.cache is not None)

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's state over all groups (buffers' spare capacity included)."""
        return sum(g.cache.nbytes for g in self.groups if g.cache is not None)

    def report(self) -> List[Dict[str, Any]]:
        """Per layer ``{"layer", "mixer", "nbytes", "groups", "state"}`` (``state``: the first group's
        state repr)."""
        rows = []
        for i, mixer in enumerate(self.mixers):
            caches = [g.cache for g in self.groups if g.cache is not None]
            rows.append(dict(layer=i, mixer=mixer, nbytes=self.layer_nbytes(i), groups=len(caches),
                             state=repr(caches[0].layers[i]) if caches else "empty"))
        return rows

    def summary(self) -> str:
        """A printable per-layer table with the total."""
        lines = [f"{'layer':>5} {'mixer':>6} {'bytes':>12}  state"]
        lines += [f"{r['layer']:>5} {r['mixer']:>6} {r['nbytes']:>12,}  {r['state']}" for r in self.report()]
        lines.append(f"{'total':>5} {'':>6} {self.nbytes:>12,}  ({format_bytes(self.nbytes)}; "
                     f"{len(self.groups)} group(s), {self.columns} columns)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"KVMCache(layers={len(self.mixers)}, batch={self.batch_size}, groups={len(self.groups)}, "
                f"columns={self.columns}, nbytes={self.nbytes})")
