"""A command with sub-commands, each the ``main(argv) -> int`` of a module imported only when run."""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Tuple


def run_subcommand(prog: str, noun: str, table: Dict[str, Tuple[str, str]], argv: List[str]) -> int:
    """Dispatch ``argv[0]`` through ``table`` (name -> (module, one-line help)); ``-h`` lists the names.

    Returns the module's exit code, 0 for help, 2 (with a message naming the choices) for an unknown name.
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
    return importlib.import_module(table[argv[0]][0]).main(argv[1:])
