"""Training-free conversion of a pretrained transformers causal LM to KVM attention (docs/pretrained.md).

``convert_hf(model, ...)`` converts the chosen attention layers in place and returns the same model
object (same class: ``generate``, ``pipeline``, ``save_pretrained`` keep working); the settings are
stored in ``config.json`` under ``kvm_conversion`` so :func:`load_converted` rebuilds the same model.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch

from kvmeans.models.hf_compat import CACHE_KWARG, cache_from, cache_kwargs
from kvmeans.ops.budget import StateBudget, as_budget
from kvmeans.ops.budget import parse_budget_spec as _parse_budget
from kvmeans.pretrained.attention import convert_attention_layer
from kvmeans.pretrained.board import BOARD_SCOPES, NoveltyBoard
from kvmeans.pretrained.cache import kvm_cache_layer
from kvmeans.pretrained.heads import AUTOMATIC, COPY_TOKENS, HEAD_FLOOR, copy_scores, head_caps
from kvmeans.pretrained.op import EXACT_RANKS, ROPE_MODES, check_exact_lead
from kvmeans.utils.heap import bound_heap
from kvmeans.utils.weights import named_weight_errors

CONFIG_KEY = "kvm_conversion"
EXACT_SCOPES = ("model", "layer", "first")
# model_type -> whether the family rotates q/k (RoPE, possibly partial); GPT-2 has learned absolute positions.
# Each is tested on a tiny random config (tests/pretrained/test_convert.py), including that our ``unrotate``
# inverts the family's own rotation (the rotate-half layout). SmolLM3's layers without RoPE (``use_rope`` false)
# are converted with ``rope_mode="none"``. Not here (``UNSUPPORTED``): interleaved RoPE (Cohere, GPT-J, GLM,
# Llama 4) and EXAONE 4, whose global layers drop RoPE unmarked.
FAMILIES = {"llama": True, "mistral": True, "mixtral": True, "qwen2": True, "qwen2_moe": True, "qwen3": True,
            "qwen3_moe": True, "gemma": True, "gemma2": True, "gemma3_text": True, "phi": True, "phi3": True,
            "olmo": True, "olmo2": True, "granite": True, "stablelm": True, "starcoder2": True, "smollm3": True,
            "gpt_neox": True, "gpt2": False}
UNSUPPORTED = {**dict.fromkeys(("cohere", "cohere2", "gptj", "glm", "glm4", "llama4_text"), "interleaved RoPE"),
               "exaone4": "layers without RoPE"}


@dataclass(frozen=True)
class KVMSpec:
    """The settings of a converted model (what ``kvm_conversion`` in config.json stores).

    ``budget``: state rows (``StateBudget`` or int); ``chunk_len``/``n_bswa_chunks``: the exact window
    keeps the current and the n-1 previous chunks; ``sink_len``: leading rows never merged into;
    ``rope_mode``: see ``kvmeans.pretrained.op``; ``rope_distance``: the relative position at which
    ``pre_rope_fixed`` reads state rows (None: three times the window span, ``3 * n_bswa_chunks * chunk_len``,
    measured better than 1, 2 and 4 spans on SmolLM2, docs/pretrained.md);
    ``log_count_bias``: the ``+log(m)`` logit of a row standing for m tokens (False: ablation);
    ``novel_rows``: at a full budget each block that leaves the window gives its most novel tokens this many
    rows of their own, freed by merging the most similar pairs of rows (``kvmeans.pretrained.routing``);
    ``exact_rows``: rows of the budget kept as a reserve of single tokens, the most novel ones, read exactly
    (``kvmeans.pretrained.reserve``; 0: none); ``exact_scope``: how the reserve ranks a token, ``"model"``
    (default: its novelty averaged over the converted layers so far, so the layers keep mostly the same tokens;
    ``kvmeans.pretrained.board``), ``"first"`` (every layer by the first converted layer's novelty: every layer
    keeps exactly the same tokens) or ``"layer"`` (each layer by its own novelty); ``exact_rank``: what a token is
    scored by, ``"novelty"`` (minus its highest cosine to the rows) or ``"attention"`` (the attention the last chunk
    of queries that sees it gave it; ``kvmeans.pretrained.op``: better perplexity on some models, no needle recall,
    docs/quality.md), averaged over layers as ``exact_scope`` says; ``exact_lead``: with novelty ranking a token
    scores the most of its own novelty and the next ``exact_lead`` tokens', so the first token of a novel run (a
    needle's first digit, which the model needs to find the rest) is kept with it (1, the default: NIAH on the
    Qwen models, docs/quality.md; 0: each token its own, what folders saved before it reload with; attention
    ranking ignores it); ``exact_join``: with novelty ranking, a block's leading run that continues a run the
    slots hold from the block before is scored as inside that block, so a novel run cut by a block boundary keeps
    its second part (``kvmeans.pretrained.op``; False: what folders saved before it reload with);
    ``exact_heads``: per-head budgets of the reserve, one weight per converted layer and kv head (``convert_hf``
    measures them when given ``"copy"``: each head's copy score on built-in text, ``kvmeans.pretrained.heads``);
    the ``exact_rows x kv heads`` slots are shared out by them (``heads.head_caps``), ``exact_rows`` staying the
    mean (None: ``exact_rows`` in every head; without exact rows it is dropped: nothing to share out);
    ``exact_floor``: with ``exact_heads``, the fewest slots a kv head keeps, as a share of ``exact_rows``
    (``heads.HEAD_FLOOR``; folders saved before it reload with 1/12);
    ``learned``: the layers carry KVM's learned read-out as parameters (merge gate, LN_s, temperatures;
    ``kvmeans.pretrained.attention.add_learned_parameters``), initialised to the training-free read;
    ``prefill_segment``: an eval-mode forward over more tokens runs them through all layers this many at a time,
    carrying the cache, so a prompt of any length is read in memory that does not grow with it (0: one call);
    the outputs are those of one call. 256 rather than 1024: the peak prefill memory above the model of
    SmolLM2-135M at 2K-32K tokens is ~70-80 MB instead of ~180-270 MB, at the same speed (docs/benchmarks.md).
    """
    budget: Union[StateBudget, int] = 128
    chunk_len: int = 32                # measured on SmolLM2: C=32, n=4 beats C=64, n=2 at the same kept keys
    n_bswa_chunks: int = 4
    sink_len: int = 4
    rope_mode: str = "pre_rope_fixed"
    rope_distance: Optional[int] = None
    log_count_bias: bool = True
    novel_rows: int = 0
    exact_rows: int = 0
    exact_scope: str = "model"
    exact_rank: str = "novelty"
    exact_lead: int = 1
    exact_join: bool = False
    exact_heads: Optional[Tuple[Tuple[float, ...], ...]] = None
    exact_floor: float = HEAD_FLOOR
    learned: bool = False
    prefill_segment: int = 256         # tokens x MLP width: the prefill's transient; as fast as 1024 on CPU

    def __post_init__(self):
        as_budget(self.budget)
        if self.chunk_len < 1 or self.n_bswa_chunks < 1:
            raise ValueError(f"chunk_len and n_bswa_chunks must be >= 1, got {self.chunk_len}, {self.n_bswa_chunks}")
        if not 0 <= self.sink_len < self.chunk_len:
            raise ValueError(f"sink_len must be in [0, chunk_len={self.chunk_len}), got {self.sink_len}")
        if self.rope_mode not in ROPE_MODES:
            raise ValueError(f"rope_mode must be one of {ROPE_MODES}, got {self.rope_mode!r}")
        if self.rope_distance is not None and self.rope_distance < 0:
            raise ValueError("rope_distance must be >= 0 (or None for three times the window span), got "
                             f"{self.rope_distance}")
        if not 0 <= self.novel_rows <= self.chunk_len:
            raise ValueError(f"novel_rows must be in [0, chunk_len={self.chunk_len}], got {self.novel_rows}")
        most = self.max_exact_rows
        if self.exact_rows < 0 or (most is not None and self.exact_rows > most):
            raise ValueError(f"exact_rows must be in [0, budget - chunk_len = {most}] (the mean pool keeps the first "
                             f"chunk's rows), got {self.exact_rows}; lower exact_rows or raise budget"
                             if most is not None else f"exact_rows must be >= 0, got {self.exact_rows}")
        if self.exact_rows and self.novel_rows:
            raise ValueError("exact_rows and novel_rows route the same budget two ways: set one of them to 0")
        if self.prefill_segment < 0:
            raise ValueError("prefill_segment must be >= 0 (0: the whole input in one call), got "
                             f"{self.prefill_segment}")
        if self.exact_rank not in EXACT_RANKS:
            raise ValueError(f"exact_rank must be one of {EXACT_RANKS} (what the reserve ranks a token by: its "
                             f"novelty, or the attention it received in the window), got {self.exact_rank!r}")
        check_exact_lead(self.exact_lead, self.chunk_len, self.n_bswa_chunks)
        if not 0 <= self.exact_floor <= 1:
            raise ValueError(f"exact_floor must be in [0, 1] (the fewest slots a kv head keeps, as a share of "
                             f"exact_rows), got {self.exact_floor}")
        if self.exact_heads is not None:
            if isinstance(self.exact_heads, str):
                raise ValueError(f"exact_heads={self.exact_heads!r}: convert_hf measures the weights (give it "
                                 "exact_heads='copy'); a KVMSpec holds them, one list per converted layer")
            rows = tuple(tuple(float(w) for w in r) for r in self.exact_heads)
            if not rows or len({len(r) for r in rows}) != 1 or any(w < 0 or w != w for r in rows for w in r):
                raise ValueError("exact_heads must hold one list of non-negative weights per converted layer, as "
                                 "many in each (its kv heads)")
            # lists (JSON) -> tuples: a frozen, hashable spec; without a reserve there is nothing to share out
            object.__setattr__(self, "exact_heads", rows if self.exact_rows else None)
        if self.exact_scope not in EXACT_SCOPES:
            raise ValueError(f"exact_scope must be one of {EXACT_SCOPES} (how the reserve ranks tokens: novelty "
                             f"averaged over the layers, the first layer's, or each layer's own), got "
                             f"{self.exact_scope!r}")

    @property
    def max_exact_rows(self) -> Optional[int]:
        """The most ``exact_rows`` the budget admits: its most rows less the first chunk's (None: no cap)."""
        b = self.budget               # the most rows it ever gives (power_law: no cap)
        cap = b if isinstance(b, int) else None if getattr(b, "kind", "power_law") == "power_law" else b.n
        return None if cap is None else max(0, cap - self.chunk_len)

    @property
    def state_budget(self):
        return as_budget(self.budget)

    def op_kwargs(self) -> dict:
        """The routing and read settings :func:`kvmeans.pretrained.op.converted_kvm_attention` takes from the spec
        (the transformers layer and the vLLM layer both call it with these)."""
        return dict(budget=self.state_budget, chunk_len=self.chunk_len, n_bswa_chunks=self.n_bswa_chunks,
                    sink_len=self.sink_len, log_count_bias=self.log_count_bias, novel_rows=self.novel_rows,
                    exact_rows=self.exact_rows, exact_rank=self.exact_rank, exact_lead=self.exact_lead,
                    exact_join=self.exact_join)

    @property
    def distance(self) -> int:
        """Read distance of ``pre_rope_fixed``; ``split`` is the same read at distance 0."""
        if self.rope_mode == "split":
            return 0
        return 3 * self.n_bswa_chunks * self.chunk_len if self.rope_distance is None else self.rope_distance

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["budget"] = dataclasses.asdict(self.budget) if isinstance(self.budget, StateBudget) else self.budget
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVMSpec":
        d = {k: v for k, v in d.items() if k != "calibration"}     # the record of how they were chosen
        d.setdefault("exact_scope", "layer")     # saved before exact_scope existed: the ranking it was saved with
        d.setdefault("exact_lead", 0)            # saved before exact_lead existed: each token its own novelty
        d.setdefault("exact_join", False)        # saved before exact_join existed
        d.setdefault("exact_floor", 1 / 12)      # saved before exact_floor existed: the floor it was saved with
        if isinstance(d.get("budget"), dict):
            d["budget"] = StateBudget(**d["budget"])
        return cls(**d)


