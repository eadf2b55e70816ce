"""The training loop, nanoGPT-direct: one process per device under ``torchrun``, DDP or FSDP2.

``train(config)`` runs ``config.total_steps()`` optimiser steps. Each step reads one global batch
(``data.batch_size`` sequences; rank r takes rows r::world), runs it in micro batches with gradient
accumulation, and normalises the summed cross entropy by the global count of target tokens, so a
run gives the same losses on any number of processes. Rank 0 alone writes files:

    OUT/config.json   the resolved config       OUT/metrics.csv   step, loss, lr, tokens_per_s, val_loss, elapsed_s
    OUT/env.json      versions, devices, commit OUT/ckpt/         step_*.pt + latest (kvmeans.train.checkpoint)
    OUT/final/        HF layout (KVMForCausalLM.save_pretrained + tokenizer), written at the end

SIGTERM / SIGINT set a flag: the current step finishes, a checkpoint is written and train() returns
(exit code 0); a second signal interrupts at once.
"""
from __future__ import annotations

import json
import platform
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvmeans.models import KVMModelConfig
from kvmeans.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_temp_files,
    restore_checkpoint,
    save_checkpoint,
)
from kvmeans.train.config import ConfigError, RunConfig
from kvmeans.train.data import TokenBatches, TokenFile
from kvmeans.train.metrics import MetricsLog, TrainProgress
from kvmeans.train.optim import apply_schedule, build_optimizer, refresh_peaks
from kvmeans.train.runtime import Runtime, build_model, grad_sync, setup_runtime
from kvmeans.utils.io import atomic_dir, atomic_write_file

__all__ = ["train", "train_step", "evaluate", "open_run", "export_final"]


def train_step(model: nn.Module, batch, optimizer, cfg: RunConfig, rt: Runtime, stop: bool):
    """One optimiser step over this rank's rows of the global batch; returns ``(loss, stop_any_rank)``.

    Each micro step backpropagates ``sum CE * world / global_count``: DDP/FSDP average over ranks,
    so the gradient is that of the mean CE over every target token of the global batch.
    """
    x, y = batch
    micro = cfg.micro_batch_size(rt.world)
    (count,) = rt.sum([(y != -100).sum()])
    scale = rt.world / max(count, 1.0)
    loss_sum = torch.zeros((), device=rt.device)
    pieces = list(zip(x.split(micro), y.split(micro)))
    for i, (xm, ym) in enumerate(pieces):
        with grad_sync(model, i == len(pieces) - 1):
            with rt.autocast():
                logits = model(xm.to(rt.device, non_blocking=True))
            ce = F.cross_entropy(logits.flatten(0, 1), ym.to(rt.device, non_blocking=True).flatten(),
                                 ignore_index=-100, reduction="sum")
            (ce * scale).backward()
        loss_sum += ce.detach()
    if cfg.optim.grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total, stops = rt.sum([loss_sum, float(stop)])
    return total / max(count, 1.0), stops > 0


@torch.no_grad()
def evaluate(model: nn.Module, val: TokenBatches, cfg: RunConfig, rt: Runtime) -> float:
    """Mean CE over ``train.val_steps`` fixed batches of val.bin (the same batches at every evaluation)."""
    model.eval()
    micro, total, count = cfg.micro_batch_size(rt.world), 0.0, 0.0
    for i in range(cfg.train.val_steps):
        x, y = val.batch(i)
        for xm, ym in zip(x.split(micro), y.split(micro)):
            with rt.autocast():
                logits = model(xm.to(rt.device))
            ym = ym.to(rt.device)
            total += F.cross_entropy(logits.flatten(0, 1), ym.flatten(), ignore_index=-100, reduction="sum")
            count += (ym != -100).sum()
    model.train()
    total, count = rt.sum([total, count])
    return total / max(count, 1.0)


