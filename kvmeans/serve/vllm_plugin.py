"""The vLLM plugin (entry point ``vllm.general_plugins``: ``kvmeans = kvmeans.serve.vllm_plugin:register``).

vLLM calls :func:`register` in every process it starts. It registers the model classes of
``kvmeans.serve.vllm_model`` (imported lazily, by vLLM's registry) under ``KVMeans<Family>ForCausalLM``, their
start-up checks (:class:`KVMServeConfig`, in ``MODELS_CONFIG_MAP``), and makes vLLM pick them for a folder whose
config.json carries ``kvm_conversion`` (a ``kvmeans.convert_hf`` + ``save_pretrained`` folder): its
``architectures`` entry (``LlamaForCausalLM``, ...) is read as ``KVMeansLlamaForCausalLM``. Folders without
``kvm_conversion`` are untouched. ``hf_overrides={"architectures": ["KVMeansLlamaForCausalLM"], "kvm_conversion":
{...}}`` does the same by hand (:func:`kvm_hf_overrides` builds it for a plain folder and a spec).

Native folders (``KVMForCausalLM``: ``model_type`` kvmeans, or the authors' rwkv7backbone layout) are served by
``kvmeans.serve.vllm_native.KVMNativeForCausalLM``, registered under the architecture their config.json names.
"""
from __future__ import annotations

import functools
import logging
from typing import Tuple

from kvmeans.models.reference_checkpoint import NATIVE_MODEL_TYPES

log = logging.getLogger("kvmeans.serve")

