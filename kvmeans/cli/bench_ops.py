"""``kvmeans bench ops``: KVM vs SDPA at the operator boundary (see :mod:`kvmeans.bench.ops`)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvmeans.bench.arms import (
    DTYPES,
    MODES,
)
from kvmeans.bench.ops import CPU_LENGTHS, CUDA_LENGTHS, run
from kvmeans.utils.args import UsageError, check_device, check_out_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvmeans bench ops", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--batch", type=int, help="B (default 1; 8 with --paper-shape)")
    p.add_argument("--heads", type=int, help="H (default 8; 32 with --paper-shape)")
    p.add_argument("--kv-heads", type=int, help="Hkv (default H)")
    p.add_argument("--head-dim", type=int, help="D (default 64; 128 with --paper-shape)")
    p.add_argument("--chunk-len", type=int, default=256, help="C (<= 256: the fixed arm holds 256 rows)")
    p.add_argument("--n-bswa-chunks", type=int, default=2)
    p.add_argument("--rope-dim", type=int, help="default head_dim // 2")
    p.add_argument("--sink-len", type=int, default=1)
    p.add_argument("--kvm-impl", choices=["auto", "torch", "triton"], default="auto",
                   help="KVM arms: auto = Triton kernels on CUDA when installed, torch paths otherwise")
    p.add_argument("--kvm-backward", choices=["auto", "graph", "reconstruct"], default="auto",
                   help="KVM backward mode (chunked path): graph keeps every chunk's activations, reconstruct rebuilds "
                        "each group's state in reverse (less memory), auto picks by size")
    p.add_argument("--numerics", choices=["exact", "mixed"],
                   help="KVM numerics (kvm_attention): default mixed for half dtypes (half-precision attention dots "
                        "with fp32 accumulation, like the flash SDPA it is compared with), exact otherwise")
    p.add_argument("--lengths", type=int, nargs="+", help=f"T values (default cpu {CPU_LENGTHS}, cuda adds 65536)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, help="timed repeats per (T, mode, arm), median reported (default 3)")
    p.add_argument("--decode-steps", type=int, help="decode tokens timed per repeat (default --chunk-len)")
    p.add_argument("--paper-shape", action="store_true", help="B=8, H=32, D=128, bfloat16 (meant for GPU)")
    p.add_argument("--max-sdpa-len", type=int, help="skip the SDPA arm for T above this")
    p.add_argument("--out", help="output folder (default bench-results/ops-<timestamp>)")
    p.add_argument("--quick", action="store_true", help="T = 512 1024 2048, 1 repeat, 16 decode steps")
    p.add_argument("--threads", type=int, nargs="+",
                   help="torch thread counts, measured in turn within every repeat (default: torch's current); "
                        "the CSV's thread_speedup is each arm's time at the first count over its time at this one")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    paper, quick = a.paper_shape, a.quick
    a.batch = (8 if paper else 1) if a.batch is None else a.batch      # an explicit 0 is checked, not defaulted
    a.heads = (32 if paper else 8) if a.heads is None else a.heads
    a.kv_heads = a.heads if a.kv_heads is None else a.kv_heads
    a.head_dim = (128 if paper else 64) if a.head_dim is None else a.head_dim
    a.rope_dim = a.head_dim // 2 if a.rope_dim is None else a.rope_dim
    a.dtype = a.dtype or ("bfloat16" if paper or a.device == "cuda" else "float32")
    a.numerics = a.numerics or ("mixed" if a.dtype in ("bfloat16", "float16") else "exact")
    a.lengths = a.lengths or ([512, 1024, 2048] if quick else CPU_LENGTHS if a.device == "cpu" else CUDA_LENGTHS)
    a.repeats = (1 if quick else 3) if a.repeats is None else a.repeats
    a.decode_steps = (16 if quick else a.chunk_len) if a.decode_steps is None else a.decode_steps
    a.modes = [m for m in MODES if m in a.modes]
    a.threads = a.threads or [torch.get_num_threads()]
    _check_args(a)
    if a.device == "cpu" and a.dtype != "float32":
        print(f"warning: {a.dtype} matmul has no fast path on many CPUs (can be ~100x slower than float32)",
              file=sys.stderr)
    a.out = Path(a.out or f"bench-results/ops-{time.strftime('%Y%m%d-%H%M%S')}")
    return a


def _check_args(a: argparse.Namespace) -> None:
    """A :class:`UsageError` naming the first argument out of range."""
    for flag, value, low in (("--batch", a.batch, 1), ("--heads", a.heads, 1), ("--kv-heads", a.kv_heads, 1),
                             ("--head-dim", a.head_dim, 1), ("--chunk-len", a.chunk_len, 1),
                             ("--n-bswa-chunks", a.n_bswa_chunks, 1), ("--sink-len", a.sink_len, 0),
                             ("--rope-dim", a.rope_dim, 0), ("--repeats", a.repeats, 1),
                             ("--decode-steps", a.decode_steps, 1), ("--lengths", min(a.lengths), 1),
                             ("--max-sdpa-len", 1 if a.max_sdpa_len is None else a.max_sdpa_len, 1),
                             ("--threads", min(a.threads), 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if a.sink_len >= a.chunk_len:
        raise UsageError(f"--sink-len {a.sink_len} must be below --chunk-len {a.chunk_len}")
    if a.rope_dim > a.head_dim:
        raise UsageError(f"--rope-dim {a.rope_dim} must be at most --head-dim {a.head_dim}")
    if a.heads % a.kv_heads:
        raise UsageError(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    check_device("--device", a.device)
    if a.out is not None:
        check_out_dir("--out", a.out)
    if a.kvm_impl == "triton":
        from kvmeans.ops.triton import unavailable_reason
        why = unavailable_reason(a.device, torch.float32)
        if why:
            raise UsageError(f"--kvm-impl triton: {why}")


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0
