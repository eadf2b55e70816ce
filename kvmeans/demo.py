"""The "main job" demo: what Key-Value Means attention is for, on a CPU in minutes, nothing downloaded.

Four tiny language models of the same size are trained for the same number of steps on a synthetic
recall task (by default passkey retrieval: one needle at a random depth, queried at the end; MQAR with
``task="mqar"`` in :func:`demo_settings`) at a short training length ``T``, differing only in their
sequence mixer:

* ``kvm-fixed``: KVM with a fixed state budget (memory flat in the context length),
* ``kvm-sqrt``:  KVM with a state that grows like ``sqrt(context)``,
* ``bswa``:      block sliding-window attention (a window of a few chunks),
* ``full``:      full causal attention (a KV cache growing linearly).

Each is then evaluated at ``1x, 2x, 4x, 8x`` the training length: recall accuracy, the cache bytes
after prefilling each length (``ModelCache.nbytes``; KVM state rows too) and decode speed (ms per token
for a few tokens after the prefill). Prints one table, writes ``results.json`` and ``demo.png``
(recall vs length, cache bytes vs length).

Usage::

    python -m kvmeans.demo [--quick] [--device cpu|cuda] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .eval.synthetic import mqar_batch, passkey_batch, recall_accuracy
from .models import KVMLanguageModel, KVMModelConfig
from .utils.io import atomic_write

__all__ = ["run_demo", "main", "MODELS", "demo_settings"]

MODELS = ("kvm-fixed", "kvm-sqrt", "bswa", "full")
LABELS = {"kvm-fixed": "KVM fixed", "kvm-sqrt": "KVM sqrt", "bswa": "BSWA", "full": "full attention"}


def demo_settings(quick: bool = False) -> Dict[str, Any]:
    """Task, model and training settings (fixed; ``quick`` trains less and evaluates fewer samples)."""
    # MQAR (task="mqar") and multi-needle passkeys did not train within the step budget on a CPU, so a
    # single passkey it is. With chunks of 8 and 8 fixed rows the fixed state held the needle as well as
    # the growing one at 8x; with chunks of 4 a 16-row fixed state learns the retrieval only partly and
    # declines with length, while 2*sqrt(N) rows (23 at 128, 64 at 1024) keep recalling (README).
    s = dict(task="passkey", num_pairs=24, num_queries=8, train_len=128, multiples=(1, 2, 4, 8), vocab_size=64,
             hidden_size=64, num_layers=2, num_heads=2,
             chunk_len=4, window_chunks=2, fixed_rows=16, sqrt_factor=2.0, steps=800, batch=32, lr=3e-3,
             warmup=50, eval_samples=64, decode_tokens=8, train_seed_offset=0)
    if quick:
        s.update(steps=200, eval_samples=32, decode_tokens=4)
    return s


def make_batch(s: Dict[str, Any], batch: int, seq_len: int, seed: int):
    """``(input_ids, targets)`` of the demo's task: MQAR (pairs first, queries last) or passkey."""
    if s["task"] == "mqar":
        return mqar_batch(batch, seq_len, s["num_pairs"], s["vocab_size"], seed, num_queries=s["num_queries"])
    x, y, _ = passkey_batch(batch, seq_len, seed=seed, vocab_size=s["vocab_size"])
    return x, y


def model_config(kind: str, s: Dict[str, Any]) -> KVMModelConfig:
    common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_layers=s["num_layers"],
                  num_heads=s["num_heads"], chunk_len=s["chunk_len"], n_bswa_chunks=s["window_chunks"],
                  bswa_chunks=s["window_chunks"], sink_len=1)
    if kind == "kvm-fixed":
        return KVMModelConfig(mixer="kvm", budget={"kind": "fixed", "n": s["fixed_rows"]}, **common)
    if kind == "kvm-sqrt":
        return KVMModelConfig(mixer="kvm", budget={"kind": "power_law", "factor": s["sqrt_factor"], "exponent": 0.5,
                                                   "min_len": s["fixed_rows"]}, **common)
    if kind == "bswa":
        return KVMModelConfig(mixer="bswa", **common)
    if kind == "full":
        return KVMModelConfig(mixer="full", **common)
    raise ValueError(f"unknown demo model {kind!r}; choose from {MODELS}")


