"""The "main job" demo: what Key-Value Means attention is for, on a CPU in minutes, nothing downloaded.

Five tiny language models of the same size are trained for the same number of steps, once per seed, on
a synthetic recall task at a short training length ``T``, differing only in their sequence mixer. The
task (``task=`` in :func:`demo_settings`, ``--task``) is by default ``passkey``: one needle at a random depth,
queried at the end (trained on the query's key and answer, scored on the answer); ``multikey`` is passkeys
with distractors, one key-value needle per 32 tokens (4 at ``T = 128``, 32 at ``8T``) and 4 of them queried
at the end, so the memory a model needs grows with the context; ``mqar`` is multi-query associative recall.

* ``rwkv7``:     RWKV-7, a fixed-state RNN (a matrix state per head, on its own backbone),
* ``kvm-fixed``: KVM with a fixed state budget (memory flat in the context length),
* ``kvm-sqrt``:  KVM with a state that grows like ``sqrt(context)``,
* ``bswa``:      block sliding-window attention (a window of a few chunks),
* ``full``:      full causal attention (a KV cache growing linearly).

Each is then evaluated at ``1x, 2x, 4x, ..., 32x`` the training length (``1x-8x`` with ``--quick`` and for
``multikey``, whose 50 one-token keys hold at most 32 needles; every length is checked before training): recall
accuracy, the cache bytes
after prefilling each length (``ModelCache.nbytes``; KVM state rows too) and decode speed (ms per token
for a few tokens after the prefill). Prints the recall's mean (min-max) over the seeds and the memory
table, writes ``results.json`` and, with matplotlib installed, ``demo.png`` (recall vs length, cache
bytes vs length).

On a CPU every (model, seed) run uses one torch thread, runs spread over ``workers`` processes, so a
seed gives the same numbers whatever the number of cores or workers (same torch build and CPU kind).
A progress bar per model (steps over all seeds, latest loss, elapsed<remaining) goes to stderr when
it is a terminal; otherwise one line per finished run.

Usage::

    kvmeans demo [--quick] [--seeds 0 1 2] [--workers N] [--device cpu|cuda] [--out DIR]
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from queue import Empty
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from kvmeans.eval.synthetic import mqar_batch, multikey_batch, passkey_batch, passkey_needle_len, recall_accuracy
from kvmeans.models import KVMLanguageModel, KVMModelConfig
from kvmeans.utils.io import atomic_write
from kvmeans.utils.progress import progress_bar, write_line

__all__ = ["run_demo", "MODELS", "TASKS", "demo_settings"]

MODELS = ("rwkv7", "kvm-fixed", "kvm-sqrt", "bswa", "full")
LABELS = {"rwkv7": "RWKV-7", "kvm-fixed": "KVM fixed", "kvm-sqrt": "KVM sqrt", "bswa": "BSWA", "full": "full attention"}


DEFAULT_TASK = "passkey"
TASKS = {"passkey": dict(key_len=2, key_targets=True),      # task -> its own settings
         "multikey": dict(pair_every=32, num_queries=4, key_len=1, multiples=(1, 2, 4, 8)),   # 50 one-token keys
         "mqar": dict(num_pairs=24, num_queries=8)}


def demo_settings(quick: bool = False, task: str = DEFAULT_TASK) -> Dict[str, Any]:
    """Task, model, training settings and seeds (``quick``: one seed, fewer steps and evaluation samples)."""
    # MQAR and multi-needle passkeys did not train within the step budget on a CPU. multikey (4 queries: with one,
    # KVM sqrt barely left chance in 800 steps) trains, but with seed 0 every model's recall fell with the length,
    # full attention's too, and RWKV-7 led at every length (README), so the single passkey stays the default.
    # With chunks of 8 and 8 fixed rows the fixed state held the needle as well as the growing one at 8x; with
    # chunks of 4 a 16-row fixed state learns the retrieval only partly. Whether a run learns the retrieval
    # depends on its seed, hence three seeds; batches of 16 (not 32) keep the five models within about 15 minutes
    # on 2 cores (400 steps of 32 did not learn it with seed 0). Lengths run to 32x: RWKV-7 leads up to 8x and
    # fades beyond, where the fixed KVM state holds (README). Trained on the 3 answer digits alone, a KVM run sat
    # on the guess-a-digit loss (2.30) for ~400 of the 800 steps and, in 3 of 6 runs (fixed seed 0, sqrt seeds 1
    # and 2), learned the retrieval too late (recall 0.22-0.57 at 1x; lr 1e-3: 0.47). Passkey's key_targets also
    # train the query's key (5 tokens a sequence): recall 1.00 at 1x in those three runs (train_targets).
    if task not in TASKS:
        raise ValueError(f"task={task!r}: choose one of {', '.join(TASKS)}")
    s = dict(task=task, train_len=128, multiples=(1, 2, 4, 8, 16, 32), vocab_size=64,
             hidden_size=64, num_layers=2, num_heads=2,
             chunk_len=4, window_chunks=2, fixed_rows=16, sqrt_factor=2.0, steps=800, batch=16, lr=3e-3,
             warmup=50, eval_samples=64, decode_tokens=8, seeds=(0, 1, 2))
    s.update(TASKS[task])
    if quick:
        s.update(steps=200, eval_samples=32, decode_tokens=4, seeds=(0,), multiples=(1, 2, 4, 8))
    return s


def check_lengths(s: Dict[str, Any]) -> List[int]:
    """The evaluation lengths ``train_len * multiples``, each checked to make a batch of the task (before training)."""
    lengths = [s["train_len"] * m for m in s["multiples"]]
    for t in lengths:
        try:
            make_batch(s, 1, t, seed=0)
        except ValueError as e:
            raise ValueError(f"task={s['task']!r} cannot be evaluated at {t} tokens "
                             f"({t // s['train_len']}x train_len={s['train_len']}): {e}") from None
    return lengths


def make_batch(s: Dict[str, Any], batch: int, seq_len: int, seed: int):
    """``(input_ids, targets)`` of the demo's task: multi-key passkey, passkey or MQAR (pairs first, queries last)."""
    if s["task"] == "multikey":
        return multikey_batch(batch, seq_len, seed, s["pair_every"], s["num_queries"], s["vocab_size"], s["key_len"])
    if s["task"] == "mqar":
        return mqar_batch(batch, seq_len, s["num_pairs"], s["vocab_size"], seed, num_queries=s["num_queries"])
    if s["task"] == "passkey":
        x, y, _ = passkey_batch(batch, seq_len, seed=seed, vocab_size=s["vocab_size"], key_len=s["key_len"])
        return x, y
    raise ValueError(f"task={s['task']!r}: choose one of {', '.join(TASKS)}")


