"""vLLM model class for native KVM folders (``KVMForCausalLM``: ``model_type`` kvmeans, or the authors'
rwkv7backbone layout; docs/serving.md). Imported by vLLM only.

The model is kvmeans' own :class:`~kvmeans.models.transformer.KVMLanguageModel` (every mixer: KVM, full / sliding
window, OVQ, RWKV-7), so vLLM serves exactly what ``KVMForCausalLM`` computes. Its per-request cache lives in one
vLLM state slot per request (:class:`NativeCacheSlot`, a ``MambaBase`` layer): the cache is packed into the slot's
bytes after each call and read back before the next (``kvmeans.serve.native_slots``), so vLLM's memory accounting,
scheduling and slot reuse apply unchanged. Each request runs the model on its own tokens (batch 1): a native model
has no per-token layers vLLM could batch around the mixers, unlike the converted families.
"""
from __future__ import annotations

from typing import Dict, Iterable, Set, Tuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kvmeans.models.cache import ModelCache
from kvmeans.models.hf import KVMConfig
from kvmeans.models.reference_checkpoint import map_reference_state_dict
from kvmeans.models.transformer import KVMLanguageModel
from kvmeans.serve.native_slots import pack_cache, slot_bytes, unpack_cache

STATE_PREFIX = "kvm_native_cache.0"          # vLLM reads one layer index from a state layer's name
REFERENCE_ARCH = "RWKV7BackboneForCausalLM"


def _model_config(vllm_config: VllmConfig):
    cfg = vllm_config.model_config.hf_config
    if not isinstance(cfg, KVMConfig):
        raise ValueError(f"kvmeans: a native KVM model needs a KVMConfig, got {type(cfg).__name__}")
    return cfg.to_model_config()


def _shapes(vllm_config: VllmConfig):
    mc = vllm_config.model_config
    return ((4,), (slot_bytes(_model_config(vllm_config), mc.max_model_len, mc.dtype),))


class NativeCacheSlot(nn.Module, MambaBase):
    """The state layer of a native model: one slot per request holding its packed ``ModelCache`` (``meta [4]``
    int32: tokens seen, packed bytes; ``cache [P]`` uint8). The skeletons (the cache's integers and where its
    tensors lie in the slot) are kept here per slot id."""

    def __init__(self, vllm_config: VllmConfig):
        super().__init__()
        self.prefix = STATE_PREFIX
        self.shapes = _shapes(vllm_config)
        self.kv_cache: Tuple[torch.Tensor, ...] = ()
        self.skeletons: Dict[int, ModelCache] = {}
        context = vllm_config.compilation_config.static_forward_context
        if self.prefix in context:
            raise ValueError(f"Duplicate layer name: {self.prefix}")
        context[self.prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR          # per-request token ranges, sequence lengths, state slot

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return (torch.int32, torch.uint8)

    def load(self, slot: int, ctx: int):
        """The cache of the request in ``slot`` that has ``ctx`` tokens computed (None for its first call)."""
        meta, arena = self.kv_cache
        if ctx == 0:
            self.skeletons.pop(slot, None)
            return None
        seen = int(meta[slot, 0])
        skeleton = self.skeletons.get(slot)
        if skeleton is None or seen != ctx or skeleton.seen_tokens != ctx:
            raise RuntimeError(f"native KVM model: the request in slot {slot} has {ctx} tokens computed but its "
                               f"cache has seen {seen} (prefix caching and speculative decoding are not supported)")
        return unpack_cache(skeleton, arena[slot])

    def store(self, slot: int, cache: ModelCache) -> None:
        meta, arena = self.kv_cache
        self.skeletons[slot] = pack_cache(cache, arena[slot])
        meta[slot, 0] = cache.seen_tokens


class KVMNativeForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """A native KVM model folder in vLLM: ``transformer`` and ``lm_head`` as in ``KVMForCausalLM`` (same weight
    names), the per-request cache in :class:`NativeCacheSlot`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config = _model_config(vllm_config)
        self.reference_layout = REFERENCE_ARCH in (vllm_config.model_config.hf_config.architectures or [])
        lm = KVMLanguageModel(self.config)
        self.transformer, self.lm_head = lm.transformer, lm.lm_head
        self.softcap = self.config.logit_softcap
        self.cache_slot = NativeCacheSlot(vllm_config)

    # ---- vLLM's state-model interface --------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return _shapes(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return (torch.int32, torch.uint8)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec,) * 2            # prefix caching (align mode) is refused at start-up

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("kvmeans: a native KVM model takes token ids, not inputs_embeds")
        out = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.lm_head.weight.dtype,
                          device=input_ids.device)
        md = get_forward_context().attn_metadata
        md = md.get(STATE_PREFIX) if isinstance(md, dict) else None
        if md is None:                              # profiling / dummy runs: nothing to continue
            return out
        n = md.num_decodes + md.num_prefills
        qsl = md.query_start_loc[:n + 1].tolist()
        slots = md.state_indices_tensor[:n].tolist()
        seq = md.seq_lens[:n].tolist()
        for a, e, slot, s in zip(qsl[:-1], qsl[1:], slots, seq):
            cache = self.cache_slot.load(slot, s - (e - a))
            hidden, cache = self.transformer(input_ids[a:e][None], cache)
            out[a:e] = hidden[0]
            self.cache_slot.store(slot, cache)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits.float()

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Our layout's tensors by name (``transformer.*``, ``lm_head.weight``; a tied head is the embedding), or
        the authors' layout mapped as ``KVMForCausalLM.from_pretrained`` maps it."""
        sd = dict(weights)
        if self.reference_layout:
            sd = map_reference_state_dict(sd, self.config)
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded = set()
        for name, w in sd.items():
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue                            # the embedding, loaded under its own name
            target = params.get(name, buffers.get(name))
            if target is None:
                raise ValueError(f"kvmeans: the checkpoint's tensor {name} has no place in the native model")
            if target.shape != w.shape:
                raise ValueError(f"kvmeans: {name} has shape {list(w.shape)} in the checkpoint, "
                                 f"{list(target.shape)} in the model")
            with torch.no_grad():
                target.copy_(w.to(target.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"kvmeans: the checkpoint lacks {len(missing)} tensors of the native model "
                             f"(e.g. {missing[0]})")
        return loaded
