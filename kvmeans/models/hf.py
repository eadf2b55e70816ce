"""Hugging Face ``transformers`` adapter: ``KVMConfig``, ``KVMForCausalLM`` (``generate()``, Auto classes).

Supported transformers: ``>=5.18,<5.25``; tests pass with 5.18.0, 5.23.0 and 5.24.0 (torch 2.13 CPU; 5.24 renamed
``past_key_values`` to ``cache``, both are taken: :mod:`~kvmeans.models.hf_compat`). Importing this
module registers ``model_type "kvmeans"`` and the authors' ``"rwkv7backbone"`` (config mapped by
:func:`~kvmeans.models.reference_checkpoint.reference_config_to_ours`) with ``AutoConfig`` and
``AutoModelForCausalLM``::

    import kvmeans.models.hf
    model = AutoModelForCausalLM.from_pretrained(dir)          # our layout
    model = KVMForCausalLM.from_pretrained(authors_dir)       # also the authors' "rwkv7backbone" layout
    model = AutoModelForCausalLM.from_pretrained(authors_dir) # the same, through the Auto classes

An authors' directory loads with ``kvm_numerics="reference"`` (their eager code's rounding points);
``from_pretrained(dir, kvm_numerics="exact")`` selects kvmeans' default numerics (either layout).
    out = model.generate(ids, attention_mask=mask, max_new_tokens=32, num_beams=2)

Parameter names are the authors' (``transformer.*``, ``lm_head.*``), so our ``model.safetensors``
keys equal theirs (minus the one unused quirk tensor, see :mod:`kvmeans.models.reference_checkpoint`).

Cache: :class:`~kvmeans.models.hf_cache.KVMCache`. ``_supports_default_dynamic_cache()`` is False and
``generate`` starts from an empty KVMCache (``forward`` also creates one when given None, and swaps
an empty ``DynamicCache`` for one). Greedy, sampling, beam search (cache reordering),
``num_return_sequences`` and ``prefill_chunk_size`` work.
Padding: the ``attention_mask`` marks pads, which are stripped per row (KVM depends on absolute
positions: chunk boundaries, sinks); each row's real tokens are numbered from 0, so a left-padded
batch gives each sequence the logits it has alone (``position_ids`` / ``cache_position`` are
accepted and ignored). Pad positions get zero logits. With KVM layers only, a batch of rows at different
positions decodes in one call per step (a ragged state, see :class:`KVMCache`). Assisted and prompt-lookup decoding
(``assistant_model=``, ``prompt_lookup_num_tokens=``; batch 1) roll the cache back with
:meth:`KVMCache.crop <kvmeans.models.hf_cache.KVMCache.crop>`. ``inputs_embeds`` is not supported.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # spelled PreTrainedConfig since 5.0; the old alias is kept for safety
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover
    from transformers import PretrainedConfig as PreTrainedConfig

from kvmeans.models.config import KVMModelConfig, with_budget
from kvmeans.models.hf_cache import KVMCache
from kvmeans.models.hf_compat import CACHE_KWARG, cache_from, cache_kwargs, either_cache
from kvmeans.models.reference_checkpoint import (
    is_reference_checkpoint,
    load_reference_state_dict,
    map_reference_state_dict,
    reference_config_to_ours,
    with_numerics,
)
from kvmeans.models.reference_layout import REFERENCE_MODEL_TYPE
from kvmeans.models.transformer import KVMLanguageModel
from kvmeans.utils.heap import bound_heap
from kvmeans.utils.weights import named_weight_errors

__all__ = ["KVMConfig", "KVMForCausalLM", "KVMReferenceConfig", "KVMReferenceForCausalLM"]

_FIELDS = [f.name for f in dataclasses.fields(KVMModelConfig)]
# an eval-mode forward over more tokens runs them through all layers this many at a time, carrying the cache
# (config.prefill_segment overrides it; 0: one call): memory bounded by the segment, outputs those of one call
PREFILL_SEGMENT = 1024
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


class KVMConfig(PreTrainedConfig):
    """``PreTrainedConfig`` holding every :class:`KVMModelConfig` field (same names, same defaults).

    ``num_hidden_layers`` / ``num_attention_heads`` / ``num_key_value_heads`` are aliases of
    ``num_layers`` / ``num_heads`` / ``num_kv_heads``; ``tie_word_embeddings`` follows ``tie_embeddings``.
    The fields are checked (and ``budget`` normalised to its dict) by :class:`KVMModelConfig` at construction;
    ``layer_types`` (transformers' name, in our older ``config.json`` files) is read as ``mixer_types``.
    """

    model_type = "kvmeans"
    keys_to_ignore_at_inference = [CACHE_KWARG]   # the output field Trainer drops from predictions
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                     "num_key_value_heads": "num_kv_heads"}

    def __init__(self, **kwargs):
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                kwargs.setdefault(name, kwargs.pop(alias))
        fields = {name: kwargs.pop(name) for name in (*_FIELDS, "layer_types") if name in kwargs}
        for name, value in KVMModelConfig(**fields).to_dict().items():
            setattr(self, name, value)
        kwargs["tie_word_embeddings"] = bool(self.tie_embeddings)
        self.use_cache = bool(kwargs.pop("use_cache", True))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):   # read by GenerationConfig
            setattr(self, name, kwargs.pop(name, None))
        kwargs.pop("format_version", None)        # written by convert_reference_checkpoint
        # no positional limit (RoPE only on the window; the state is position-free); lm-eval reads this
        self.max_position_embeddings = int(kwargs.pop("max_position_embeddings", 2 ** 30))
        super().__init__(**kwargs)

    def to_model_config(self) -> KVMModelConfig:
        return KVMModelConfig(**{name: getattr(self, name) for name in _FIELDS})

    @classmethod
    def from_model_config(cls, config: KVMModelConfig, **kwargs) -> "KVMConfig":
        """``KVMConfig`` from a :class:`KVMModelConfig`; ``kwargs``: HF fields (``eos_token_id``, ...)."""
        return cls(**config.to_dict(), **kwargs)


class KVMForCausalLM(PreTrainedModel, GenerationMixin):
    """:class:`KVMLanguageModel` as a ``transformers`` causal LM (``transformer`` + ``lm_head``)."""

    config_class = KVMConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _supports_cache_class = True
    supports_gradient_checkpointing = True     # per Block (see transformer.Block), as the training CLI does

    def __init__(self, config: KVMConfig):
        super().__init__(config)
        lm = KVMLanguageModel(config.to_model_config())
        self.transformer, self.lm_head = lm.transformer, lm.lm_head
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                   # never a DynamicCache: generate() gets a KVMCache (below / forward)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Let ``generate`` start with an empty :class:`KVMCache` (chunked prefill needs one up front), recording
        what ``crop`` needs in assisted decoding (transformers 5.0 does not call ``activate_past_recording``)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if cache_from(model_kwargs) is None and generation_config.use_cache:
            cache = model_kwargs[CACHE_KWARG] = KVMCache(self.layer_types())
            mode = kwargs.get("generation_mode", args[0] if args else None)
            if getattr(generation_config, "is_assistant", False) or mode == GenerationMode.ASSISTED_GENERATION:
                cache.activate_past_recording()

    def _init_weights(self, module):
        """No-op: every module initialises itself in its constructor (the paper's scheme);
        ``from_pretrained`` refuses checkpoints with missing tensors instead of inventing them."""

    @classmethod
    def from_language_model(cls, lm: KVMLanguageModel, **config_kwargs) -> "KVMForCausalLM":
        """Wrap an existing :class:`KVMLanguageModel` (weights copied)."""
        model = cls(KVMConfig.from_model_config(lm.config, **config_kwargs))
        model.load_state_dict(lm.state_dict())
        p = next(lm.parameters())
        return model.to(device=p.device, dtype=p.dtype)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def layer_types(self) -> List[str]:
        return [b.mixer for b in self.transformer.h]

    # ---- forward ---------------------------------------------------------------------------------
    def _advance_in_segments(self, cache: KVMCache, input_ids: Tensor, mask: Optional[Tensor], segment: int,
                             keep: int) -> Optional[Tensor]:
        """The final hidden states ``[B, keep or T, d]`` of ``input_ids [B, T]`` run ``segment`` tokens at a time
        through every layer, carrying ``cache`` (the same as one call; memory bounded by the segment)."""
        T, out = input_ids.shape[1], []
        if input_ids.device.type == "cpu":
            bound_heap()        # freed segment activations go back to the OS: flat peak (kvmeans.utils.heap)
        for s in range(0, T, segment):
            e = min(T, s + segment)
            want = e - s if keep == 0 else max(0, min(e - s, keep - (T - e)))
            hidden = cache.advance(self._backbone(False), input_ids[:, s:e], None if mask is None else mask[:, s:e])
            if want and hidden is None:             # a segment of pads only
                hidden = self.lm_head.weight.new_zeros(input_ids.shape[0], e - s, self.config.hidden_size)
            if want:
                out.append(hidden[:, e - s - want:])
        return torch.cat(out, 1) if len(out) > 1 else out[0]

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                past_key_values: Optional[Cache] = None, use_cache: Optional[bool] = None,
                cache_position: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                logits_to_keep: Union[int, Tensor] = 0, labels: Optional[Tensor] = None,
                inputs_embeds: Optional[Tensor] = None, return_dict: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, output_attentions: Optional[bool] = None,
                cache: Optional[Cache] = None, **kwargs) -> CausalLMOutputWithPast:
        """``input_ids [B, T]`` -> ``CausalLMOutputWithPast(loss, logits [B, T', V] fp32, cache, hidden_states)``
        (the cache field is ``past_key_values`` before transformers 5.24, ``cache`` from 5.24).

        Args:
            attention_mask: ``[B, past + T]`` or ``[B, T]``, 1 = token, 0 = pad (any pattern; pads
                are stripped per row and get zero logits).
            past_key_values, cache: a :class:`KVMCache` from a previous call (or None / an empty Cache); two
                names for one argument (transformers 5.24 renamed it ``cache``): either, not both.
            logits_to_keep: int k > 0 keeps the last k positions, or a 1-D index tensor; ignored
                when ``labels`` are given.
            labels: ``[B, T]``; loss = mean CE of ``logits[:, :-1]`` vs ``labels[:, 1:]``, -100
                ignored (``num_items_in_batch`` in kwargs: summed / that count).
            position_ids, cache_position: accepted for API compatibility and ignored.
            return_dict: False returns ``out.to_tuple()``.
            output_hidden_states: (default ``config.output_hidden_states``) a tuple of ``num_layers + 1``
                ``[B, T, d]``: the embedding output (after ``ln_emb``) and each block's output, the last
                one after the final norm ``ln_head`` (LlamaForCausalLM's convention); zeros at pads.
            output_attentions: not supported (raises): KVM attends to a compressed state, so there is
                no ``[T, T]`` attention matrix to return.
        """
        if inputs_embeds is not None:
            raise NotImplementedError("KVMForCausalLM takes input_ids, not inputs_embeds")
        if output_attentions or (output_attentions is None and self.config.output_attentions):
            raise ValueError("output_attentions=True: KVM layers attend to a compressed state and have no dense "
                             "attention matrix to return; leave output_attentions unset (False)")
        if output_hidden_states is None:
            output_hidden_states = bool(self.config.output_hidden_states)
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("input_ids [B, T] is required")
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and labels is None
        cache = self._as_kvm_cache(either_cache(cache, past_key_values))
        mask = self._new_columns_mask(attention_mask, cache, input_ids.shape[1])
        segment = getattr(self.config, "prefill_segment", PREFILL_SEGMENT)
        if (segment and not self.training and labels is None and not output_hidden_states
                and isinstance(logits_to_keep, int) and input_ids.shape[1] > segment):
            hidden = self._advance_in_segments(cache, input_ids, mask, segment, logits_to_keep)
            logits_to_keep = 0                  # kept already
        else:
            hidden = cache.advance(self._backbone(output_hidden_states), input_ids, mask)
        d = self.config.hidden_size
        if hidden is None:             # every new column is a pad (e.g. a chunk of left padding)
            width = d * (self.config.num_layers + 1) if output_hidden_states else d
            hidden = self.lm_head.weight.new_zeros(input_ids.shape[0], input_ids.shape[1], width)
        states = None
        if output_hidden_states:
            states = hidden.split(d, dim=-1)
            hidden = states[-1]
        if labels is None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            hidden = hidden[:, keep]
        logits = self.lm_head(hidden)
        cap = self.config.logit_softcap
        if cap:
            logits = cap * torch.tanh(logits / cap)
        logits = logits.float()
        loss = None if labels is None else self._loss(logits, labels, kwargs.get("num_items_in_batch"))
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states,
                                     **cache_kwargs(cache if use_cache else None))
        return out.to_tuple() if return_dict is False else out

    def _backbone(self, output_hidden_states: bool):
        """What :meth:`KVMCache.advance` runs: the backbone, or one that returns every hidden state
        concatenated on the last dim (``[G, n, (num_layers + 1) * d]``, so padding scatters them alike)."""
        if not output_hidden_states:
            return self.transformer

        def run(ids: Tensor, cache):
            _, cache, states = self.transformer(ids, cache, output_hidden_states=True)
            return torch.cat(states, dim=-1), cache
        return run

    def _as_kvm_cache(self, past: Optional[Cache]) -> KVMCache:
        if isinstance(past, KVMCache):
            return past.bind(self.layer_types())
        if past is None or (isinstance(past, Cache) and past.get_seq_length() == 0):
            return KVMCache(self.layer_types())
        raise TypeError(f"{CACHE_KWARG}= must be a KVMCache returned by this model (or None), "
                        f"got {type(past).__name__}")

    @staticmethod
    def _new_columns_mask(attention_mask: Optional[Tensor], cache: KVMCache, T: int) -> Optional[Tensor]:
        """The ``[B, T]`` mask of the new columns from a ``[B, past + T]`` or ``[B, T]`` mask."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D [B, L] (1 = token, 0 = pad), got {attention_mask.dim()}-D")
        L = attention_mask.shape[1]
        if L not in (T, cache.get_seq_length() + T):
            raise ValueError(f"attention_mask has {L} columns; expected {T} (this call) or "
                             f"{cache.get_seq_length() + T} (cached {cache.get_seq_length()} + this call)")
        return attention_mask[:, L - T:]

    @staticmethod
    def _loss(logits: Tensor, labels: Tensor, num_items: Optional[Any]) -> Tensor:
        shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
        if num_items is None:
            return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum") / num_items

    # ---- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load our layout (``model_type "kvmeans"``, through transformers) or, for a local directory
        whose ``config.json`` has ``model_type "rwkv7backbone"``, the authors' layout (config mapped
        by :func:`reference_config_to_ours`, tensors checked by :func:`map_reference_state_dict`).

        A ``config.json`` of another ``model_type`` (``gpt2``, ...) raises ``ValueError`` before a model is
        built. ``dtype=torch.bfloat16`` gives every parameter in bf16 (none is kept in fp32: the authors
        train all in bf16). Missing or mis-shaped tensors raise ``ValueError``. Authors' layout:
        ``dtype``/``torch_dtype`` (default ``"auto"`` = as stored, bf16 for the released models, like
        transformers 5 does for ours; pass ``dtype=torch.float32`` on CPU) and ``device_map`` (one device) apply.
        ``kvm_numerics``: ``"reference"`` (default for the authors' layout: their eager rounding points)
        or ``"exact"`` (kvmeans' numerics); for our layout it overrides what ``config.json`` records.
        ``budget``: a state schedule for every KVM layer instead of the saved one (no retraining; see
        :func:`~kvmeans.models.config.with_budget`: a ``StateBudget``, an int, its dict or a spec such as
        ``"power_law:16:0.5:256"``); ``ValueError`` for a model with no KVM layer.
        """
        path = pretrained_model_name_or_path
        if not isinstance(kwargs.get("config"), PreTrainedConfig):
            cls._check_model_type(path, kwargs)
        budget = kwargs.pop("budget", None)
        given = kwargs.get("config")
        if budget is None and isinstance(given, KVMConfig) and not isinstance(given.budget, dict):
            budget = given.budget       # AutoModelForCausalLM.from_pretrained(dir, budget=...) set it as given
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and is_reference_checkpoint(path):
            with named_weight_errors(path):
                return cls._from_reference(Path(path), budget=budget, **kwargs)
        if isinstance(given, PreTrainedConfig) and budget is not None:
            kept = KVMModelConfig(**{name: getattr(given, name) for name in _FIELDS if name != "budget"})
            kwargs["config"] = copy.deepcopy(given)
            kwargs["config"].budget = with_budget(kept, budget).budget
        elif budget is not None:            # transformers sets it on the config it reads (as kvm_numerics)
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            raw = PreTrainedConfig.get_config_dict(given or path, **hub)[0]
            kwargs["budget"] = with_budget(KVMConfig(**raw).to_model_config(), budget).budget
        want_info = kwargs.pop("output_loading_info", False)
        with named_weight_errors(path):
            model, info = super().from_pretrained(path, *model_args, output_loading_info=True, **kwargs)
        bad = {k: sorted(map(str, info.get(k) or [])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(bad.values()):
            raise ValueError(f"{path}: checkpoint does not match the config: " +
                             "; ".join(f"{k}: {v[:5]}" for k, v in bad.items() if v))
        return (model, info) if want_info else model

    @staticmethod
    def _check_model_type(path, kwargs: dict) -> None:
        """Refuse a ``config.json`` of another architecture before a model is built from it."""
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        found = PreTrainedConfig.get_config_dict(path, **hub)[0].get("model_type")
        if found not in (None, KVMConfig.model_type, REFERENCE_MODEL_TYPE):
            raise ValueError(f"{path}: config.json has model_type {found!r}; KVMForCausalLM loads model_type "
                             f"{KVMConfig.model_type!r} (or the authors' {REFERENCE_MODEL_TYPE!r}): load this "
                             "one with AutoModelForCausalLM")

    @classmethod
    def _from_reference(cls, path: Path, dtype=None, torch_dtype=None, device_map=None, config=None,
                        kvm_numerics=None, budget=None, **ignored) -> "KVMForCausalLM":
        raw = json.loads((path / "config.json").read_text())
        # a config built by AutoConfig from this directory (KVMReferenceConfig) carries the mapping and
        # any overrides given to AutoModelForCausalLM.from_pretrained (kvm_numerics="exact", ...)
        mc = config.to_model_config() if isinstance(config, KVMConfig) else reference_config_to_ours(raw)
        if kvm_numerics is not None:
            mc = with_numerics(mc, kvm_numerics)
        if budget is not None:
            mc = with_budget(mc, budget)
        sd = map_reference_state_dict(load_reference_state_dict(path), mc)
        hf_extra = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
        cfg = KVMConfig.from_model_config(mc, **hf_extra)
        dtype = dtype if dtype is not None else torch_dtype
        if dtype is None or dtype == "auto":       # transformers 5's default: as stored
            dtype = next(v.dtype for v in sd.values() if v.is_floating_point())
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        cfg.dtype = dtype
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True, assign=True)
        if device_map is not None:
            if isinstance(device_map, dict):
                raise NotImplementedError("device_map dicts are not supported for the authors' layout; "
                                          "pass one device (\"cpu\", \"cuda\")")
            model.to(device_map)
        model.config.name_or_path = str(path)
        return model.eval()


class KVMReferenceConfig(KVMConfig):
    """``AutoConfig`` for the authors' ``config.json`` (``model_type "rwkv7backbone"``): their keys are
    mapped by :func:`reference_config_to_ours` (``kvm_numerics="reference"`` unless given), so this is
    a :class:`KVMConfig` with our fields; it serialises as ``model_type "kvmeans"`` (our layout).
    Without their keys (no ``token_mixer``) it takes :class:`KVMConfig` keywords."""

    model_type = REFERENCE_MODEL_TYPE

    def __init__(self, **kwargs):
        if "token_mixer" in kwargs:                   # an authors' config.json
            numerics = kwargs.pop("kvm_numerics", "reference")
            mc = with_numerics(reference_config_to_ours({**kwargs, "model_type": REFERENCE_MODEL_TYPE}), numerics)
            hf = {k: kwargs[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
                                         "name_or_path", "_name_or_path", "transformers_version")
                  if kwargs.get(k) is not None}
            kwargs = {**mc.to_dict(), **hf}
        else:
            kwargs.setdefault("kvm_numerics", "reference")
        kwargs.pop("model_type", None)
        super().__init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["model_type"] = KVMConfig.model_type      # saved configs are our layout
        return out


class KVMReferenceForCausalLM(KVMForCausalLM):
    """``AutoModelForCausalLM`` entry for the authors' layout: ``from_pretrained`` maps the weights with
    :meth:`KVMForCausalLM.from_pretrained` and returns a :class:`KVMForCausalLM`."""

    config_class = KVMReferenceConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        for key in ("trust_remote_code", "adapter_kwargs"):   # added by the Auto class
            kwargs.pop(key, None)
        return KVMForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)


AutoConfig.register(KVMConfig.model_type, KVMConfig, exist_ok=True)
AutoModelForCausalLM.register(KVMConfig, KVMForCausalLM, exist_ok=True)
AutoConfig.register(KVMReferenceConfig.model_type, KVMReferenceConfig, exist_ok=True)
AutoModelForCausalLM.register(KVMReferenceConfig, KVMReferenceForCausalLM, exist_ok=True)
