"""The paper's Table 1 trade-off on a real pretrained model: full attention, KVM with a fixed state and KVM with a
state growing like sqrt(N), one set of weights converted training-free (``kvmeans.convert_hf``).

Every arm loads the same transformers model; the KVM arms differ only in their state budget: ``fixed:F`` rows
against ``power_law:A:0.5`` (``A * sqrt(N)`` rows after ``N`` tokens; the default ``A = F / 32`` gives the
two states the same rows at 1024 tokens, so the sqrt state has 2x the fixed rows at 4096 and 2.8x at 8192).
For each arm: RULER recall (``kvmeans.eval.ruler_suite.run_ruler``: RULER's data generated offline with the
model's tokenizer, greedy, string_match_all x100) per task and length, their mean per length, and the cache
bytes after prefilling one prompt of each length (full attention: its KV cache; KVM: the states, windows and
sinks). Prints one table and writes ``schedules.json``, ``schedules.csv`` and, with matplotlib, ``schedules.png``::

    python benchmarks/pretrained_schedules.py --model ~/.cache/kvmeans/models/smollm2-135m \\
        [--tasks niah_single_2 niah_multikey_1] [--lengths 1024 2048 4096 8192] [--samples 8] \\
        [--fixed 128] [--sqrt-factor 4] [--kvm exact_rows=32] [--arms full fixed sqrt] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from kvmeans.eval import ruler_tasks as rt
from kvmeans.eval.ruler_suite import run_ruler
from kvmeans.models.load import load_model, load_model_tokenizer
from kvmeans.utils.args import UsageError, parse_kvm_arg
from kvmeans.utils.io import atomic_write, atomic_write_text

ARMS = ("full", "fixed", "sqrt")
DEFAULT_TASKS = ("niah_single_2", "niah_multikey_1")


def arm_specs(arms: Sequence[str], kvm: str, fixed: int, sqrt_factor: float) -> Dict[str, Optional[str]]:
    """``label -> --kvm spec`` (None: full attention, unconverted) of each arm, ``kvm``'s settings plus its budget."""
    base = f"{kvm}," if kvm else ""
    specs = {"full": ("full attention", None),
             "fixed": (f"KVM fixed:{fixed}", f"{base}budget=fixed:{fixed}"),
             "sqrt": (f"KVM {sqrt_factor:g}*sqrt(N)", f"{base}budget=power_law:{sqrt_factor:g}:0.5")}
    return dict(specs[a] for a in arms)


@torch.no_grad()
def cache_bytes(model, length: int, vocab_size: int, seed: int = 0) -> int:
    """Bytes the model's cache holds after prefilling ``length`` tokens (random ids: the budgets here depend on
    the length alone)."""
    from transformers import DynamicCache

    from kvmeans.models.hf_compat import cache_kwargs
    from kvmeans.pretrained.cache import cache_nbytes
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, length), generator=g).to(next(model.parameters()).device)
    cache = DynamicCache()
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
    return int(cache_nbytes(cache))


def run(model_dir: str, specs: Dict[str, Optional[str]], tasks: Sequence[str], lengths: Sequence[int],
        samples: int, batch_size: int = 8, seed: int = 42, device: str = "cpu", max_new_tokens: Optional[int] = None,
        progress: bool = True) -> Dict[str, Any]:
    """Every arm on the same RULER samples; ``{"config", "arms": {label: {"spec", "scores", "cache_bytes",
    "averages", "samples", "elapsed_s"}}}``; a :class:`UsageError` for a spec that cannot apply, before any arm
    runs."""
    kvm = {label: parse_kvm_arg(spec) for label, spec in specs.items()}    # every spec checked before any arm runs
    tok = load_model_tokenizer(model_dir)
    out: Dict[str, Any] = {"config": dict(model=str(Path(model_dir).resolve()), tasks=list(tasks),
                                          lengths=[int(n) for n in lengths], samples=samples, seed=seed,
                                          device=device, dtype="float32", max_new_tokens=max_new_tokens,
                                          torch=torch.__version__, threads=torch.get_num_threads()),
                           "arms": {}}
    for label, spec in specs.items():
        t0 = time.perf_counter()
        model = load_model(model_dir, torch.float32, device, kvm[label])
        res = run_ruler(model, tok, tasks, lengths, samples, batch_size, seed, max_new_tokens=max_new_tokens,
                        progress=progress)
        vocab = model.config.vocab_size
        nbytes = {int(n): cache_bytes(model, int(n), vocab) for n in lengths}
        out["arms"][label] = dict(spec=spec, kvm_conversion=getattr(model.config, "kvm_conversion", None),
                                  scores=res["scores"], averages=res["averages"], cache_bytes=nbytes,
                                  samples=res["samples"],
                                  haystack=res["haystack"], elapsed_s=round(time.perf_counter() - t0, 1))
        del model
    return out


