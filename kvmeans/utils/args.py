"""User errors (:class:`UsageError`) and the argument checks and spec parsers that raise them: library code
validates what a user gave it and names the flag; the CLI (``kvmeans.cli``) prints the message."""
from __future__ import annotations

import os
from typing import Optional


class UsageError(Exception):
    """A mistake in a command's arguments or inputs: reported as ``<prog>: error: <message>``, exit code 2."""


def check_device(flag: str, value: str):
    """``value`` as a ``torch.device`` this machine has, else a :class:`UsageError` naming ``flag``."""
    import torch
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag} {value!r} is not a device; use cpu, cuda or cuda:N") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (backend is not None and hasattr(backend, "is_available")
                                     and backend.is_available()):
        raise UsageError(f"{flag} {value}: no {device.type} device on this machine "
                         f"(torch.{device.type}.is_available() is False); use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"{flag} {value}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_out_dir(flag: str, path: "os.PathLike | str") -> None:
    """Refuse an output folder that exists as a file (every writer would fail deep inside)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file; give a folder (it is created if missing)")


def parse_kvm_arg(spec: Optional[str], budget_later: bool = False) -> Optional[dict]:
    """``convert_hf`` keyword arguments of ``--kvm SPEC`` (None without it); a :class:`UsageError` when bad.
    ``budget_later``: the command sets the budget per kept keys (benches), so ``exact_rows`` is checked then."""
    if spec is None:
        return None
    from kvmeans.pretrained.convert import parse_kvm_spec
    try:
        return parse_kvm_spec(spec, budget_later=budget_later)
    except ValueError as err:
        raise UsageError(f"--kvm {spec}: {err}") from None


def parse_budget_arg(spec: Optional[str]):
    """The budget of ``--budget SPEC`` (None without it); a :class:`UsageError` naming ``--budget`` when bad."""
    if spec is None:
        return None
    from kvmeans.ops.budget import parse_budget_spec
    try:
        return parse_budget_spec(str(spec))
    except ValueError as err:
        raise UsageError(f"--budget: {err}") from None


def check_model_dir(model_dir: str) -> None:
    """A :class:`UsageError` naming ``--model`` unless ``model_dir`` is a folder with a config.json."""
    if not os.path.isdir(model_dir):
        raise UsageError(f"--model {model_dir}: not a directory; give the folder of a saved model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"--model {model_dir}: no config.json in it; give the folder of a saved model "
                         "(e.g. OUT/final of kvmeans train)")
