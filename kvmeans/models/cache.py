"""ModelCache: everything a :class:`KVMLanguageModel` carries between calls for a batch of sequences."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

__all__ = ["ModelCache"]


def _tensor_bytes(obj) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    return 0


@dataclass
class ModelCache:
    """Per-layer mixer states plus the MLP token-shift rows.

    Like the layer states it holds, the cache is advanced in place by the model (``clone()`` it to
    keep a snapshot).

    Attributes:
        layers: one state per layer (``KVMState``, ``KVCacheState``, ``OVQState`` or ``RWKV7State``); None before
            the first call.
        mlp_shift: per layer the last MLP input ``[B, d]`` (None without MLP token shift).
        mixers: per layer the mixer name (``"kvm"``, ``"full"``, ...), for reports.
        seen_tokens: tokens of each sequence processed so far (stacked rows at different positions: the most;
            each ``KVMState.schedule`` holds every row's).
    """

    layers: List[Any]
    mlp_shift: List[Optional[Tensor]]
    mixers: List[str] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, mixers: List[str]) -> "ModelCache":
        n = len(mixers)
        return cls([None] * n, [None] * n, list(mixers))

    @property
    def batch_size(self) -> Optional[int]:
        for s in self.mlp_shift:
            if s is not None:
                return s.shape[0]
        for st in self.layers:
            if st is not None:
                return next(t for t in vars(st).values() if isinstance(t, Tensor)).shape[0]
        return None

    # ---- memory ----------------------------------------------------------------------------------
    def layer_nbytes(self, i: int) -> int:
        """Bytes held for layer ``i``: mixer buffers + token-shift rows + MLP shift row."""
        st = self.layers[i]
        mixer = 0 if st is None else st.nbytes + _tensor_bytes(getattr(st, "extras", {}))
        return mixer + _tensor_bytes(self.mlp_shift[i])

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the whole cache (buffers' spare capacity included)."""
        return sum(self.layer_nbytes(i) for i in range(len(self.layers)))

    def report(self) -> List[Dict[str, Any]]:
        """Per layer: ``{"layer", "mixer", "nbytes", "mixer_nbytes", "shift_nbytes", "state"}``
        (``state`` is the state's repr: rows / window / centroids in use)."""
        rows = []
        for i, st in enumerate(self.layers):
            mixer_b = 0 if st is None else st.nbytes
            rows.append(dict(layer=i, mixer=self.mixers[i] if i < len(self.mixers) else "?",
                             nbytes=self.layer_nbytes(i), mixer_nbytes=mixer_b,
                             shift_nbytes=self.layer_nbytes(i) - mixer_b, state=repr(st)))
        return rows

    def summary(self) -> str:
        """A printable table of :meth:`report` with the total."""
        lines = [f"{'layer':>5} {'mixer':>6} {'bytes':>12}  state"]
        for r in self.report():
            lines.append(f"{r['layer']:>5} {r['mixer']:>6} {r['nbytes']:>12,}  {r['state']}")
        lines.append(f"{'total':>5} {'':>6} {self.nbytes:>12,}  seen_tokens={self.seen_tokens}")
        return "\n".join(lines)

    # ---- batch operations (beam search) ----------------------------------------------------------
    def _map(self, state_fn, tensor_fn) -> "ModelCache":
        out = copy.copy(self)
        out.layers = [None if st is None else state_fn(st) for st in self.layers]
        out.mlp_shift = [None if t is None else tensor_fn(t) for t in self.mlp_shift]
        out.mixers = list(self.mixers)
        return out

    def clone(self) -> "ModelCache":
        return self._map(lambda st: st.clone(), lambda t: t.clone())

    def detach(self) -> "ModelCache":
        """A copy cut from the autograd graph (truncated backpropagation through time)."""
        return self._map(lambda st: st.detach(), lambda t: t.detach())

    def index_select(self, batch_index: Tensor) -> "ModelCache":
        """Select / reorder the batch's sequences: ``batch_index`` is ``[B']`` long."""
        idx = torch.as_tensor(batch_index, dtype=torch.long)
        return self._map(lambda st: st.index_select(idx), lambda t: t.index_select(0, idx.to(t.device)))

    @staticmethod
    def stackable(caches: List["ModelCache"]) -> bool:
        """Whether :meth:`stack` can join these caches: every layer of every cache holds a ``KVMState``, or
        every one an ``RWKV7State``."""
        from kvmeans.layers.rwkv7 import RWKV7State
        from kvmeans.ops.state import KVMState
        kinds = {type(st) for c in caches for st in c.layers}
        return len(kinds) == 1 and kinds <= {KVMState, RWKV7State} and \
            len({tuple(s is None for s in c.mlp_shift) for c in caches}) == 1

    @classmethod
    def stack(cls, caches: List["ModelCache"]) -> "ModelCache":
        """One cache holding the rows of ``caches`` in order (see :meth:`stackable`); rows at different positions
        make each KVM layer's state ragged (``KVMState.stack``; ``RWKV7State.stack`` needs no positions)."""
        first = caches[0]
        layers = [type(first.layers[i]).stack([c.layers[i] for c in caches]) for i in range(len(first.layers))]
        shift = [None if t is None else torch.cat([c.mlp_shift[i] for c in caches])
                 for i, t in enumerate(first.mlp_shift)]
        return cls(layers, shift, list(first.mixers), max(c.seen_tokens for c in caches))

    def reorder_(self, batch_index: Tensor) -> "ModelCache":
        """In-place :meth:`index_select` (each layer state object is kept and reordered)."""
        idx = torch.as_tensor(batch_index, dtype=torch.long)
        for st in self.layers:
            if st is not None:
                st.reorder_(idx)
        self.mlp_shift = [None if t is None else t.index_select(0, idx.to(t.device)) for t in self.mlp_shift]
        return self