# the family's architecture (config.json) -> ours; each is a class in kvmeans.serve.vllm_model
SERVED = {"LlamaForCausalLM": "KVMeansLlamaForCausalLM", "MistralForCausalLM": "KVMeansMistralForCausalLM",
          "Qwen2ForCausalLM": "KVMeansQwen2ForCausalLM", "Qwen3ForCausalLM": "KVMeansQwen3ForCausalLM"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def conversion_spec(hf_config) -> Tuple[list, "object"]:
    """``(layers, KVMSpec)`` of a converted model's config (``kvm_conversion``)."""
    from kvmeans.pretrained.convert import CONFIG_KEY, KVMSpec

    settings = getattr(hf_config, CONFIG_KEY, None)
    if not settings:
        raise ValueError(f"the model's config has no {CONFIG_KEY!r}: it is not a kvmeans.convert_hf folder")
    settings = dict(settings)
    layers = settings.pop("layers")
    return list(layers), KVMSpec.from_dict(settings)


def _engine_refusals(vllm_config, where: str) -> None:
    """What no KVM model can be served with yet (converted or native), refused with the reason."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    if cache_config.enable_prefix_caching:
        raise ValueError(f"{where}: prefix caching is not supported (a KVM state cannot be rebuilt from cached "
                         "blocks of another request); drop --enable-prefix-caching")
    if vllm_config.speculative_config is not None:
        raise ValueError(f"{where}: speculative decoding is not supported (rejected draft tokens would need the "
                         "state rolled back); drop the speculative config")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"{where}: tensor / pipeline parallelism is not supported (a request's KVM state is "
                         "read and merged whole, over all its kv heads, on one device); use one device")
    if getattr(model_config, "model_impl", "auto") == "transformers":
        raise ValueError(f"{where}: --model-impl transformers is not supported; use the default (vLLM's own code)")


def _refusals(vllm_config) -> None:
    """What the KVM layers of a converted folder cannot serve yet is refused here, at start-up, with the reason."""
    model_config = vllm_config.model_config
    cfg = model_config.hf_text_config
    layers, spec = conversion_spec(cfg)
    where = f"kvmeans: serving {model_config.model} with KVM layers"
    _engine_refusals(vllm_config, where)
    n_layers = cfg.num_hidden_layers
    if sorted(layers) != list(range(n_layers)):
        raise ValueError(f"{where}: kvm_conversion converts layers {layers} of {n_layers}; serving keeps no paged "
                         "KV cache beside KVM layers yet, so convert every layer (layers='all')")
    if spec.exact_rows and spec.exact_rank != "novelty":
        raise ValueError(f"{where}: exact_rank={spec.exact_rank!r} (the reserve ranks tokens by the attention they "
                         "received in the window) is not served yet (the state slots hold no per-token scores); "
                         "convert with exact_rank=novelty or exact_rows=0")
    if spec.exact_heads is not None:
        raise ValueError(f"{where}: exact_heads (per-head reserve budgets) is not served yet (the state slots hold as "
                         "many slots in every kv head); convert without exact_heads")
    if spec.rope_mode not in ("pre_rope_fixed", "post_rope", "split"):
        raise ValueError(f"{where}: rope_mode={spec.rope_mode!r} is not served (the families served rotate q/k)")


def _config_class(native: bool = False):
    from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

    class KVMServeConfig(VerifyAndUpdateConfig):
        """Start-up checks and settings of a KVM model in vLLM: refusals (prefix caching, speculative decoding,
        parallelism; for converted folders also partial conversion and what their layers do not serve), eager
        mode (the layers run Python per request), and the state slot sized for ``max_model_len``
        (``MambaModelConfig``: one state block per request)."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            model_config = vllm_config.model_config
            if native:
                _engine_refusals(vllm_config, f"kvmeans: serving the native KVM model {model_config.model}")
            else:
                _refusals(vllm_config)
            if not model_config.enforce_eager:
                log.warning("kvmeans: KVM layers run in eager mode (no torch.compile / CUDA graphs): enforce_eager "
                            "set to True")
                model_config.enforce_eager = True
            MambaModelConfig.verify_and_update_config(vllm_config)

    return KVMServeConfig


# the architecture a native folder's config.json names -> the class serving it (kvmeans.serve.vllm_native)
NATIVE = {"KVMForCausalLM": "KVMNativeForCausalLM", "RWKV7BackboneForCausalLM": "KVMNativeForCausalLM"}


def _patch_get_config() -> None:
    """Make vLLM read a converted folder's architecture as ours (once per process)."""
    import vllm.config.model as model_module

    original = model_module.get_config
    if getattr(original, "_kvmeans", False):
        return

    @functools.wraps(original)
    def get_config(*args, **kwargs):
        config = original(*args, **kwargs)
        archs = list(getattr(config, "architectures", None) or [])
        if getattr(config, "kvm_conversion", None) and archs and archs[0] in SERVED:
            config.architectures = [SERVED[archs[0]]]
        elif getattr(config, "model_type", None) in NATIVE_MODEL_TYPES:
            if not (archs and archs[0] in NATIVE):
                config.architectures = ["KVMForCausalLM"]
            if getattr(config, "num_kv_heads", 0) is None:      # "as many as query heads": vLLM wants the count
                config.num_kv_heads = config.num_heads
        return config

    get_config._kvmeans = True
    model_module.get_config = get_config


def register() -> None:
    """The plugin: register the model classes, their start-up checks, and converted-folder detection."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import kvmeans.models.hf  # noqa: F401  (registers model_type kvmeans / rwkv7backbone with AutoConfig)

    config_cls, native_cls = _config_class(), _config_class(native=True)
    for ours in SERVED.values():
        if ours not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(ours, f"kvmeans.serve.vllm_model:{ours}")
        MODELS_CONFIG_MAP[ours] = config_cls
    for arch, ours in NATIVE.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"kvmeans.serve.vllm_native:{ours}")
        MODELS_CONFIG_MAP[arch] = native_cls
    try:
        _patch_get_config()
    except (ImportError, AttributeError) as err:       # another vLLM layout: hf_overrides still works
        log.warning("kvmeans: converted folders are not detected automatically (%s); pass "
                    "hf_overrides={'architectures': ['KVMeans<Family>ForCausalLM']}", err)


def kvm_hf_overrides(model_dir, spec) -> dict:
    """``hf_overrides`` that serve a plain transformers folder converted on the fly: ``{"architectures": [ours],
    "kvm_conversion": {...}}`` with the settings ``kvmeans.convert_hf(model, **spec)`` would store (``spec``: a
    ``--kvm`` string or convert_hf's keyword arguments; ``"auto"``: calibrated on the folder's weights). The
    weights are the folder's own (training-free)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvmeans.pretrained.convert import CONFIG_KEY, calibrates, convert_hf, parse_kvm_spec

    settings = parse_kvm_spec(spec) if isinstance(spec, str) else dict(spec)
    if "exact_heads" not in (spec if isinstance(spec, str) else settings):
        settings["exact_heads"] = "uniform"     # the automatic setting's per-head budgets are not served yet
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, CONFIG_KEY, None):
        raise ValueError(f"{model_dir} is converted already (its config.json has {CONFIG_KEY!r}); serve it without "
                         "a spec")
    if config.model_type in NATIVE_MODEL_TYPES:
        raise ValueError(f"{model_dir} is a native KVM model (model_type {config.model_type!r}): it is served as it "
                         "is; drop the spec (--kvm)")
    arch = MODEL_TYPES.get(config.model_type)
    if arch is None:
        raise ValueError(f"serving KVM supports model_type in {sorted(MODEL_TYPES)}, got {config.model_type!r}")
    if calibrates(settings):
        # the automatic setting: the calibration reads the weights (minutes on CPU)
        from kvmeans.models.load import load_hf_tokenizer
        settings = {**settings, "calibrate": True}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        convert_hf(model, tokenizer=load_hf_tokenizer(str(model_dir)), **settings)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        convert_hf(model, **settings)
    return {"architectures": [SERVED[arch]], CONFIG_KEY: dict(getattr(model.config, CONFIG_KEY))}
