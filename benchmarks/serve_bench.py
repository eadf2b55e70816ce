"""Full attention vs KVM served by the same vLLM engine with the same cache memory (docs/serving.md).

Two measurements, each arm in its own process (one engine at a time; ``VLLM_CPU_KVCACHE_SPACE`` is the cache
memory on CPU, ``--gpu-memory-utilization`` on a GPU):

* capacity: for each ``--contexts`` length L, an engine with ``max_model_len=L`` reports how many requests of L
  tokens its cache holds at once (vLLM's own count: cache blocks / blocks one request of L tokens needs; for KVM
  one state slot per request, sized for L);
* throughput: ``--requests`` requests of ``--prompt-len`` random tokens each, ``--max-tokens`` greedy tokens
  each (ignore_eos), submitted at once with ``max_num_seqs=--requests``: wall time and output tok/s (all output
  tokens / wall time, prefill included).

    /work/venv-vllm/bin/python benchmarks/serve_bench.py --model ~/.cache/kvmeans/models/smollm2-135m \\
        --out benchmarks/results/serve-cpu

The KVM arm converts the plain folder on the fly (``--kvm``, training-free, as ``kvmeans serve --kvm``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvmeans.utils.io import atomic_write_text

DEFAULT_KVM = "budget=fixed:132,chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32,exact_scope=layer"


def worker(job: dict) -> dict:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{job['cache_gib']:g}"          # vLLM reads an integer number of GiB
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if job.get("allow_long"):                   # a context beyond the model's trained length: speed, not quality
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    import torch
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    kw = dict(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True,
              seed=0, max_num_seqs=job.get("max_num_seqs", 256))
    if job["kvm"]:
        from kvmeans.serve.vllm_plugin import kvm_hf_overrides
        kw["hf_overrides"] = kvm_hf_overrides(job["model"], job["kvm"])
    if job.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = job["gpu_memory_utilization"]
    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    res = {"start_s": round(time.perf_counter() - t0, 1)}
    core = llm.llm_engine.engine_core.engine_core
    kv = core.scheduler.kv_cache_config
    res["cache_blocks"] = kv.num_blocks
    res["max_concurrency"] = round(get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config, kv), 2)
    if job.get("requests"):
        g = torch.Generator().manual_seed(0)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, vocab - 100, (job["prompt_len"],),
                                                                generator=g).tolist())
                   for _ in range(job["requests"])]
        sp = vllm.SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
        llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        res.update(wall_s=round(wall, 1), output_tokens=n_out, output_tok_s=round(n_out / wall, 2),
                   total_tok_s=round((n_out + job["requests"] * job["prompt_len"]) / wall, 1))
    llm.llm_engine.engine_core.shutdown()
    return res


def run_job(job: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr or p.stdout)[-1500:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a plain transformers folder (Llama / Qwen2 / Qwen3)")
    ap.add_argument("--kvm", default=DEFAULT_KVM, help=f"the KVM arm's spec (default {DEFAULT_KVM})")
    ap.add_argument("--cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for every engine (GiB)")
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--arms", nargs="*", default=["full", "kvm"], choices=["full", "kvm"])
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="throughput runs per arm, in ABBA order (the arms reversed every other round) so that a "
                         "machine whose speed drifts during the run slows both arms alike")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine run")
    ap.add_argument("--allow-long", action="store_true",
                    help="let max_model_len exceed the model's trained context (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): "
                         "memory and speed do not depend on it, the tokens past it are not meaningful")
    ap.add_argument("--out", type=Path, default=None, help="write results.json here")
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
    if not a.model:
        ap.error("--model is required")
    base = dict(model=str(Path(a.model).expanduser()), dtype=a.dtype, cache_gib=a.cache_gib, allow_long=a.allow_long)
    rows = []
    settings = {k: v for k, v in vars(a).items() if k not in ("worker", "out")}

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:                                   # after every row: a run cut short keeps what it measured
            a.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(a.out / "results.json", json.dumps({"settings": settings, "rows": rows}, indent=1,
                                                                  default=str))

    for arm in a.arms:                              # capacity first (quick), then throughput
        for L in a.contexts:
            r = run_job({**base, "kvm": a.kvm if arm == "kvm" else None, "max_model_len": L}, a.timeout)
            record({"arm": arm, "what": "capacity", "context": L, **r})
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    order = [arm for rep in range(a.repeats) for arm in (a.arms if rep % 2 == 0 else a.arms[::-1])]
    for i, arm in enumerate([] if a.skip_throughput else order):
        r = run_job({**base, "kvm": a.kvm if arm == "kvm" else None, "max_model_len": a.prompt_len + a.max_tokens,
                     "max_num_seqs": a.requests, "requests": a.requests, "prompt_len": a.prompt_len,
                     "max_tokens": a.max_tokens}, a.timeout)
        record({"arm": arm, "what": "throughput", "round": i // len(a.arms), "requests": a.requests,
                "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, **r})
    by_round = {}
    for row in rows:
        if row["what"] == "throughput" and row.get("wall_s"):      # unrounded: output tokens / wall
            by_round.setdefault(row["round"], {})[row["arm"]] = row["output_tokens"] / row["wall_s"]
    ratios = [r["kvm"] / r["full"] for r in by_round.values() if r.get("full") and "kvm" in r]
    if ratios:
        record({"what": "ratio", "kvm_over_full_output_tok_s": [round(x, 3) for x in ratios],
                "median": round(statistics.median(ratios), 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
