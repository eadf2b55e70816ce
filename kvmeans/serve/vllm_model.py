"""vLLM model classes for KVM-converted transformers folders (docs/serving.md). Imported by vLLM only.

A converted folder (``kvmeans.convert_hf`` + ``save_pretrained``: the family's weights and ``kvm_conversion`` in
config.json) is served by vLLM's own implementation of the family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``: projections, norms, RoPE, MLPs, batching) with each converted layer's ``Attention`` (which
would keep a paged KV cache) replaced by a :class:`KVMStateLayer`: a vLLM state layer (``MambaBase``) whose
per-request slot holds the layer's KVM state (``kvmeans.serve.state_slots``: rows, reserve, counts, the exact
window). Each call continues the state with kvmeans' own op (``converted_kvm_attention``), so vLLM serves what
``kvmeans.load_converted`` computes; a decode step that routes nothing is read for every such request at once
(``state_slots.decode_batch``).
"""
from __future__ import annotations

import functools
import importlib
from typing import Iterable, Optional, Set, Tuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kvmeans.pretrained.board import BOARD_SCOPES, NoveltyBoard
from kvmeans.pretrained.convert import _RopeAt
from kvmeans.pretrained.op import converted_kvm_attention, state_query
from kvmeans.serve.state_slots import SlotLayout, decode_batch, load_state, needs_routing, store_state
from kvmeans.serve.vllm_plugin import conversion_spec

LEARNED = ("kvm_state_key_weight", "kvm_state_key_bias", "kvm_state_temp", "kvm_window_temp", "kvm_gate_weight",
           "kvm_gate_bias")


def slot_layout(vllm_config: VllmConfig) -> SlotLayout:
    """The per-request slot of one converted layer for this engine (its max_model_len and dtype)."""
    model_config = vllm_config.model_config
    cfg = model_config.hf_text_config
    _, spec = conversion_spec(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return SlotLayout.for_spec(spec, num_kv_heads=kv_heads, head_dim=head_dim, max_len=model_config.max_model_len,
                               dtype=model_config.dtype)


def hf_rope(hf_config) -> _RopeAt:
    """The family's transformers rotary embedding (what the converted transformers model uses to unrotate keys and
    rotate queries by the read distance), as a ``kvmeans.pretrained.convert._RopeAt``."""
    family = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and n[0] != "_")
    rope = _RopeAt.__new__(_RopeAt)
    rope.rotary, rope.extra, rope._at = cls(config=hf_config).eval(), {}, {}
    return rope


class _Plan:
    """One forward's requests, read once from the metadata for all layers: token ranges, slots, context lengths."""

    def __init__(self, md):
        n = md.num_decodes + md.num_prefills
        qsl = md.query_start_loc[:n + 1].tolist()
        self.starts, self.ends = qsl[:-1], qsl[1:]
        self.slots = md.state_indices_tensor[:n].tolist()
        seq = md.seq_lens[:n].tolist()
        self.context = [s - (e - a) for s, a, e in zip(seq, self.starts, self.ends)]
        self.num_tokens = qsl[-1]
        self.slot_tensor = md.state_indices_tensor[:n].long()
        self.memo = {}              # what every layer of this forward computes alike (the decode steps' RoPE)


class _Shared:
    """What a model's converted layers share: the spec, the family's RoPE, the current forward's plan (rebuilt
    when the metadata object changes) and, for ``exact_scope`` 'model' or 'first', the novelty board (blocks keyed
    by the request's slot: every layer of a forward routes the same blocks of a request, in layer order, as in
    transformers)."""

    def __init__(self, hf_config, spec, n_layers: int):
        self.spec = spec
        self.pre_rope = spec.rope_mode in ("pre_rope_fixed", "split")
        self.rope = hf_rope(hf_config) if spec.rope_mode != "none" else None
        self.board = (NoveltyBoard(n_layers, spec.exact_scope)
                      if spec.exact_rows and spec.exact_scope in BOARD_SCOPES else None)
        self._md, self._plan = None, None

    def plan(self, md) -> _Plan:
        if md is not self._md:
            self._md, self._plan = md, _Plan(md)
        return self._plan

    def plan_memo(self) -> dict:
        """The current forward's memo (what every layer computes alike)."""
        return self._plan.memo


