"""Data-dependent growth on the demo task: the trained KVM models evaluated with novelty budgets (no retraining).

Trains the demo's ``kvm-fixed`` (16 rows) and ``kvm-sqrt`` (2*sqrt(N) rows, at least 16) models exactly as
``kvmeans demo`` does (:func:`kvmeans.demo.train_model`; the weights are kept in ``--out`` and reused by a later
run with the same demo settings), then evaluates each with its own schedule and with
``StateBudget.novelty(threshold, cap)`` at every threshold (:func:`kvmeans.models.config.with_budget`, what
``--budget novelty:T:CAP`` applies): recall at
1x-8x the training length and the state rows per (sequence, kv head) after prefilling the evaluation samples
(mean, min-max over samples, layers and heads). Prints one table and writes ``growth_ablation.json``::

    python benchmarks/demo_growth_ablation.py [--seeds 0] [--thresholds 0.1 0.2 0.35 0.5] [--cap 64] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

import torch

from kvmeans.demo import LABELS, demo_settings, make_batch, measure, train_model, worker_env
from kvmeans.models import KVMLanguageModel, KVMModelConfig
from kvmeans.models.config import with_budget
from kvmeans.ops.budget import StateBudget
from kvmeans.utils.io import atomic_write, atomic_write_text

MODELS = ("kvm-fixed", "kvm-sqrt")
ROW_SAMPLES = 16        # evaluation samples whose state rows are counted


@torch.no_grad()
def state_rows(model: KVMLanguageModel, length: int, s: Dict[str, Any], seed: int) -> Dict[str, float]:
    """Rows in use per (sample, layer, kv head) after prefilling ``ROW_SAMPLES`` evaluation samples."""
    x, _ = make_batch(s, ROW_SAMPLES, length, seed)
    _, cache = model.eval()(x)
    counts = [(st.row_count if st.row_count is not None else torch.full(st.keys.shape[:2], st.num_rows)).flatten()
              for st, m in zip(cache.layers, cache.mixers) if m == "kvm"]
    c = torch.cat(counts).double()
    return dict(mean=float(c.mean()), min=int(c.min()), max=int(c.max()))


def run(kind: str, seed: int, s: Dict[str, Any], budgets: Dict[str, Any], out: str) -> List[Dict[str, Any]]:
    """Train (or reload) ``kind`` with ``seed``; recall and state rows per length under every budget."""
    torch.set_num_threads(1)
    saved = Path(out) / f"{kind}-seed{seed}.pt"
    trained_with = {k: list(v) if isinstance(v, tuple) else v for k, v in s.items() if k != "seeds"}
    meta = json.loads(saved.with_suffix(".json").read_text()) if saved.exists() else {}
    if meta.get("settings") == trained_with:      # weights trained with these very settings: reused
        model = KVMLanguageModel(KVMModelConfig.from_dict(meta["config"]))
        model.load_state_dict(torch.load(saved))
    else:
        model = train_model(kind, s, seed, "cpu")["model"]
        atomic_write(saved, lambda tmp: torch.save(model.state_dict(), tmp))
        atomic_write_text(saved.with_suffix(".json"), json.dumps(dict(config=model.config.to_dict(),
                                                                      settings=trained_with)))
    rows = []
    for name, budget in {"own": None, **budgets}.items():
        evaluated = model
        if budget is not None:
            evaluated = KVMLanguageModel(with_budget(model.config, budget))
            evaluated.load_state_dict(model.state_dict())
        for j, m in enumerate(s["multiples"]):        # the demo's evaluation seeds (kvmeans.demo.run_one)
            length, eval_seed = s["train_len"] * m, 10_000 + 7 * seed + j
            e = measure(evaluated, length, s, seed=eval_seed, device="cpu")
            rows.append(dict(model=kind, seed=seed, budget=name, length=length, recall=e["recall"],
                             rows=state_rows(evaluated, length, s, eval_seed)))
    return rows


def table(rows: List[Dict[str, Any]], names: List[str], lengths: List[int]) -> str:
    head = f"{'model':<11}{'evaluated with':<22}" + "".join(f"{'recall@' + str(t):>12}" for t in lengths) + \
        "".join(f"{'rows@' + str(t):>15}" for t in lengths)
    lines = [head, "-" * len(head)]
    for seed in sorted({r["seed"] for r in rows}):
        lines.append(f"seed {seed}")
        for kind in MODELS:
            for name in names:
                cells = [next(r for r in rows
                              if (r["model"], r["seed"], r["budget"], r["length"]) == (kind, seed, name, t))
                         for t in lengths]
                rec = "".join(f"{c['recall']:>12.2f}" for c in cells)
                st = "".join(f"{c['rows']['mean']:.1f} ({c['rows']['min']}-{c['rows']['max']})".rjust(15)
                             for c in cells)
                label = "own schedule" if name == "own" else name
                lines.append(f"{LABELS[kind]:<11}{label:<22}{rec}{st}")
    lines.append(f"(recall per answer digit, teacher-forced; rows in use: mean (min-max) over {ROW_SAMPLES} "
                 "samples x KVM layers x kv heads after prefilling each length)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="default: 0 (the demo runs 0 1 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's 800)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.35, 0.5])
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="processes of one torch thread each")
    p.add_argument("--out", default="growth-ablation", help="folder for growth_ablation.json and the trained weights")
    a = p.parse_args()
    s = demo_settings()
    s["seeds"] = tuple(a.seeds)
    if a.steps is not None:
        s["steps"] = a.steps
    budgets = {f"novelty({t:g}, cap {a.cap})": StateBudget.novelty(t, a.cap) for t in a.thresholds}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(kind, seed) for kind in MODELS for seed in s["seeds"]]
    ctx = multiprocessing.get_context("spawn")
    with worker_env(), ProcessPoolExecutor(a.workers, mp_context=ctx) as pool:      # the demo's kernels
        parts = pool.map(run, *zip(*jobs), *([x] * len(jobs) for x in (s, budgets, a.out)))
        rows = [r for part in parts for r in part]
    text = table(rows, ["own", *budgets], [s["train_len"] * m for m in s["multiples"]])
    print(text)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}
    path = Path(a.out) / "growth_ablation.json"
    atomic_write_text(path, json.dumps(dict(settings=settings, budgets={k: repr(v) for k, v in budgets.items()},
                                            rows=rows, table=text), indent=1))
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
