"""The demo's KVM models evaluated with another state schedule than they were trained with (no retraining).

Trains the demo's ``kvm-fixed`` (16 rows) and ``kvm-sqrt`` (2*sqrt(N) rows, at least 16) models exactly as
``kvmeans demo`` does (same settings, seeds and evaluation samples), then evaluates each one with every
schedule below, the weights unchanged (:func:`kvmeans.models.config.with_budget`, what
``from_pretrained(dir, budget=...)`` and ``--budget`` apply): recall and KVM state rows at 1x-8x the training
length. Prints one table and writes ``schedule_swap.json``::

    python benchmarks/demo_schedule_swap.py [--seeds 0] [--steps 800] [--workers 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

import torch

from kvmeans.demo import LABELS, demo_settings, measure, train_model, worker_env
from kvmeans.models import KVMLanguageModel
from kvmeans.models.config import with_budget
from kvmeans.ops.budget import StateBudget
from kvmeans.utils.io import atomic_write_text

SCHEDULES = {"fixed-16": StateBudget.fixed(16), "2*sqrt(N)": StateBudget.power_law(2.0, 0.5, min_len=16),
             "saturating-64": StateBudget.saturating(64, min_len=16)}
TRAINED_WITH = {"kvm-fixed": "fixed-16", "kvm-sqrt": "2*sqrt(N)"}


def run(kind: str, seed: int, s: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Train ``kind`` with ``seed``; recall and state rows per length under every schedule."""
    torch.set_num_threads(1)
    model = train_model(kind, s, seed, "cpu")["model"]
    out = []
    for name, budget in SCHEDULES.items():
        swapped = KVMLanguageModel(with_budget(model.config, budget))
        swapped.load_state_dict(model.state_dict())
        for j, m in enumerate(s["multiples"]):        # the demo's evaluation seeds (kvmeans.demo.run_one)
            e = measure(swapped, s["train_len"] * m, s, seed=10_000 + 7 * seed + j, device="cpu")
            out.append(dict(model=kind, seed=seed, schedule=name, length=e["length"], recall=e["recall"],
                            state_rows=e["state_rows"]))
    return out


def table(rows: List[Dict[str, Any]], lengths: List[int]) -> str:
    head = f"{'trained':<11}{'evaluated with':<16}" + "".join(f"{'recall@' + str(t):>12}" for t in lengths) + \
        "".join(f"{'rows@' + str(t):>10}" for t in lengths)
    lines = [head, "-" * len(head)]
    for kind, own in TRAINED_WITH.items():
        for name in SCHEDULES:
            cells = [[r for r in rows if (r["model"], r["schedule"], r["length"]) == (kind, name, t)] for t in lengths]
            rec = "".join(f"{statistics.fmean(r['recall'] for r in c):>12.2f}" for c in cells)
            st = "".join(f"{c[0]['state_rows'][0]:>10}" for c in cells)
            lines.append(f"{LABELS[kind]:<11}{name + (' *' if name == own else ''):<16}{rec}{st}")
    lines.append("(* = the training schedule; recall: mean over seeds, per answer digit, teacher-forced; rows per "
                 "KVM layer after prefilling each length)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the demo's (0 1 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's 800)")
    p.add_argument("--workers", type=int, default=2, help="processes of one torch thread each")
    p.add_argument("--out", default="schedule-swap", help="folder for schedule_swap.json")
    a = p.parse_args()
    s = demo_settings()
    if a.seeds is not None:
        s["seeds"] = tuple(a.seeds)
    if a.steps is not None:
        s["steps"] = a.steps
    t0 = time.perf_counter()
    jobs = [(kind, seed) for kind in TRAINED_WITH for seed in s["seeds"]]
    ctx = multiprocessing.get_context("spawn")
    with worker_env(), ProcessPoolExecutor(a.workers, mp_context=ctx) as pool:      # the demo's kernels
        rows = [r for part in pool.map(run, *zip(*jobs), [s] * len(jobs)) for r in part]
    lengths = [s["train_len"] * m for m in s["multiples"]]
    text = table(rows, lengths)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}
    atomic_write_text(out / "schedule_swap.json", json.dumps(dict(settings=settings, schedules={
        k: repr(v) for k, v in SCHEDULES.items()}, rows=rows, table=text), indent=1))
    print(f"wrote {out / 'schedule_swap.json'} ({time.perf_counter() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
