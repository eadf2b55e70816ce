"""Run output on rank 0: OUT/metrics.csv (always), TensorBoard / W&B (if asked and installed), progress.

metrics.csv columns: ``step`` (optimiser steps done), ``loss`` (mean train CE of that step over the
global batch), ``lr`` (the base lr used), ``tokens_per_s`` (of that step), ``val_loss`` (empty on steps
without validation), ``elapsed_s`` (seconds inside training steps, validation and checkpoints
excluded, summed over resumed segments). Losses and lr are written with full float precision
(``repr``), so two runs can be compared bit for bit. On resume, rows after the checkpoint's step
are dropped first.
"""
from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Callable, Optional

from kvmeans.train.config import RunConfig
from kvmeans.utils.io import atomic_write_file
from kvmeans.utils.progress import progress_bar

__all__ = ["MetricsLog", "TrainProgress", "COLUMNS"]

COLUMNS = ("step", "loss", "lr", "tokens_per_s", "val_loss", "elapsed_s")


class MetricsLog:
    """Context manager writing one CSV row per step (flushed, so other processes can follow it)."""

    def __init__(self, out: Path, cfg: RunConfig, resume_step: Optional[int], enabled: bool = True):
        self.path, self.cfg, self.resume_step, self.enabled = Path(out) / "metrics.csv", cfg, resume_step, enabled
        self._file = self._tb = self._wandb = None

    def __enter__(self) -> "MetricsLog":
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_step is not None and self.path.exists():
            self._truncate(self.resume_step)
            self._file = open(self.path, "a", newline="")
        else:
            self._file = open(self.path, "w", newline="")
            self._file.write(",".join(COLUMNS) + "\n")
        self._open_trackers()
        return self

    def _truncate(self, step: int) -> None:
        """Keep the rows up to ``step`` (a run killed after its last checkpoint logged later steps)."""
        with open(self.path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_file(self.path, lambda f: f.write(buf.getvalue().encode()))

    def _open_trackers(self) -> None:
        t = self.cfg.train
        if t.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                print("note: train.tensorboard is set but tensorboard is not installed (pip install tensorboard)")
        if t.wandb:
            try:
                import wandb
                self._wandb = wandb.init(project=t.wandb_project, name=Path(t.out).name, dir=str(self.path.parent),
                                         config=self.cfg.to_dict(), resume="allow")
            except ImportError:
                print("note: train.wandb is set but wandb is not installed (pip install wandb)")

    def row(self, step: int, loss: float, lr: float, tokens_per_s: float, val_loss: Optional[float],
            elapsed_s: float) -> None:
        if not self.enabled:
            return
        values = [str(step), repr(float(loss)), repr(float(lr)), f"{tokens_per_s:.1f}",
                  "" if val_loss is None else repr(float(val_loss)), f"{elapsed_s:.3f}"]
        self._file.write(",".join(values) + "\n")
        self._file.flush()
        scalars = {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s}
        if val_loss is not None:
            scalars["val/loss"] = val_loss
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def __exit__(self, *exc) -> None:
        for closer in (self._file, self._tb):
            if closer is not None:
                closer.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class TrainProgress:
    """A tqdm bar on a terminal (if tqdm is installed: :func:`kvmeans.utils.progress.progress_bar`), else a plain
    line every ``every`` steps."""

    def __init__(self, total: int, start: int, every: int, enabled: bool = True,
                 log_fn: Callable[[str], None] = print):
        self.total, self.start, self.every, self.enabled, self.log_fn = total, start, every, enabled, log_fn
        self.t_start = time.perf_counter()
        self.bar = progress_bar(total, enabled, terminal=True, initial=start, unit="step")

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, val_loss: Optional[float]) -> None:
        if not self.enabled:
            return
        done = step - self.start
        eta = (time.perf_counter() - self.t_start) / done * (self.total - step)
        val = f" | val {val_loss:.4f}" if val_loss is not None else ""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s{val}", refresh=False)
            if val:
                self.bar.write(f"step {step}: val {val_loss:.4f}")
        elif step % self.every == 0 or done == 1 or step == self.total or val:
            self.log_fn(f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
                        f"{val} | ETA {_fmt_time(eta)}")

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log_fn(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