def prepare_data(cfg: RunConfig, model_cfg: KVMModelConfig, rt: Runtime, out: Path) -> Path:
    """The prepared data folder; for ``data.path = builtin`` rank 0 writes it once into OUT/data."""
    if cfg.data.path != "builtin":
        path = Path(cfg.data.path)
        missing = [n for n in ("train.bin", "val.bin") if not (path / n).is_file()]
        if missing:
            raise ConfigError(f"data.path={path}: missing {', '.join(missing)}; prepare it with "
                              f"`kvmeans data prepare --input ... --out {path}` (or use --data builtin)")
        return path
    path = out / "data"
    if rt.is_main and not (path / "val.bin").is_file():
        from kvmeans.train.prepare import prepare_tokens
        vocab = cfg.data.vocab_size or model_cfg.vocab_size
        prepare_tokens(["builtin"], path, "builtin", vocab_size=vocab, val_fraction=0.05, seed=0,
                       log=lambda m: print(f"data: {m}", flush=True))
    rt.barrier()
    return path


def _check_vocab(tf: TokenFile, model_cfg: KVMModelConfig) -> None:
    if tf.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"{tf.path}: tokenizer {tf.header.get('tokenizer_id')!r} has {tf.vocab_size} ids but "
                          f"the model's vocab_size is {model_cfg.vocab_size}; pass --model.vocab_size "
                          f"{-(-tf.vocab_size // 64) * 64} (a multiple of 64 is fastest)")


@dataclass
class Run:
    """Everything the loop carries between steps."""
    cfg: RunConfig
    rt: Runtime
    out: Path
    model_cfg: KVMModelConfig
    data_dir: Path
    raw: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: TokenBatches
    val: TokenBatches
    eos_id: Optional[int]
    step: int = 0                                    # optimiser steps done
    elapsed: float = 0.0                             # training seconds, summed over resumed segments
    summary: Dict[str, Any] = field(default_factory=dict)


def open_run(cfg: RunConfig, rt: Runtime, resume: Optional[str]) -> Run:
    """Create or resume the run: data, model, optimiser, batches, and the restored state if resuming."""
    cfg.check(rt.world)
    out = Path(cfg.train.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out={out} is a file; choose a folder (--out DIR)")
    ckpt = _resume_file(out, resume)
    model_cfg = cfg.model.build()
    data_dir = prepare_data(cfg, model_cfg, rt, out)
    train_file, val_file = TokenFile(data_dir / "train.bin"), TokenFile(data_dir / "val.bin")
    _check_vocab(train_file, model_cfg)
    raw, model = build_model(cfg, model_cfg, rt)
    optimizer = build_optimizer(raw, cfg.optim, rt.device.type)
    per_rank = cfg.data.batch_size // rt.world
    batches = TokenBatches(train_file, per_rank, cfg.data.seq_len, cfg.train.seed, rt.rank, rt.world)
    val = TokenBatches(val_file, per_rank, cfg.data.seq_len, cfg.train.seed + 1, rt.rank, rt.world)
    run = Run(cfg, rt, out, model_cfg, data_dir, raw, model, optimizer, batches, val, train_file.eos_id)
    if ckpt is not None:
        if rt.is_main:
            remove_temp_files(out / "ckpt")
        state = load_checkpoint(ckpt)
        _check_same_model(state, cfg, ckpt)
        restore_checkpoint(state, raw, optimizer)
        refresh_peaks(optimizer, raw, cfg.optim)
        batches.load_state_dict(state["data"])
        run.step, run.elapsed = state["step"], state["elapsed"]
    return run


def _resume_file(out: Path, resume: Optional[str]) -> Optional[Path]:
    found = latest_checkpoint(out / "ckpt")
    if resume is None:
        if found is not None:
            raise ConfigError(f"{out} already holds checkpoints ({found.name}); pass --resume to continue "
                              "that run, or choose another --out")
        return None
    path = found if resume == "latest" else Path(resume)
    if path is None or not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path or out / 'ckpt/latest'}")
    return path


