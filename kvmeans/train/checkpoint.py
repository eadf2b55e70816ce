"""Training checkpoints: one ``.pt`` file per save, written atomically, the newest named by ``ckpt/latest``.

A checkpoint holds everything an exact resume needs: the model and optimiser (full, unsharded
state dicts keyed by parameter name, so a DDP run can resume under FSDP or another world size),
the step, the data position (``TokenBatches.state_dict()``), the RNG states, elapsed time and the
run config. Files are written by rank 0 into a temp file in the same folder, fsynced, then
``os.replace``d: a crash or a signal never leaves a half-written checkpoint behind (the temp files of
a killed process are removed by the next save and on resume).

Each checkpoint records a CRC32 of its payload (every tensor's bytes, dtype and shape, and every
other value), which :func:`load_checkpoint` verifies: ``torch.load`` itself reads a corrupted tensor
region silently. A mismatch is an error naming the file and the previous checkpoint to resume from
(no silent fallback). Checkpoints written before the checksum existed load unverified.
"""
from __future__ import annotations

import random
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kvmeans.utils.io import atomic_write_file
from kvmeans.utils.weights import read_error

__all__ = ["save_checkpoint", "load_checkpoint", "restore_checkpoint", "latest_checkpoint", "rng_state",
           "set_rng_state", "remove_temp_files", "payload_checksum", "CheckpointError"]

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TEMP = re.compile(r"^\.(step_\d+\.pt|latest)\..+\.tmp$")      # atomic_write's temp names


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read or fails its checksum."""


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Dict[str, Any], keep: int = 3) -> Optional[Path]:
    """Write ``ckpt_dir/step_{step:08d}.pt`` and point ``ckpt_dir/latest`` at it; keep the ``keep`` newest.

    Collective under torch.distributed (every rank must call it: FSDP gathers the full tensors);
    only rank 0 writes. ``model`` is the unwrapped module (or the FSDP root). ``extra``: step-level
    state (data position, elapsed time, config, ...). Returns the path on rank 0, else None.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=opts),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=opts),
             "step": step, "rng": rng_state(), **extra}
    if not _is_rank0():
        return None
    state["checksum"] = payload_checksum(state)
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / f"step_{step:08d}.pt"
    atomic_write_file(path, lambda f: torch.save(state, f))
    atomic_write_file(ckpt_dir / "latest", lambda f: f.write(path.name.encode() + b"\n"))
    for old in sorted(p for p in ckpt_dir.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink()
    remove_temp_files(ckpt_dir)
    return path


def remove_temp_files(ckpt_dir: Path) -> None:
    """Delete the temp files a process killed while writing a checkpoint left behind (the only writer
    of ``ckpt_dir`` calls this, so none of them is in use)."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_dir():
        for p in ckpt_dir.iterdir():
            if _TEMP.match(p.name):
                p.unlink(missing_ok=True)


def _leaves(value: Any, key: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{key}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{key}/{i}")
    else:
        yield key, value


def payload_checksum(state: Dict[str, Any]) -> str:
    """``"crc32:<hex>"`` over ``state`` (but its ``checksum`` key): each leaf's path, then a tensor's dtype,
    shape and bytes, or another value's ``repr``."""
    crc = 0
    for key, value in _leaves({k: v for k, v in state.items() if k != "checksum"}):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            crc = zlib.crc32(f"{key}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            crc = zlib.crc32(f"{key}={value!r}".encode(), crc)
    return f"crc32:{crc:08x}"


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The file named by ``ckpt_dir/latest`` (or the highest ``step_*.pt`` if that file is missing)."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    if pointer.exists():
        path = ckpt_dir / pointer.read_text().strip()
        if path.exists():
            return path
    found = sorted(p for p in ckpt_dir.glob("step_*.pt") if _NAME.match(p.name))
    return found[-1] if found else None


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Read a checkpoint onto the CPU (``weights_only``: plain containers and tensors, no pickled code)
    and verify its checksum; a :class:`CheckpointError` names the file and the previous checkpoint."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({read_error(e)}); {_previous_hint(path)}") from e
    saved = state.pop("checksum", None)          # None: written before checkpoints had one
    if saved is not None and saved != payload_checksum(state):
        raise CheckpointError(f"checkpoint {path} is corrupted (its checksum {saved} does not match its "
                              f"contents); {_previous_hint(path)}")
    return state


def _previous_hint(path: Path) -> str:
    earlier = sorted(p for p in path.parent.glob("step_*.pt")    # zero-padded names; a cut file is no zip
                     if _NAME.match(p.name) and _NAME.match(path.name) and p.name < path.name and zipfile.is_zipfile(p))
    if earlier:
        return f"resume from the previous one with --resume {earlier[-1]}"
    return "no earlier checkpoint next to it is intact; start a new run (another --out)"


def restore_checkpoint(state: Dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimiser state and the RNG states (every rank; FSDP re-shards)."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    # non-strict: a parameter that never had a gradient (e.g. a KVM state projection before the
    # first overflow chunk) has no AdamW state yet, exactly as in a fresh optimiser
    set_optimizer_state_dict(model, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    set_rng_state(state["rng"])