def _parse_layers(text: str) -> Union[str, list]:
    if text == "all":
        return text
    out = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"layers {text!r}: use 'all', indices joined by '+' and ranges 'a-b' (e.g. 0-3+7)")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_kvm_spec(text: str, budget_later: bool = False) -> dict:
    """``"budget=fixed:128,chunk_len=64,n_bswa_chunks=2,sink_len=4"`` -> the keyword arguments of
    :func:`convert_hf` (keys: ``layers`` and the :class:`KVMSpec` fields); ``"auto"`` (or ``"auto,layers=..."``):
    the settings a calibration pass picks (``calibrate=True``); ``"auto:NAME"`` (e.g. ``auto:C16-w0.75-e0.75``, a
    calibration record's ``chosen``): that split's sizes at ``keys=N`` kept keys (default 260) without calibrating,
    with any other settings but the sizes. ``budget_later``: the caller sets the budget (a bench, per kept keys) and
    checks ``exact_rows`` against it, so they are not checked here."""
    from kvmeans.pretrained.calibrate import DEFAULT_KEYS, SPLIT_SIZES, split_named, split_settings
    fields = {f.name: f.type for f in dataclasses.fields(KVMSpec)}
    out = {}
    items = [s.strip() for s in text.split(",")]
    named = [s for s in items if s.startswith("auto:")]
    keys = [s for s in items if s.startswith("keys=")]
    if "auto" in items:
        out["calibrate"] = True
    if len(named) + ("calibrate" in out) > 1:
        raise ValueError(f"give one of auto or auto:NAME, got {', '.join(named + ['auto'] * ('calibrate' in out))}")
    if keys and not (named or "calibrate" in out):
        raise ValueError("keys=N goes with auto (calibrate at N kept keys) or auto:NAME (that split at N)")
    if len(keys) > 1 or (keys and not keys[0].partition("=")[2].isdigit()):
        raise ValueError(f"keys must be one non-negative integer (the kept keys), got {', '.join(keys)}")
    n = int(keys[0].partition("=")[2]) if keys else None
    if named:
        sized = [s.partition("=")[0] for s in items if s.partition("=")[0] in SPLIT_SIZES]
        if sized:
            raise ValueError(f"{named[0]} sets {', '.join(SPLIT_SIZES)} itself; drop {', '.join(sized)} "
                             "(keys=N sets the kept keys)")
        out.update(split_settings(split_named(named[0].partition(":")[2]), DEFAULT_KEYS if n is None else n))
    elif n is not None:                     # auto,keys=N: calibrate at N kept keys (convert_hf's keys)
        out["keys"] = n
    text = ",".join(s for s in items if s != "auto" and s not in named and s not in keys)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, val = item.partition("=")
        if not eq or (key not in fields and key != "layers"):
            raise ValueError(f"--kvm item {item!r}: expected KEY=VALUE with KEY one of layers, {', '.join(fields)}")
        if key == "layers":
            out[key] = _parse_layers(val)
        elif key == "budget":
            out[key] = _parse_budget(val)
        elif key in ("rope_mode", "exact_scope", "exact_rank"):
            out[key] = val
        elif key == "exact_heads":
            if val not in ("copy", "uniform"):
                raise ValueError(f"exact_heads must be copy (per-head budgets from each head's copy score) or "
                                 f"uniform (the same in every head), got {val!r}")
            out[key] = val
        elif key in ("log_count_bias", "learned", "exact_join"):
            if val not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} must be true or false, got {val!r}")
            out[key] = val in ("true", "1")
        elif key == "rope_distance" and val == "none":
            out[key] = None
        elif key == "exact_floor":
            try:
                out[key] = float(val)
            except ValueError:
                raise ValueError(f"exact_floor must be a number in [0, 1], got {val!r}") from None
        else:
            if not val.isdigit():
                raise ValueError(f"{key} must be a non-negative integer, got {val!r}")
            out[key] = int(val)
    if named:                               # a named split converts as the automatic setting does
        out.setdefault("exact_heads", AUTOMATIC)
    later = ("budget", "exact_rows") if budget_later else ()
    KVMSpec(**{k: v for k, v in out.items() if k not in ("layers", "calibrate", "keys", "exact_heads") + later})
    return out


