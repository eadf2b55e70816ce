"""The cache of a converted transformers model: a KVM layer in place of the KV cache of each converted layer.

Any transformers ``Cache`` works (``generate`` builds its usual ``DynamicCache``): the first call of a
converted layer swaps that layer's entry for a :class:`ConvertedCacheLayer`, which keeps a
``ConvertedBatchState`` (per group of rows: merged rows + exact window, bounded) instead of every key and
value. It takes left-padded batches and ``crop`` (assisted / prompt-lookup decoding) as that class
describes (``kvmeans.pretrained.batch``).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

from kvmeans.pretrained.batch import ConvertedBatchState


class ConvertedCacheLayer(CacheLayerMixin):
    """One converted layer's cache: ``update`` passes the new keys/values through untouched (the KVM
    attention consumes them into ``state``); ``get_seq_length`` counts every column seen, pads included."""

    is_sliding = False
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.state = ConvertedBatchState(recording=True)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = ConvertedBatchState(recording=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state.index_select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state.index_select(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state.batch_size:
            self.state.index_select(torch.arange(self.state.batch_size).repeat_interleave(repeats))

    def activate_past_recording(self) -> None:
        """Nothing to do: a cache's converted layer always keeps what ``crop`` needs."""

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' convention: <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of tokens to remove (<= 0)")
        self.state.crop(self.state.columns + tokens_to_remove)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def __repr__(self) -> str:
        return f"ConvertedCacheLayer({self.state})"


def kvm_cache_layer(cache: Cache, layer_idx: int) -> ConvertedCacheLayer:
    """The :class:`ConvertedCacheLayer` of ``layer_idx`` in ``cache``, swapped in on first use."""
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    while len(cache.layers) <= layer_idx:
        if cache.layer_class_to_replicate is None:
            raise ValueError(f"the cache has {len(cache.layers)} layers; layer {layer_idx} is missing")
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[layer_idx]
    if not isinstance(layer, ConvertedCacheLayer):
        if layer.is_initialized and layer.get_seq_length() > 0:
            raise ValueError(f"cache layer {layer_idx} already holds {layer.get_seq_length()} tokens of plain "
                             "keys/values; pass a fresh cache (or none) to a converted model")
        layer = cache.layers[layer_idx] = ConvertedCacheLayer()
    return layer


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by a converted model's cache: KVM layers' states plus any plain layers' keys/values."""
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    total = 0
    for layer in cache.layers:
        if isinstance(layer, ConvertedCacheLayer):
            total += layer.nbytes
        else:
            total += sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None),
                                                                 getattr(layer, "values", None))
                         if isinstance(t, torch.Tensor))
    return total
