"""Operator benchmark: KVM (fixed-256 and 16*sqrt(N) budgets) against full causal SDPA.

``kvmeans bench ops [--quick] [--device cuda] ...`` (see ``--help``).
Shapes: ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``, ``gate [B, Hkv, T]`` (``1 + elu(randn)``),
``dy [B, H, T, D]``; the three arms see the same tensors in the same run.

Modes (times in ms, median over ``--repeats``; each repeat runs sdpa, kvm-fixed256, kvm-sqrt16 in turn, at each of
``--threads`` torch thread counts in turn, so the counts are compared under the same load):
  prefill:  forward of T tokens under ``torch.no_grad()`` (KVM with ``return_state=False``).
  backward: ``(y * dy).sum().backward()`` only; q, k, v (and gate for KVM) require grad. The forward
            with grad is timed separately (CSV ``fwd_grad_ms``).
  decode:   mean per-token time of ``--decode-steps`` (default chunk_len: one chunk-boundary update per C
            tokens, as in a long generation) consecutive one-token steps after T tokens: KVM continues a
            copy of a prefilled state (``initial_state``, recurrent path; the copy adopts its buffers before the
            clock starts, as a prefill leaves them; for T a multiple of chunk_len the first step runs a
            chunk-boundary update); SDPA writes the new k/v into a preallocated cache and attends one query over
            ``cache[:T+i+1]``. CSV ``step_median_ms`` / ``step_max_ms`` give the steady-state and the worst step.
Memory: KVM state rows and ``state.nbytes`` right after prefilling T tokens (``state_bytes``; the
decode buffers with spare capacity are ``state_bytes_decode``) vs the KV cache ``2*B*Hkv*T*D*elem``.
FLOP bound: each arm's useful FLOPs (:mod:`kvmeans.bench.flops`) per second against the rate of one large matmul
in the run's dtype, measured at the start and at the end of the run (the faster is kept): CSV ``useful_gflop``,
``gflops``, ``matmul_gflops``, ``bound_fraction``; the table's "of bound" column. Decode is bound by reading
its keys and values instead: ``useful_read_mb`` per token, ``read_gbps`` reached, ``read_rate_gbps`` of a plain
read of as many bytes (measured after the decode repeats of each T) and ``read_fraction``, which the table's
"of bound" column shows for decode rows.
KVM implementation (``--kvm-impl``, CSV ``kvm_impl``): auto = the Triton kernels on CUDA when Triton is
installed (``backend="triton"``), the torch paths otherwise; run once with ``torch`` and once with ``triton``
to compare them. On CUDA the warm-up call also runs the kernels' autotuning.
Warm-up: on CPU once per (arm, mode) at the first length; on CUDA once per (arm, mode, T), with
``torch.cuda.synchronize`` around every timed region.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from kvmeans.bench.arms import (
    ARMS,
    BUDGETS,
    DTYPES,
    MEASURE,
    is_oom,
    make_inputs,
    prepare_decode,
    resolved_kvm_impl,
)
from kvmeans.bench.flops import matmul_rate, read_rate, useful_bytes, useful_flops
from kvmeans.bench.report import env_info, format_env, human_bytes, plot_panels, print_table, write_csv, write_json
from kvmeans.ops.schedule import rows_after

CPU_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
CUDA_LENGTHS = CPU_LENGTHS + [65536]
COLUMNS = ["T", "mode", "arm", "threads", "time_ms", "time_min_ms", "time_max_ms", "repeats", "fwd_grad_ms",
           "step_median_ms", "step_max_ms", "speedup_vs_sdpa", "thread_speedup", "rows", "state_bytes",
           "state_bytes_used",
           "state_bytes_decode", "kv_cache_bytes", "status", "device", "dtype", "batch", "heads", "kv_heads",
           "head_dim", "chunk_len", "n_bswa_chunks", "sink_len", "rope_dim", "decode_steps", "kvm_impl", "kvm_backward",
           "numerics",
           "saved_bytes", "useful_gflop", "gflops", "matmul_gflops", "bound_fraction", "useful_read_mb", "read_gbps",
           "read_rate_gbps", "read_fraction"]


@dataclass
class OpsResult:
    """What :func:`run` produced: the output folder, file paths (png None without matplotlib), CSV rows."""
    out_dir: Path
    csv: Path
    png: Optional[Path]
    env_json: Path
    rows: List[Dict[str, object]] = field(default_factory=list)


def _state_memory(a, arm, T, state) -> Dict[str, int]:
    expect = rows_after(BUDGETS[arm], T, a.chunk_len, a.n_bswa_chunks)
    if state.num_rows != expect:
        print(f"warning: {arm} T={T}: state has {state.num_rows} rows, rows_after() says {expect}", file=sys.stderr)
    return {"rows": state.num_rows, "state_bytes": state.nbytes, "state_bytes_used": state.nbytes_used}


# ---- the run ----------------------------------------------------------------------------------
def run(a) -> OpsResult:
    """Measure the settings ``a`` (``kvmeans.cli.bench_ops.parse_args``), print the table, write ``ops.csv``,
    ``ops.png`` and ``env.json`` to ``a.out``."""
    a.dev = torch.device(a.device)
    a.kvm_impl = resolved_kvm_impl(a)
    info = env_info(a.device)
    print(format_env(info))
    print(f"# shape B={a.batch} H={a.heads} Hkv={a.kv_heads} D={a.head_dim} {a.dtype} C={a.chunk_len} "
          f"n={a.n_bswa_chunks} sink={a.sink_len} rope_dim={a.rope_dim} kvm_impl={a.kvm_impl} "
          f"kvm_backward={a.kvm_backward} numerics={a.numerics}; repeats={a.repeats} (median), "
          f"decode_steps={a.decode_steps}; modes={' '.join(a.modes)}; threads={' '.join(map(str, a.threads))}",
          flush=True)
    threads0 = torch.get_num_threads()
    rates = [matmul_rate(a.dev, DTYPES[a.dtype])]       # the FLOP bound's rate, measured again at the end
    res: Dict[tuple, Dict[str, list]] = {}       # (T, mode, arm, threads) -> {"time": [...], ...} or {"status": "oom"}
    mem: Dict[tuple, Dict[str, int]] = {}        # (T, arm) -> rows / bytes
    warmed, start = set(), time.perf_counter()
    for T in a.lengths:
        arms = [arm for arm in ARMS if arm != "sdpa" or a.max_sdpa_len is None or T <= a.max_sdpa_len]
        x = make_inputs(a, T)
        for mode in a.modes:
            ctx, live = {}, []
            for arm in arms:
                for th in a.threads:
                    res[T, mode, arm, th] = {}
                try:
                    if mode == "decode":
                        ctx[arm] = prepare_decode(a, arm, x)
                        if arm != "sdpa":
                            mem[T, arm] = _state_memory(a, arm, T, ctx[arm])
                    for th in a.threads:
                        key = (arm, mode, th) if a.dev.type == "cpu" else (arm, mode, th, T)
                        if key not in warmed:
                            torch.set_num_threads(th)
                            MEASURE[mode](a, arm, x, ctx.get(arm))
                            warmed.add(key)
                    live.append(arm)
                except (RuntimeError, MemoryError) as e:
                    if not is_oom(e):
                        raise
                    for th in a.threads:
                        res[T, mode, arm, th]["status"] = "oom"
                    print(f"[ops] T={T} {mode} {arm}: out of memory, skipped", file=sys.stderr)
            for r in range(a.repeats):
                for th in a.threads:
                    torch.set_num_threads(th)
                    for arm in list(live):
                        try:
                            m = MEASURE[mode](a, arm, x, ctx.get(arm))
                        except (RuntimeError, MemoryError) as e:
                            if not is_oom(e):
                                raise
                            live.remove(arm)
                            for t in a.threads:
                                res[T, mode, arm, t]["status"] = "oom"
                            continue
                        for name, val in m.items():
                            res[T, mode, arm, th].setdefault(name, []).append(val)
                        print(f"[ops] T={T} {mode} {arm} threads={th} rep {r + 1}/{a.repeats}: "
                              f"{m['time'] * 1e3:.3f} ms ({time.perf_counter() - start:.0f} s elapsed)",
                              file=sys.stderr, flush=True)
            torch.set_num_threads(threads0)
            if mode == "decode":                # the read bound of each arm's bytes per token, measured now
                for arm in live:
                    rate = [read_rate(a.dev, _decode_bytes(a, arm, T))]
                    for th in a.threads:
                        res[T, mode, arm, th]["read_rate"] = rate
            del ctx
            if a.dev.type == "cuda":
                torch.cuda.empty_cache()
        for arm in BUDGETS:
            if (T, arm) not in mem:             # no decode run: one untimed prefill for the state size
                try:
                    mem[T, arm] = _state_memory(a, arm, T, prepare_decode(a, arm, x))
                except (RuntimeError, MemoryError) as e:
                    if not is_oom(e):
                        raise
        del x
    info["loadavg_end"] = env_info(a.device)["loadavg"]
    rates.append(matmul_rate(a.dev, DTYPES[a.dtype]))
    a.matmul_rate = info["matmul_gflops"] = max(rates) / 1e9
    print(f"# matmul rate ({a.dtype}, one large square matmul): {rates[0] / 1e9:.1f} GFLOP/s at start, "
          f"{rates[1] / 1e9:.1f} at end; the bound uses {a.matmul_rate:.1f}")
    print(f"# /proc/loadavg at end: {info['loadavg_end']}  ({time.perf_counter() - start:.0f} s)")
    return _report(a, info, res, mem)


def _decode_bytes(a, arm, T) -> float:
    return useful_bytes(arm, T, batch=a.batch, kv_heads=a.kv_heads, head_dim=a.head_dim, chunk_len=a.chunk_len,
                        n_bswa_chunks=a.n_bswa_chunks, decode_steps=a.decode_steps,
                        elem=torch.empty(0, dtype=DTYPES[a.dtype]).element_size(), budget=BUDGETS.get(arm))


def _ms(vals, pick=statistics.median):
    """Seconds -> ms of ``pick(vals)``; None for no values."""
    return pick(vals) * 1e3 if vals else None


def _csv_rows(a, res, mem, kv) -> List[Dict[str, object]]:
    cfg = dict(device=a.device, dtype=a.dtype, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
               head_dim=a.head_dim, chunk_len=a.chunk_len, n_bswa_chunks=a.n_bswa_chunks, sink_len=a.sink_len,
               rope_dim=a.rope_dim, decode_steps=a.decode_steps, kvm_impl=a.kvm_impl, kvm_backward=a.kvm_backward,
               numerics=a.numerics)
    rows = []
    for (T, mode, arm, th), r in res.items():
        t = _ms(r.get("time"))
        sd = _ms(res.get((T, mode, "sdpa", th), {}).get("time"))
        first = _ms(res.get((T, mode, arm, a.threads[0]), {}).get("time"))     # the same arm at the first count
        # the "state" of full attention is its KV cache
        m = {"rows": T, "state_bytes": kv(T), "state_bytes_used": kv(T)} if arm == "sdpa" else mem.get((T, arm), {})
        flops = useful_flops(arm, mode, T, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                             chunk_len=a.chunk_len, n_bswa_chunks=a.n_bswa_chunks, decode_steps=a.decode_steps,
                             budget=BUDGETS.get(arm))
        rate = flops / (t / 1e3) / 1e9 if t else None          # GFLOP/s of useful work
        read = {}
        if mode == "decode" and t and r.get("read_rate"):
            nbytes = _decode_bytes(a, arm, T)
            got, peak = nbytes / (t / 1e3) / 1e9, r["read_rate"][0] / 1e9
            read = {"useful_read_mb": nbytes / 2 ** 20, "read_gbps": got, "read_rate_gbps": peak,
                    "read_fraction": got / peak}
        rows.append({"T": T, "mode": mode, "arm": arm, "threads": th, "time_ms": t,
                     "time_min_ms": _ms(r.get("time"), min),
                     "time_max_ms": _ms(r.get("time"), max), "repeats": len(r.get("time", [])),
                     "fwd_grad_ms": _ms(r.get("fwd_grad")), "step_median_ms": _ms(r.get("step_median")),
                     "step_max_ms": _ms(r.get("step_max")), "speedup_vs_sdpa": sd / t if t and sd else None,
                     "thread_speedup": first / t if t and first else None,
                     **m, "state_bytes_decode": max(r["state_bytes_decode"]) if r.get("state_bytes_decode") else None,
                     "kv_cache_bytes": kv(T), "status": r.get("status", "ok" if t else "skipped"),
                     "saved_bytes": int(max(r["saved_bytes"])) if r.get("saved_bytes") else None,
                     "useful_gflop": flops / 1e9, "gflops": rate, "matmul_gflops": a.matmul_rate,
                     "bound_fraction": rate / a.matmul_rate if rate else None, **read, **cfg})
    return rows


def _report(a, info, res, mem) -> OpsResult:
    elem = torch.empty(0, dtype=DTYPES[a.dtype]).element_size()
    kv = lambda T: 2 * a.batch * a.kv_heads * T * a.head_dim * elem
    rows, table = _csv_rows(a, res, mem, kv), []
    fmt = lambda ms: "-" if ms is None else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"
    by = {(row["T"], row["mode"], row["arm"], row["threads"]): row for row in rows}
    for T, mode, th in ((T, mode, th) for T in a.lengths for mode in a.modes for th in a.threads):
        g = lambda arm, k: by.get((T, mode, arm, th), {}).get(k)
        cell = lambda arm: "oom" if g(arm, "status") == "oom" else fmt(g(arm, "time_ms"))
        sp = lambda arm: "" if g(arm, "speedup_vs_sdpa") is None else f"{g(arm, 'speedup_vs_sdpa'):.2f}x"
        of = "read_fraction" if mode == "decode" else "bound_fraction"
        bound = lambda arm: "-" if g(arm, of) is None else f"{100 * g(arm, of):.{0 if g(arm, of) >= 0.1 else 1}f}%"
        mf, ms = mem.get((T, "kvm-fixed256"), {}), mem.get((T, "kvm-sqrt16"), {})
        scale = "/".join("-" if g(arm, "thread_speedup") is None else f"{g(arm, 'thread_speedup'):.2f}x"
                         for arm in ARMS)
        table.append([T, mode, th, cell("sdpa"), cell("kvm-fixed256"), cell("kvm-sqrt16"), sp("kvm-fixed256"),
                      sp("kvm-sqrt16"), mf.get("rows", ""), ms.get("rows", ""),
                      f"{human_bytes(mf.get('state_bytes'))}/{human_bytes(ms.get('state_bytes'))}",
                      human_bytes(kv(T)), "/".join(bound(arm) for arm in ARMS), scale])
    print(f"\n# times in ms (median of {a.repeats}); decode = mean per token over {a.decode_steps} steps; "
          f"speedup = sdpa / kvm; bytes per layer; of bound = useful FLOPs / time / matmul rate "
          f"({a.matmul_rate:.1f} GFLOP/s; kvmeans.bench.flops), for decode keys/values read per token / time / "
          f"read rate of as many bytes")
    print_table(["T", "mode", "threads", "sdpa", "kvm-fixed256", "kvm-sqrt16", "speedup fixed", "speedup sqrt",
                 "rows fixed", "rows sqrt", "state bytes fixed/sqrt", "kv-cache bytes", "of bound sdpa/fixed/sqrt",
                 f"vs {a.threads[0]} thread(s) sdpa/fixed/sqrt"], table)
    if "backward" in a.modes:
        kept = lambda T, arm: by.get((T, "backward", arm, a.threads[0]), {}).get("saved_bytes")
        print("\n# kept by autograd for backward (bytes, inputs included; the memory a training step holds per layer)")
        print_table(["T", "sdpa", "kvm-fixed256", "kvm-sqrt16"],
                    [[T, *(human_bytes(kept(T, arm)) for arm in ARMS)] for T in a.lengths])
    out = Path(a.out)
    csv_path = write_csv(out / "ops.csv", COLUMNS, rows)
    config = {k: v for k, v in vars(a).items() if k not in ("dev", "out", "argv")}
    env_path = write_json(out / "env.json", {"env": info, "config": config, "argv": a.argv})
    Ts = a.lengths
    th = a.threads[-1]                  # the plot shows the last thread count
    series = lambda mode: {arm: (Ts, [by.get((T, mode, arm, th), {}).get("time_ms") for T in Ts]) for arm in ARMS}
    panels = [{"title": f"{mode}" + (" (per token)" if mode == "decode" else ""), "ylabel": "time (ms)",
               "series": series(mode)} for mode in a.modes]
    panels.append({"title": "memory per layer", "ylabel": "bytes", "series": {   # colours follow the arms
        "full KV cache": (Ts, [kv(T) for T in Ts]),
        "kvm-fixed256 state": (Ts, [mem.get((T, "kvm-fixed256"), {}).get("state_bytes") for T in Ts]),
        "kvm-sqrt16 state": (Ts, [mem.get((T, "kvm-sqrt16"), {}).get("state_bytes") for T in Ts])}})
    title = (f"KVM vs SDPA, {info['device_name']}, B={a.batch} H={a.heads} Hkv={a.kv_heads} D={a.head_dim} "
             f"{a.dtype}, git {info['git_commit']}")
    png = plot_panels(out / "ops.png", panels, title=title)
    print(f"wrote {csv_path}" + (f", {png}" if png else "") + f", {env_path}")
    return OpsResult(out, csv_path, png, env_path, rows)
