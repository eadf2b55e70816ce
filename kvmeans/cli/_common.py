"""Arguments and checks shared by several commands."""
from __future__ import annotations

import argparse
import sys


def need_hf(cmd: str, extra: str = "hf") -> bool:
    """True when transformers and safetensors import; else say which extra installs them."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"kvmeans {cmd}: needs transformers and safetensors: pip install 'kvmeans[{extra}]'", file=sys.stderr)
        return False
    return True


def add_kvm_argument(parser: argparse.ArgumentParser) -> None:
    """``--kvm SPEC``: convert a plain transformers model on the fly (:func:`kvmeans.convert_hf`)."""
    parser.add_argument("--kvm", default=None, metavar="SPEC",
                        help="convert a plain transformers model to KVM attention after loading, e.g. "
                             "budget=fixed:128,chunk_len=32,n_bswa_chunks=4,sink_len=4; 'auto' calibrates (minutes), "
                             "'auto:NAME[,keys=N]' takes a calibration split without calibrating (docs/pretrained.md)")


def add_budget_argument(parser: argparse.ArgumentParser) -> None:
    """``--budget SPEC``: evaluate a KVM model with another state schedule than it was trained with."""
    parser.add_argument("--budget", default=None, metavar="SPEC",
                        help="KVM models: replace every KVM layer's state budget on load (no retraining): N, "
                             "fixed:N, saturating:N[:MIN_LEN] or power_law:FACTOR[:EXPONENT[:MIN_LEN]] "
                             "(16*sqrt(N): power_law:16:0.5:256)")
