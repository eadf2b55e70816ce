"""KVM in place of one transformers attention layer, over the layer's own projections, norms and RoPE.

The family's attention ``forward`` still runs unchanged (q/k/v/o projections, biases, q/k norms, RoPE,
GQA layout, cache update) and calls its attention function by name; a converted layer gets its own
config copy naming ours (``kvmeans_converted``), so only that layer's score/softmax/value step becomes
KVM. A forward pre-hook hands the function what the interface does not pass: the layer's cache entry,
the RoPE cos/sin of the current positions and the layer's input (for the merge gate).

With ``spec.learned`` the layer also carries KVM's learned read-out as parameters (``kvm_*``, trained by
``kvmeans distill``), initialised so that the layer computes exactly the training-free read.
"""
from __future__ import annotations

import copy
import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from kvmeans.models.hf_compat import cache_from
from kvmeans.pretrained.batch import ConvertedBatchState
from kvmeans.pretrained.board import BOARD_SCOPES, NoveltyBoard
from kvmeans.pretrained.cache import kvm_cache_layer
from kvmeans.pretrained.op import converted_kvm_attention

ATTN_IMPLEMENTATION = "kvmeans_converted"


def kvm_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: Optional[float] = None, softcap: Optional[float] = None, **kwargs):
    """The transformers attention-interface function of a converted layer: ``q [B, H, T, D]`` (post-RoPE),
    ``k``/``v [B, Hkv, T, D]`` (only the new tokens: the KVM cache layer passes them through) ->
    ``([B, T, H, Dv], None)``. The causal mask is implied; padding comes as the model's 2D mask."""
    spec = module.kvm_spec
    state, position_embeddings, hidden_states = module.__dict__.pop("_kvm_call")
    rope = dict(rope_mode=spec.rope_mode)
    if spec.rope_mode != "none":
        if position_embeddings is None:
            raise ValueError(f"layer {module.layer_idx} got no position_embeddings; rope_mode={spec.rope_mode!r} "
                             "needs the model's RoPE (use rope_mode='none' for models without RoPE)")
        rope["cos"], rope["sin"] = position_embeddings
        if spec.rope_mode in ("pre_rope_fixed", "split"):
            rope["cos_d"], rope["sin_d"] = module.kvm_rope_at(spec.distance, query)
            rope["rope"] = functools.partial(module.kvm_rope_at.positions, dtype=query.dtype)
            rope["positions"] = module.__dict__.get("_kvm_positions")
    out = state.attend(                 # each row by its real tokens (mask: kvmeans.pretrained.convert._set_inputs)
        converted_kvm_attention, module.__dict__.get("_kvm_mask"), query, key, value,
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling, softcap=softcap, **spec.op_kwargs(),
        exact_caps=module.__dict__.get("kvm_exact_caps"), layer_novelty=_layer_novelty(module), **rope,
        **learned_readout(module, hidden_states))
    return out.transpose(1, 2).contiguous(), None


def _layer_novelty(module) -> Optional[Callable]:
    """The reserve's ranking shared across the converted layers (``exact_scope`` "model" or "first"), or None."""
    spec, board = module.kvm_spec, module.kvm_board
    if not spec.exact_rows or spec.exact_scope not in BOARD_SCOPES or board is None:
        return None
    return functools.partial(board.combine, module.kvm_layer_pos)


def learned_readout(module, hidden_states) -> dict:
    """The learned read-out arguments of ``converted_kvm_attention`` ({} for a training-free layer): the merge
    gate ``1 + ELU(x W_g / d + b_g)`` per kv head from the layer input ``x [B, T, d]``, LN_s, temperatures."""
    if not module.kvm_spec.learned:
        return {}
    # x W_g / d: an Adam step of lr moves the gate by about lr (not lr * d: a sum over d inputs)
    w = module.kvm_gate_weight
    gate = 1 + F.elu(F.linear(hidden_states, w / w.shape[-1], module.kvm_gate_bias))   # [B, T, Hkv]
    return dict(merge_gate=gate.transpose(1, 2), state_key_weight=module.kvm_state_key_weight,
                state_key_bias=module.kvm_state_key_bias, state_temp=module.kvm_state_temp,
                window_temp=module.kvm_window_temp)


