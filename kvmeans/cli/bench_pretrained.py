"""``kvmeans bench pretrained``: full attention, StreamingLLM, KVM and kvpress on the same samples (see
:mod:`kvmeans.pretrained.bench`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from kvmeans.eval import ruler_tasks
from kvmeans.pretrained.arms import (
    SPLIT_SIZES,
    Arm,
    distilled_arm,
    effective_record,
    kvm_arm,
    kvm_settings,
    shrink_note,
    streaming_arm,
)
from kvmeans.pretrained.bench import (
    ARMS,
    DEFAULT_KVM,
    _recall_setting,
    _settings,
    _write,
    all_samples,
    kept_keys,
    merge_kvpress,
    ppl_row,
    tables,
    write_samples,
)
from kvmeans.utils.args import UsageError, check_out_dir
from kvmeans.utils.progress import progress_bar


# ---- command line ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans bench pretrained", description="A pretrained transformers causal LM "
                                "with full attention, StreamingLLM, training-free KVM, a distilled KVM and kvpress "
                                "presses on the same samples at equal kept keys: NIAH / RULER recall, perplexity by "
                                "position, cache bytes, tokens/s")
    p.add_argument("--model", required=True,
                   help="transformers model folder (e.g. `kvmeans models fetch smollm2-135m`)")
    p.add_argument("--out", required=True, help="folder for samples.jsonl, bench.csv, bench.json")
    p.add_argument("--kvm", default=DEFAULT_KVM, metavar="SPEC", help="training-free KVM settings for "
                   f"kvmeans.convert_hf (its budget is set to match the kept keys, its window to at most half of "
                   f"them; default {DEFAULT_KVM}); 'auto': the split convert_hf(model) calibrates (minutes), spent "
                   "at each setting's kept keys; 'auto:NAME': that calibration split (e.g. auto:C16-w0.75-e0.75, "
                   "a calibration record's 'chosen') without calibrating; either followed by other settings than the "
                   "sizes, e.g. auto:C16-w0.75-e0.75,exact_scope=first,exact_join=1; 'none': no KVM arm")
    p.add_argument("--distilled", metavar="DIR",
                   help="a distilled (saved converted) KVM folder, run at its own settings")
    p.add_argument("--kvpress-results", nargs="+", metavar="FILE", help="kvpress.json files of "
                   "benchmarks/kvpress/run_kvpress.py on this run's samples.jsonl, merged into the table")
    p.add_argument("--samples-only", action="store_true", help="write OUT/samples.jsonl and stop")
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS, help="our arms to run (default all; none: "
                   "only merge --kvpress-results); the distilled arm runs whenever --distilled is given")
    p.add_argument("--benches", nargs="+", default=["niah", "ruler", "ppl"], choices=["niah", "ruler", "ppl"])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75], help="compression ratios for recall "
                   "(kept keys = (1 - r) x the context; default 0.5 0.75)")
    p.add_argument("--niah-samples", type=int, default=20)
    p.add_argument("--niah-length", type=int, default=1024, help="context tokens of the prose NIAH (default 1024)")
    p.add_argument("--ruler-tasks", nargs="+", default=["niah_single_1", "niah_single_2"],
                   choices=list(ruler_tasks.SYNTHETIC_TASKS) + ["all"], help="RULER's synthetic tasks (all: the 11 "
                   "of kvpress' RULER protocol); default niah_single_1 niah_single_2")
    p.add_argument("--ruler-lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--ruler-samples", type=int, default=4)
    p.add_argument("--ppl-lengths", nargs="+", type=int, default=[2048, 4096, 8192])
    p.add_argument("--ppl-windows", type=int, default=1, help="Shakespeare windows per length")
    p.add_argument("--ppl-keys", type=int, default=260, help="kept keys of compressed arms in ppl (default 260)")
    p.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="most tokens an answer may have, for samples "
                   "without a budget of their own (RULER's tasks have theirs); default 24")
    p.add_argument("--seed", type=int, default=0,
                   help="draws the NIAH samples, RULER's samples (RULER's seed 42 + this) and the perplexity windows; "
                        "another seed gives another sample set, e.g. a tuning split beside the default one")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def _check(p, a) -> None:
    if not all(0 < r < 1 for r in a.ratios):
        p.error(f"--ratios must lie in (0, 1), got {a.ratios}")
    if min(a.niah_samples, a.ruler_samples, a.ppl_windows, a.max_new_tokens) < 1:
        p.error("--niah-samples, --ruler-samples, --ppl-windows and --max-new-tokens must be >= 1")
    if a.sinks < 0 or a.ppl_keys <= a.sinks:
        p.error(f"need 0 <= --sinks < --ppl-keys, got {a.sinks} and {a.ppl_keys}")
    if not (Path(a.model) / "config.json").is_file():
        raise UsageError(f"--model {a.model}: no config.json there; give a transformers model folder")
    check_out_dir("--out", a.out)
    for path in a.kvpress_results or []:
        if not Path(path).is_file():
            p.error(f"--kvpress-results {path}: no such file; run benchmarks/kvpress/run_kvpress.py first")


def _named_split(text: str):
    """``--kvm auto[,KEY=VALUE...]`` -> ``{"calibrate": True, **settings}`` (calibrated once the model is loaded);
    ``--kvm auto:NAME[,KEY=VALUE...]`` -> ``{"split": that calibration Split, **settings}``. The extra settings are
    any ``convert_hf`` settings but the sizes the split sets (:data:`SPLIT_SIZES`), e.g. ``exact_scope=first``."""
    from kvmeans.pretrained.calibrate import CANDIDATES, split_named
    from kvmeans.pretrained.convert import parse_kvm_spec
    from kvmeans.pretrained.heads import AUTOMATIC
    head, _, rest = text.partition(",")
    if any(item.strip().startswith("keys=") for item in rest.split(",")):
        raise UsageError(f"--kvm {text}: keys=N does not apply to a benchmark, which spends the split at each "
                         "setting's kept keys; drop keys=N (give auto or auto:NAME)")
    try:
        extra = parse_kvm_spec(rest) if rest else {}
    except ValueError as err:
        raise UsageError(f"--kvm {text}: {err}") from None
    extra.setdefault("exact_heads", AUTOMATIC)     # the automatic setting's per-head budgets (docs/pretrained.md)
    sized = [k for k in SPLIT_SIZES if k in extra]
    if sized or extra.get("calibrate"):
        raise UsageError(f"--kvm {text}: 'auto' sets {', '.join(SPLIT_SIZES)} itself; give auto or auto:NAME "
                         "followed only by other settings (e.g. auto,exact_scope=first)")
    if head == "auto":
        return {"calibrate": True, **extra}
    auto, _, name = head.partition(":")
    names = ", ".join(c.name for c in CANDIDATES)
    if auto != "auto" or not name:
        raise UsageError(f"--kvm {text}: give auto, or auto:NAME with NAME one of {names}")
    try:
        return {"split": split_named(name), **extra}
    except ValueError as err:
        raise UsageError(f"--kvm {text}: {err}") from None


def _calibrated_split(model, tok, base: dict):
    """``(Split, calibration record)`` that ``convert_hf(model, **base)`` picks on its built-in text, once for the
    run."""
    from kvmeans.pretrained.calibrate import BUILT_IN, calibrate, calibration_windows, split_named
    from kvmeans.pretrained.convert import convert_hf
    chosen = calibrate(model, convert=convert_hf, windows=calibration_windows(tok), text=BUILT_IN,
                       base={**base, "exact_heads": "uniform"})      # the split is chosen with equal budgets
    record = chosen["calibration"]
    print(f"--kvm auto: calibrated split {record['chosen']} ({record['seconds']} s)", flush=True)
    return split_named(record["chosen"]), record


def _effective(kvm, samples, a) -> Dict[str, Dict[str, int]]:
    """Per kept keys of the run, what the KVM arm will run (:func:`kvm_settings`): every cell's geometry before the
    run, not an hour into it; a line on stderr where ``--kvm``'s window is shrunk."""
    keys = {kept_keys(smp, r) for smp in samples for r in a.ratios}
    keys |= {a.ppl_keys} if "ppl" in a.benches else set()
    effective = {}
    for k in sorted(keys):
        got = kvm_settings(k, kvm)
        effective[str(k)] = effective_record(got)
        note = shrink_note(k, kvm, got)
        if note:
            print(note, file=sys.stderr, flush=True)
    return effective


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if "all" in a.ruler_tasks:
        a.ruler_tasks = list(ruler_tasks.SYNTHETIC_TASKS)
    _check(p, a)
    from kvmeans.models.load import load_hf_tokenizer, load_model
    from kvmeans.utils.args import parse_kvm_arg
    kvm = None if a.kvm == "none" else _named_split(a.kvm) if a.kvm.startswith("auto") else \
        parse_kvm_arg(a.kvm, budget_later=True)         # the budget is set per kept keys (kvm_settings)
    if a.threads is not None:
        torch.set_num_threads(max(1, a.threads))
    from transformers.utils import logging as hf_logging

    from kvmeans.bench.report import env_info, format_env
    from kvmeans.pretrained.ppl import text_windows
    hf_logging.disable_progress_bar()
    out = Path(a.out)
    tok = load_hf_tokenizer(a.model)
    try:
        samples = all_samples(tok, a)
    except ValueError as err:
        raise UsageError(str(err)) from None
    write_samples(out / "samples.jsonl", samples)
    print(f"wrote {len(samples)} samples to {out / 'samples.jsonl'}", flush=True)
    if a.samples_only:
        return 0
    rows: List[Dict[str, Any]] = []
    answers: List[Dict[str, Any]] = []
    for path in a.kvpress_results or []:
        got = merge_kvpress(json.loads(Path(path).read_text()), samples, tok)
        rows += got[0]
        answers += got[1]
    model = load_model(a.model, torch.float32, "cpu") if a.arms else None
    calibration = None
    if kvm is not None and kvm.get("calibrate"):
        extra = {k: v for k, v in kvm.items() if k != "calibrate"}
        split, calibration = _calibrated_split(model, tok, extra) if "kvm" in a.arms else (None, None)
        kvm = {"split": split, **extra} if split is not None else None
    effective = _effective(kvm, samples, a) if kvm is not None and "kvm" in a.arms else {}
    distilled = load_model(a.distilled, torch.float32, "cpu") if a.distilled else None
    if distilled is not None and not getattr(distilled.config, "kvm_conversion", None):
        raise UsageError(f"--distilled {a.distilled}: not a converted KVM folder (no kvm_conversion in its "
                         "config.json); give the output folder of kvmeans distill")
    windows = {n: text_windows(tok, "shakespeare", a.ppl_windows, n, a.seed) for n in a.ppl_lengths} \
        if "ppl" in a.benches and (a.arms or distilled is not None) else {}
    groups = _settings(samples)
    n_comp = ("streaming" in a.arms) + (kvm is not None and "kvm" in a.arms)
    n_one = ("full" in a.arms) + (distilled is not None)
    total = sum(len(g) * (n_one + n_comp * len(a.ratios)) for g in groups) + \
        len(windows) * a.ppl_windows * (n_one + n_comp)
    info = env_info()
    settings = {k: v for k, v in vars(a).items()}
    settings["kvm_settings"] = {"auto": kvm["split"].name, **{k: v for k, v in kvm.items() if k != "split"}} \
        if kvm is not None and "split" in kvm else kvm
    if calibration is not None:
        settings["calibration"] = calibration
    settings["kvm_effective"] = effective       # per kept keys: what the KVM arm ran (kvm_settings)
    print(format_env(info), flush=True)
    bar = progress_bar(total, not a.no_progress, unit="run")
    tick = bar.update if bar is not None else None

    def record(row, ans=()):
        rows.append(row)
        answers.extend(ans)
        _write(out, settings, info, rows, answers)
    try:
        full = Arm("full", model)
        niah = [g for g in groups if g[0]["bench"] == "niah"]
        for group in niah:
            _recall_setting(group, full, kvm, distilled, a, tok, record, bar)
        for length, w in windows.items():
            arms = [full] if "full" in a.arms else []
            arms += [streaming_arm(model, a.ppl_keys, a.sinks)] if "streaming" in a.arms else []
            arms += [kvm_arm(model, a.ppl_keys, kvm)] if kvm is not None and "kvm" in a.arms else []
            arms += [distilled_arm(distilled, length)] if distilled is not None else []
            for arm in arms:
                if bar is not None:
                    bar.set_description(f"ppl {length} {arm.name}")
                record(ppl_row(arm, w, tick))
        for group in groups[len(niah):]:
            _recall_setting(group, full, kvm, distilled, a, tok, record, bar)
    finally:
        if bar is not None:
            bar.close()
    _write(out, settings, info, rows, answers)
    print(tables(rows))
    print(f"wrote {out / 'bench.csv'} and bench.json")
    return 0
