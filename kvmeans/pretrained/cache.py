"""The cache of a converted transformers model: a KVM layer in place of the KV cache of each converted layer.

Any transformers ``Cache`` works (``generate`` builds its usual ``DynamicCache``): a converted layer's entry
becomes a :class:`ConvertedCacheLayer` (at its first call, or when ``generate`` prepares its cache), which keeps
a ``ConvertedBatchState`` (per group of rows: merged rows + exact window, bounded) instead of every key and
value. It takes left-padded batches and ``crop`` (assisted / prompt-lookup decoding, once asked to record) as
that class describes (``kvmeans.pretrained.batch``).
"""
from __future__ import annotations

from typing import Dict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

from kvmeans.pretrained.batch import ConvertedBatchState


class ConvertedCacheLayer(CacheLayerMixin):
    """One converted layer's cache: ``update`` passes the new keys/values through untouched (the KVM
    attention consumes them into ``state``); ``get_seq_length`` counts every column seen, pads included.

    ``compact_mask``: every full-attention layer of the model is converted, so the model's full-attention mask
    (which no layer reads: the KVM attention takes the 2D padding mask) is sized for the new tokens only, not
    for all the tokens seen: ``[B, 1, T, T]`` instead of ``[B, 1, T, seen + T]``."""

    is_sliding = False
    is_croppable = True

    def __init__(self, compact_mask: bool = False, **kwargs):
        super().__init__()
        self.compact_mask = compact_mask
        self.state = ConvertedBatchState()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # empty tensors of their own: a view of the first call's keys would keep them all alive
        self.keys = key_states.new_empty(*key_states.shape[:-2], 0, key_states.shape[-1])
        self.values = value_states.new_empty(*value_states.shape[:-2], 0, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        if self.compact_mask:
            return query_length, self.state.seen
        return self.state.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        recording = self.state.recording
        self.state = ConvertedBatchState(recording=recording)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state.index_select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state.index_select(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state.batch_size:
            self.state.index_select(torch.arange(self.state.batch_size).repeat_interleave(repeats))

    def activate_past_recording(self) -> None:
        """Keep what ``crop`` needs from the next call on (transformers asks for it in assisted decoding)."""
        self.state.start_recording()

    @property
    def record_past(self) -> bool:
        return self.state.recording

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' convention: <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of tokens to remove (<= 0)")
        self.state.crop(self.state.columns + tokens_to_remove)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def nbytes_by_kind(self) -> Dict[str, int]:
        return self.state.nbytes_by_kind()

    def __repr__(self) -> str:
        return f"ConvertedCacheLayer({self.state})"


def _self_attention(cache: Cache) -> Cache:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def kvm_cache_layer(cache: Cache, layer_idx: int, compact_mask: bool = False) -> ConvertedCacheLayer:
    """The :class:`ConvertedCacheLayer` of ``layer_idx`` in ``cache``, swapped in on first use."""
    cache = _self_attention(cache)
    while len(cache.layers) <= layer_idx:
        if cache.layer_class_to_replicate is None:
            raise ValueError(f"the cache has {len(cache.layers)} layers; layer {layer_idx} is missing")
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[layer_idx]
    if not isinstance(layer, ConvertedCacheLayer):
        if layer.is_initialized and layer.get_seq_length() > 0:
            raise ValueError(f"cache layer {layer_idx} already holds {layer.get_seq_length()} tokens of plain "
                             "keys/values; pass a fresh cache (or none) to a converted model")
        layer = cache.layers[layer_idx] = ConvertedCacheLayer(compact_mask)
    return layer


def _layer_nbytes(layer) -> int:
    if isinstance(layer, ConvertedCacheLayer):
        return layer.nbytes
    return sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by a converted model's cache: KVM layers' states plus any plain layers' keys/values."""
    return sum(_layer_nbytes(layer) for layer in _self_attention(cache).layers)


def cache_nbytes_by_kind(cache: Cache) -> Dict[str, int]:
    """:func:`cache_nbytes` split by kind: the converted layers' ``sinks``, ``rows``, ``reserve``, ``window`` and
    ``recording`` (``ConvertedBatchState.nbytes_by_kind``) and ``kv`` (the plain layers' keys and values)."""
    out = {"sinks": 0, "rows": 0, "reserve": 0, "window": 0, "recording": 0, "kv": 0}
    for layer in _self_attention(cache).layers:
        if isinstance(layer, ConvertedCacheLayer):
            for kind, n in layer.nbytes_by_kind().items():
                out[kind] += n
        else:
            out["kv"] += _layer_nbytes(layer)
    return out
