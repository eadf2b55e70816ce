"""Command dispatch: a sub-command table, and user errors turned into one line and exit code 2."""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, Optional, Tuple

from kvmeans.utils.args import UsageError


def run_main(prog: str, main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]]) -> int:
    """``main(argv)``, with a :class:`UsageError` turned into one line on stderr and exit code 2."""
    try:
        return main(argv)
    except UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


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