def _check_same_model(state: Dict[str, Any], cfg: RunConfig, path: Path) -> None:
    saved, now = state["config"]["model"], cfg.to_dict()["model"]
    if saved != now:
        keys = sorted(k for k in set(saved["overrides"]) | set(now["overrides"])
                      if saved["overrides"].get(k) != now["overrides"].get(k))
        raise ConfigError(f"{path} was trained with model {saved}, this run asks for {now} "
                          f"(differences: preset/overrides {keys}); resume with the same model section")


def save(run: Run) -> None:
    """Checkpoint the current step (collective; rank 0 writes)."""
    extra = {"data": run.batches.state_dict(), "elapsed": run.elapsed, "config": run.cfg.to_dict(),
             "world_size": run.rt.world}
    path = save_checkpoint(run.out / "ckpt", run.step, run.raw, run.optimizer, extra, run.cfg.train.keep_ckpts)
    if path is not None:
        run.summary["checkpoint"] = str(path)


def write_run_files(run: Run) -> None:
    """OUT/config.json (the resolved config) and OUT/env.json (versions, devices, commit); rank 0."""
    if not run.rt.is_main:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    config = json.dumps(run.cfg.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write_file(run.out / "config.json", lambda f: f.write(config.encode()))
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": torch.cuda.get_device_name(run.rt.device) if run.rt.device.type == "cuda" else "cpu",
           "world_size": run.rt.world, "commit": _git_commit(), "strategy": run.cfg.train.strategy,
           "autocast": str(run.rt.amp_dtype), "parameters": sum(p.numel() for p in run.raw.parameters())}
    atomic_write_file(run.out / "env.json", lambda f: f.write((json.dumps(env, indent=2) + "\n").encode()))


