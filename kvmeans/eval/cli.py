"""``kvmeans eval <task>``: one evaluation per module, imported only when asked for."""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Tuple

# task -> (module under kvmeans.eval with a ``main(argv) -> int``, one-line help)
TASKS: Dict[str, Tuple[str, str]] = {
    "niah": ("niah", "RULER needle-in-a-haystack (niah_single_1/2/3), generated offline: "
                     "`kvmeans eval niah --model DIR --lengths 4096 8192`"),
    "position-loss": ("position_loss", "mean loss per position block over long documents, several models "
                                       "in one plot: `kvmeans eval position-loss --model DIR --data TOKENS`"),
    "lm-eval": ("harness", "run lm-evaluation-harness tasks with the registered `kvm` model: "
                           "`kvmeans eval lm-eval --model DIR --tasks ...`"),
    "memory": ("memory", "state rows, cache bytes, prefill time and decode speed vs length: "
                         "`kvmeans eval memory --model DIR --lengths ...`"),
}


def main(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans eval <task> [options]   (kvmeans eval <task> --help)\n\ntasks:")
        for name, (_, help_) in TASKS.items():
            print(f"  {name:<14} {help_}")
        return 0
    if argv[0] not in TASKS:
        print(f"kvmeans eval: unknown task {argv[0]!r}; available: {', '.join(TASKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvmeans.eval.{TASKS[argv[0]][0]}")
    return module.main(argv[1:])