class KVMStateLayer(nn.Module, MambaBase):
    """A converted layer in vLLM: takes the family's post-RoPE ``q [T, H*D]``, ``k``, ``v [T, Hkv*D]`` of every
    request in the batch (as vLLM's ``Attention`` does) and continues each request's KVM state in its slot."""

    def __init__(self, *, prefix: str, shared: _Shared, layout: SlotLayout, num_heads: int, scaling: float,
                 softcap: Optional[float], layer_pos: int, vllm_config: VllmConfig):
        super().__init__()
        self.prefix, self.shared, self.layout = prefix, shared, layout
        self.num_heads, self.scaling, self.softcap, self.layer_pos = num_heads, scaling, softcap, layer_pos
        self.model_config, self.cache_config = vllm_config.model_config, vllm_config.cache_config
        self.kv_cache: Tuple[torch.Tensor, ...] = ()
        self._hidden = None
        spec = shared.spec
        if spec.learned:                    # initialised to the training-free read; loaded from the folder
            H, Hkv, D = num_heads, layout.num_kv_heads, layout.head_dim
            d = vllm_config.model_config.hf_text_config.hidden_size
            dt = vllm_config.model_config.dtype
            for name, fill, shape in (("kvm_state_key_weight", 1, (Hkv, D)), ("kvm_state_key_bias", 0, (Hkv, D)),
                                      ("kvm_state_temp", 1, (H,)), ("kvm_window_temp", 1, (H,)),
                                      ("kvm_gate_weight", 0, (Hkv, d)), ("kvm_gate_bias", 0, (Hkv,))):
                setattr(self, name, nn.Parameter(torch.full(shape, float(fill), dtype=dt), requires_grad=False))
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context and context[prefix] is not self:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    # ---- vLLM's state-layer interface ------------------------------------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR          # per-request token ranges, sequence lengths, state slot

    def get_state_shape(self):
        return self.layout.shapes

    def get_state_dtype(self):
        return self.layout.dtypes

    # ---- forward -----------------------------------------------------------------------------------
    def _learned(self, hidden: Optional[torch.Tensor]):
        """The learned read-out's arguments (``kvmeans.pretrained.attention.learned_readout``) and the merge
        gates ``[T, Hkv]`` of the tokens (None for a training-free layer)."""
        if not self.shared.spec.learned:
            return {}, None
        w = self.kvm_gate_weight
        gate = 1 + torch.nn.functional.elu(torch.nn.functional.linear(hidden, w / w.shape[-1], self.kvm_gate_bias))
        return dict(state_key_weight=self.kvm_state_key_weight, state_key_bias=self.kvm_state_key_bias,
                    state_temp=self.kvm_state_temp, window_temp=self.kvm_window_temp), gate

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape=None,
                output_dtype=None) -> torch.Tensor:
        H, Hkv, D, Dv = self.num_heads, self.layout.num_kv_heads, self.layout.head_dim, self.layout.head_dim_v
        out = query.new_zeros(query.shape[0], H * Dv)
        md = get_forward_context().attn_metadata
        md = md.get(self.prefix) if isinstance(md, dict) else None
        hidden, self._hidden = self._hidden, None
        if md is None:                      # profiling / dummy runs: nothing to continue
            return out
        spec, shared = self.shared.spec, self.shared
        plan = shared.plan(md)
        if self.layer_pos == 0 and shared.board is not None:
            shared.board.clear()            # a forward that failed midway leaves nothing for the next
        slots = dict(zip(self.layout.names, self.kv_cache))
        T = plan.num_tokens
        q, k, v = query[:T].view(T, H, D), key[:T].view(T, Hkv, D), value[:T].view(T, Hkv, Dv)
        learned, gate = self._learned(None if hidden is None else hidden[:T])
        meta = slots["meta"]
        for r, ctx in enumerate(plan.context):          # a request's first tokens: a fresh state in its slot
            if ctx == 0:
                meta[plan.slots[r]].zero_()
        counters = meta[plan.slot_tensor].tolist()
        fast = []
        for r, (a, e, slot, ctx) in enumerate(zip(plan.starts, plan.ends, plan.slots, plan.context)):
            seen, covered = counters[r][0], counters[r][1]
            if seen != ctx:
                raise RuntimeError(f"KVM layer {self.prefix}: request in slot {slot} has {ctx} tokens computed but "
                                   f"its state has seen {seen} (prefix caching and speculative decoding are not "
                                   "supported)")
            if e - a == 1 and seen and not needs_routing(seen, covered, spec.chunk_len, spec.n_bswa_chunks):
                fast.append(r)
                continue
            out[a:e] = self._through_op(slots, slot, q[a:e], k[a:e], v[a:e], seen, learned,
                                        None if gate is None else gate[a:e])
        if fast:
            rows = torch.tensor([plan.starts[r] for r in fast], device=q.device)
            idx = plan.slot_tensor[fast]
            pos = torch.tensor([counters[r][0] for r in fast], device=q.device)
            q_state = q[rows]
            if shared.pre_rope:
                cos, sin = self._rope_at(("decode", tuple(counters[r][0] for r in fast), q.dtype),
                                         lambda: pos[:, None])                                # [N, 1, R]
                cos_d, sin_d = shared.rope(spec.distance, q)
                q_state = state_query(q_state[:, :, None], cos[:, None], sin[:, None], cos_d, sin_d)[:, :, 0]
            res = decode_batch(slots, self.layout, idx, meta[idx], q[rows], k[rows], v[rows], q_state,
                               scaling=self.scaling, softcap=self.softcap, gate=None if gate is None else gate[rows],
                               **{name: learned[name] for name in ("state_temp", "window_temp") if name in learned})
            out[rows] = res.reshape(len(fast), H * Dv).to(out.dtype)
        return out

    def _rope_at(self, key: tuple, positions) -> Tuple[torch.Tensor, torch.Tensor]:
        """The family's ``(cos, sin)`` at ``positions()`` (``[B, n]``; ``key`` names them and ends with the dtype),
        computed once per forward for all layers: the decode steps', a request's tokens and its buffer are the same
        positions in every layer."""
        memo = self.shared.plan_memo()
        if key not in memo:
            memo[key] = self.shared.rope.positions(positions(), dtype=key[-1])
        return memo[key]

    def _through_op(self, slots, slot: int, q, k, v, seen: int, learned: dict, gate) -> torch.Tensor:
        """One request's tokens ``q [T, H, D]`` through ``converted_kvm_attention`` on its slot -> ``[T, H*Dv]``."""
        spec, shared = self.shared.spec, self.shared
        T = q.shape[0]
        st = load_state(slots, slot, self.layout, spec.sink_len, shared.pre_rope)
        rope = {"rope_mode": spec.rope_mode}
        if spec.rope_mode != "none":
            pos = torch.arange(seen, seen + T, device=q.device)[None]
            rope["cos"], rope["sin"] = self._rope_at(("tokens", seen, T, q.dtype), lambda: pos)
            if shared.pre_rope:
                rope["cos_d"], rope["sin_d"] = shared.rope(spec.distance, q)
                # the op unrotates its buffer, the tokens [seen + T - n, seen + T) in every layer alike
                rope["rope"] = lambda p: self._rope_at(("buffer", seen, T, p.shape[-1], q.dtype), lambda: p)
                rope["positions"] = pos
        board = None if shared.board is None else functools.partial(shared.board.combine, self.layer_pos,
                                                                     rows=("slot", slot))
        res = converted_kvm_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], st, scaling=self.scaling,
            softcap=self.softcap, **spec.op_kwargs(), merge_gate=None if gate is None else gate.transpose(0, 1)[None],
            layer_novelty=board, **rope, **learned)
        store_state(slots, slot, st, self.layout, log_count_bias=spec.log_count_bias,
                    **{name: learned[name] for name in ("state_key_weight", "state_key_bias") if name in learned})
        return res[0].transpose(0, 1).reshape(T, -1)


