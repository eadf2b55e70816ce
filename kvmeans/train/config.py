"""Training configuration: typed sections, presets by name, a YAML/JSON file, ``--section.key value`` overrides.

Resolution order (later wins): the preset, then ``--config FILE``, then command-line overrides. Every
key is checked against its dataclass field and its type; unknown keys fail with the list of valid
ones. Values on the command line are read with ``ast.literal_eval`` (never ``eval``), falling back to
the raw string. ``model`` accepts any :class:`KVMModelConfig` field (``--model.hidden_size 64``).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvmeans.models.config import PRESETS as MODEL_PRESETS
from kvmeans.models.config import KVMModelConfig, budget_to_dict, preset

__all__ = ["ModelSection", "DataSection", "OptimSection", "TrainSection", "RunConfig", "RUN_PRESETS",
           "ConfigError", "resolve_config", "parse_overrides"]


class ConfigError(ValueError):
    """A bad configuration: the message names the key and what would be accepted."""


@dataclass
class ModelSection:
    preset: str = "tiny-cpu"                                     # a name in kvmeans.models.PRESETS
    overrides: Dict[str, Any] = field(default_factory=dict)      # KVMModelConfig fields over the preset

    def build(self) -> KVMModelConfig:
        return preset(self.preset, **self.overrides)


@dataclass
class DataSection:
    path: str = "builtin"                  # a prepared folder (train.bin, val.bin) or "builtin" (bundled text)
    seq_len: int = 256
    batch_size: int = 8                    # global sequences per optimiser step (all ranks, all micro steps)
    micro_batch_size: Optional[int] = None  # sequences per rank per forward; None = batch_size // world_size
    vocab_size: Optional[int] = None       # builtin tokenizer's vocabulary; None = the model's vocab_size


@dataclass
class OptimSection:
    lr: float = 2e-3                       # peak lr at mup_base_dim width
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.2              # peak decoupled decay of matrices and embedding (reference 8.3)
    adamc: bool = True                     # wd follows lr: wd_now = wd_peak * lr_now / lr_peak
    warmup_steps: int = 200                # linear warm-up (it + 1) / warmup_steps
    decay: str = "linear"                  # linear | cosine | constant, from the end of warm-up to min_lr
    min_lr: float = 0.0
    grad_clip: Optional[float] = None      # max global grad norm; None = off (the authors clip nothing)
    mup_base_dim: int = 768                # CompleteP: matrices use lr / r and wd * r, r = hidden / mup_base_dim


@dataclass
class TrainSection:
    max_steps: Optional[int] = None        # optimiser steps; or give token_budget instead
    token_budget: Optional[int] = None     # steps = ceil(token_budget / tokens per step)
    val_every: int = 250                   # 0 = only at the end
    val_steps: int = 20                    # validation batches (of data.batch_size sequences)
    ckpt_every: int = 1000                 # 0 = only at the end
    keep_ckpts: int = 3
    log_every: int = 10                    # plain-text progress lines (when tqdm is absent or not a terminal)
    out: str = "runs/tiny-cpu"
    seed: int = 1337
    device: str = "auto"                   # auto (cuda if present) | cpu | cuda
    dtype: str = "auto"                    # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False                  # torch.compile each block
    grad_checkpointing: bool = False       # recompute each block in backward (non-reentrant)
    strategy: str = "ddp"                  # ddp | fsdp (FSDP2 fully_shard per block, then the root)
    wandb: bool = False
    wandb_project: str = "kvmeans"
    tensorboard: bool = False


_SECTIONS = {"model": ModelSection, "data": DataSection, "optim": OptimSection, "train": TrainSection}
_CHOICES = {("optim", "decay"): ("linear", "cosine", "constant"), ("train", "device"): ("auto", "cpu", "cuda"),
            ("train", "dtype"): ("auto", "fp32", "bf16"), ("train", "strategy"): ("ddp", "fsdp")}
_MODEL_FIELDS = {f.name for f in dataclasses.fields(KVMModelConfig)}
_MODEL_ALIASES = {"layer_types": "mixer_types"}      # old names of KVMModelConfig fields, still accepted


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    name: str = "tiny-cpu"                 # the run preset this config started from

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RunConfig":
        """Build from nested plain data, checking every key and type (see :func:`resolve_config`)."""
        d = dict(d)
        name = d.pop("name", "tiny-cpu")
        sections = {}
        for sec, values in d.items():
            if sec not in _SECTIONS:
                raise ConfigError(f"unknown config section {sec!r}; valid sections: {', '.join(_SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"config section {sec!r} must be a mapping, got {type(values).__name__}")
            sections[sec] = _build_section(sec, values)
        return cls(name=name, **sections)

    def tokens_per_step(self) -> int:
        return self.data.batch_size * self.data.seq_len

    def total_steps(self) -> int:
        if self.train.max_steps is not None:
            return self.train.max_steps
        return math.ceil(self.train.token_budget / self.tokens_per_step())

    def check(self, world_size: int = 1) -> None:
        """Cross-field checks that need the world size (each error says how to fix it)."""
        t, dt, o = self.train, self.data, self.optim
        if not dt.path:
            raise ConfigError(f"data.path is empty: preset {self.name!r} trains on a prepared folder; pass --data DIR "
                              "(written by `kvmeans data prepare`) or --data builtin")
        if (t.max_steps is None) == (t.token_budget is None):
            raise ConfigError("set exactly one of train.max_steps and train.token_budget "
                              f"(got max_steps={t.max_steps}, token_budget={t.token_budget})")
        for name, value in (("data.batch_size", dt.batch_size), ("data.seq_len", dt.seq_len),
                            ("data.micro_batch_size", dt.micro_batch_size or 1)):
            if value < 1:                  # before the divisions below
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.total_steps() < 1:
            raise ConfigError(f"the run has {self.total_steps()} steps; raise train.max_steps or train.token_budget")
        if dt.batch_size % world_size:
            raise ConfigError(f"data.batch_size={dt.batch_size} is not divisible by the world size {world_size}")
        micro = self.micro_batch_size(world_size)
        if (dt.batch_size // world_size) % micro:
            raise ConfigError(f"data.micro_batch_size={micro} does not divide the per-rank batch "
                              f"{dt.batch_size // world_size} (data.batch_size / world size)")
        for name, value, low in (("data.seq_len", dt.seq_len, 1), ("train.val_steps", t.val_steps, 1),
                                 ("train.keep_ckpts", t.keep_ckpts, 1), ("train.log_every", t.log_every, 1),
                                 ("optim.mup_base_dim", o.mup_base_dim, 1), ("optim.warmup_steps", o.warmup_steps, 0),
                                 ("train.val_every", t.val_every, 0), ("train.ckpt_every", t.ckpt_every, 0)):
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")
        if not 0 <= o.min_lr <= o.lr:
            raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")

    def micro_batch_size(self, world_size: int = 1) -> int:
        return self.data.micro_batch_size or self.data.batch_size // world_size

    def grad_accum_steps(self, world_size: int = 1) -> int:
        return self.data.batch_size // world_size // self.micro_batch_size(world_size)


def _build_section(sec: str, values: Dict[str, Any]):
    if sec == "model":
        values = dict(values)
        name = _check(sec, "preset", values.pop("preset", ModelSection.preset))
        overrides = {**(values.pop("overrides", None) or {}), **values}   # flat model keys are overrides too
        section = ModelSection(name, {_MODEL_ALIASES.get(k, k): _check(sec, k, v) for k, v in overrides.items()})
        try:
            section.build()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None
        return section
    return _SECTIONS[sec](**{k: _check(sec, k, v) for k, v in values.items()})


def field_type(sec: str, key: str):
    """The declared type of ``sec.key``; unknown sections or keys raise a :class:`ConfigError`."""
    if sec not in _SECTIONS:
        raise ConfigError(f"unknown config section {sec!r} (in {sec}.{key}); valid sections: {', '.join(_SECTIONS)}")
    hints = typing.get_type_hints(_SECTIONS[sec])
    if sec == "model" and _MODEL_ALIASES.get(key, key) in _MODEL_FIELDS:
        hints, key = typing.get_type_hints(KVMModelConfig), _MODEL_ALIASES.get(key, key)
    if key not in hints:
        valid = sorted(set(hints) | (_MODEL_FIELDS if sec == "model" else set()))
        raise ConfigError(f"unknown config key {sec}.{key}; valid keys in {sec!r}: {', '.join(valid)}")
    return hints[key]


def _check(sec: str, key: str, value: Any) -> Any:
    if (sec, key) == ("model", "budget") and isinstance(value, str):    # a spec, as every command's --budget takes
        from kvmeans.ops.budget import parse_budget_spec
        try:
            value = parse_budget_spec(value)
        except ValueError as err:
            raise ConfigError(f"model.budget: {err}") from None
        value = value if isinstance(value, int) else budget_to_dict(value)
    if (sec, key) == ("model", "budget") and isinstance(value, int) and not isinstance(value, bool):
        value = {"kind": "fixed", "n": value}       # an int budget is StateBudget.fixed, as in the op
    value = _coerce(value, field_type(sec, key), f"{sec}.{key}")
    choices = _CHOICES.get((sec, key))
    if choices and value not in choices:
        raise ConfigError(f"{sec}.{key} must be one of {', '.join(choices)}; got {value!r}")
    if sec == "model" and key == "preset" and value not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {value!r}; available: {', '.join(sorted(MODEL_PRESETS))}")
    return value


def _coerce(value: Any, tp, key: str) -> Any:
    """``value`` as type ``tp`` (int, float, bool, str, Optional, Tuple, Dict, List, Any) or a ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:                             # Optional[X]
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is tuple and len(args) == 2 and args[1] is not Ellipsis and len(value) != len(args):
            raise ConfigError(f"{key} needs {len(args)} values, got {list(value)!r}")
        items = [_coerce(v, args[i] if origin is tuple else args[0], key) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict and isinstance(value, dict):
        return dict(value)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    want = getattr(origin or tp, "__name__", str(tp))
    raise ConfigError(f"{key} must be {want}, got {value!r} ({type(value).__name__})")


def parse_value(sec: str, key: str, text: str) -> Any:
    """A command-line value: the raw text for str fields, otherwise ``ast.literal_eval`` (or the string)."""
    tp = field_type(sec, key)
    if tp is str or (typing.get_origin(tp) is typing.Union and str in typing.get_args(tp) and text != "None"):
        return text
    if text.lower() in ("true", "false") and tp is bool:
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_overrides(argv: Sequence[str]) -> List[Tuple[str, str, Any]]:
    """``["--train.max_steps", "10", "--optim.lr=1e-3"]`` -> ``[("train", "max_steps", 10), ...]``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"expected --section.key value, got {arg!r}; sections: {', '.join(_SECTIONS)}")
        name, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            i, text = i + 1, argv[i + 1]
        sec, _, key = name.partition(".")
        out.append((sec, key.replace("-", "_"), parse_value(sec, key.replace("-", "_"), text)))
        i += 1
    return out


def _merge(base: Dict[str, Any], update: Dict[str, Any]) -> None:
    """Recursive dict merge in place (the model's overrides merge key by key)."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k != "budget":
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


def _set_steps_exclusive(raw: Dict[str, Any], layer: Dict[str, Any]) -> None:
    """max_steps and token_budget are alternatives: a layer that sets one of them clears the other."""
    train = layer.get("train", {})
    for key, other in (("max_steps", "token_budget"), ("token_budget", "max_steps")):
        if key in train and other not in train:
            raw.setdefault("train", {})[other] = None


def _yaml_loader(yaml):
    """SafeLoader that also reads ``2e-3`` as a float (YAML 1.1 wants ``2.0e-3``; PyYAML gives a string)."""
    class Loader(yaml.SafeLoader):
        pass
    number = re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
                        r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", number, list("-+0123456789."))
    return Loader


def _read_file(path: str) -> Dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use a .json file") from None
        try:
            data = yaml.load(text, Loader=_yaml_loader(yaml)) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"--config {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _normalise(layer: Dict[str, Any]) -> Dict[str, Any]:
    """Fold flat model keys into ``model.overrides`` so that layers merge key by key."""
    layer = copy.deepcopy(layer)
    model = layer.get("model")
    if isinstance(model, dict):
        overrides = model.pop("overrides", None) or {}
        flat = {k: model.pop(k) for k in list(model) if k != "preset"}
        model["overrides"] = {**overrides, **flat}
    return layer


def resolve_config(preset_name: Optional[str] = None, config_file: Optional[str] = None,
                   overrides: Sequence[Tuple[str, str, Any]] = (), base: Optional[Dict[str, Any]] = None) -> RunConfig:
    """The run configuration: ``base`` (a saved config.json) or the run preset, then the file, then overrides.

    ``preset_name`` defaults to the file's top-level ``preset`` key, else ``tiny-cpu``.
    """
    layer = _read_file(config_file) if config_file else {}
    name = preset_name or layer.pop("preset", None) or (base or {}).get("name") or "tiny-cpu"
    layer.pop("preset", None)
    if base is not None and preset_name is None:
        raw = _normalise(base)
    elif name in RUN_PRESETS:
        raw = _normalise(RUN_PRESETS[name])
    else:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(sorted(RUN_PRESETS))}")
    raw["name"] = name
    for layer in (_normalise(layer), _normalise(_nest(overrides))):
        _set_steps_exclusive(raw, layer)
        _merge(raw, layer)
    return RunConfig.from_dict(raw)


def _nest(overrides: Sequence[Tuple[str, str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for sec, key, value in overrides:
        field_type(sec, key)
        out.setdefault(sec, {})[key] = value
    return out


def _paper_recipe(model_preset: str) -> Dict[str, Any]:
    """The authors' recipe (reference 8.2-8.4): 524,288 tokens per step, warm-up 200, linear decay, AdamC."""
    big = model_preset.endswith("350m")
    steps, lr, wd = (15000, 1.26491e-3, 0.126491) if big else (6000, 2e-3, 0.2)
    # the authors turned on activation checkpointing for the 350M sqrt / saturating-hybrid / OVQ runs
    grad_cp = model_preset in ("kvm-sqrt-350m", "kvm-swa-350m", "ovq-swa-350m")
    return {"model": {"preset": model_preset},
            "data": {"path": "", "seq_len": 8192, "batch_size": 64},
            "optim": {"lr": lr, "weight_decay": wd, "adamc": True, "warmup_steps": 200, "mup_base_dim": 768},
            "train": {"max_steps": steps, "val_every": 500, "val_steps": 20, "ckpt_every": 1000,
                      "out": f"runs/{model_preset}", "grad_checkpointing": grad_cp}}


RUN_PRESETS: Dict[str, Dict[str, Any]] = {
    # CPU demo on the bundled text: about 200 steps of a 4-layer, 128-wide model in a few minutes
    "tiny-cpu": {"model": {"preset": "tiny-cpu"},
                 "data": {"path": "builtin", "seq_len": 256, "batch_size": 8},
                 "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 20, "mup_base_dim": 128},
                 "train": {"max_steps": 200, "val_every": 50, "val_steps": 4, "ckpt_every": 100,
                           "out": "runs/tiny-cpu"}},
    **{name: _paper_recipe(name) for name in MODEL_PRESETS if name != "tiny-cpu"},
}
