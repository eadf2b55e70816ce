"""``kvmeans eval ruler``: RULER's synthetic tasks on a saved model (see :mod:`kvmeans.eval.ruler_suite`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

from kvmeans.cli.eval_niah import (
    add_output_arguments,
    add_run_arguments,
    check_run_arguments,
    load_run_model,
    run_out_dir,
)
from kvmeans.eval import ruler_tasks as rt
from kvmeans.eval.niah import haystack_for
from kvmeans.eval.ruler_suite import _check_args, format_table, run_ruler, write_results
from kvmeans.eval.ruler_tasks.qa import load_qa_data
from kvmeans.models.load import load_model_tokenizer
from kvmeans.utils.args import parse_budget_arg, parse_kvm_arg


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans eval ruler", description="RULER's synthetic tasks (8 NIAH, vt, cwe, "
                                "fwe), data generated offline with the model's tokenizer; greedy; RULER's metrics "
                                "x100 and their average per length")
    p.add_argument("--model", required=True,
                   help="model directory (ours, the authors' layout or transformers) with its tokenizer")
    p.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                   help=f"default: the {len(rt.SYNTHETIC_TASKS)} synthetic tasks ({' '.join(rt.SYNTHETIC_TASKS)}) "
                        "plus qa_1 / qa_2 when --qa-data gives their data")
    p.add_argument("--qa-data", nargs="+", default=[], metavar="PATH",
                   help="your copies of RULER's QA data (not shipped): SQuAD 2.0 dev-v2.0.json (qa_1) and/or "
                        "HotpotQA hotpot_dev_distractor_v1.json (qa_2), told apart by their contents")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096],
                   help="total lengths in tokens: prompt + the task's generated tokens (default: 4096)")
    add_run_arguments(p)
    p.add_argument("--haystack-file", default=None,
                   help="essay haystack for the essay NIAH tasks: RULER's PaulGrahamEssays.json or a .txt; "
                        "default: the built-in Shakespeare distractor corpus (not comparable with the paper)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: each task's RULER budget; fewer only for smoke tests)")
    p.add_argument("--out", default=None, help="folder for ruler.json and ruler.csv "
                                               "(default: results/ruler/<model>-<timestamp>)")
    add_output_arguments(p)
    a = p.parse_args(argv)
    prog = "kvmeans eval ruler"
    kvm = parse_kvm_arg(a.kvm)
    budget = parse_budget_arg(a.budget)
    try:
        qa_data = {d.task: d for d in map(load_qa_data, a.qa_data)}
        if a.tasks is None:
            a.tasks = list(rt.SYNTHETIC_TASKS) + [t for t in rt.QA_TASKS if t in qa_data]
        _check_args(a.tasks, a.lengths, a.samples, a.batch_size, a.max_new_tokens, qa_data)
    except ValueError as err:
        p.error(str(err))
    if not check_run_arguments(a, "eval ruler"):
        return 2
    try:
        tok = load_model_tokenizer(a.model)
        hay = haystack_for(a.tasks, a.haystack_file)
        for task in dict.fromkeys(a.tasks):   # fail fast (before loading the model) on lengths too small
            rt.generate_samples(task, min(a.lengths), 1, tok, seed=a.seed, haystack=hay, qa_data=qa_data)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    model, run_config = load_run_model(a, kvm, budget)
    results = run_ruler(model, tok, a.tasks, a.lengths, a.samples, a.batch_size, a.seed, a.haystack_file,
                        a.max_new_tokens, qa_data, progress=not a.no_progress)
    results["config"].update(run_config)
    out = run_out_dir(a, "ruler")
    write_results(results, out)
    print(format_table(results))
    print(f"results: {out}{os.sep}ruler.json, ruler.csv" if a.out else f"results (default folder): {out}")
    return 0