def _stash_hidden(layer: KVMStateLayer, module, args, kwargs):
    """Forward pre-hook on the family's attention module: the learned merge gate reads the layer's input."""
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    layer._hidden = hidden


class _KVMServed:
    """Mixed into a vLLM family class: swaps the converted layers' ``Attention`` for :class:`KVMStateLayer`."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return slot_layout(vllm_config).shapes

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return slot_layout(vllm_config).dtypes

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec,) * 16           # prefix caching (align mode) is refused at start-up

    def _install_kvm(self, vllm_config: VllmConfig) -> None:
        cfg = vllm_config.model_config.hf_text_config
        layers, spec = conversion_spec(cfg)
        layout = slot_layout(vllm_config)
        found = [(name, m) for name, m in self.named_modules() if isinstance(m, Attention)]
        chosen = [(name, m) for name, m in found if extract_layer_index(m.layer_name) in set(layers)]
        if len(chosen) != len(found):
            raise ValueError(f"kvm_conversion converts layers {layers} of {len(found)}: serving keeps no paged KV "
                             "cache beside KVM layers yet; convert every layer (layers='all')")
        shared = _Shared(cfg, spec, len(chosen))
        context = vllm_config.compilation_config.static_forward_context
        self.kvm_layers = []
        for pos, (name, attn) in enumerate(sorted(chosen, key=lambda e: extract_layer_index(e[1].layer_name))):
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name)
            context.pop(attn.layer_name, None)
            layer = KVMStateLayer(prefix=attn.layer_name, shared=shared, layout=layout, num_heads=attn.num_heads,
                                  scaling=attn.impl.scale, softcap=getattr(attn.impl, "logits_soft_cap", None) or None,
                                  layer_pos=pos, vllm_config=vllm_config)
            setattr(parent, child, layer)
            if spec.learned:
                parent.register_forward_pre_hook(functools.partial(_stash_hidden, layer), with_kwargs=True)
            self.kvm_layers.append(layer)
        self.kvm_shared = shared

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """The family's weights by vLLM's loader; the learned read-out (``*.self_attn.kvm_*``) onto the KVM layers
        (``*.self_attn.attn.kvm_*``)."""
        learned = {}

        def family_weights():
            for name, w in weights:
                if name.rsplit(".", 1)[-1] in LEARNED:
                    learned[name] = w
                else:
                    yield name, w

        loaded = set(super().load_weights(family_weights()))
        params = dict(self.named_parameters())
        for name, w in learned.items():
            target = name.replace(".self_attn.kvm_", ".self_attn.attn.kvm_")
            if target not in params:
                raise ValueError(f"learned KVM weight {name} has no place in the served model ({target})")
            params[target].data.copy_(w)
            loaded.add(target)
        missing = [n for n in params if n.rsplit(".", 1)[-1] in LEARNED and n not in loaded]
        if missing:
            raise ValueError(f"config.json says learned=true but the weights lack {len(missing)} learned KVM "
                             f"parameters (e.g. {missing[0]})")
        return loaded


class KVMeansLlamaForCausalLM(_KVMServed, LlamaForCausalLM, HasInnerState, IsAttentionFree):
    """A KVM-converted Llama folder (SmolLM2, ...)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_kvm(vllm_config)


class KVMeansMistralForCausalLM(KVMeansLlamaForCausalLM):
    """A KVM-converted Mistral folder (vLLM serves Mistral with its Llama code; the KVM window replaces the
    sliding window)."""


class KVMeansQwen2ForCausalLM(_KVMServed, Qwen2ForCausalLM, HasInnerState, IsAttentionFree):
    """A KVM-converted Qwen2 folder (Qwen2.5, Qwen2.5-Coder, ...)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_kvm(vllm_config)


class KVMeansQwen3ForCausalLM(_KVMServed, Qwen3ForCausalLM, HasInnerState, IsAttentionFree):
    """A KVM-converted Qwen3 folder (q/k norms are the family's, before RoPE)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install_kvm(vllm_config)
