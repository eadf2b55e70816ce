"""A converted layer's state over a batch: padding (row groups) and rollback (``crop``), docs/pretrained.md.

Padding. KVM chunks each sequence by its own token positions, so rows that have seen different numbers of
real tokens cannot share one state. :class:`ConvertedBatchState` partitions the batch into *parts*, rows
that have seen the same number of real tokens, each with one batched :class:`ConvertedKVMState`. A call
without pads on a single part runs as one batch (the common case, no copies); otherwise each part is split
by its rows' count of new real tokens, the pads are stripped and every piece runs alone: pads never enter
a state or a window, their outputs are zeros, and each row gets exactly what it gets alone. A left-padded
prompt batch then decodes as one part per distinct prompt length. Parts are never merged back.

Rollback. Merged rows cannot be un-merged, but :class:`ConvertedKVMState` tensors are replaced, never
written in place, so a shallow copy is a snapshot. Recording is off unless asked for: assisted and
prompt-lookup decoding ask through the cache's ``activate_past_recording``, which reaches a converted layer
because ``convert_hf`` puts the converted cache layers in ``generate``'s cache before decoding starts; without
it ``crop`` can only keep everything. With ``recording`` a call with no snapshot held takes one first (a call
of more than ``replay_limit`` tokens runs in two, the snapshot before its last ``replay_limit``, whether or not
one is held), and the inputs of every call since are kept. ``crop`` back to the snapshot or later restores it
and runs the kept inputs again (outputs discarded): the state equals one that never saw the removed tokens. A
crop keeping more than ``replay_limit`` tokens since the snapshot, or a call finding ``2 * replay_limit`` kept,
lets the next call snapshot afresh; so the snapshot is always at or before the start of the last call, and what
is kept is at most one state's tensors (shared with the live state until they change) and the q/k/v of
``3 * replay_limit`` tokens (``nbytes_by_kind()["recording"]``).
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from kvmeans.pretrained.op import ConvertedKVMState
from kvmeans.utils.rows import by_count, put_real, split_selection, take_real

# keyword tensors of the attention function given per row and token: name -> axis of the tokens (rows: axis 0)
PER_TOKEN = {"cos": 1, "sin": 1, "positions": 1, "merge_gate": 2}

Part = Tuple[Optional[Tensor], ConvertedKVMState]       # (batch rows [g] ascending, or None: all rows in order)


class ConvertedBatchState:
    """What a converted layer carries between calls for a whole batch (see the module docstring).

    ``columns``: input columns seen, pads included (the cache's sequence length); ``parts``: the row
    groups and their states.
    """

    replay_limit = 32

    def __init__(self, recording: bool = False):
        self.columns = 0
        self.parts: List[Part] = []
        self.recording = recording
        self._snapshot: Optional[Tuple[int, List[Part]]] = None
        self._calls: List[tuple] = []           # (q, k, v, mask, per-token kwargs) of each call since the snapshot
        self._replay: Optional[Tuple[Callable, Dict]] = None     # the attention function and its other kwargs

    # ---- running ---------------------------------------------------------------------------------
    def attend(self, fn: Callable, mask: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        """``fn(q, k, v, ConvertedKVMState, **kwargs) -> [B, H, T, Dv]`` (``converted_kvm_attention``) over
        the batch, each row continuing its own state by its real tokens. ``mask [B, >= T]`` 1 = token,
        0 = pad (its last ``T`` columns are this call's; None: no pads); ``q [B, H, T, D]``."""
        T = q.shape[2]
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != q.shape[0] or mask.shape[1] < T:
                raise ValueError(f"attention_mask must be [batch={q.shape[0]}, >= {T}] (1 = token, 0 = pad), got "
                                 f"{list(mask.shape)}")
            mask = mask[:, -T:].bool()
            mask = None if bool(mask.all()) else mask
        if not self.recording:
            return self._run(fn, q, k, v, mask, kwargs)
        per_token = {n: kwargs.pop(n) for n in PER_TOKEN if kwargs.get(n) is not None}
        self._replay = (fn, kwargs)
        if self._snapshot is not None and (self._kept() >= 2 * self.replay_limit or T > self.replay_limit):
            self._snapshot = None
        if self._snapshot is None and T > self.replay_limit:           # snapshot before the last replay_limit
            head = T - self.replay_limit
            out = self._run(fn, q[:, :, :head], k[:, :, :head], v[:, :, :head],
                            None if mask is None else mask[:, :head], self._cut(per_token, 0, head, kwargs))
            tail = self._cut(per_token, head, T, {})
            return torch.cat((out, self.attend(fn, None if mask is None else mask[:, head:], q[:, :, head:],
                                               k[:, :, head:], v[:, :, head:], **tail, **kwargs)), 2)
        if self._snapshot is None:
            self._snapshot = (self.columns, [(rows, st.copy()) for rows, st in self.parts])
            self._calls = []
        self._calls.append((q, k, v, mask, per_token))
        return self._run(fn, q, k, v, mask, {**kwargs, **per_token})

    @staticmethod
    def _cut(per_token: Dict[str, Tensor], lo: int, hi: int, into: Dict) -> Dict:
        """``per_token`` tensors cut to tokens ``[lo, hi)``, added to a copy of ``into``."""
        return {**into, **{n: t.narrow(PER_TOKEN[n], lo, hi - lo) for n, t in per_token.items()}}

    def _run(self, fn: Callable, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], kwargs: Dict) -> Tensor:
        B, T = q.shape[0], q.shape[2]
        if mask is not None and bool(mask.all()):
            mask = None
        if not self.parts:
            self.parts = [(None, ConvertedKVMState())]
        self.columns += T
        if mask is None and len(self.parts) == 1 and self.parts[0][0] is None:   # common case: one batch
            return fn(q, k, v, self.parts[0][1], **kwargs)
        new = torch.full((B,), T) if mask is None else mask.sum(1).cpu()
        out = q.new_zeros(B, q.shape[1], T, v.shape[-1])
        parts: List[Part] = []
        groups = [torch.arange(B) if rows is None else rows for rows, _ in self.parts]
        for p, n, local, r in by_count(groups, new):
            rows, st = self.parts[p]
            whole = len(local) == len(groups[p])
            sub = st if whole else st.copy().index_select(local)
            if n > 0:
                args = {name: (take_real(t, r, mask, n, PER_TOKEN[name]) if name in PER_TOKEN and t is not None
                               else t) for name, t in kwargs.items()}
                if args.get("layer_novelty") is not None:      # the part's own entries on the board
                    args["layer_novelty"] = functools.partial(args["layer_novelty"], rows=tuple(r.tolist()))
                put_real(out, r, mask, fn(*(take_real(x, r, mask, n, 2) for x in (q, k, v)), sub, **args), 2)
            parts.append((rows if whole else r, sub))
        self.parts = parts
        return out

    # ---- rollback --------------------------------------------------------------------------------
    def _kept(self) -> int:
        return sum(c[0].shape[2] for c in self._calls)

    def crop(self, keep: int) -> None:
        """Roll back to the first ``keep`` columns (see the module docstring)."""
        if keep >= self.columns:
            if self._snapshot is not None and self._kept() > self.replay_limit:
                self._snapshot = None
            return
        snap = self._snapshot
        if snap is None or keep < snap[0]:
            raise ValueError(f"crop: a converted layer can roll {self.columns} columns back to "
                             f"{self.columns if snap is None else snap[0]} at the least (its last snapshot), not "
                             f"{keep}" + ("" if self.recording else "; it does not record: call the cache's "
                                          "activate_past_recording() before the calls to roll back"))
        calls, n = [], keep - snap[0]
        for q, k, v, mask, per_token in self._calls:
            m = min(n - sum(c[0].shape[2] for c in calls), q.shape[2])
            if m <= 0:
                break
            calls.append((q[:, :, :m], k[:, :, :m], v[:, :, :m], None if mask is None else mask[:, :m],
                          self._cut(per_token, 0, m, {})))
        self.columns, self.parts = snap[0], [(rows, st.copy()) for rows, st in snap[1]]
        fn, kwargs = self._replay
        for q, k, v, mask, per_token in calls:
            self._run(fn, q, k, v, mask, {**kwargs, **per_token})
        self._calls = calls
        if n > self.replay_limit:
            self._snapshot = None

    # ---- batch rows ------------------------------------------------------------------------------
    def index_select(self, idx: Tensor) -> None:
        """Row ``j`` becomes old row ``idx[j]`` (beam search, batch selection, repeats); forgets the snapshot."""
        idx = torch.as_tensor(idx, dtype=torch.long).cpu().flatten()
        self._snapshot, self._calls = None, []
        if not self.parts:
            return
        if len(self.parts) == 1 and self.parts[0][0] is None:
            self.parts[0][1].index_select(idx)
            return
        self.parts = [(js, self.parts[p][1].copy().index_select(ls))
                      for p, js, ls in split_selection([rows for rows, _ in self.parts], idx)]
        if len(self.parts) == 1:                       # every row from one part: one batch again
            self.parts = [(None, self.parts[0][1])]

    @property
    def batch_size(self) -> int:
        """Rows held (0 before the first call)."""
        if not self.parts:
            return 0
        if self.parts[0][0] is None:
            st = self.parts[0][1]
            return 0 if st.buf_v is None else st.buf_v.shape[0]
        return sum(len(rows) for rows, _ in self.parts)

    # ---- inspection ------------------------------------------------------------------------------
    @property
    def seen(self) -> int:
        """Columns seen, pads included (what the cache reports as its length)."""
        return self.columns

    @property
    def num_rows(self) -> int:
        """State rows (the largest over the parts)."""
        return max((st.num_rows for _, st in self.parts), default=0)

    @property
    def window_tokens(self) -> int:
        """Tokens buffered for the exact window (the most over the parts)."""
        return max((st.seen - st.covered for _, st in self.parts), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes held: the states' tensors and, when recording, what only the snapshot and the kept calls hold."""
        return sum(self.nbytes_by_kind().values())

    def nbytes_by_kind(self) -> Dict[str, int]:
        """Bytes held per kind: ``sinks``, ``rows``, ``reserve``, ``window`` (:meth:`ConvertedKVMState.nbytes_by_kind`,
        summed over the parts) and ``recording`` (for ``crop``: the snapshot's tensors the live states no longer
        share, and the inputs of the calls since it)."""
        out = {"sinks": 0, "rows": 0, "reserve": 0, "window": 0, "recording": 0}
        for _, st in self.parts:
            for kind, n in st.nbytes_by_kind().items():
                out[kind] += n
        if self._snapshot is not None:
            live = {t.data_ptr() for _, st in self.parts for t in st._tensors()}
            out["recording"] += sum(t.numel() * t.element_size() for _, st in self._snapshot[1]
                                    for t in st._tensors() if t.data_ptr() not in live)
            out["recording"] += sum(t.numel() * t.element_size() for call in self._calls
                                    for t in (*call[:3], *call[4].values()))
        return out

    def start_recording(self) -> None:
        """Keep what ``crop`` needs from the next call on (assisted / prompt-lookup decoding)."""
        self.recording = True

    def __repr__(self) -> str:
        inner = self.parts[0][1] if len(self.parts) == 1 else f"{len(self.parts)} parts"
        return f"ConvertedBatchState(columns={self.columns}, {inner})"
