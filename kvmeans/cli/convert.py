"""``kvmeans convert SRC DST``: an authors' checkpoint folder into the kvmeans layout."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

from kvmeans.cli._common import need_hf
from kvmeans.utils.args import UsageError, check_out_dir


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans convert", description="Convert an authors' checkpoint directory "
                                "(model_type rwkv7backbone) into the kvmeans layout")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--no-check", action="store_true", help="skip loading the result with KVMForCausalLM")
    p.add_argument("--numerics", choices=("reference", "exact", "mixed"), default="reference",
                   help="KVM rounding recorded in config.json: 'reference' (default: the authors' eager code's "
                        "bf16 rounding points), 'exact' (kvmeans' default numerics) or 'mixed' (exact with "
                        "half-precision attention dots)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.src):
        raise UsageError(f"SRC {a.src}: not a directory; give the authors' checkpoint folder")
    if not os.path.isfile(os.path.join(a.src, "config.json")):
        raise UsageError(f"SRC {a.src}: no config.json in it; give the authors' checkpoint folder "
                         "(config.json and model.safetensors)")
    check_out_dir("DST", a.dst)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        print("kvmeans convert: needs safetensors: pip install 'kvmeans[hf]'", file=sys.stderr)
        return 2
    from kvmeans.models.reference_checkpoint import convert_reference_checkpoint
    try:
        config = convert_reference_checkpoint(a.src, a.dst, numerics=a.numerics)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(f"converted {a.src} -> {a.dst}: {config.num_layers} layers {config.mixer_per_layer()}, "
          f"d={config.hidden_size}, vocab={config.vocab_size}, kvm_numerics={config.kvm_numerics!r}")
    if not a.no_check and need_hf("convert"):
        from kvmeans.models.hf import KVMForCausalLM
        model = KVMForCausalLM.from_pretrained(a.dst)
        print(f"loads with KVMForCausalLM.from_pretrained: {model.num_parameters():,} parameters, {model.dtype}")
    return 0
