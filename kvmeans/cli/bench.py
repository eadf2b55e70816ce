"""``kvmeans bench <benchmark>``: one module per benchmark, imported only when asked for."""
from __future__ import annotations

from typing import Dict, List, Tuple

from kvmeans.cli._dispatch import run_subcommand

BENCHMARKS: Dict[str, Tuple[str, str]] = {
    "ops": ("kvmeans.cli.bench_ops", "KVM vs SDPA: prefill, backward, decode, memory (`kvmeans bench ops --help`)"),
    "ragged": ("kvmeans.cli.bench_ragged", "generate on prompts of distinct lengths vs equal lengths: time ratio and "
               "calls per token (`kvmeans bench ragged --help`)"),
    "quality": ("kvmeans.cli.bench_quality", "converted-model perplexity on models x corpora x lengths, tuning and "
                "held-out cells marked (`kvmeans bench quality --models DIR... --out DIR`)"),
    "pretrained": ("kvmeans.cli.bench_pretrained", "a transformers model: full, StreamingLLM, KVM, kvpress on the "
                   "same samples (`kvmeans bench pretrained --model DIR --out DIR`)"),
    "longctx": ("kvmeans.cli.bench_longctx", "long context in bounded memory: peak RSS, time to first token, "
                "decode ms/token, cache bytes vs length for full, StreamingLLM and KVM, each run in its own process "
                "(`kvmeans bench longctx --model DIR --out DIR`)"),
}


def main(argv: List[str]) -> int:
    return run_subcommand("kvmeans bench", "benchmark", BENCHMARKS, argv)
