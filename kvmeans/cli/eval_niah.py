"""``kvmeans eval niah``: RULER's single-needle NIAH tasks on a saved model (see :mod:`kvmeans.eval.niah`)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List

from kvmeans.cli._common import add_budget_argument, add_kvm_argument, need_hf
from kvmeans.eval import ruler
from kvmeans.eval.niah import _check_args, format_table, haystack_for, run_niah, write_results
from kvmeans.models.load import conversion_settings, load_model, load_model_tokenizer
from kvmeans.utils.args import check_device, check_model_dir, check_out_dir, parse_budget_arg, parse_kvm_arg


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every RULER-style eval command shares (samples, batching, seed, device, dtype)."""
    p.add_argument("--samples", type=int, default=500, help="samples per (task, length) (RULER: 500)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together (left-padded)")
    p.add_argument("--seed", type=int, default=ruler.DEFAULT_SEED, help="RULER's random seed (default 42)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto (default): bfloat16 on cuda, float32 on cpu")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_kvm_argument(p)
    add_budget_argument(p)


def check_run_arguments(a: argparse.Namespace, command: str) -> bool:
    """Model folder, device and --out checked before anything heavy; False when transformers is missing."""
    check_model_dir(a.model)
    if a.device is not None:
        check_device("--device", a.device)
    if a.out is not None:
        check_out_dir("--out", a.out)
    return need_hf(command, extra="eval")


def load_run_model(a: argparse.Namespace, kvm, budget):
    """``(model, config entries for the results)`` on ``a.device`` (default cuda if available) in ``a.dtype``."""
    import torch
    from transformers.utils import logging as hf_logging
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if str(device).startswith("cuda") else "float32")
    hf_logging.disable_progress_bar()
    model = load_model(a.model, getattr(torch, dtype), device, kvm, budget)
    return model, {"model": os.path.abspath(a.model), "device": str(device), "dtype": dtype, "kvm": a.kvm,
                   "kvm_conversion": conversion_settings(model), "budget": a.budget}


def run_out_dir(a: argparse.Namespace, kind: str) -> Path:
    """``--out``, or ``results/<kind>/<model>-<timestamp>``."""
    name = Path(os.path.abspath(a.model)).name or "model"
    return Path(a.out) if a.out else Path("results") / kind / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans eval niah", description="RULER needle-in-a-haystack (niah_single_1/2/3), "
                                "data generated offline with the model's tokenizer; greedy; string_match_all x100")
    p.add_argument("--model", required=True,
                   help="model directory (ours, the authors' layout or transformers) with its tokenizer")
    p.add_argument("--tasks", nargs="+", default=list(ruler.TASKS), choices=list(ruler.TASKS),
                   help="default: all three")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768],
                   help="total lengths in tokens: prompt + 128 generated (default: 4096 8192 16384 32768)")
    add_run_arguments(p)
    p.add_argument("--haystack-file", default=None,
                   help="essay haystack for S2/S3: RULER's PaulGrahamEssays.json ({\"text\": ...}) or a .txt; "
                        "default: the built-in Shakespeare distractor corpus (not comparable with the paper)")
    p.add_argument("--max-new-tokens", type=int, default=ruler.TOKENS_TO_GENERATE,
                   help="generated tokens (default and RULER: 128; fewer only for smoke tests, the budget stays 128)")
    p.add_argument("--out", default=None, help="folder for niah.json and niah.csv "
                                               "(default: results/niah/<model>-<timestamp>)")
    add_output_arguments(p)
    a = p.parse_args(argv)
    prog = "kvmeans eval niah"
    kvm = parse_kvm_arg(a.kvm)
    budget = parse_budget_arg(a.budget)
    try:
        _check_args(a.tasks, a.lengths, a.samples, a.batch_size, a.max_new_tokens)
    except ValueError as err:
        p.error(str(err))
    if not check_run_arguments(a, "eval niah"):
        return 2
    try:
        tok = load_model_tokenizer(a.model)
        hay = haystack_for(a.tasks, a.haystack_file)
        for task in a.tasks:   # fail fast (before loading the model) on lengths that cannot hold the template
            ruler.generate_samples(task, min(a.lengths), 1, tok, seed=a.seed, haystack=hay)
    except (ValueError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    model, run_config = load_run_model(a, kvm, budget)
    results = run_niah(model, tok, a.tasks, a.lengths, a.samples, a.batch_size, a.seed, a.haystack_file,
                       a.max_new_tokens, progress=not a.no_progress)
    results["config"].update(run_config)
    out = run_out_dir(a, "niah")
    write_results(results, out)
    print(format_table(results))
    print(f"results: {out}{os.sep}niah.json, niah.csv" if a.out else f"results (default folder): {out}")
    return 0
