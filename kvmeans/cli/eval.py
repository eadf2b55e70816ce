"""``kvmeans eval <task>``: one evaluation per module, imported only when asked for."""
from __future__ import annotations

from typing import Dict, List, Tuple

from kvmeans.cli._dispatch import run_subcommand

# task -> (module with a ``main(argv) -> int``, one-line help)
TASKS: Dict[str, Tuple[str, str]] = {
    "niah": ("kvmeans.cli.eval_niah", "RULER needle-in-a-haystack (niah_single_1/2/3), generated offline: "
             "`kvmeans eval niah --model DIR --lengths 4096 8192`"),
    "ruler": ("kvmeans.cli.eval_ruler", "RULER's synthetic tasks (8 NIAH, vt, cwe, fwe), generated offline, and their "
              "average per length: `kvmeans eval ruler --model DIR --lengths 4096`"),
    "position-loss": ("kvmeans.cli.eval_position_loss", "mean loss per position block over long documents, several "
                      "models in one plot: `kvmeans eval position-loss --model DIR --data TOKENS`"),
    "lm-eval": ("kvmeans.cli.eval_lm_eval", "run lm-evaluation-harness tasks with the registered `kvm` model: "
                "`kvmeans eval lm-eval --model DIR --tasks ...`"),
    "memory": ("kvmeans.cli.eval_memory", "state rows, cache bytes, prefill time and decode speed vs length: "
               "`kvmeans eval memory --model DIR --lengths ...`"),
    "ppl": ("kvmeans.cli.eval_ppl", "perplexity of an HF causal LM over long-text windows, full attention vs "
            "StreamingLLM: `kvmeans eval ppl --model DIR --length 2048 --arms full,streaming:4+256`"),
}


def main(argv: List[str]) -> int:
    return run_subcommand("kvmeans eval", "task", TASKS, argv)
