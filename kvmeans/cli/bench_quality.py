"""``kvmeans bench quality``: converted-model quality on models and texts not tuned on (see
:mod:`kvmeans.pretrained.quality` and docs/quality.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from kvmeans.pretrained.quality import format_tables, merge_kvpress, run_protocol, write_outputs
from kvmeans.utils.args import UsageError, check_out_dir, parse_kvm_arg

DEFAULT_KVM = "chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans bench quality", description="Perplexity of full attention, "
                                "StreamingLLM, training-free KVM, a distilled KVM and kvpress' presses at equal kept "
                                "keys, on every (model, corpus, length) cell; tuning and held-out cells marked")
    p.add_argument("--models", nargs="+", metavar="DIR", help="transformers model folders (required unless "
                   "--rows-from)")
    p.add_argument("--corpora", nargs="+", default=["shakespeare", "wikipedia", "django", "sotu"],
                   help="kvmeans.eval.corpora names (default: shakespeare wikipedia django sotu)")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--windows", nargs="+", type=int, default=[4, 2], help="windows per length (one number, or one "
                   "per --lengths; default 4 2)")
    p.add_argument("--keep", type=float, default=0.125, help="kept keys as a fraction of the length (default 0.125)")
    p.add_argument("--kvm", default=DEFAULT_KVM, metavar="SPEC", help="training-free KVM settings (budget and window "
                   f"set from the kept keys; default {DEFAULT_KVM}); 'none': no KVM arm")
    p.add_argument("--auto", action="store_true", help="add the kvm-auto arm: the split convert_hf(model) calibrates "
                   "per model on built-in text, at each cell's kept keys")
    p.add_argument("--distilled", nargs="+", default=[], metavar="NAME=DIR", help="a distilled folder per model "
                   "(NAME: the model folder's name)")
    p.add_argument("--kvpress-results", nargs="+", default=[], metavar="FILE",
                   help="kvpress.json of benchmarks/kvpress/run_kvpress.py --windows OUT/windows.jsonl, merged")
    p.add_argument("--rows-from", metavar="QUALITY_JSON", help="merge --kvpress-results into the rows of an earlier "
                   "run's quality.json (same windows) and write them to --out; runs no model")
    p.add_argument("--tune-model", default="smollm2-135m", help="the model settings were chosen on")
    p.add_argument("--tune-corpus", default="shakespeare", help="the corpus settings were chosen on")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    return p


def _read_kvpress(paths) -> list:
    rows = []
    for path in paths:
        try:
            rows.extend(json.loads(Path(path).read_text(encoding="utf-8"))["rows"])
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"--kvpress-results {path}: cannot read its rows ({err})") from None
    return rows


def _merge_into(a) -> int:
    """``--rows-from``: an earlier run's rows (its own kvpress rows of the presses given replaced) + the new ones."""
    if not a.kvpress_results:
        raise UsageError("--rows-from merges --kvpress-results into an earlier run: give --kvpress-results too")
    try:
        before = json.loads(Path(a.rows_from).read_text(encoding="utf-8"))
        settings, rows = before["settings"], before["rows"]
    except (OSError, ValueError, KeyError) as err:
        raise UsageError(f"--rows-from {a.rows_from}: not a quality.json of kvmeans bench quality ({err})") from None
    check_out_dir("--out", a.out)
    kvpress = _read_kvpress(a.kvpress_results)
    new = {(k["cell"], f"kvpress:{k['press']}") for k in kvpress}
    rows = [r for r in rows if (r["cell"], r["arm"]) not in new]
    cells = {r["cell"] for r in rows if r["arm"] == "full"}
    missing = sorted({k["cell"] for k in kvpress} - cells)
    if missing:
        raise UsageError(f"--kvpress-results: cells {missing} are not in {a.rows_from}; run kvpress on that run's "
                         "windows.jsonl")
    merged = settings.setdefault("kvpress_merged", [])
    merged.extend(str(p) for p in a.kvpress_results)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_kvpress(rows, kvpress)
    write_outputs(out, settings, rows)
    print(format_tables(rows))
    print(f"results: {out / 'quality.json'}, quality.csv")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if a.rows_from:
        return _merge_into(a)
    if not a.models:
        raise UsageError("--models: give the transformers model folders to score (or --rows-from to merge kvpress "
                         "results into an earlier run)")
    windows = a.windows * len(a.lengths) if len(a.windows) == 1 else a.windows
    if len(windows) != len(a.lengths):
        raise UsageError(f"--windows: give one number or one per --lengths ({len(a.lengths)}), got {a.windows}")
    if min(a.lengths) < 64 or min(windows) < 1:
        raise UsageError(f"--lengths must be >= 64 and --windows >= 1, got {a.lengths} and {a.windows}")
    if not 0 < a.keep < 1:
        raise UsageError(f"--keep must lie in (0, 1), got {a.keep}")
    for m in a.models:
        if not (Path(m) / "config.json").is_file():
            raise UsageError(f"--models {m}: no config.json there; give transformers model folders")
    from kvmeans.eval.corpora import CORPORA
    for c in a.corpora:
        if c not in CORPORA:
            raise UsageError(f"--corpora {c}: unknown; choose from {', '.join(CORPORA)}")
    distilled = {}
    for item in a.distilled:
        name, eq, folder = item.partition("=")
        if not eq or not (Path(folder) / "config.json").is_file():
            raise UsageError(f"--distilled {item}: give NAME=DIR with DIR a saved distilled folder")
        distilled[name] = folder
    kvm = None if a.kvm == "none" else parse_kvm_arg(a.kvm, budget_later=True)
    check_out_dir("--out", a.out)
    kvpress = _read_kvpress(a.kvpress_results)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    from kvmeans.bench.report import env_info
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**{k: v for k, v in vars(a).items() if k != "kvpress_results"}, "windows": windows,
                "kvm_settings": kvm, "env": env_info("cpu")}
    rows = run_protocol(a.models, a.corpora, a.lengths, windows, a.keep, kvm, distilled, a.tune_model,
                        a.tune_corpus, out, a.seed, log=lambda m: print(m, file=sys.stderr, flush=True),
                        settings=settings, auto=a.auto)
    rows = merge_kvpress(rows, kvpress)
    write_outputs(out, settings, rows)
    print(format_tables(rows))
    print(f"results: {out / 'quality.json'}, quality.csv; windows for kvpress: {out / 'windows.jsonl'}")
    return 0
