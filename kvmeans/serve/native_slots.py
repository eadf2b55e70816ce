"""A native KVM model's per-request cache in one fixed-size byte slot (what a vLLM state slot holds; plain torch).

A :class:`~kvmeans.models.cache.ModelCache` of one sequence holds, per layer, the mixer's state (``KVMState``,
``KVCacheState`` of full / sliding-window layers, ``OVQState``, ``RWKV7State``) and the MLP token-shift row. Its
tensors change shape while the sequence runs (state rows up to the budget, the window up to ``(n+1)*C`` tokens,
a full-attention layer's keys up to the context), so a slot is sized for the largest cache a sequence of
``max_len`` tokens can hold (:func:`slot_bytes`) and a call's cache is packed into it:

* :func:`pack_cache`: the cache's tensors, cut to what is in use (``KVMState`` rows and window, a
  ``KVCacheState``'s ``length`` rows), written one after another (8-byte aligned) into the slot; returns the
  *skeleton*: the cache with each tensor replaced by its place in the slot (offset, shape, dtype) and every
  integer (tokens seen, rows in use, ...) kept. The skeleton is a few hundred bytes of Python objects.
* :func:`unpack_cache`: the skeleton and the slot back to a ``ModelCache`` whose tensors are views of the slot.
  The model then continues it as it continues any cache: the recurrent KVM path copies the rows and window into
  buffers of its own before writing (a loaded state does not own its buffers), full-attention layers append by
  reallocating, so a call never writes past a tensor's own bytes.

Packing goes through one staging buffer, so a tensor still viewing the slot is read before anything is
written over it. Nothing here imports vLLM.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, List

import torch
from torch import Tensor

from kvmeans.layers.states import KVCacheState
from kvmeans.models.cache import ModelCache
from kvmeans.ops.state import KVMState

ALIGN = 8                           # every tensor starts at a multiple of 8 bytes of the slot


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Where a tensor of the skeleton lives in the slot."""
    offset: int
    shape: tuple
    dtype: torch.dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _compact(st):
    """A shallow copy of a layer state with its growing tensors cut to what is in use."""
    out = copy.copy(st)
    if isinstance(st, KVMState):
        st_rows, win = st.rows(), st.window()
        out.keys, out.values, out.radii = st_rows
        out.window_keys, out.window_values, out.window_gates = win
    elif isinstance(st, KVCacheState):
        out.keys, out.values = st.rows()
    out.extras = dict(st.extras)
    if hasattr(out, "_reset_caches"):
        out._reset_caches()
    return out


def _map_leaves(cache: ModelCache, kind: type, leaf: Callable, state: Callable, other: Callable = lambda v: v):
    """A copy of ``cache`` whose ``kind`` leaves (tensors or ``_Ref``: a layer state's fields, its ``extras``
    values, the MLP shift rows) are ``leaf(x)``; each layer state is first replaced by ``state(st)`` (a copy the
    walk may change) and its other ``extras`` values by ``other(v)``."""
    out = copy.copy(cache)
    out.layers = []
    for st in cache.layers:
        if st is not None:
            st = state(st)
            for f in dataclasses.fields(st):
                value = getattr(st, f.name)
                if isinstance(value, kind):
                    setattr(st, f.name, leaf(value))
            st.extras = {k: leaf(v) if isinstance(v, kind) else other(v) for k, v in st.extras.items()}
        out.layers.append(st)
    out.mlp_shift = [None if t is None else leaf(t) for t in cache.mlp_shift]
    out.mixers = list(cache.mixers)
    return out


def pack_cache(cache: ModelCache, slot: Tensor) -> ModelCache:
    """Write the tensors of ``cache`` (one sequence) into ``slot`` (``[P]`` uint8) and return the skeleton.

    Raises ``RuntimeError`` naming the sizes when the cache does not fit (the slot is sized by
    :func:`slot_bytes` for ``max_len``; a longer sequence is a caller's error)."""
    if cache.batch_size not in (None, 1):
        raise ValueError(f"pack_cache: one sequence per slot, the cache holds {cache.batch_size}")
    parts: List[Tensor] = []
    offset = 0

    def ref(t: Tensor) -> _Ref:
        nonlocal offset
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        r = _Ref(offset, tuple(t.shape), t.dtype)
        if nbytes:
            parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        pad = _aligned(nbytes) - nbytes
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
        offset += nbytes + pad
        return r

    skeleton = _map_leaves(cache, Tensor, ref, _compact, copy.deepcopy)
    if offset > slot.numel():
        raise RuntimeError(f"native KVM cache of {offset:,} bytes does not fit its slot of {slot.numel():,} bytes "
                           f"(seen {cache.seen_tokens} tokens): the slot is sized for max_model_len")
    if parts:
        staging = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        slot[:offset].copy_(staging)
    return skeleton


def unpack_cache(skeleton: ModelCache, slot: Tensor) -> ModelCache:
    """The cache of :func:`pack_cache`'s skeleton, its tensors views of ``slot``."""

    def view(r: _Ref) -> Tensor:
        n = math.prod(r.shape) * r.dtype.itemsize
        if n == 0:
            return torch.empty(r.shape, dtype=r.dtype, device=slot.device)
        return slot[r.offset:r.offset + n].view(r.dtype).view(r.shape)

    return _map_leaves(skeleton, _Ref, view, copy.copy)


def slot_bytes(config, max_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the largest packed cache of one sequence of at most ``max_len`` tokens for a
    :class:`~kvmeans.models.config.KVMModelConfig` (states in ``dtype``, counts and sums in float32 at least)."""
    e = max(dtype.itemsize, 4)
    H, Hkv, D, d = config.num_heads, config.kv_heads, config.qk_head_dim, config.hidden_size
    Dv = D                                                  # value heads have the key heads' width
    total = 0
    for i, kind in enumerate(config.mixer_per_layer()):
        tensors = 0                                          # bytes of the layer's tensors
        n_tensors = 2
        if kind == "rwkv7":
            K = d // H
            tensors = H * K * K * 4 + d * e + d * e          # the matrix state (fp32), x_prev, the value anchor
            n_tensors = 4
        else:
            if kind == "kvm":
                C, n = config.chunk_len, config.n_bswa_chunks
                budget = config.state_budget()
                t = -(-max(max_len, 1) // C) * C              # the last chunk boundary a sequence reaches
                rows = max(C, min(int(budget(t)), t))         # every StateBudget is non-decreasing in t
                window = (n + 1) * C
                tensors = (rows + window) * Hkv * (D + Dv + 1) * e + Hkv * 8     # + row_count
                n_tensors = 7
            elif kind == "full":
                tensors = max_len * Hkv * (D + Dv) * e
            elif kind == "swa":
                tensors = config.swa_window * Hkv * (D + Dv) * e
            elif kind == "bswa":
                tensors = (config.bswa_sink_len + config.bswa_chunks * config.chunk_len) * Hkv * (D + Dv) * e
            elif kind == "ovq":
                N, C = config.ovq_max_centroids, config.ovq_chunk_len
                tensors = N * Hkv * (D + Dv + 1) * e + C * Hkv * (D + Dv) * e
                n_tensors = 5
            else:
                raise ValueError(f"layer {i}: no slot size for mixer {kind!r}")
            tensors += (H * D + 2 * Hkv * max(D, Dv)) * e    # token-shift predecessors (q, k, v rows)
            n_tensors += 3
        tensors += d * e                                     # the MLP's token-shift row
        total += tensors + (n_tensors + 1) * ALIGN
    return _aligned(total)


__all__ = ["pack_cache", "unpack_cache", "slot_bytes", "ALIGN"]
