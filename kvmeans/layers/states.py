"""Carried caches of the baseline mixers and the helpers they share with the OVQ state.

Every state is a small dataclass with ``seen_tokens``, ``extras`` (token-shift rows), ``nbytes``,
``clone()``, ``index_select(batch_idx)`` and ``reorder_(batch_idx)``, like :class:`KVMState`.
``nbytes`` counts the mixer's buffers (capacity included), not ``extras``, as ``KVMState`` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from kvmeans.ops.state import BatchedState

__all__ = ["BatchedState", "KVCacheState", "expand_kv", "pack_rows"]


def expand_kv(t: Tensor, groups: int) -> Tensor:
    """``[B, Hkv, L, X]`` -> ``[B, Hkv*groups, L, X]``: query head h reads kv head ``h // groups``."""
    if groups == 1:
        return t
    B, Hkv, L, X = t.shape
    return t[:, :, None].expand(B, Hkv, groups, L, X).reshape(B, Hkv * groups, L, X)


def pack_rows(rows: Tensor, capacity: int) -> Tensor:
    """Copy ``rows [B, Hkv, n, X]`` into a fresh ``[B, Hkv, capacity, X]`` buffer (zero tail).

    A fresh buffer (never a view) so a long prefill's projections are not kept alive, and the
    same capacity every call so the cache's memory stays flat while decoding.
    """
    B, Hkv, n, X = rows.shape
    if n > capacity:
        raise ValueError(f"{n} rows do not fit a buffer of {capacity}")
    return torch.cat((rows, rows.new_zeros(B, Hkv, capacity - n, X)), dim=2)


@dataclass
class KVCacheState(BatchedState):
    """Cached keys / values of full, sliding-window and block-sliding-window attention.

    Rows ``[0, length)`` hold tokens at positions ``[0, n_sinks)`` (always-visible sinks) followed by
    the contiguous run ``[seen_tokens - (length - n_sinks), seen_tokens)``; later rows are spare capacity.

    Attributes:
        keys: ``[B, Hkv, capacity, D]`` keys after ln_k and RoPE.
        values: ``[B, Hkv, capacity, Dv]``.
        length: rows in use.  n_sinks: leading rows that are sink tokens.
        seen_tokens: tokens of the sequence processed so far.
        extras: token-shift predecessors and the like.
    """

    keys: Tensor
    values: Tensor
    length: int = 0
    n_sinks: int = 0
    seen_tokens: int = 0
    extras: dict = field(default_factory=dict)

    _TENSORS = ("keys", "values")

    @property
    def run_start(self) -> int:
        """Position of the first row after the sinks."""
        return self.seen_tokens - (self.length - self.n_sinks)

    def positions(self, device=None) -> Tensor:
        """``[length]`` absolute positions of the rows in use (ascending)."""
        dev = self.keys.device if device is None else device
        return torch.cat((torch.arange(self.n_sinks, device=dev),
                          torch.arange(self.run_start, self.seen_tokens, device=dev)))

    def rows(self):
        """``(keys [B, Hkv, length, D], values [B, Hkv, length, Dv])``."""
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def __repr__(self) -> str:
        B, Hkv, cap, D = self.keys.shape
        return (f"KVCacheState(batch={B}, kv_heads={Hkv}, head_dim={D}, rows={self.length}/{cap}, "
                f"sinks={self.n_sinks}, seen_tokens={self.seen_tokens}, dtype={self.keys.dtype})")


def empty_kv_state(batch: int, kv_heads: int, head_dim: int, value_dim: int, like: Tensor,
                   capacity: int = 0) -> KVCacheState:
    z = lambda d: like.new_zeros(batch, kv_heads, capacity, d)
    return KVCacheState(z(head_dim), z(value_dim))


def needs_graph(*tensors: Optional[Tensor]) -> bool:
    """True when writing these into a shared buffer in place would break autograd."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