AttentionInterface.register(ATTN_IMPLEMENTATION, kvm_attention_forward)


def _capture(module, args, kwargs):
    """Forward pre-hook: stash the layer's KVM state (from the cache, or a fresh one without a cache)
    and the RoPE cos/sin for :func:`kvm_attention_forward`."""
    if args or "hidden_states" not in kwargs:     # positional call: bind by the signature (slower)
        bound = module._kvm_signature.bind(*args, **kwargs).arguments
        kwargs = {**bound.pop("kwargs", {}), **bound}
    cache = cache_from(kwargs, "layer_past")      # GPT-NeoX attention calls it layer_past
    if cache is None:
        state = ConvertedBatchState()
    else:
        state = kvm_cache_layer(cache, module.layer_idx, module.kvm_compact_mask).state
    module._kvm_call = (state, kwargs.get("position_embeddings"), kwargs.get("hidden_states"))
    if module.kvm_layer_pos == 0 and module.kvm_board is not None:
        module.kvm_board.clear()        # a forward that failed midway leaves nothing for the next


def _release(module, args, output):
    module.__dict__.pop("_kvm_call", None)


def convert_attention_layer(module: torch.nn.Module, spec, rope_at: Optional[Callable] = None,
                            board: Optional[NoveltyBoard] = None, layer_pos: int = 0) -> None:
    """Make ``module`` (a transformers attention layer with ``layer_idx``) run KVM with ``spec`` (a
    ``kvmeans.pretrained.convert.KVMSpec``); ``rope_at(distance, like) -> (cos [R], sin [R])`` is the model's
    RoPE at one position (needed by ``rope_mode='pre_rope_fixed'``); ``board`` the model's
    :class:`NoveltyBoard` and ``layer_pos`` this layer's place among the converted ones (``exact_scope``)."""
    if getattr(module, "kvm_spec", None) is not None:
        raise ValueError(f"attention layer {module.layer_idx} is already converted; convert the original model once")
    module.config = copy.copy(module.config)
    module.config._attn_implementation_internal = ATTN_IMPLEMENTATION   # this layer only (no sub-config walk)
    module.kvm_spec = spec
    module.kvm_rope_at = rope_at
    module.kvm_board, module.kvm_layer_pos = board, layer_pos
    module.kvm_compact_mask = False     # convert_hf sets it when every full-attention layer is converted
    module.kvm_exact_caps = None        # and these, the reserve's slots per kv head (KVMSpec.exact_heads)
    module._kvm_signature = inspect.signature(module.forward)
    if spec.learned:
        add_learned_parameters(module)
    module.register_forward_pre_hook(_capture, with_kwargs=True)
    module.register_forward_hook(_release)


def add_learned_parameters(module: torch.nn.Module) -> None:
    """Register KVM's learned read-out on a converted layer, at the values that give the training-free read:
    ``kvm_state_key_weight``/``kvm_state_key_bias [Hkv, D]`` (LN_s as an affine map, identity),
    ``kvm_state_temp``/``kvm_window_temp [H]`` (1) and the merge gate ``kvm_gate_weight [Hkv, d]``,
    ``kvm_gate_bias [Hkv]`` (0, so every token weighs ``1 + ELU(0) = 1``: the plain mean)."""
    cfg = module.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    like = next(module.parameters())
    def param(fill, *shape):
        return nn.Parameter(torch.full(shape, float(fill), dtype=like.dtype, device=like.device))
    module.kvm_state_key_weight = param(1, kv_heads, head_dim)
    module.kvm_state_key_bias = param(0, kv_heads, head_dim)
    module.kvm_state_temp = param(1, heads)
    module.kvm_window_temp = param(1, heads)
    module.kvm_gate_weight = param(0, kv_heads, cfg.hidden_size)
    module.kvm_gate_bias = param(0, kv_heads)
