"""``kvmeans bench longctx --interleave``: decode time per token of every arm in ONE process, the arms' steps
taken in turn, so that on a shared, noisy machine every arm sees the same load and their ratios hold (the
per-process runs of :mod:`kvmeans.bench.longctx` measure memory; their decode times each see their own load)."""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List

from kvmeans.bench.longctx import LongctxConfig, _kvm_settings, _load, _runner, _sync, check_config

__all__ = ["run_interleaved"]


def run_interleaved(c: LongctxConfig, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Decode time per token of every arm, measured in ONE process with the arms' steps interleaved (on a shared,
    noisy machine every arm sees the same load): per length, each arm prefills the same prompt, then the arms take
    one decode step each in turn, ``decode_tokens`` rounds. Rows: median ms per token (first round dropped) and
    the ratio to the first arm's. No memory figures (the arms share a process); ``decode.csv`` / ``decode.json``."""
    import torch

    from kvmeans.bench.report import env_info, format_env, write_csv, write_json
    folder, random = check_config(c)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    env = env_info(c.device)
    log(format_env(env))
    if c.threads:
        torch.set_num_threads(c.threads)
    device = torch.device(c.device)
    base = {"model": folder, "random": random, "dtype": c.dtype, "seed": c.seed}
    plain = _load(base, device)
    models = {}
    for arm in c.arms:
        a = asdict(arm)
        if arm.kind == "kvm":
            from kvmeans.pretrained.convert import convert_hf
            models[arm.label] = convert_hf(copy.deepcopy(plain), **_kvm_settings(a["spec"], c.segment))
        else:
            models[arm.label] = plain
    cfg = plain.config.get_text_config(decoder=True) if hasattr(plain.config, "get_text_config") else plain.config
    rows: List[Dict[str, Any]] = []
    for length in sorted(set(c.lengths)):
        ids = torch.randint(0, cfg.vocab_size, (c.batch, length),
                            generator=torch.Generator().manual_seed(c.seed)).to(device)
        runners, nxt, steps = {}, {}, {}
        with torch.no_grad():
            for arm in c.arms:
                runners[arm.label] = r = _runner(models[arm.label], asdict(arm))
                t0 = time.perf_counter()
                nxt[arm.label] = r.prefill(ids, c.segment).argmax(-1, keepdim=True)
                _sync(device)
                log(f"{arm.label} @ {length}: prefilled in {time.perf_counter() - t0:.1f} s")
                steps[arm.label] = []
            for _ in range(c.decode_tokens):
                for arm in c.arms:
                    t0 = time.perf_counter()
                    nxt[arm.label] = runners[arm.label](nxt[arm.label]).argmax(-1, keepdim=True)
                    _sync(device)
                    steps[arm.label].append(time.perf_counter() - t0)
        first = None
        for arm in c.arms:
            s = steps[arm.label]
            ms = 1000 * statistics.median(s[1:] if len(s) > 1 else s)
            first = ms if first is None else first
            rows.append({"arm": arm.label, "length": length, "decode_ms_per_tok": ms, "ratio_to_first": ms / first,
                         "decode_step_s": s})
            log(f"{arm.label} @ {length}: decode {ms:.2f} ms/token ({ms / first:.3f}x {c.arms[0].label})")
        del runners
        write_csv(out / "decode.csv", ["arm", "length", "decode_ms_per_tok", "ratio_to_first"], rows)
        write_json(out / "decode.json", {"settings": {**{k: v for k, v in asdict(c).items() if k != "arms"},
                                                      "arms": [a.label for a in c.arms], "model_folder": folder},
                                         "env": env, "rows": rows})
    return rows