def mean_score(arm: Dict[str, Any], length: int) -> float:
    """The arm's mean over the tasks at ``length`` (``run_ruler``'s RULER average)."""
    return next(a["score"] for a in arm["averages"] if a["length"] == length)


def format_table(results: Dict[str, Any]) -> str:
    lengths, tasks = results["config"]["lengths"], results["config"]["tasks"]
    head = f"{'arm':<22}{'':<10}" + "".join(f"{n:>10}" for n in lengths)
    lines = [head, "-" * len(head)]
    for label, arm in results["arms"].items():
        for i, task in enumerate(tasks):
            cells = {s["length"]: s["score"] for s in arm["scores"] if s["task"] == task}
            lines.append(f"{label if i == 0 else '':<22}{rt.LABELS[task]:<10}"
                         + "".join(f"{cells[n]:>10.1f}" for n in lengths))
        lines.append(f"{'':<22}{'mean':<10}" + "".join(f"{mean_score(arm, n):>10.1f}" for n in lengths))
        lines.append(f"{'':<22}{'cache KB':<10}" + "".join(f"{arm['cache_bytes'][n] / 1024:>10,.0f}" for n in lengths))
    c = results["config"]
    lines.append(f"(RULER string_match_all x100, {c['samples']} samples per cell, greedy, the same samples for every "
                 f"arm; cache KB after prefilling each length; columns: total tokens)")
    return "\n".join(lines)


def to_csv(results: Dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arm", "spec", "task", "length", "score", "samples", "cache_bytes"])
    for label, arm in results["arms"].items():
        for s in arm["scores"]:
            w.writerow([label, arm["spec"] or "", s["task"], s["length"], s["score"], s["samples"],
                        arm["cache_bytes"][s["length"]]])
    return buf.getvalue()


def plot(results: Dict[str, Any], path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lengths = results["config"]["lengths"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, arm in results["arms"].items():
        a1.plot(lengths, [mean_score(arm, n) for n in lengths], marker="o", label=label)
        a2.plot(lengths, [arm["cache_bytes"][n] / 1024 for n in lengths], marker="o", label=label)
    for ax, title, ylabel in ((a1, "RULER recall (mean over tasks)", "score x100"),
                              (a2, "cache after the prefill", "KB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    a2.set_yscale("log")
    a1.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return str(path)


def write(results: Dict[str, Any], out: Path) -> List[str]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "schedules.json", json.dumps(results, indent=1))
    atomic_write_text(out / "schedules.csv", to_csv(results))
    png = plot(results, out / "schedules.png")
    return [str(out / "schedules.json"), str(out / "schedules.csv")] + ([png] if png else [])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers causal LM folder with its tokenizer")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=list(rt.SYNTHETIC_TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--samples", type=int, default=8, help="samples per (task, length)")
    p.add_argument("--fixed", type=int, default=128, help="rows of the fixed state (default 128)")
    p.add_argument("--sqrt-factor", type=float, default=None,
                   help="A of the A*sqrt(N) state (default FIXED / 32: the same rows as the fixed state at 1024)")
    p.add_argument("--kvm", default="exact_rows=32",
                   help="the KVM arms' other convert_hf settings (default exact_rows=32; '' for the defaults)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated tokens (smoke tests)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--out", default="pretrained-schedules", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.kvm and "budget" in parse_kvm_arg(a.kvm):
            p.error(f"--kvm {a.kvm!r}: leave the budget out; the arms set it (--fixed, --sqrt-factor)")
    except UsageError as err:
        p.error(str(err))
    if a.fixed < 1 or a.samples < 1 or (a.sqrt_factor is not None and a.sqrt_factor <= 0):
        p.error("--fixed, --samples and --sqrt-factor must be positive")
    if a.threads:
        torch.set_num_threads(a.threads)
    specs = arm_specs(a.arms, a.kvm, a.fixed, a.sqrt_factor if a.sqrt_factor is not None else a.fixed / 32)
    try:
        results = run(a.model, specs, a.tasks, a.lengths, a.samples, a.batch_size, max_new_tokens=a.max_new_tokens,
                      progress=not a.no_progress)
    except (UsageError, ValueError) as err:
        print(f"pretrained_schedules: error: {err}", file=sys.stderr)
        return 2
    text = format_table(results)
    results["table"] = text
    print(text)
    print("wrote " + ", ".join(write(results, Path(a.out))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