def _lr_at(step: int, s: Dict[str, Any]) -> float:
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    frac = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    return s["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(kind: str, s: Dict[str, Any], seed: int, device: str) -> Dict[str, Any]:
    torch.manual_seed(seed)
    model = KVMLanguageModel(model_config(kind, s)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.perf_counter()
    losses = []
    model.train()
    for step in range(s["steps"]):
        x, y = make_batch(s, s["batch"], s["train_len"], seed * 100_003 + step)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, s)
        loss = model.loss(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return dict(model=model, train_s=time.perf_counter() - t0, final_loss=sum(losses[-10:]) / min(10, len(losses)))


@torch.no_grad()
def measure(model: KVMLanguageModel, length: int, s: Dict[str, Any], seed: int, device: str) -> Dict[str, Any]:
    """Recall at ``length`` plus cache bytes / KVM state rows after prefilling it, and decode ms/token."""
    model.eval()
    x, y = make_batch(s, s["eval_samples"], length, seed)
    acc = recall_accuracy(model, x.to(device), y.to(device), batch_size=16)
    prompt = x[:1].to(device)
    _, cache = model(prompt)
    nbytes = int(cache.nbytes)
    rows = [int(st.num_rows) for st, m in zip(cache.layers, cache.mixers) if m == "kvm"]
    tok = prompt[:, -1:]
    model(tok, cache)                                   # warm-up step (not timed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(s["decode_tokens"]):
        logits, cache = model(tok, cache)
        tok = logits[:, -1:].argmax(-1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / s["decode_tokens"]
    return dict(length=length, recall=acc, cache_bytes=nbytes, state_rows=rows, decode_ms_per_token=ms)


def format_table(results: Dict[str, Any]) -> str:
    """Two blocks: recall per length (like the paper's table), then memory and speed per length."""
    lengths = results["lengths"]
    name_w = 15
    head = f"{'model':<{name_w}}" + "".join(f"{'recall@' + str(t):>12}" for t in lengths) + f"{'train s':>9}"
    lines = [head, "-" * len(head)]
    for name, r in results["models"].items():
        lines.append(f"{LABELS.get(name, name):<{name_w}}" + "".join(f"{e['recall']:>12.2f}" for e in r["evals"])
                     + f"{r['train_s']:>9.1f}")
    head = f"{'model':<{name_w}}" + "".join(f"{'cache KB@' + str(t):>14}" for t in lengths) + \
        f"{'state rows@' + str(lengths[-1]):>17}{'decode ms/tok':>15}"
    lines += ["", head, "-" * len(head)]
    for name, r in results["models"].items():
        ev = r["evals"]
        rows = ev[-1]["state_rows"]
        rows_s = "/".join(str(x) for x in rows) if rows else "-"
        lines.append(f"{LABELS.get(name, name):<{name_w}}" + "".join(f"{e['cache_bytes'] / 1024:>14,.1f}" for e in ev)
                     + f"{rows_s:>17}{ev[-1]['decode_ms_per_token']:>15.2f}")
    lines.append("(cache KB = bytes held after prefilling each length; state rows per KVM layer; decode time "
                 "per token after the longest prefill)")
    return "\n".join(lines)


def plot(results: Dict[str, Any], path: Path) -> Optional[str]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return None
    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    lengths = results["lengths"]
    for name, r in results["models"].items():
        ev = r["evals"]
        ax1.plot(lengths, [e["recall"] for e in ev], marker="o", label=LABELS.get(name, name))
        ax2.plot(lengths, [e["cache_bytes"] for e in ev], marker="o", label=LABELS.get(name, name))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.set_xlabel(f"context length (trained at {results['settings']['train_len']})")
        ax.grid(alpha=0.3)
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel(f"{results['settings']['task']} recall accuracy")
    ax1.set_title("recall vs context length")
    ax1.legend()
    ax2.set_yscale("log")
    ax2.set_ylabel("cache bytes after prefill")
    ax2.set_title("memory vs context length")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return str(path)


def run_demo(out_dir=None, quick: bool = False, device: str = "cpu", seed: int = 0,
             models: Sequence[str] = MODELS) -> Dict[str, Any]:
    """Train, evaluate, print the table and write ``results.json`` + ``demo.png`` under ``out_dir``."""
    if out_dir is None:
        out_dir = Path("results") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    s = demo_settings(quick)
    lengths = [s["train_len"] * m for m in s["multiples"]]
    results: Dict[str, Any] = dict(settings={k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()},
                                   quick=quick, device=device, seed=seed, lengths=lengths, models={})
    for i, name in enumerate(models):
        tr = train_model(name, s, seed, device)
        model = tr.pop("model")
        evals = [measure(model, t, s, seed=10_000 + 7 * seed + j, device=device) for j, t in enumerate(lengths)]
        results["models"][name] = dict(config=model.config.to_dict(), params=model.num_parameters(),
                                       train_s=tr["train_s"], final_loss=tr["final_loss"], evals=evals)
        print(f"[{i + 1}/{len(models)}] {name}: loss {tr['final_loss']:.3f}, trained in {tr['train_s']:.1f}s, "
              "recall " + " ".join(f"{e['recall']:.2f}" for e in evals), flush=True)
    table = format_table(results)
    results["table"] = table
    print()
    print(table)
    json_path = out / "results.json"
    atomic_write(json_path, lambda tmp: Path(tmp).write_text(json.dumps(results, indent=2)))
    png = plot(results, out / "demo.png")
    results["files"] = dict(results=str(json_path), plot=png)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
    return results


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="train less (under 2 minutes on a CPU)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=None, help="output folder (default results/demo-<timestamp>)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    run_demo(args.out, quick=args.quick, device=args.device, seed=args.seed)
    print(f"total wall time {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
