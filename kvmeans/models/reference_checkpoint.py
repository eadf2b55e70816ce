"""Read the authors' checkpoints (HF ``model_type: "rwkv7backbone"``) and convert them to ours.

Their directory (docs/reference-conventions.md §5.1-5.4): ``config.json`` with every field of their flat config
dataclass (~120 keys, most dead), bf16 ``model.safetensors`` (or shards, or ``pytorch_model.bin``),
GPT-2 tokenizer files. Parameter names are the ones our model uses, so conversion is: map the config
(:func:`reference_config_to_ours`, refusing every flag we cannot reproduce), check every tensor name
and shape against the layout that config implies (:func:`reference_parameter_shapes`), drop the one
unused quirk tensor, write ``config.json`` + ``model.safetensors`` in our format.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from kvmeans.models.config import KVMModelConfig
from kvmeans.models.reference_layout import (
    KVM_CLASS_PATHS,
    MIXER_NAMES,
    MODE_PREFIX,
    REFERENCE_DEFAULTS,
    REFERENCE_MODEL_TYPE,
    dropped_names,
    reference_parameter_shapes,
)
from kvmeans.ops.kvm import NUMERICS
from kvmeans.utils.io import atomic_write
from kvmeans.utils.weights import named_weight_errors

__all__ = ["reference_config_to_ours", "is_reference_checkpoint", "load_reference_state_dict",
           "reference_parameter_shapes", "kvmeans_parameter_shapes", "map_reference_state_dict",
           "convert_reference_checkpoint", "read_converted_checkpoint", "build_tiny_reference_checkpoint",
           "with_numerics",
           "FORMAT_VERSION", "TOKENIZER_FILES", "NATIVE_MODEL_TYPES"]

PathLike = Union[str, os.PathLike]
FORMAT_VERSION = 1
OUR_MODEL_TYPE = "kvmeans"
NATIVE_MODEL_TYPES = (OUR_MODEL_TYPE, REFERENCE_MODEL_TYPE)    # a native KVM folder's config.json: ours, the authors'
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json")
# Required even though their dataclass has defaults: the defaults are not what the paper models use
# (token_mixer "rwkv7", token shift off) or changed between versions (gating of appends).
_REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "token_mixer", "use_tokenshift_att", "use_tokenshift_ffn")
_REQUIRED_KVM = ("kvm_apply_merge_gate_to_appends", "state_budget_mode", "chunk_len")


def _refuse(key: str, value: Any, supported: str):
    raise ValueError(f"reference config {key}={value!r} is not supported: {supported}")


def reference_config_to_ours(cfg: Dict[str, Any]) -> KVMModelConfig:
    """Map an authors' ``config.json`` dict to :class:`KVMModelConfig`.

    Absent optional keys take the reference defaults (their dataclass at HEAD); keys in ``_REQUIRED``
    must be present. Unknown/dead keys (lact_*, kda_*, gated_deltanet_*, param_dtype, use_l2wrap,
    mup_base_dim, ovq_window_size, kvm_aotriton_*, use_state_*, ...) are ignored, and so are the keys of
    mixers the model does not build (``alt_*`` without alternate layers, ``kvm_*`` / ``state_*`` without
    KVM layers, ``ovq_*``, ``swa_window_size``, ``rope_*`` of OVQ streams, ...): those fields keep
    :class:`KVMModelConfig`'s defaults whatever they hold. Every used flag we cannot reproduce raises
    ``ValueError`` naming the key, its value and what is supported.

    Notes: ``kvm_use_vlens=0`` maps to ``value_radius=False``, which in kvmeans is the *intended*
    ablation (each state row reads its running mean ``V_sum / count``); the reference's own ablation
    is buggy (a global divisor, crashes on growing states; reference 1.9), so that variant's outputs are
    not reproduced. cos/sin of RoPE are rounded to bf16 like the authors' code (``rope_reference_bf16``)
    and KVM layers use the authors' eager rounding points (``kvm_numerics="reference"``; replace it with
    ``dataclasses.replace(config, kvm_numerics="exact")`` for kvmeans' default numerics).
    """
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"reference config.json lacks required key(s) {missing}; is this an authors' "
                         f"(model_type {REFERENCE_MODEL_TYPE!r}) config?")
    if cfg["model_type"] != REFERENCE_MODEL_TYPE:
        _refuse("model_type", cfg["model_type"], f"only {REFERENCE_MODEL_TYPE!r} (the authors' backbone)")

    def get(key):
        return cfg[key] if key in cfg else REFERENCE_DEFAULTS[key]

    def flag(key) -> bool:
        return bool(int(get(key) or 0))

    for key in ("use_block_lambdas", "use_skip_connections"):
        if flag(key):
            _refuse(key, get(key), "0 only (block lambdas / U-Net skips are unused by the paper models)")

    L, d, H = int(get("num_hidden_layers")), int(get("hidden_size")), int(get("num_attention_heads"))
    every = int(get("alt_layer_every"))
    hybrid = every > 1     # every == 1 is equivalent to no hybrid in the reference (alt rotary unused)
    main = _mixer(get("token_mixer"), get("token_mixer_class_path"), "token_mixer")
    alt = _mixer(get("alt_token_mixer"), get("alt_token_mixer_class_path"), "alt_token_mixer") if hybrid else None
    used = {main} | ({alt} if hybrid else set())

    d_qk = get("d_qk_head") or get("d_head") or d // H
    d_v = get("d_v_head") or get("d_head") or d // H
    if d_qk != d_v:
        _refuse("d_v_head", d_v, f"value head dim equal to the query/key head dim ({d_qk}); "
                                 "KVMModelConfig has a single head_dim")

    token_shift = flag("use_tokenshift_att")
    if token_shift:
        modes = {f"{MODE_PREFIX[m]}_token_shift_mode": get(f"{MODE_PREFIX[m]}_token_shift_mode") for m in used}
        for key, mode in sorted(modes.items()):
            if mode not in ("rwkv", "none"):
                _refuse(key, mode, "'rwkv' (per-channel shift of the projected q, k, v) or 'none'")
        if len(set(modes.values())) > 1:
            _refuse(", ".join(sorted(modes)), tuple(modes[k] for k in sorted(modes)),
                    "the same token-shift mode for every mixer used by the model")
        token_shift = next(iter(modes.values())) == "rwkv"
    value_residual = flag("use_value_residual")
    if value_residual:
        for key in sorted({f"{MODE_PREFIX[m]}_value_residual_mode" for m in used}):
            if get(key) != "rwkv":
                _refuse(key, get(key), "'rwkv' only (the data-dependent sigmoid gate before token shift)")
        if hybrid and flag("alt_share_v0"):
            _refuse("alt_share_v0", get("alt_share_v0"), "0 only (each layer stream keeps its own v_first)")

    out: Dict[str, Any] = dict(
        vocab_size=int(get("vocab_size")), hidden_size=d, num_layers=L, num_heads=H,
        num_kv_heads=get("num_key_value_heads"), head_dim=int(d_qk), ffn_mult=float(get("ffn_expansion")),
        residual_scale=float(get("residual_scale") or 1.0), mixer=main, rope_reference_bf16=True,
        kvm_numerics="reference", token_shift=token_shift, mlp_token_shift=flag("use_tokenshift_ffn"),
        value_residual=value_residual, qk_norm=True, tie_embeddings=False,
        logit_softcap=abs(float(get("logit_softcap"))) if get("logit_softcap") else None)
    # the fields of mixers the model does not build keep our defaults: their values there may be
    # anything the reference accepts (e.g. alt_rope_partial_dim > head_dim without alternate layers)
    if main != "ovq":                    # OVQ has no RoPE
        out.update(rope_dim=int(get("rope_partial_dim")), rope_theta=float(get("rope_theta")))
    if hybrid:
        out.update(alt_mixer=alt, alt_every=every)
        if alt != "ovq":
            out.update(alt_rope_dim=int(get("alt_rope_partial_dim")), alt_rope_theta=float(get("alt_rope_theta")))
    if "swa" in used:                    # swa_window_size <= 0 falls back to chunk_len (reference 4.9)
        window = int(get("swa_window_size"))
        out["swa_window"] = window if window > 0 else int(get("chunk_len"))
    if "bswa" in used:
        out.update(chunk_len=int(get("chunk_len")), bswa_chunks=int(get("n_bswa_chunks")),
                   bswa_sink_len=int(get("sink_len")))
    if "ovq" in used:
        for key in ("ovq_normalize_centroids", "ovq_use_min_state_size", "ovq_use_counts_for_lr_only",
                    "ovq_use_delta_rule"):
            if flag(key):
                _refuse(key, get(key), "0 only (the paper's OVQ baseline)")
        out.update(ovq_chunk_len=int(get("ovq_chunk_size")), ovq_max_centroids=int(get("ovq_max_centroids")))
    if "kvm" in used:
        out.update(_kvm_fields(cfg, get, flag, alt == "kvm"))
    return KVMModelConfig(**out)


def _mixer(name: Any, class_path: Any, key: str) -> str:
    if class_path:
        if class_path in KVM_CLASS_PATHS:
            return "kvm"
        head, tail = "model.", "_mixer.SequenceMixer"
        if not (isinstance(class_path, str) and class_path.startswith(head) and class_path.endswith(tail)):
            _refuse(f"{key}_class_path", class_path, f"null, one of {sorted(KVM_CLASS_PATHS)} or "
                                                      f"model.<name>_mixer.SequenceMixer")
        if class_path[len(head):-len(tail)] not in MIXER_NAMES:
            _refuse(f"{key}_class_path", class_path, f"a mixer module named after one of {sorted(MIXER_NAMES)}")
        return MIXER_NAMES[class_path[len(head):-len(tail)]]
    if name not in MIXER_NAMES:
        _refuse(key, name, f"one of {sorted(MIXER_NAMES)} (rwkv7, lact, kda, gated_deltanet are not "
                           "implemented in kvmeans)")
    return MIXER_NAMES[name]


def _kvm_fields(cfg, get, flag, alt_is_kvm: bool) -> Dict[str, Any]:
    """The KVM fields of :class:`KVMModelConfig` (geometry, budget, gates); the budget keys a mode does not
    read, and the gate-placement flags without a merge gate (the gate is then 1), may hold anything."""
    missing = [k for k in _REQUIRED_KVM if k not in cfg]
    if missing:
        raise ValueError(f"reference config.json lacks required KVM key(s) {missing} (their defaults changed "
                         "between versions of the reference code)")
    rope = int(get("rope_partial_dim"))     # the state's zeroed width in main and alternate KVM layers alike
    if rope <= 0:
        _refuse("rope_partial_dim", rope, "> 0 for KVM layers (the reference zeroes all D channels of state "
                                          "keys when it is 0, a known bug we do not reproduce)")
    if alt_is_kvm and int(get("alt_rope_partial_dim")) != rope:
        _refuse("alt_rope_partial_dim", get("alt_rope_partial_dim"),
                f"equal to rope_partial_dim={rope} when KVM is the alternate mixer (the reference zeroes the main "
                "width there)")
    gk, gv = flag("kvm_use_merge_gate_keys"), flag("kvm_use_merge_gate_values")
    if gk != gv:
        _refuse("kvm_use_merge_gate_keys/kvm_use_merge_gate_values", (int(gk), int(gv)),
                "both 1 (merge gate) or both 0 (no merge gate); gating only keys or only values is not "
                "representable in KVMModelConfig")
    if gk and flag("kvm_apply_merge_gate_to_initial_state"):
        _refuse("kvm_apply_merge_gate_to_initial_state", get("kvm_apply_merge_gate_to_initial_state"),
                "0 only with a merge gate (the reference applies it inconsistently between prefill and decode)")
    C = int(get("chunk_len"))
    n_max = int(get("n_max_d_chunks"))
    if n_max < 1:
        _refuse("n_max_d_chunks", n_max, ">= 1 (the state cap is chunk_len * n_max_d_chunks rows)")
    cap, mode, min_len = C * n_max, get("state_budget_mode"), int(get("state_min_len"))
    if mode == "fixed":     # the initial state is one chunk and never shrinks: targets below C never bite
        budget = {"kind": "fixed", "n": min(max(min_len, C), cap)}
    elif mode in ("power_law", "kvm_saturation"):
        if mode == "power_law":
            budget = {"kind": "power_law", "factor": float(get("state_growth_factor")),
                      "exponent": float(get("state_growth_exponent"))}
        else:
            n_sat = get("state_saturation_n")
            if n_sat is None or int(n_sat) < 1:
                _refuse("state_saturation_n", n_sat, "an integer >= 1 with state_budget_mode='kvm_saturation'")
            budget = {"kind": "saturating", "n": int(n_sat)}
        budget.update(min_len=min(max(min_len, 0), cap), round_down=max(int(get("state_round_down")), 1),
                      max_len=cap)
    else:
        _refuse("state_budget_mode", mode, "'fixed', 'power_law' or 'kvm_saturation'")
    return dict(chunk_len=C, n_bswa_chunks=int(get("n_bswa_chunks")), sink_len=int(get("sink_len")),
                budget=budget, merge_gate=gk, gate_appends=gk and flag("kvm_apply_merge_gate_to_appends"),
                head_temps=flag("kvm_use_head_temps"), value_radius=flag("kvm_use_vlens"))


# ---- state dicts ------------------------------------------------------------------------------
def kvmeans_parameter_shapes(config: KVMModelConfig) -> Dict[str, Tuple[int, ...]]:
    """The converted layout: :func:`reference_parameter_shapes` minus :func:`dropped_names`."""
    shapes = reference_parameter_shapes(config)
    for name in dropped_names(config):
        shapes.pop(name)
    return shapes


def _check_layout(sd: Dict[str, Tensor], expected: Dict[str, Tuple[int, ...]], what: str):
    problems = [f"missing {k} {list(s)}" for k, s in expected.items() if k not in sd]
    problems += [f"unexpected {k} {list(sd[k].shape)}" for k in sd if k not in expected]
    problems += [f"shape of {k}: expected {list(s)}, got {list(sd[k].shape)}"
                 for k, s in expected.items() if k in sd and tuple(sd[k].shape) != s]
    if problems:
        raise ValueError(f"{what}: this checkpoint layout is not supported ({len(problems)} problem(s); "
                         f"first {min(5, len(problems))}: " + "; ".join(problems[:5]) + ")")


def map_reference_state_dict(sd: Dict[str, Tensor], config: KVMModelConfig) -> Dict[str, Tensor]:
    """Check ``sd`` against :func:`reference_parameter_shapes` and return our state dict.

    Names are identical except the dropped quirk tensors; dtypes are kept as stored (bf16 for the
    released models; the caller casts). Raises ``ValueError`` on any missing, unexpected or
    wrong-shaped tensor.
    """
    _check_layout(sd, reference_parameter_shapes(config), "reference state dict")
    dropped = set(dropped_names(config))
    return {k: v for k, v in sd.items() if k not in dropped}


# ---- files ----------------------------------------------------------------------------------
def _read_json(path: Path) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_reference_checkpoint(path: PathLike) -> bool:
    """True if ``path`` is a directory whose ``config.json`` has ``model_type: "rwkv7backbone"``."""
    try:
        return _read_json(Path(path) / "config.json").get("model_type") == REFERENCE_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def load_reference_state_dict(path: PathLike) -> Dict[str, Tensor]:
    """Tensors of a checkpoint directory, as stored: ``model.safetensors``, sharded
    ``model.safetensors.index.json``, else ``pytorch_model.bin`` (``torch.load(weights_only=True)``)."""
    from safetensors.torch import load_file
    root = Path(path)
    if (root / "model.safetensors").is_file():
        return load_file(root / "model.safetensors")
    for index, loader in (("model.safetensors.index.json", load_file),
                          ("pytorch_model.bin.index.json", _load_bin)):
        if (root / index).is_file():
            shards = sorted(set(_read_json(root / index)["weight_map"].values()))
            sd: Dict[str, Tensor] = {}
            for shard in shards:
                if Path(shard).name != shard:
                    raise ValueError(f"{root / index}: shard name {shard!r} must be a file in the same directory")
                part = loader(root / shard)
                clash = sorted(set(part) & set(sd))
                if clash:
                    raise ValueError(f"{root / index}: tensor(s) {clash[:3]} appear in more than one shard")
                sd.update(part)
            return sd
    if (root / "pytorch_model.bin").is_file():
        return _load_bin(root / "pytorch_model.bin")
    raise FileNotFoundError(f"{root}: no model.safetensors, model.safetensors.index.json, "
                            "pytorch_model.bin.index.json or pytorch_model.bin")


def _load_bin(path: Path) -> Dict[str, Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def convert_reference_checkpoint(src_dir: PathLike, dst_dir: PathLike,
                                 numerics: Optional[str] = None) -> KVMModelConfig:
    """Convert an authors' checkpoint directory into ours; returns the mapped config.

    ``numerics``: the ``kvm_numerics`` recorded in the new ``config.json``; None keeps the mapping's
    ``"reference"`` (the authors' eager rounding points), ``"exact"`` selects kvmeans' default numerics.

    Writes ``dst_dir/config.json`` (``KVMModelConfig.to_dict()`` + ``model_type: "kvmeans"``,
    ``format_version``), ``dst_dir/model.safetensors`` (tensors as stored), each atomically, and copies
    the tokenizer files present in ``src_dir``.
    """
    from safetensors.torch import save_file
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.exists() and src.resolve() == dst.resolve():
        raise ValueError(f"convert_reference_checkpoint: dst_dir must differ from src_dir ({src})")
    config = reference_config_to_ours(_read_json(src / "config.json"))
    if numerics is not None:
        config = with_numerics(config, numerics, "numerics")
    with named_weight_errors(src):
        sd = map_reference_state_dict(load_reference_state_dict(src), config)
    dst.mkdir(parents=True, exist_ok=True)
    # safetensors refuses views and shared storage: give each tensor its own compact buffer
    sd = {k: v.detach().contiguous().clone() for k, v in sd.items()}
    meta = {"format": "pt", "kvmeans_format_version": str(FORMAT_VERSION), "converted_from": REFERENCE_MODEL_TYPE}
    atomic_write(dst / "model.safetensors", lambda tmp: save_file(sd, tmp, metadata=meta))
    ours = {**config.to_dict(), "model_type": OUR_MODEL_TYPE, "format_version": FORMAT_VERSION}
    atomic_write(dst / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(ours, indent=2) + "\n"))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            atomic_write(dst / name, lambda tmp, n=name: shutil.copyfile(src / n, tmp))
    return config


def with_numerics(config: KVMModelConfig, numerics: str, argument: str = "kvm_numerics") -> KVMModelConfig:
    """``config`` with ``kvm_numerics=numerics``; a bad value raises ``ValueError`` naming ``argument``."""
    if numerics not in NUMERICS:
        raise ValueError(f"{argument} must be 'exact' (kvmeans' default numerics), 'mixed' (exact with half-precision "
                         f"attention dots) or 'reference' (the authors' eager rounding points), got {numerics!r}")
    return dataclasses.replace(config, kvm_numerics=numerics)


def read_converted_checkpoint(path: PathLike) -> Tuple[KVMModelConfig, Dict[str, Tensor]]:
    """Load a directory written by :func:`convert_reference_checkpoint`: ``(config, state_dict)``,
    the state dict checked against :func:`kvmeans_parameter_shapes`."""
    from safetensors.torch import load_file
    root = Path(path)
    raw = _read_json(root / "config.json")
    if raw.get("model_type") != OUR_MODEL_TYPE or raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{root}: not a kvmeans checkpoint (model_type={raw.get('model_type')!r}, "
                         f"format_version={raw.get('format_version')!r}; expected {OUR_MODEL_TYPE!r}, "
                         f"{FORMAT_VERSION}); convert an authors' checkpoint with convert_reference_checkpoint")
    config = KVMModelConfig.from_dict({k: v for k, v in raw.items() if k not in ("model_type", "format_version")})
    with named_weight_errors(root):
        sd = load_file(root / "model.safetensors")
    _check_layout(sd, kvmeans_parameter_shapes(config), f"{root}/model.safetensors")
    return config, sd


# fields transformers' save_pretrained adds (reference 5.2), including their misspelled key
_HF_FIELDS: Dict[str, Any] = {
    "model_type": REFERENCE_MODEL_TYPE, "architectures": ["RWKV7BackboneForCausalLM"],
    "auto_map": {"AutoConfig": "rwkv7_backbone.MixerConfig",
                 "AutoModelForCausalLM": "rwkv7_backbone.RWKV7BackboneForCausalLM"},
    "dtype": "bfloat16", "transformers_version": "5.3.0", "max_position_embeddings": 2 ** 30,
    "tie_worhidden_sizedings": False, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}


# a tiny KVM model configured like the paper ones (token shift, value residual, gates, temps)
_TINY: Dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "rope_partial_dim": 16, "alt_rope_partial_dim": 32, "token_mixer": "kvm", "use_tokenshift_att": 1,
    "use_tokenshift_ffn": 1, "residual_scale": 1.0, "chunk_len": 8, "n_bswa_chunks": 2,
    "state_min_len": 16, "n_max_d_chunks": 2, "swa_window_size": 16, "ovq_chunk_size": 8,
    "ovq_max_centroids": 32, "kvm_apply_merge_gate_to_appends": 0,
}


def _random_tensor(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Plausible random values by parameter kind, all non-trivial (no zero-initialised projections)."""
    module, leaf = (name.rsplit(".", 2)[-2:] if name.count(".") else ("", name))
    randn = torch.randn(shape, generator=gen)
    if module.startswith("ln_"):                                   # LayerNorm weight / bias
        return 1.0 + 0.1 * randn if leaf == "weight" else 0.1 * randn
    if leaf in ("x_q", "x_k", "x_v"):                              # token-shift mixes in [0, 1]
        return torch.rand(shape, generator=gen)
    if leaf in ("front_head_temp", "state_head_temp", "beta"):
        return 1.0 + 0.1 * randn
    if leaf == "v_gate0":
        return 0.5 * randn
    if name == "transformer.wte.weight":
        return randn
    return randn / shape[-1] ** 0.5                                # Linear [out, in]


def build_tiny_reference_checkpoint(dst_dir, seed: int = 0, **flag_overrides) -> Dict[str, Any]:
    """Write a tiny random checkpoint in exactly the authors' layout; return its ``config.json`` dict.

    Defaults: KVM, hidden 64, 2 layers, 2 heads of dim 32, vocab 128, chunk_len 8, rope_partial_dim 16,
    fixed 16-row state. ``flag_overrides`` are reference keys (e.g. ``kvm_use_merge_gate_keys=0``,
    ``alt_layer_every=2``, ``token_mixer="ovq"``); the tensors present follow those flags exactly as the
    reference creates them (:func:`reference_parameter_shapes`). Files:
    ``config.json``, bf16 ``model.safetensors``, ``generation_config.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json`` (the last two small stand-ins for the GPT-2 tokenizer files).
    """
    from safetensors.torch import save_file

    cfg = {**REFERENCE_DEFAULTS, **_HF_FIELDS, **_TINY, **flag_overrides}
    shapes = reference_parameter_shapes(reference_config_to_ours(cfg))
    gen = torch.Generator().manual_seed(seed)
    sd = {name: _random_tensor(name, shape, gen).to(torch.bfloat16) for name, shape in shapes.items()}
    root = Path(dst_dir)
    root.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (root / "generation_config.json").write_text(json.dumps({"_from_model_config": True,
                                                             "transformers_version": "5.3.0"}, indent=2))
    eos = "<|endoftext|>"
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 0, "eos_token": eos, "pad_token": eos,
         "bos_token": eos, "unk_token": eos, "add_prefix_space": False}, indent=2))
    (root / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": eos, "eos_token": eos, "pad_token": eos, "unk_token": eos}, indent=2))
    return cfg
