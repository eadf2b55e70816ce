"""``kvmeans train``: train a KVM language model (``python -m kvmeans train`` and ``torchrun -m kvmeans train`` too).

    kvmeans train --preset tiny-cpu                                   # CPU demo on the bundled text
    kvmeans train --preset tiny-cpu --max-steps 50 --out runs/t --optim.lr 1e-3
    torchrun --nproc_per_node=8 -m kvmeans train --preset kvm-sqrt-120m --data DIR
    kvmeans train --out runs/t --resume                               # continue from runs/t/ckpt/latest

Every other option is a ``--section.key value`` override (sections model, data,
optim, train; ``--model.KEY`` sets any KVMModelConfig field), e.g. ``--train.val_every 100``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from kvmeans.cli._dispatch import run_main
from kvmeans.train.checkpoint import CheckpointError
from kvmeans.train.config import RUN_PRESETS, ConfigError, parse_overrides, resolve_config
from kvmeans.utils.args import UsageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans train", description=__doc__.split("\n\n")[0].strip(),
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"run preset: {', '.join(RUN_PRESETS)} (default tiny-cpu, or the "
                   "saved config when resuming)")
    p.add_argument("--config", help="YAML or JSON file of sections merged over the preset")
    p.add_argument("--data", help="prepared data folder (train.bin, val.bin) or 'builtin' (= --data.path)")
    p.add_argument("--out", help="run folder (= --train.out)")
    p.add_argument("--max-steps", type=int, help="optimiser steps (= --train.max_steps)")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CKPT",
                   help="continue from OUT/ckpt/latest (or the given checkpoint file)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Exit code 0, or 2 with one line on stderr for a config, data or checkpoint mistake."""
    return run_main("kvmeans train", _main, sys.argv[1:] if argv is None else list(argv))


def _main(argv: List[str]) -> int:
    p = _parser()
    args, rest = p.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        for key, value in (("path", args.data), ("out", args.out), ("max_steps", args.max_steps)):
            if value is not None:
                overrides.append(("data" if key == "path" else "train", key, value))
        base = None
        if args.resume and not args.preset and args.out and (Path(args.out) / "config.json").is_file():
            base = json.loads((Path(args.out) / "config.json").read_text())
        cfg = resolve_config(args.preset, args.config, overrides, base=base)
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        from kvmeans.train.loop import train
        train(cfg, resume=args.resume)
    except (ConfigError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    return 0
