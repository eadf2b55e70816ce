"""Model configuration: the GPTAlpha-2 backbone with a sequence mixer per layer, and the paper's presets.

Plain data (JSON-serialisable) so it can live inside a Hugging Face ``config.json``; budgets are
stored as dicts (``{"kind": "power_law", "factor": 16, ...}``) and turned into :class:`StateBudget`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

from kvmeans.ops.budget import KINDS, StateBudget, parse_budget_spec
from kvmeans.ops.kvm import NUMERICS
from kvmeans.utils.fields import check_field_types

MIXERS = ("kvm", "full", "swa", "bswa", "ovq", "rwkv7")


def budget_from_dict(spec: Dict[str, Any]) -> StateBudget:
    """``{"kind": "fixed", "n": 256}`` -> ``StateBudget.fixed(256)`` (the fields of :class:`StateBudget`)."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"budget kind must be one of {', '.join(KINDS)}, got {kind!r}")
    known = {f.name for f in dataclasses.fields(StateBudget)} - {"kind"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"budget {kind}: unknown fields {sorted(unknown)}; known: {sorted(known)}")
    return StateBudget(kind, **spec)


def budget_to_dict(budget: StateBudget) -> Dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(budget).items()
            if k == "kind" or v != {f.name: f.default for f in dataclasses.fields(StateBudget)}.get(k)}


def _budget_field(budget: Any) -> Any:
    """``KVMModelConfig.budget``: an int or a StateBudget as its dict, a dict validated, a callable kept."""
    if isinstance(budget, StateBudget):
        return budget_to_dict(budget)
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget_to_dict(StateBudget.fixed(budget))
    if isinstance(budget, dict):
        try:
            budget_from_dict(budget)              # validates
        except (TypeError, ValueError) as err:
            raise type(err)(f"KVMModelConfig.budget: {err}") from None
        return budget
    if callable(budget):
        return budget
    raise TypeError(f"KVMModelConfig.budget: expected a dict of StateBudget fields, an int, a StateBudget or a "
                    f"callable ctx_len -> rows, got {budget!r} ({type(budget).__name__})")