def train_targets(s: Dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The targets trained on, ``[B, T]``: ``y`` (the answer), with passkey's ``key_targets`` also the query's key.

    The query ``KEY k_1 .. k_K VAL`` then predicts ``k_1 .. k_K``, the same copy from the needle as the answer's
    digits: 5 tokens per sequence train the lookup instead of 3 (evaluation scores the digits only).
    """
    if s["task"] != "passkey" or not s["key_targets"]:
        return y
    q = x.shape[1] - passkey_needle_len(s["key_len"])                  # the query's KEY
    y = y.clone()
    y[:, q:q + s["key_len"]] = x[:, q + 1:q + 1 + s["key_len"]]
    return y


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
    if kind == "rwkv7":
        return KVMModelConfig(mixer="rwkv7", **common)
    if kind == "full":
        return KVMModelConfig(mixer="full", **common)
    raise ValueError(f"unknown demo model {kind!r}; choose from {MODELS}")


def _lr_at(step: int, s: Dict[str, Any]) -> float:
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    frac = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    return s["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


REPORT_EVERY = 10       # steps between progress reports


def train_model(kind: str, s: Dict[str, Any], seed: int, device: str,
                report: Optional[Callable[[int, float], None]] = None) -> Dict[str, Any]:
    """Train one model; ``report(steps_done_since_last, mean_loss)`` every ``REPORT_EVERY`` steps."""
    torch.manual_seed(seed)
    model = KVMLanguageModel(model_config(kind, s)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.perf_counter()
    losses = []
    model.train()
    for step in range(s["steps"]):
        x, y = make_batch(s, s["batch"], s["train_len"], seed * 100_003 + step)
        x, y = x.to(device), y.to(device)
        target = train_targets(s, x, y)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, s)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if target is not y:                 # report the answer's loss, what recall scores
            loss = F.cross_entropy(logits.detach().flatten(0, 1), y.flatten(), ignore_index=-100)
        losses.append(float(loss.detach()))
        if report is not None and ((step + 1) % REPORT_EVERY == 0 or step + 1 == s["steps"]):
            done = (step % REPORT_EVERY) + 1
            report(done, sum(losses[-done:]) / done)
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


def run_one(kind: str, seed: int, s: Dict[str, Any], device: str,
            report: Optional[Callable[[int, float], None]] = None) -> Dict[str, Any]:
    """One run of the demo: train ``kind`` with ``seed``, then measure it at every length."""
    tr = train_model(kind, s, seed, device, report)
    model = tr.pop("model")
    lengths = [s["train_len"] * m for m in s["multiples"]]
    evals = [measure(model, t, s, seed=10_000 + 7 * seed + j, device=device) for j, t in enumerate(lengths)]
    return dict(model=kind, seed=seed, config=model.config.to_dict(), params=model.num_parameters(),
                train_s=tr["train_s"], final_loss=tr["final_loss"], evals=evals)


_progress_queue = None      # in a worker process: where its progress reports go


def _init_worker(queue) -> None:
    global _progress_queue
    _progress_queue = queue
    torch.set_num_threads(1)


def _run_in_worker(kind: str, seed: int, s: Dict[str, Any], device: str) -> Dict[str, Any]:
    return run_one(kind, seed, s, device, lambda n, loss: _progress_queue.put((kind, seed, n, loss)))


def _drain(queue, on_progress: Callable, wait_s: float = 0.0) -> None:
    while True:
        try:
            on_progress(*(queue.get(timeout=wait_s) if wait_s else queue.get_nowait()))
        except Empty:
            return


def run_all(runs: Sequence[Tuple[str, int]], s: Dict[str, Any], device: str, workers: int,
            on_progress: Callable[[str, int, int, float], None],
            on_done: Callable[[Dict[str, Any]], None]) -> List[Dict[str, Any]]:
    """:func:`run_one` for each ``(kind, seed)``, in this process (``workers == 1``) or in ``workers`` others.

    ``on_progress(kind, seed, steps, loss)`` and ``on_done(run)`` are called in this process.
    """
    if workers == 1:
        out = []
        for kind, seed in runs:
            out.append(run_one(kind, seed, s, device, lambda n, loss: on_progress(kind, seed, n, loss)))
            on_done(out[-1])
        return out
    ctx = multiprocessing.get_context("spawn")       # never fork a process that holds torch's thread pools
    queue = ctx.Queue()
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
        futures = [pool.submit(_run_in_worker, kind, seed, s, device) for kind, seed in runs]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(queue, on_progress)
                for f in done:
                    on_done(f.result())
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        _drain(queue, on_progress, wait_s=1.0)       # reports still in the pipe
    return [f.result() for f in futures]


class ModelBars:
    """One bar per model (steps over all its seeds, the latest loss), on stderr and only if it is a terminal."""

    def __init__(self, models: Sequence[str], steps_per_model: int):
        self.bars = {m: progress_bar(steps_per_model, terminal=True, desc=f"{LABELS.get(m, m):<14}", position=i,
                                     unit="step") for i, m in enumerate(models)}

    def update(self, kind: str, seed: int, steps: int, loss: float) -> None:
        bar = self.bars[kind]
        if bar is None:
            return
        if bar.n == 0:
            bar.reset()                 # its clock starts with the model's first run, not with the demo
        bar.set_postfix_str(f"seed {seed} loss {loss:.3f}", refresh=False)
        bar.update(steps)

    def close(self) -> None:
        for bar in self.bars.values():
            if bar is not None:
                bar.close()


def summarize(runs: List[Dict[str, Any]], models: Sequence[str], lengths: List[int]) -> Dict[str, Any]:
    """Per model and length: recall mean / min / max over the seeds, memory, median decode time; the runs."""
    out = {}
    for name in models:
        rs = sorted((r for r in runs if r["model"] == name), key=lambda r: r["seed"])
        evals = []
        for j, length in enumerate(lengths):
            per_seed = [r["evals"][j] for r in rs]
            recalls = [e["recall"] for e in per_seed]
            evals.append(dict(length=length, recall=statistics.fmean(recalls), recall_min=min(recalls),
                              recall_max=max(recalls), cache_bytes=per_seed[0]["cache_bytes"],
                              state_rows=per_seed[0]["state_rows"],
                              decode_ms_per_token=statistics.median(e["decode_ms_per_token"] for e in per_seed)))
        out[name] = dict(config=rs[0]["config"], params=rs[0]["params"], seeds=[r["seed"] for r in rs],
                         train_s=statistics.fmean(r["train_s"] for r in rs),
                         final_loss=statistics.fmean(r["final_loss"] for r in rs), evals=evals,
                         runs=[{k: r[k] for k in ("seed", "final_loss", "train_s", "evals")} for r in rs])
    return out


def _recall_cell(e: Dict[str, Any]) -> str:
    if e["recall_min"] == e["recall_max"]:
        return f"{e['recall']:.2f}"
    return f"{e['recall']:.2f} ({e['recall_min']:.2f}-{e['recall_max']:.2f})"


def format_table(results: Dict[str, Any]) -> str:
    """Two blocks: recall per length (mean and min-max over seeds), then memory and speed per length."""
    lengths = results["lengths"]
    name_w, cell_w = 15, 18
    head = f"{'model':<{name_w}}" + "".join(f"{'recall@' + str(t):>{cell_w}}" for t in lengths) + \
        f"{'loss':>7}{'train s':>9}"
    lines = [head, "-" * len(head)]
    for name, r in results["models"].items():
        lines.append(f"{LABELS.get(name, name):<{name_w}}" + "".join(f"{_recall_cell(e):>{cell_w}}" for e in r["evals"])
                     + f"{r['final_loss']:>7.3f}{r['train_s']:>9.1f}")
    seeds = results["seeds"]
    over = f"mean (min-max) over seeds {', '.join(str(x) for x in seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}"
    lines.append(f"(recall: {over}; loss and train s: mean per run)")
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
                 "per token after the longest prefill, median over seeds)")
    return "\n".join(lines)


def plot(results: Dict[str, Any], path: Path) -> Optional[str]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed; skipping demo.png (pip install matplotlib)")
        return None
    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    lengths = results["lengths"]
    for name, r in results["models"].items():
        ev = r["evals"]
        mean = [e["recall"] for e in ev]
        spread = [[m - e["recall_min"] for m, e in zip(mean, ev)], [e["recall_max"] - m for m, e in zip(mean, ev)]]
        ax1.errorbar(lengths, mean, yerr=spread, marker="o", capsize=3, label=LABELS.get(name, name))
        ax2.plot(lengths, [e["cache_bytes"] for e in ev], marker="o", label=LABELS.get(name, name))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.set_xlabel(f"context length (trained at {results['settings']['train_len']})")
        ax.grid(alpha=0.3)
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel(f"{results['settings']['task']} recall accuracy")
    ax1.set_title(f"recall vs context length (mean, min-max over {len(results['seeds'])} seeds)")
    ax1.legend()
    ax2.set_yscale("log")
    ax2.set_ylabel("cache bytes after prefill")
    ax2.set_title("memory vs context length")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return str(path)


def run_demo(out_dir=None, quick: bool = False, device: str = "cpu", seeds: Optional[Sequence[int]] = None,
             models: Sequence[str] = MODELS, workers: Optional[int] = None,
             settings: Optional[Dict[str, Any]] = None, task: str = DEFAULT_TASK) -> Dict[str, Any]:
    """Train every model once per seed, evaluate, print the tables; write ``results.json`` (+ ``demo.png``).

    ``settings`` defaults to :func:`demo_settings` (``quick``, ``task``), ``seeds`` to its ``seeds``; ``workers``
    (processes of one torch thread each) to one per CPU core, at most one per run; on CUDA, one.
    """
    s = dict(settings if settings is not None else demo_settings(quick, task))
    if seeds is not None:
        s["seeds"] = tuple(seeds)
    if not s["seeds"]:
        raise ValueError("seeds is empty; give at least one seed, e.g. seeds=(0, 1, 2)")
    runs = [(m, seed) for m in models for seed in s["seeds"]]       # model-major: the slower KVM runs go first
    if workers is None:
        workers = min(os.cpu_count() or 1, len(runs)) if device == "cpu" else 1
    if workers < 1 or (workers > 1 and device != "cpu"):
        raise ValueError(f"workers={workers}: use workers >= 1, and workers=1 with device={device!r}")
    if out_dir is None:
        out_dir = Path("results") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    lengths = check_lengths(s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = dict(settings={k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()},
                                   quick=quick, device=device, seeds=list(s["seeds"]), workers=workers,
                                   lengths=lengths, models={})
    progress = ModelBars(models, s["steps"] * len(s["seeds"]))
    finished = []

    def on_done(r: Dict[str, Any]) -> None:
        finished.append(r)
        write_line(f"[{len(finished)}/{len(runs)}] {LABELS.get(r['model'], r['model'])} seed {r['seed']}: "
                   f"loss {r['final_loss']:.3f}, trained in {r['train_s']:.1f}s, recall "
                   + " ".join(f"{e['recall']:.2f}" for e in r["evals"]))

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)                    # a seed's numbers must not depend on the core count
    try:
        all_runs = run_all(runs, s, device, workers, progress.update, on_done)
    finally:
        progress.close()
        torch.set_num_threads(threads)
    results["models"] = summarize(all_runs, models, lengths)
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
