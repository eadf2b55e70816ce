"""``kvmeans demo``: the main job (see :mod:`kvmeans.demo`)."""
from __future__ import annotations

import argparse
import time
from typing import List, Optional

from kvmeans import demo
from kvmeans.demo import DEFAULT_TASK, TASKS
from kvmeans.utils.args import check_device, check_out_dir


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans demo", description=demo.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, fewer steps (1-2 minutes on a 2-core CPU)")
    p.add_argument("--task", default=DEFAULT_TASK, choices=tuple(TASKS),
                   help=f"recall task (default {DEFAULT_TASK}; multikey: needles with distractors, "
                        "more with the length)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2; --quick: 0)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes of one torch thread each (default: one per CPU core; 1 with --device cuda)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=None, help="output folder (default results/demo-<timestamp>)")
    args = p.parse_args(argv)
    if args.workers is not None and (args.workers < 1 or (args.workers > 1 and args.device != "cpu")):
        p.error(f"--workers {args.workers}: use --workers >= 1, and --workers 1 with --device {args.device}")
    check_device("--device", args.device)
    if args.out is not None:
        check_out_dir("--out", args.out)
    t0 = time.perf_counter()
    demo.run_demo(args.out, quick=args.quick, device=args.device, seeds=args.seeds, workers=args.workers,
                  task=args.task)
    print(f"total wall time {time.perf_counter() - t0:.1f}s")
    return 0
