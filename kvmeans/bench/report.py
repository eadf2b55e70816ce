"""Benchmark reporting: environment header, fixed-width tables, atomic CSV / JSON / PNG writers.

Every file is written atomically: to a temporary file in the destination folder, then
``os.replace``-d over the final name, so a reader never sees a half-written result.
matplotlib is optional and imported lazily; without it the PNG is skipped with a one-line note.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvmeans.utils.io import atomic_write

__all__ = ["env_info", "format_env", "format_table", "print_table", "write_csv", "write_json",
           "plot_panels", "human_bytes"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- environment --------------------------------------------------------------------------------
def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "unavailable"


def env_info(device: str = "cpu") -> Dict[str, object]:
    """Describe where a benchmark runs: device, CPU, versions, git commit + dirty flag, load, threads, date."""
    dev = torch.device(device)
    cpu = _cpu_model()
    if dev.type == "cuda" and torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name(dev)} (host CPU: {cpu})"
    else:
        name = f"CPU: {cpu} ({os.cpu_count()} logical cores)"
    try:
        import triton  # noqa: F401  (optional)
        triton_version = triton.__version__
    except Exception:                      # not installed, or broken without a driver
        triton_version = None
    commit = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain") if commit else None   # untracked (not ignored) counts too
    return {
        "device": str(dev), "device_name": name, "torch": torch.__version__, "triton": triton_version,
        "cuda": torch.version.cuda, "python": platform.python_version(), "platform": platform.platform(),
        "git_commit": commit or "unknown", "git_dirty": None if status is None else bool(status),
        "loadavg": _loadavg(), "threads": torch.get_num_threads(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def format_env(info: Dict[str, object]) -> str:
    """A few ``# key: value`` lines for the top of a report."""
    dirty = {True: " (dirty)", False: "", None: " (dirty: unknown)"}[info.get("git_dirty")]
    return "\n".join([
        f"# device: {info['device_name']}",
        f"# torch {info['torch']}  triton {info['triton'] or 'not installed'}  python {info['python']}",
        f"# git {info['git_commit']}{dirty}  threads {info['threads']}  date {info['date']}",
        f"# /proc/loadavg: {info['loadavg']}",
    ])


# ---- tables -----------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Fixed-width text table; the first column is left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], file=None) -> None:
    print(format_table(headers, rows), file=file or sys.stdout, flush=True)


def human_bytes(n: Optional[float]) -> str:
    """``1536 -> '1.5K'`` (binary units); None -> ''."""
    if n is None:
        return ""
    for unit in ("B", "K", "M", "G"):
        if abs(n) < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024.0
    return f"{n:.1f}G"


# ---- atomic writers ---------------------------------------------------------------------------
def _atomic(path, write: Callable[[str], None]) -> Path:
    atomic_write(path, write)
    return Path(path)


def write_csv(path, fieldnames: Sequence[str], rows: Sequence[Dict[str, object]]) -> Path:
    """Write dict rows as CSV (missing keys -> empty cells), atomically."""
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(fieldnames), extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return _atomic(path, write)


def write_json(path, obj) -> Path:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
    return _atomic(path, write)


def plot_panels(path, panels: List[Dict[str, object]], title: str = "", ncols: int = 2) -> Optional[Path]:
    """Log-log line plots, one panel per dict, written as a PNG atomically.

    Each panel: ``{"title": str, "ylabel": str, "xlabel": str (optional),
    "series": {label: (xs, ys)}}``; points whose y is None or <= 0 are dropped.
    Returns the path, or None (with a one-line note) when matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed, skipping the PNG (pip install matplotlib)", file=sys.stderr)
        return None
    nrows = max(1, -(-len(panels) // ncols))
    fig = Figure(figsize=(5.5 * ncols, 4.0 * nrows))
    FigureCanvasAgg(fig)                   # Agg canvas, no pyplot global state touched
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        for label, (xs, ys) in panel["series"].items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y == y and y > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(panel["title"])
        ax.set_xlabel(panel.get("xlabel", "T (tokens)"))
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