def _git_commit() -> Optional[str]:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def export_final(run: Run) -> Optional[Path]:
    """OUT/final/: the model in Hugging Face layout plus the data's tokenizer (collective; rank 0 writes).

    Written into a temp folder and renamed into place (:func:`~kvmeans.utils.io.atomic_dir`); without
    ``transformers`` a plain ``model.pt`` + ``kvm_config.json`` is written instead.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(run.raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not run.rt.is_main:
        return None
    final = run.out / "final"
    with atomic_dir(final) as tmp:
        _write_model(tmp, sd, run.model_cfg, run.eos_id)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (run.data_dir / name).is_file():
                shutil.copy2(run.data_dir / name, tmp / name)
    return final


def _write_model(folder: Path, sd: Dict[str, torch.Tensor], model_cfg: KVMModelConfig, eos: Optional[int]) -> None:
    try:
        from transformers.utils import logging as hf_logging

        from kvmeans.models.hf import KVMConfig, KVMForCausalLM
    except ImportError:
        print("note: transformers is not installed; OUT/final holds model.pt + kvm_config.json "
              "(pip install 'kvmeans[hf]' for the Hugging Face layout)", flush=True)
        torch.save(sd, folder / "model.pt")
        (folder / "kvm_config.json").write_text(json.dumps(model_cfg.to_dict(), indent=2) + "\n")
        return
    hf = KVMForCausalLM(KVMConfig.from_model_config(model_cfg, eos_token_id=eos, pad_token_id=eos))
    hf.load_state_dict(sd)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()          # a one-shard "Writing model shards" bar is noise in the log
    try:
        hf.save_pretrained(folder, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


class StopSignal:
    """SIGTERM / SIGINT set ``requested``; a second signal raises KeyboardInterrupt (hard stop)."""

    def __init__(self, verbose: bool = True):
        self.requested: Optional[str] = None
        self.verbose = verbose
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():   # signal() works only there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        if self.verbose:
            print(f"\n{self.requested} received: stopping after this step (send it again to abort now)", flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _describe(run: Run, total: int) -> str:
    cfg, rt = run.cfg, run.rt
    n = sum(p.numel() for p in run.raw.parameters())
    return (f"run {cfg.name}: {n:,} parameters ({', '.join(sorted(set(run.model_cfg.mixer_per_layer())))}), "
            f"{total} steps x {cfg.tokens_per_step():,} tokens ({cfg.data.batch_size} x {cfg.data.seq_len}), "
            f"{rt.world} process(es) on {rt.device.type}, {cfg.grad_accum_steps(rt.world)} micro step(s) of "
            f"{cfg.micro_batch_size(rt.world)}, {'bf16 autocast' if rt.amp_dtype else 'fp32'}, "
            f"{cfg.train.strategy if rt.world > 1 else 'single process'}; out {run.out}"
            + (f"; resuming at step {run.step}" if run.step else ""))


def run_loop(run: Run, stop: StopSignal, log: MetricsLog, progress: TrainProgress) -> None:
    """Steps until the end or a stop signal; validation, checkpoints and metrics along the way."""
    cfg, total = run.cfg, run.cfg.total_steps()
    loss = float("nan")
    while run.step < total:
        lr = apply_schedule(run.optimizer, run.step, total, cfg.optim)
        t0 = time.perf_counter()
        loss, stopping = train_step(run.model, next(run.batches), run.optimizer, cfg, run.rt, bool(stop.requested))
        dt = time.perf_counter() - t0
        run.step += 1
        run.elapsed += dt
        end = run.step == total
        val_loss = None
        if end or (cfg.train.val_every and run.step % cfg.train.val_every == 0):
            val_loss = run.summary["val_loss"] = evaluate(run.model, run.val, cfg, run.rt)
        log.row(run.step, loss, lr, cfg.tokens_per_step() / dt, val_loss, run.elapsed)
        progress.update(run.step, loss, lr, cfg.tokens_per_step() / dt, val_loss)
        if end or stopping or (cfg.train.ckpt_every and run.step % cfg.train.ckpt_every == 0):
            save(run)
            progress.write(f"checkpoint: step {run.step} -> {run.out / 'ckpt'}")
        if stopping and not end:
            progress.write(f"stopped by {stop.requested or 'a signal on another rank'} after step {run.step}; "
                           f"continue with --resume (out {run.out})")
            run.summary["stopped_early"] = True
            break
    run.summary["final_loss"] = loss


def _finish(run: Run, log_fn: Callable[[str], None]) -> None:
    final = export_final(run)
    if final is None:                                    # not rank 0
        return
    run.summary["final"] = str(final)
    losses = ", ".join(f"{label} {run.summary[key]:.4f}" for key, label in
                       (("final_loss", "train loss"), ("val_loss", "val loss")) if run.summary[key] is not None)
    log_fn(f"final model: {final} ({losses}; {run.elapsed:.0f} s of training)")


def _print(message: str) -> None:
    print(message, flush=True)


def train(cfg: RunConfig, resume: Optional[str] = None, log_fn: Callable[[str], None] = _print) -> Dict[str, Any]:
    """Train (or resume, ``resume`` = ``"latest"`` or a checkpoint path) and return a summary dict:
    ``steps``, ``final_loss``, ``val_loss``, ``elapsed_s``, ``stopped_early``, ``checkpoint``, ``final``, ``out``."""
    rt = setup_runtime(cfg)
    try:
        run = open_run(cfg, rt, resume)
        write_run_files(run)
        total = cfg.total_steps()
        progress = TrainProgress(total, run.step, cfg.train.log_every, rt.is_main, log_fn)
        progress.write(_describe(run, total))
        run.summary.update(stopped_early=False, out=str(run.out), val_loss=None)
        metrics = MetricsLog(run.out, cfg, run.step if resume else None, rt.is_main)
        with StopSignal(rt.is_main) as stop, metrics as log:
            run_loop(run, stop, log, progress)
        progress.close()
        if not run.summary["stopped_early"]:
            _finish(run, log_fn)
        run.summary.update(steps=run.step, elapsed_s=run.elapsed)
        return run.summary
    finally:
        if rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
