"""``kvmeans`` command line: one subcommand per job (``kvmeans --help``)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional, Tuple


def _bench(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans bench ops [options]   (kvmeans bench ops --help)")
        return 0
    if argv[0] != "ops":
        print(f"kvmeans bench: unknown benchmark {argv[0]!r}; available: ops", file=sys.stderr)
        return 2
    from .bench.ops import main
    return main(argv[1:])


def _demo(argv: List[str]) -> int:
    """Until the training/eval demo lands: the operator benchmark on small sizes."""
    p = argparse.ArgumentParser(prog="kvmeans demo", description="KVM vs full attention on this machine, small sizes")
    p.add_argument("--out", help="output folder (default bench-results/ops-<timestamp>)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = p.parse_args(argv)
    from .bench.ops import run
    args = ["--lengths", "1024", "4096", "16384", "--repeats", "1", "--decode-steps", "32", "--device", a.device]
    result = run(args + (["--out", a.out] if a.out else []))
    print(f"\nKVM keeps a bounded state while full attention's KV cache grows with T; files in {result.out_dir}")
    return 0


COMMANDS: Dict[str, Tuple[str, Callable[[List[str]], int]]] = {
    "demo": ("KVM vs full attention on small sizes (the README's first command)", _demo),
    "bench": ("benchmarks: `kvmeans bench ops` (KVM vs SDPA: prefill, backward, decode, memory)", _bench),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans <command> [options]\n\ncommands:")
        for name, (help_, _) in COMMANDS.items():
            print(f"  {name:<8} {help_}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvmeans: unknown command {argv[0]!r}; run `kvmeans --help`", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][1](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