def _attention_layers(model) -> dict:
    """``{layer_idx: attention module}`` of the decoder's self-attention layers."""
    found = {}
    for name, mod in model.named_modules():
        if (type(mod).__name__.endswith("Attention") and isinstance(getattr(mod, "layer_idx", None), int)
                and not getattr(mod, "is_cross_attention", False)):
            found[mod.layer_idx] = mod
    return found


class _RopeAt:
    """The model's own rotary embedding (one source of truth for theta, partial rotary and scaling; Gemma3 picks
    the layer type's RoPE): ``(distance, like) -> (cos [R], sin [R])`` at one position (cached) and
    :meth:`positions`. An object, not a closure, so ``copy.deepcopy(model)`` points the copy at its own rotary
    module."""

    def __init__(self, model, module):
        self.rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
        params = inspect.signature(self.rotary.forward).parameters
        self.extra = {"layer_type": module.layer_type} if "layer_type" in params else {}
        self._at = {}

    def __call__(self, distance: int, like: torch.Tensor):
        key = (distance, like.device)
        if key not in self._at:
            cos, sin = self.positions(torch.tensor([[distance]], device=like.device), torch.float32)
            self._at[key] = (cos[0, 0], sin[0, 0])
        return self._at[key]

    def positions(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(cos, sin) [B, n, R]`` at ``positions [B, n]``, as the model computes them for activations of ``dtype``."""
        x = torch.empty(0, device=positions.device, dtype=dtype)
        return self.rotary(x, positions, **self.extra)

    def __deepcopy__(self, memo):
        out = _RopeAt.__new__(_RopeAt)
        out.rotary, out.extra, out._at = copy.deepcopy(self.rotary, memo), dict(self.extra), {}
        return out


def _converted(model):
    """The converted attention modules (listed once: walking every module per forward costs milliseconds)."""
    found = model.__dict__.get("_kvm_modules")
    if found is None:
        found = model._kvm_modules = [m for m in model.modules() if getattr(m, "kvm_spec", None) is not None]
    return found


def _set_inputs(model, named: dict, cache) -> None:
    """Hand the converted layers what the attention interface does not pass: the 2D padding mask
    (``kvmeans.pretrained.batch``: each row runs on its real tokens only; None when there is no padding) and the
    tokens' positions (the pre-RoPE modes unrotate keys at them later), as the model computes them."""
    mask = named.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError("a KVM-converted model takes a 2D attention_mask (1 = token, 0 = pad), got a "
                         f"{mask.dim()}D one; custom 4D masks are not supported")
    if mask is not None and bool(mask.all()):
        mask = None
    positions = named.get("position_ids")
    if positions is None:           # what the model uses then: the cache's length on
        x = named["input_ids"] if named.get("input_ids") is not None else named["inputs_embeds"]
        past = 0 if cache is None else cache.get_seq_length()
        positions = torch.arange(past, past + x.shape[1], device=x.device)[None]
    for module in _converted(model):
        module._kvm_mask, module._kvm_positions = mask, positions


def _clear_inputs(model) -> None:
    for module in _converted(model):
        module.__dict__.pop("_kvm_mask", None)
        module.__dict__.pop("_kvm_positions", None)


_SEGMENT_OFF = ("labels", "output_attentions", "output_hidden_states")


def _forward(self, *args, **kwargs):
    """A converted model's ``forward`` (bound to it by :func:`convert_hf`): the plain forward, over segments of
    ``prefill_segment`` tokens carrying the cache when the input is longer (eval mode; logits only where
    ``logits_to_keep`` asks; one call otherwise, and with labels, attentions or hidden states asked for)."""
    inner = self.__dict__.get("_kvm_inner_forward") or functools.partial(type(self).forward, self)
    named = self._kvm_signature.bind_partial(*args, **kwargs).arguments
    named = {**named.pop("kwargs", {}), **named}
    x = named["input_ids"] if named.get("input_ids") is not None else named.get("inputs_embeds")
    segment = self.config.kvm_conversion.get("prefill_segment", 0)
    keep = named.get("logits_to_keep", 0)
    cache = cache_from(named)
    if (x is None or self.training or not segment or x.shape[1] <= segment or isinstance(keep, torch.Tensor)
            or any(named.get(k) for k in _SEGMENT_OFF)):
        try:
            _set_inputs(self, named, cache)
            return inner(**named)
        finally:
            _clear_inputs(self)
    return _segmented(self, inner, named, x, segment, keep, cache)


def _segmented(model, inner, named: dict, x: torch.Tensor, segment: int, keep: int, cache):
    from transformers import DynamicCache

    name = "input_ids" if named.get("input_ids") is not None else "inputs_embeds"
    use_cache = named.get("use_cache")
    use_cache = model.config.use_cache if use_cache is None else use_cache
    return_dict = named.pop("return_dict", None)
    if cache is None:
        cache = DynamicCache(config=model.config)
    T, mask, positions = x.shape[1], named.get("attention_mask"), named.get("position_ids")
    if x.device.type == "cpu":
        bound_heap()        # freed segment activations go back to the OS: flat peak (kvmeans.utils.heap)
    past = cache.get_seq_length()
    logits, out, filled = None, None, 0      # logits written into one tensor: a list then cat would hold two copies
    for s in range(0, T, segment):
        e = min(T, s + segment)
        want = e - s if keep == 0 else max(0, min(e - s, keep - (T - e)))      # logits of [s, e) to return
        part = {**named, name: x[:, s:e], "use_cache": True, "logits_to_keep": 0 if keep == 0 else max(want, 1),
                **cache_kwargs(cache)}
        if mask is not None:
            part["attention_mask"] = mask[:, :past + e]
        if positions is not None:
            part["position_ids"] = positions[..., s:e]
        if named.get("cache_position") is not None:
            part["cache_position"] = named["cache_position"][s:e]
        try:
            _set_inputs(model, part, cache)
            out = inner(**part)
        finally:
            _clear_inputs(model)
        part_logits = out.logits if keep == 0 else out.logits[:, -want:] if want else None
        if part_logits is not None:
            if logits is None:
                n = T if keep == 0 else min(T, keep)
                logits = part_logits.new_empty(part_logits.shape[0], n, *part_logits.shape[2:])
            logits[:, filled:filled + part_logits.shape[1]] = part_logits
            filled += part_logits.shape[1]
        part_logits = out["logits"] = None      # item and attribute: not held through the next segment's forward
    out["logits"] = logits
    if not use_cache and out.get(CACHE_KWARG) is not None:
        out[CACHE_KWARG] = None     # the installed name only: 5.24 warns on the old one
    return out if return_dict is not False else out.to_tuple()


def converted_cache(model, cache=None):
    """``cache`` (default: a new ``DynamicCache`` for ``model``) with the converted layers' cache layers in place
    already, so that ``cache.activate_past_recording()`` reaches them before the first forward (``crop`` after
    calls made from then on); ``generate`` does this itself."""
    if cache is None:
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    for module in _converted(model):
        kvm_cache_layer(cache, module.layer_idx, module.kvm_compact_mask)
    return cache


def _prepare_cache(self, *args, **kwargs):
    """``generate``'s cache preparation, then the converted layers' cache layers put in place at once, so that
    assisted and prompt-lookup decoding (which ask the cache to record before the first forward) reach them."""
    result = type(self)._prepare_cache_for_generation(self, *args, **kwargs)
    model_kwargs = kwargs.get("model_kwargs", next((a for a in args if isinstance(a, dict)), None))
    cache = None if model_kwargs is None else cache_from(model_kwargs)
    config = kwargs.get("generation_config", args[0] if args else None)
    if cache is not None and hasattr(cache, "layers"):
        converted_cache(self, cache)
        if getattr(config, "is_assistant", False):      # generate asked before our layers were there
            cache.activate_past_recording()
    return result


def calibrates(settings: dict) -> bool:
    """Whether ``convert_hf(model, **settings)`` runs the calibration pass: ``calibrate=True``, or ``calibrate``
    not given (``None``) and no setting besides ``layers`` (what ``parse_kvm_spec("auto")`` and ``""`` give) and
    the per-head budgets' own (``exact_heads``, ``exact_floor``: they shape the automatic setting's reserve)."""
    rest = [k for k in settings
            if k not in ("layers", "calibrate", "calibration", "tokenizer", "exact_heads", "exact_floor")]
    return bool(settings.get("calibrate")) or (settings.get("calibrate") is None and not rest)


def convert_hf(model, *, layers: Union[str, Sequence[int]] = "all", calibrate: Optional[bool] = None,
               calibration=None, tokenizer=None, **settings):
    """Give ``model`` (a transformers causal LM of a family in ``FAMILIES``) training-free KVM attention in
    ``layers`` ("all": every global-attention layer; sliding-window layers of Gemma2/3 keep their window).
    ``settings`` are :class:`KVMSpec` fields; ``rope_mode`` defaults to ``pre_rope_fixed`` with RoPE and
    ``none`` without. With no settings (or ``calibrate=True``) the window / state / exact-row split of the kept
    keys is chosen by a short calibration pass (:mod:`kvmeans.pretrained.calibrate`; on ``calibration`` token ids
    ``[N, T]`` if given, else built-in text through ``tokenizer`` or the model's own, loaded from its folder), and
    recorded under ``calibration`` in ``config.kvm_conversion``; ``calibrate=False`` with no settings takes
    :class:`KVMSpec`'s defaults. Converts in place and returns ``model``."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    family = cfg.model_type
    if family not in FAMILIES:
        why = f" ({UNSUPPORTED[family]}: the op reads keys before RoPE in the rotate-half layout)" \
            if family in UNSUPPORTED else ""
        raise ValueError(f"convert_hf supports model_type in {sorted(FAMILIES)}, got {family!r}{why}")
    attn = _attention_layers(model)
    kinds = getattr(cfg, "layer_types", None)
    is_global = {i: kinds is None or kinds[i] != "sliding_attention" for i in attn}
    chosen = [i for i in sorted(attn) if is_global[i]] if layers == "all" else sorted(set(layers))
    for i in chosen:
        if i not in attn:
            raise ValueError(f"layers: {i} is not an attention layer index (0..{len(attn) - 1})")
        if not is_global[i]:
            raise ValueError(f"layers: {i} is a sliding-window layer; convert only global layers (layers='all')")
    record = None
    auto = calibrates({**settings, "calibrate": calibrate})
    # per-head budgets: the automatic setting's unless asked otherwise ("uniform"); chosen after the split, which
    # the calibration picks with equal budgets
    heads = settings.pop("exact_heads", AUTOMATIC if auto else None)
    heads = None if heads == "uniform" else heads
    if auto:      # after the cheap checks: it takes minutes
        from kvmeans.pretrained.calibrate import DEFAULT_KEYS
        from kvmeans.pretrained.calibrate import calibrate as _calibrate
        _check_rope_read(cfg, settings.get("rope_mode", "pre_rope_fixed" if FAMILIES[family] else "none"))
        keys = settings.pop("keys", DEFAULT_KEYS)
        base = {**settings, "layers": chosen}
        settings = _calibrate(model, keys, convert=convert_hf, windows=calibration, tokenizer=tokenizer,
                              base={**base, "exact_heads": "uniform"})
        record = settings.pop("calibration")
        settings.pop("layers")
        settings.pop("exact_heads")
    if heads == "copy" and settings.get("exact_rows"):      # measured on the model as it is, before conversion
        if any(getattr(m, "kvm_spec", None) is not None for m in model.modules()):
            raise ValueError("exact_heads='copy' measures the original model's heads; convert the original model")
        passage = None if calibration is None else calibration.flatten().tolist()
        try:
            scores = copy_scores(model, tokenizer, ids=passage,
                                 tokens=COPY_TOKENS if passage is None else min(COPY_TOKENS, len(passage)))
        except ValueError as err:
            raise ValueError(f"exact_heads='copy' (the automatic setting's per-head budgets) reads a passage through "
                             f"the model's tokenizer: {err}; or give exact_heads='uniform' (equal budgets)") from err
        heads = tuple(tuple(scores[i]) for i in chosen)
    settings["exact_heads"] = None if heads == "copy" else heads     # "copy" without exact rows: nothing to share
    has_rope = FAMILIES[family]
    settings.setdefault("rope_mode", "pre_rope_fixed" if has_rope else "none")
    if not has_rope and settings["rope_mode"] != "none":
        raise ValueError(f"{family} has no RoPE (learned absolute positions): use rope_mode='none'")
    if has_rope and settings["rope_mode"] == "none":
        raise ValueError(f"{family} rotates q/k: rope_mode='none' would mix rotated keys unknowingly; "
                         "use pre_rope_fixed, post_rope or split")
    spec = KVMSpec(**settings)
    if spec.rope_mode == "pre_rope_fixed" and spec.rope_distance is None:
        # stored resolved, so a saved model reloads at the distance it was converted (or distilled) with
        spec = dataclasses.replace(spec, rope_distance=spec.distance)
    _check_rope_read(cfg, spec.rope_mode)
    caps = None
    if spec.exact_heads is not None:
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if len(spec.exact_heads) != len(chosen) or len(spec.exact_heads[0]) != kv_heads:
            raise ValueError(f"exact_heads holds {len(spec.exact_heads)} layers x {len(spec.exact_heads[0])} heads; "
                             f"this conversion has {len(chosen)} layers x {kv_heads} kv heads")
        caps = head_caps(torch.tensor(spec.exact_heads, dtype=torch.float64), spec.exact_rows, spec.exact_floor)
    # exact_scope "model" / "first": one board per model
    board = NoveltyBoard(len(chosen), spec.exact_scope) if chosen and spec.exact_scope in BOARD_SCOPES else None
    for pos, i in enumerate(chosen):
        if has_rope and not getattr(attn[i], "use_rope", True):    # SmolLM3's NoPE layers: keys carry no position
            convert_attention_layer(attn[i], dataclasses.replace(spec, rope_mode="none"), None, board, pos)
        else:
            convert_attention_layer(attn[i], spec, _RopeAt(model, attn[i]) if has_rope else None, board, pos)
        attn[i].kvm_exact_caps = None if caps is None else caps[pos]
    model.__dict__.pop("_kvm_modules", None)
    compact = all(i in chosen for i in attn if is_global[i])     # no plain full-attention layer reads the mask
    for i in chosen:
        attn[i].kvm_compact_mask = compact
    if not getattr(model, "_kvm_forward", False):
        if "forward" in model.__dict__:          # e.g. accelerate's device hooks: keep them inside ours
            model._kvm_inner_forward = model.__dict__["forward"]
        sig = inspect.signature(type(model).forward)
        model._kvm_signature = sig.replace(parameters=list(sig.parameters.values())[1:])     # without self
        # generate reads forward's parameters (logits_to_keep, attention_mask, ...): ours shows the model's
        forward = types.FunctionType(_forward.__code__, _forward.__globals__, "forward")
        forward.__signature__, forward.__doc__ = sig, _forward.__doc__
        model.forward = types.MethodType(forward, model)
        if hasattr(type(model), "_prepare_cache_for_generation"):
            model._prepare_cache_for_generation = types.MethodType(_prepare_cache, model)
        model._kvm_forward = True
    model.config.kvm_conversion = {"layers": chosen, **spec.to_dict()}
    if record is not None:
        model.config.kvm_conversion["calibration"] = record
    return model


def _check_rope_read(cfg, rope_mode: str) -> None:
    """The pre-RoPE modes read RoPE at a fixed position, which dynamic RoPE does not have (checked before a
    calibration pass spends minutes, and for every conversion)."""
    if rope_mode in ("pre_rope_fixed", "split") and "'dynamic'" in repr(getattr(cfg, "rope_parameters", None)):
        raise ValueError(f"rope_mode={rope_mode!r} reads RoPE at a fixed position, which dynamic RoPE (scaled "
                         "by the sequence length) does not have; use rope_mode='post_rope'")


def load_converted(path, settings: Optional[dict] = None, **from_pretrained_kwargs):
    """Load a model saved after :func:`convert_hf` and convert it again with its stored settings, or with
    ``settings`` replacing some of them (e.g. another budget and window: the learned read-out does not depend on
    them), and, for ``learned=True``, its learned KVM parameters from the folder's safetensors files."""
    with named_weight_errors(path):
        model = _from_pretrained_quiet_on_kvm_keys(path, **from_pretrained_kwargs)
    stored = getattr(model.config, CONFIG_KEY, None)
    if not stored:
        raise ValueError(f"{path} has no '{CONFIG_KEY}' in config.json: it was not saved from a converted model; "
                         "load it with from_pretrained and call kvmeans.convert_hf")
    override = settings or {}
    settings = {**stored, **override}
    layers = settings.pop("layers")
    record = settings.pop("calibration", None)
    model = convert_hf(model, layers=layers, **vars(KVMSpec.from_dict(settings)))
    if record is not None and not override:      # the stored settings as they were chosen: keep the record
        model.config.kvm_conversion["calibration"] = record
    if settings.get("learned"):
        _load_learned(model, Path(path))
    return model


def _from_pretrained_quiet_on_kvm_keys(path, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` whose load report leaves out the learned ``kvm_*`` weights (the
    plain class has no such parameters; :func:`_load_learned` loads them): any other unexpected, missing or
    mismatched key is still reported."""
    import logging

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    log = hf_logging.get_logger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        log.setLevel(level)
    issues = {kind: sorted(k for k in info.get(kind) or () if ".kvm_" not in str(k))
              for kind in ("unexpected_keys", "missing_keys", "mismatched_keys")}
    if any(issues.values()):
        log.warning(f"loading {path}: " + "; ".join(f"{kind} {keys}" for kind, keys in issues.items() if keys))
    return model


def _load_learned(model, path: Path) -> None:
    """Copy the ``kvm_*`` parameters saved in ``path/*.safetensors`` into ``model`` (from_pretrained skips
    them: the plain class has no such parameters)."""
    from safetensors import safe_open

    want = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("kvm_")}
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if k in want})
    missing = sorted(set(want) - set(found))
    if missing:
        raise ValueError(f"{path}: config.json says learned=true but the weights lack {len(missing)} learned KVM "
                         f"parameters (e.g. {missing[0]}); save the model again with save_pretrained")
    with torch.no_grad():
        for name, value in found.items():
            want[name].copy_(value)
