"""Where a KVM op call's time goes: torch.profiler over one prefill, one forward+backward and one decode chunk
of each KVM arm at ``bench ops``'s shape, against SDPA.

Prints, per (arm, mode): wall time, the sum of device-kernel times, their ratio (busy: near 1 = the kernels are the
bound; far below 1 = launches / host code are), the number of kernel launches, and the top kernels by device time.

    python benchmarks/gpu_profile.py --device cuda --paper-shape --lengths 32768 --kvm-impl triton
    python benchmarks/gpu_profile.py --device cpu --lengths 2048          # CPU: op self-times instead of kernels

Arguments are ``kvmeans bench ops``'s (``kvmeans.cli.bench_ops.parse_args``); ``--top N`` (default 12) and
``--arms a,b`` (default sdpa and both KVM arms) are this script's own.
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvmeans.bench.arms import BUDGETS, MEASURE, make_inputs, prepare_decode, resolved_kvm_impl
from kvmeans.cli.bench_ops import parse_args


def profiled(a, arm, mode, x, top):
    ctx = prepare_decode(a, arm, x) if mode == "decode" else None
    MEASURE[mode](a, arm, x, ctx)                                  # warm-up (compiles, autotunes)
    if mode == "decode":
        ctx = prepare_decode(a, arm, x)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        MEASURE[mode](a, arm, x, ctx)
        if a.dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    cuda = a.dev.type == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [e for e in prof.key_averages()
               if getattr(e, key, 0) > 0 and (not cuda or e.device_type.name == "CUDA")]
    busy = sum(getattr(e, key) for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    print(f"\n== T={x.q.shape[2]} {arm} {mode}: wall {wall * 1e3:.2f} ms, kernels {busy * 1e3:.2f} ms "
          f"(busy {busy / wall:.2f}), {launches} launches ({launches / max(wall, 1e-9) / 1e3:.1f} per ms)",
          flush=True)
    for e in sorted(kernels, key=lambda e: -getattr(e, key))[:top]:
        print(f"   {getattr(e, key) / 1e3:9.3f} ms  x{e.count:<6d} {e.key[:110]}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    top, arms = 12, ["sdpa", *BUDGETS]
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i:i + 2]
    if "--arms" in argv:                       # e.g. --arms sdpa,kvm-fixed256
        i = argv.index("--arms")
        arms = argv[i + 1].split(",")
        del argv[i:i + 2]
    a = parse_args(argv)
    a.dev = torch.device(a.device)
    a.kvm_impl = resolved_kvm_impl(a)
    print(f"# {a.device} B={a.batch} H={a.heads} Hkv={a.kv_heads} D={a.head_dim} {a.dtype} C={a.chunk_len} "
          f"n={a.n_bswa_chunks} kvm_impl={a.kvm_impl} numerics={a.numerics} modes={a.modes}", flush=True)
    for T in a.lengths:
        x = make_inputs(a, T)
        for mode in a.modes:
            for arm in arms:
                profiled(a, arm, mode, x, top)
        del x
        if a.dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
