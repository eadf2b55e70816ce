"""The paper's decoder-only LM on the GPTAlpha-2 backbone (reference 4.1).

``wte -> ln_emb (= x0) -> blocks -> ln_head -> lm_head``; each block is pre-norm,
``x += attn(ln_attn(x)) * s``, ``x += mlp(ln_mlp(x)) * s`` with ``s = residual_scale``.
Module names match the authors' checkpoints (``transformer.h.{i}.attn.c_q.weight``, ...).
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kvmeans.layers.attention import AttentionConfig, KVMAttention, KVMAttentionConfig
from kvmeans.layers.baselines import (
    BlockSlidingWindowAttention,
    BSWAConfig,
    FullAttention,
    SlidingWindowAttention,
    SWAConfig,
)
from kvmeans.layers.ovq import OVQAttention, OVQConfig
from kvmeans.layers.rwkv7 import RWKV7Config, RWKV7TimeMix
from kvmeans.models.cache import ModelCache
from kvmeans.models.config import KVMModelConfig, preset
from kvmeans.models.mlp import MLP

__all__ = ["Block", "KVMModel", "KVMLanguageModel", "build_mixer"]


def build_mixer(config: KVMModelConfig, i: int) -> nn.Module:
    """The sequence mixer of layer ``i``: its kind, RoPE and window settings come from ``config``."""
    kind = config.mixer_per_layer()[i]
    common = dict(hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.kv_heads,
                  head_dim=config.qk_head_dim, token_shift=config.token_shift,
                  value_residual=config.value_residual, layer_idx=i, num_layers=config.num_layers,
                  init_output_zero=True)
    rope = dict(rope_dim=config.rope_for_layer(i), rope_theta=config.rope_theta_for_layer(i),
                rope_reference_bf16=config.rope_reference_bf16, qk_norm=config.qk_norm)
    if kind == "kvm":
        return KVMAttention(KVMAttentionConfig(
            **common, **rope, chunk_len=config.chunk_len, n_bswa_chunks=config.n_bswa_chunks,
            sink_len=config.sink_len, budget=config.state_budget(), merge_gate=config.merge_gate,
            gate_appends=config.gate_appends, head_temps=config.head_temps, value_radius=config.value_radius,
            numerics=config.kvm_numerics))
    if kind == "full":
        return FullAttention(AttentionConfig(**common, **rope))
    if kind == "swa":
        return SlidingWindowAttention(SWAConfig(**common, **rope, window=config.swa_window))
    if kind == "bswa":
        return BlockSlidingWindowAttention(BSWAConfig(**common, **rope, chunk_len=config.chunk_len,
                                                      n_chunks=config.bswa_chunks, sink_len=config.bswa_sink_len))
    if kind == "ovq":  # no RoPE, no qk-LN whatever the stream's settings (reference 4.11)
        return OVQAttention(OVQConfig(**common, chunk_len=config.ovq_chunk_len,
                                      max_centroids=config.ovq_max_centroids))
    if kind == "rwkv7":  # its own token shift and value residual (reference 4.12)
        return RWKV7TimeMix(RWKV7Config(hidden_size=config.hidden_size, num_heads=config.num_heads, layer_idx=i,
                                        num_layers=config.num_layers, value_residual=config.value_residual,
                                        chunk_size=config.rwkv7_chunk_size))
    raise ValueError(f"layer {i}: unknown mixer {kind!r}")


class Block(nn.Module):
    """Pre-norm block: ``ln_attn``, ``attn`` (the layer's mixer), ``ln_mlp``, ``mlp``.

    ``gradient_checkpointing = True`` (transformers' flag, set by ``gradient_checkpointing_enable`` and by
    the training CLI's ``grad_checkpointing``): in training mode with grad enabled the block keeps only
    its inputs and recomputes itself in backward (``_gradient_checkpointing_func``, a non-reentrant
    ``torch.utils.checkpoint`` unless transformers sets another).
    """

    gradient_checkpointing = False

    def __init__(self, config: KVMModelConfig, i: int):
        super().__init__()
        self._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        d = config.hidden_size
        self.mixer = config.mixer_per_layer()[i]
        self.residual_scale = config.residual_scale
        self.ln_attn = nn.LayerNorm(d)
        self.attn = build_mixer(config, i)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp = MLP(d, config.ffn_dim, i, config.num_layers, config.mlp_token_shift)

    def forward(self, x: Tensor, state=None, mlp_prev: Optional[Tensor] = None, v_first: Optional[Tensor] = None):
        """``x [B, T, d]`` -> ``(x [B, T, d], mixer state, MLP shift row [B, d] or None)``."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self._recomputable, x, state, mlp_prev, v_first)
        return self._forward(x, state, mlp_prev, v_first)

    def _recomputable(self, x: Tensor, state, mlp_prev: Optional[Tensor], v_first: Optional[Tensor]):
        # the mixer advances its state in place: advance a copy, so the backward's re-run starts
        # from the same state as the forward did
        return self._forward(x, None if state is None else state.clone(), mlp_prev, v_first)

    def _forward(self, x: Tensor, state, mlp_prev: Optional[Tensor], v_first: Optional[Tensor]):
        a, state = self.attn(self.ln_attn(x), state, v_first=v_first)
        x = x + a * self.residual_scale
        m, mlp_last = self.mlp(self.ln_mlp(x), mlp_prev)
        return x + m * self.residual_scale, state, mlp_last


class KVMModel(nn.Module):
    """The backbone without the LM head: ``wte``, ``ln_emb``, ``h`` (blocks), ``ln_head``."""

    def __init__(self, config: KVMModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.ln_emb = nn.LayerNorm(config.hidden_size)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.ln_head = nn.LayerNorm(config.hidden_size)
        with torch.no_grad():
            nn.init.uniform_(self.wte.weight, -config.init_std_embed, config.init_std_embed)
        # value-residual streams: main and alternate layers each anchor on their first layer (ref 4.3)
        self._stream = ["alt" if config.is_alt_layer(i) else "main" for i in range(config.num_layers)]
        self._first: Dict[str, int] = {}
        for i, s in enumerate(self._stream):
            self._first.setdefault(s, i)

    def value_anchors(self, x0: Tensor, cache: Optional[ModelCache] = None) -> Dict[str, Optional[Tensor]]:
        """Per stream ``v_first [B, T, Hkv*Dv]``: the stream's first layer's ``c_v(ln_attn(x0))`` (RWKV-7: layer
        0's token-shifted value, continuing ``cache``)."""
        if not self.config.value_residual:
            return dict.fromkeys(self._first)
        if isinstance(self.h[0].attn, RWKV7TimeMix):      # an RWKV-7 model: every layer is one
            return {"main": self.h[0].attn.value_anchor(self.h[0].ln_attn(x0),
                                                        None if cache is None else cache.layers[0])}
        return {s: self.h[i].attn.c_v(self.h[i].ln_attn(x0)) for s, i in self._first.items()}

    def forward(self, input_ids: Tensor, cache: Optional[ModelCache] = None, output_hidden_states: bool = False):
        """``input_ids [B, T]`` -> ``(hidden [B, T, d] after ln_head, cache)``; ``cache`` is advanced in place.

        ``output_hidden_states``: also return a tuple of ``num_layers + 1`` ``[B, T, d]``: ``x0`` (after
        ``ln_emb``) and each block's output, the last one after ``ln_head`` (LlamaModel's convention).
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T>=1], got shape {list(input_ids.shape)}")
        if cache is None:
            cache = ModelCache.empty([b.mixer for b in self.h])
        elif len(cache.layers) != len(self.h):
            raise ValueError(f"cache has {len(cache.layers)} layers but the model has {len(self.h)}")
        elif cache.batch_size not in (None, input_ids.shape[0]):
            raise ValueError(f"cache holds {cache.batch_size} sequences but input_ids has batch "
                             f"{input_ids.shape[0]}; index_select the cache for beams")
        x0 = self.ln_emb(self.wte(input_ids))
        anchors = self.value_anchors(x0, cache)
        x, states = x0, [x0]
        for i, block in enumerate(self.h):
            x, cache.layers[i], cache.mlp_shift[i] = block(x, cache.layers[i], cache.mlp_shift[i],
                                                           v_first=anchors[self._stream[i]])
            if output_hidden_states:        # else each block's output is freed as the next one runs
                states.append(x)
        cache.seen_tokens += input_ids.shape[1]
        hidden = self.ln_head(x)
        if not output_hidden_states:
            return hidden, cache
        return hidden, cache, tuple(states[:-1]) + (hidden,)


class KVMLanguageModel(nn.Module):
    """Causal LM: :class:`KVMModel` as ``transformer`` plus an untied ``lm_head`` (no bias).

    Example::

        model = KVMLanguageModel(preset("tiny-cpu"))
        logits, cache = model(prompt_ids)                 # prefill
        logits, cache = model(next_ids, cache)            # decode, continuing the cache
    """

    def __init__(self, config: KVMModelConfig):
        super().__init__()
        self.config = config
        self.transformer = KVMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            nn.init.orthogonal_(self.lm_head.weight, gain=0.5 * (config.vocab_size / config.hidden_size) ** 0.5)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "KVMLanguageModel":
        """``KVMLanguageModel.from_preset("kvm-120m")``; see :func:`kvmeans.models.preset`."""
        return cls(preset(name, **overrides))

    def forward(self, input_ids: Tensor, cache: Optional[ModelCache] = None) -> Tuple[Tensor, ModelCache]:
        """``input_ids [B, T]`` -> ``(logits [B, T, vocab] fp32, cache)``.

        ``cache``: None to start new sequences at position 0, or the cache returned by the previous
        call (advanced in place and returned); any split of a sequence into calls gives the logits of
        one call over the whole sequence.
        """
        hidden, cache = self.transformer(input_ids, cache)
        logits = self.lm_head(hidden)
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits.float(), cache

    def loss(self, input_ids: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross entropy; ``targets [B, T]`` are already shifted (-100 = ignore)."""
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets must match input_ids {list(input_ids.shape)}, got {list(targets.shape)}")
        logits, _ = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (the paper's totals include both untied ``vocab x d`` matrices)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wte.weight.numel() if exclude_embeddings else n

    def layer_types(self) -> List[str]:
        return [b.mixer for b in self.transformer.h]
