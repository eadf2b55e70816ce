"""``kvmeans data <action>``: data preparation."""
from __future__ import annotations

from typing import List

from kvmeans.cli._dispatch import run_subcommand


def main(argv: List[str]) -> int:
    return run_subcommand("kvmeans data", "action", {
        "prepare": ("kvmeans.cli.data_prepare", "tokenize files into a token file: `--input PATH... --out DIR`"),
        "corpora": ("kvmeans.cli.data_corpora", "the offline evaluation corpora: their table; `--verify` loads and "
                    "hash-checks each installed one")}, argv)
