"""``kvmeans bench longctx --interleave``: decode time per token of every arm in ONE process, the arms' steps
taken in turn, so that on a shared, noisy machine every arm sees the same load and their ratios hold (the
per-process runs of :mod:`kvmeans.bench.longctx` measure memory; their decode times each see their own load)."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List

from kvmeans.bench.longctx import LongctxConfig, _kvm_settings, _load, _runner, _sync, check_config
from kvmeans.utils.modules import copy_sharing_weights

__all__ = ["run_interleaved"]


def run_interleaved(c: LongctxConfig, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Decode time per token of every arm at every length, measured in ONE process with all steps interleaved (on a
    shared, noisy machine every (arm, length) sees the same load): each arm prefills the same prompt at each length
    (all caches held at once), then every (arm, length) takes one decode step in turn, ``decode_tokens`` rounds.
    Rows: median ms per token (first round dropped), its ratio to the first arm's at that length and to the same
    arm's at the shortest length (flat decode: 1). No memory figures (one process); ``decode.csv``/``.json``."""
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
            models[arm.label] = convert_hf(copy_sharing_weights(plain), **_kvm_settings(a["spec"], c.segment))
        else:
            models[arm.label] = plain
    cfg = plain.config.get_text_config(decoder=True) if hasattr(plain.config, "get_text_config") else plain.config
    lengths = sorted(set(c.lengths))
    runners, nxt, steps = {}, {}, {}
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, cfg.vocab_size, (c.batch, length),
                                generator=torch.Generator().manual_seed(c.seed)).to(device)
            for arm in c.arms:
                key = (arm.label, length)
                runners[key] = r = _runner(models[arm.label], asdict(arm))
                t0 = time.perf_counter()
                nxt[key] = r.prefill(ids, c.segment).argmax(-1, keepdim=True)
                _sync(device)
                log(f"{arm.label} @ {length}: prefilled in {time.perf_counter() - t0:.1f} s")
                steps[key] = []
        for _ in range(c.decode_tokens):        # every (arm, length) one step in turn: the same load for all
            for key, r in runners.items():
                t0 = time.perf_counter()
                nxt[key] = r(nxt[key]).argmax(-1, keepdim=True)
                _sync(device)
                steps[key].append(time.perf_counter() - t0)
    ms = {k: 1000 * statistics.median(s[1:] if len(s) > 1 else s) for k, s in steps.items()}
    rows: List[Dict[str, Any]] = []
    for length in lengths:
        for arm in c.arms:
            key = (arm.label, length)
            rows.append({"arm": arm.label, "length": length, "decode_ms_per_tok": ms[key],
                         "ratio_to_first": ms[key] / ms[(c.arms[0].label, length)],
                         "ratio_to_shortest": ms[key] / ms[(arm.label, lengths[0])], "decode_step_s": steps[key]})
            log(f"{arm.label} @ {length}: decode {ms[key]:.2f} ms/token ({rows[-1]['ratio_to_first']:.3f}x "
                f"{c.arms[0].label}, {rows[-1]['ratio_to_shortest']:.3f}x its own at {lengths[0]})")
    write_csv(out / "decode.csv", ["arm", "length", "decode_ms_per_tok", "ratio_to_first", "ratio_to_shortest"], rows)
    write_json(out / "decode.json", {"settings": {**{k: v for k, v in asdict(c).items() if k != "arms"},
                                                  "arms": [a.label for a in c.arms], "model_folder": folder},
                                     "env": env, "rows": rows})
    return rows
