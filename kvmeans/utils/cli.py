"""Command-line plumbing: user errors (:class:`UsageError`), argument checks, and sub-command dispatch."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple


class UsageError(Exception):
    """A mistake in a command's arguments or inputs: reported as ``<prog>: error: <message>``, exit code 2."""


def run_main(prog: str, main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]]) -> int:
    """``main(argv)``, with a :class:`UsageError` turned into one line on stderr and exit code 2."""
    try:
        return main(argv)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


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


def run_subcommand(prog: str, noun: str, table: Dict[str, Tuple[str, str]], argv: List[str]) -> int:
    """Dispatch ``argv[0]`` through ``table`` (name -> (module, one-line help)); ``-h`` lists the names.

    Returns the module's exit code (2 for a :class:`UsageError`), 0 for help, 2 (with a message naming
    the choices) for an unknown name.
    """
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} <{noun}> [options]   ({prog} <{noun}> --help)\n\n{noun}s:")
        width = max(len(name) for name in table) + 2
        for name, (_, help_) in table.items():
            print(f"  {name:<{width}}{help_}")
        return 0
    if argv[0] not in table:
        print(f"{prog}: unknown {noun} {argv[0]!r}; available: {', '.join(table)}", file=sys.stderr)
        return 2
    return run_main(f"{prog} {argv[0]}", importlib.import_module(table[argv[0]][0]).main, argv[1:])