@dataclass
class KVMModelConfig:
    """A decoder-only LM: ``embedding -> ln_emb -> blocks -> ln_head -> lm_head``.

    Layer ``i`` uses ``alt_mixer`` when ``alt_every > 1 and i % alt_every == 0`` (the authors' hybrid rule:
    layers 0, 2, 4, ... are the alternate mixer for ``alt_every=2``), else ``mixer``; ``mixer_types``
    overrides both with an explicit list (``layer_types=`` is accepted as its old name; transformers owns
    ``layer_types`` in a Hugging Face config).

    ``budget``: a dict of :class:`StateBudget` fields (``{"kind": "fixed", "n": 256}``); an int or a
    ``StateBudget`` is stored as that dict. Any callable ``ctx_len -> rows`` works for the model too, but
    such a config cannot be serialised (:meth:`to_dict`, ``KVMConfig``, ``save_pretrained``).
    Every field is checked at construction (types: bools are not ints); ``None`` means "derived" only
    where a comment says so.
    """

    vocab_size: int = 50304
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 6
    num_kv_heads: Optional[int] = None          # None -> num_heads
    head_dim: Optional[int] = None              # None -> hidden_size // num_heads
    ffn_mult: float = 4.0                        # d_ff = floor(ffn_mult * d) // 32 * 32
    residual_scale: float = 1.0                  # 0.5 for 24-layer models (CompleteP, reference 4.1)
    mixer: str = "kvm"
    alt_mixer: Optional[str] = None              # None: no alternate layers
    alt_every: int = 0                           # 0 or 1: no alternate layers
    mixer_types: Optional[List[str]] = None      # None: from mixer / alt_mixer / alt_every
    layer_types: dataclasses.InitVar[Optional[List[str]]] = None   # old name of mixer_types (input only)
    rope_dim: Optional[int] = None               # main mixer: None -> head_dim // 4 * 2 (HalfRoPE); 0 = NoPE
    rope_theta: float = 10000.0
    alt_rope_dim: Optional[int] = None           # alternate mixer: None -> head_dim (full RoPE); 0 = NoPE
    alt_rope_theta: float = 10000.0
    rope_reference_bf16: bool = False            # round cos/sin to bf16 like the authors' code
    # KVM
    chunk_len: int = 256
    n_bswa_chunks: int = 2
    sink_len: int = 1
    budget: Union[Dict[str, Any], Callable[[int], int]] = field(default_factory=lambda: {"kind": "fixed", "n": 256})
    merge_gate: bool = True
    gate_appends: bool = False
    head_temps: bool = True
    value_radius: bool = True
    kvm_numerics: str = "exact"                  # "reference": the authors' eager rounding (their checkpoints)
    # baselines
    swa_window: int = 256
    bswa_chunks: int = 3
    bswa_sink_len: int = 0
    ovq_chunk_len: int = 256
    ovq_max_centroids: int = 1024
    rwkv7_chunk_size: int = 64                   # chunk of RWKV-7's chunked path (CPU/training; fla on CUDA)
    # GPTAlpha-2 preparation
    token_shift: bool = True
    mlp_token_shift: bool = True
    value_residual: bool = True
    qk_norm: bool = True
    tie_embeddings: bool = False
    logit_softcap: Optional[float] = None        # None: no softcap
    init_std_embed: float = 1e-4

    def __post_init__(self, layer_types):
        def bad(name, problem, fix):
            raise ValueError(f"KVMModelConfig.{name}: {problem}; {fix}")
        if layer_types is not None:
            if self.mixer_types is not None and list(self.mixer_types) != list(layer_types):
                bad("layer_types", f"{layer_types} disagrees with mixer_types={self.mixer_types}",
                    "pass only mixer_types (layer_types is its old name)")
            self.mixer_types = layer_types
        self.budget = _budget_field(self.budget)
        check_field_types(self)
        if self.mixer_types is not None:
            self.mixer_types = list(self.mixer_types)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "chunk_len", "n_bswa_chunks",
                     "swa_window", "bswa_chunks", "ovq_chunk_len", "ovq_max_centroids", "rwkv7_chunk_size"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}", "use a positive size")
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}", "use a positive size, or None for the default")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            bad("num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}",
                "set head_dim explicitly")
        if self.num_heads % self.kv_heads:
            bad("num_kv_heads", f"{self.kv_heads} does not divide num_heads={self.num_heads}",
                "use a divisor of num_heads")
        if not self.ffn_mult > 0 or self.ffn_dim < 1:
            bad("ffn_mult", f"{self.ffn_mult} gives d_ff = floor({self.ffn_mult} * {self.hidden_size}) // 32 * 32 = "
                f"{self.ffn_dim}", "use ffn_mult > 0 with ffn_mult * hidden_size >= 32")
        if self.alt_every < 0:
            bad("alt_every", f"must be >= 0, got {self.alt_every}", "use 0 for no alternate layers")
        for name in ("mixer", "alt_mixer"):
            if getattr(self, name) is not None and getattr(self, name) not in MIXERS:
                bad(name, f"unknown mixer {getattr(self, name)!r}", f"choose from {MIXERS}")
        if self.mixer_types is not None:
            if len(self.mixer_types) != self.num_layers:
                bad("mixer_types", f"has {len(self.mixer_types)} entries for {self.num_layers} layers",
                    "give one per layer")
            for t in self.mixer_types:
                if t not in MIXERS:
                    bad("mixer_types", f"unknown mixer {t!r}", f"choose from {MIXERS}")
        self._check_rwkv7()
        if self.sink_len < 0 or self.bswa_sink_len < 0:
            bad("sink_len" if self.sink_len < 0 else "bswa_sink_len", "must be >= 0", "use 0 for no sinks")
        if "kvm" in self.mixer_per_layer() and self.sink_len >= self.chunk_len:
            bad("sink_len", f"{self.sink_len} must be < chunk_len={self.chunk_len}",
                "lower sink_len so the first chunk leaves mergeable state rows")
        if not self.residual_scale > 0:
            bad("residual_scale", f"must be > 0, got {self.residual_scale}", "use 1.0 (12 layers) or 0.5 (24)")
        for name in ("rope_theta", "alt_rope_theta"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}", "use e.g. 10000.0")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            bad("logit_softcap", f"must be > 0, got {self.logit_softcap}", "use None for no softcap")
        if not self.init_std_embed >= 0:
            bad("init_std_embed", f"must be >= 0, got {self.init_std_embed}", "use e.g. 1e-4 (the reference)")
        if self.kvm_numerics not in NUMERICS:
            bad("kvm_numerics", f"must be one of {NUMERICS}, got {self.kvm_numerics!r}",
                "use 'reference' to reproduce the authors' eager rounding, 'mixed' for half-precision attention "
                "dots (fast on GPU), else 'exact'")
        for name in ("rope_dim", "alt_rope_dim"):
            r = getattr(self, name)
            if r is not None and (r < 0 or r % 2 or r > self.qk_head_dim):
                bad(name, f"{r} must be even and in [0, head_dim={self.qk_head_dim}]", "pick an even channel count")

    def _check_rwkv7(self) -> None:
        """RWKV-7 runs on its own backbone (the paper's baseline): every layer or none, heads of hidden/num_heads."""
        kinds = self.mixer_per_layer()
        if "rwkv7" not in kinds:
            return
        if set(kinds) != {"rwkv7"}:
            name = "mixer_types" if self.mixer_types is not None else "alt_mixer"
            raise ValueError(f"KVMModelConfig.{name}: rwkv7 layers cannot be mixed with "
                             f"{sorted(set(kinds) - {'rwkv7'})} "
                             "(RWKV-7 has its own backbone: token shift on x, value residual from layer 0's value); "
                             "use mixer='rwkv7' alone")
        if self.head_dim is not None and self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(f"KVMModelConfig.head_dim: RWKV-7 heads split hidden_size={self.hidden_size} into "
                             f"num_heads={self.num_heads}, got head_dim={self.head_dim}; leave head_dim=None")
        if self.kv_heads != self.num_heads:
            raise ValueError(f"KVMModelConfig.num_kv_heads: RWKV-7 has no grouped heads, got {self.kv_heads} for "
                             f"num_heads={self.num_heads}; leave num_kv_heads=None")
        if not self.token_shift:
            raise ValueError("KVMModelConfig.token_shift: RWKV-7's time mixer always shifts its input (its r, w, k, v, "
                             "a, g mixes); leave token_shift=True (mlp_token_shift switches the channel mixer's)")

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_dim(self) -> int:
        return int(self.ffn_mult * self.hidden_size) // 32 * 32

    def state_budget(self) -> Callable[[int], int]:
        """The KVM budget: a :class:`StateBudget`, or the callable given as ``budget``."""
        return budget_from_dict(self.budget) if isinstance(self.budget, dict) else self.budget

    def mixer_per_layer(self) -> List[str]:
        if self.mixer_types is not None:
            return list(self.mixer_types)
        alt = self.alt_mixer if (self.alt_mixer and self.alt_every > 1) else None
        return [alt if alt and i % self.alt_every == 0 else self.mixer for i in range(self.num_layers)]

    def is_alt_layer(self, i: int) -> bool:
        return bool(self.alt_mixer and self.alt_every > 1 and i % self.alt_every == 0)

    def rope_for_layer(self, i: int) -> int:
        if self.is_alt_layer(i):
            return self.qk_head_dim if self.alt_rope_dim is None else self.alt_rope_dim
        # half the head rounded down to an even count (an odd head_dim // 2 cannot be rotated in pairs)
        return self.qk_head_dim // 4 * 2 if self.rope_dim is None else self.rope_dim

    def rope_theta_for_layer(self, i: int) -> float:
        return self.alt_rope_theta if self.is_alt_layer(i) else self.rope_theta

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON data; a callable ``budget`` cannot be serialised (``ValueError``)."""
        if not isinstance(self.budget, dict):
            raise ValueError(f"KVMModelConfig.budget: the callable {self.budget!r} cannot be serialised (to_dict, "
                             "config.json, KVMConfig); use an int or StateBudget.fixed / power_law / saturating")
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "KVMModelConfig":
        """Inverse of :meth:`to_dict`; also reads ``layer_types`` (the old name of ``mixer_types``)."""
        known = {f.name for f in dataclasses.fields(cls)} | {"layer_types"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"KVMModelConfig: unknown keys {sorted(unknown)}")
        return cls(**d)


_SIZES = {"120m": dict(hidden_size=768, num_layers=12, num_heads=6),
          "350m": dict(hidden_size=1024, num_layers=24, num_heads=8, residual_scale=0.5)}
_ARCHS = {
    "kvm": dict(mixer="kvm", budget={"kind": "fixed", "n": 256}),
    "kvm-sqrt": dict(mixer="kvm", budget={"kind": "power_law", "factor": 16.0, "exponent": 0.5, "min_len": 256}),
    "kvm-swa": dict(mixer="kvm", alt_mixer="swa", alt_every=2, budget={"kind": "saturating", "n": 1024, "min_len": 1}),
    "gpta": dict(mixer="full"),
    "bswa": dict(mixer="bswa"),
    "ovq-swa": dict(mixer="ovq", alt_mixer="swa", alt_every=2),
}
_RWKV7_SIZES = {"120m": dict(num_heads=12), "350m": dict(num_heads=16)}   # head_dim 64, RWKV-7's

PRESETS: Dict[str, Dict[str, Any]] = {f"{a}-{s}": {**size, **arch} for a, arch in _ARCHS.items()
                                      for s, size in _SIZES.items()}
PRESETS.update({f"rwkv7-{s}": {**size, **_RWKV7_SIZES[s], "mixer": "rwkv7"} for s, size in _SIZES.items()})
PRESETS["tiny-cpu"] = dict(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, chunk_len=32,
                           budget={"kind": "power_law", "factor": 4.0, "exponent": 0.5, "min_len": 32},
                           swa_window=32, ovq_chunk_len=32, ovq_max_centroids=128)


def preset(name: str, **overrides) -> KVMModelConfig:
    """A paper configuration by name (``kvm-120m``, ``kvm-sqrt-350m``, ``tiny-cpu``, ...) with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return KVMModelConfig(**{**PRESETS[name], **overrides})


def with_budget(config: KVMModelConfig, budget: Any) -> KVMModelConfig:
    """``config`` with every KVM layer's budget replaced (a schedule change at load, no retraining): ``budget`` is
    anything ``KVMModelConfig.budget`` takes or a spec ``N``, ``fixed:N``, ``saturating:N[:MIN_LEN]``,
    ``power_law:FACTOR[:EXPONENT[:MIN_LEN]]``, ``novelty:THRESHOLD:CAP``. ``ValueError`` when no layer is KVM or a
    fixed budget (a novelty cap) is below ``chunk_len``."""
    if "kvm" not in config.mixer_per_layer():
        raise ValueError("budget override: the model has no KVM layer "
                         f"(layers {sorted(set(config.mixer_per_layer()))}); drop budget / --budget")
    out = dataclasses.replace(config, budget=parse_budget_spec(budget) if isinstance(budget, str) else budget)
    b = out.state_budget()
    if isinstance(b, StateBudget) and b.kind in ("fixed", "novelty") and b.n < config.chunk_len:   # the op's check
        raise ValueError(f"budget override: {b.kind} {b.n} rows would shrink the state below the initial state of "
                         f"chunk_len={config.chunk_len} rows; use at least {config.chunk_len}")
    return out
