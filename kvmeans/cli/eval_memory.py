"""``kvmeans eval memory``: state rows, cache bytes, prefill and decode vs length (see :mod:`kvmeans.eval.memory`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from kvmeans.bench.report import format_table, human_bytes
from kvmeans.cli._common import add_kvm_argument
from kvmeans.eval.memory import (
    BUDGET_FORMS,
    PAPER_BUDGETS,
    _describe,
    _model_dtype,
    _rows_cell,
    measure_model,
    parse_budget,
    schedule_curves,
    write_model_outputs,
    write_schedule_outputs,
)
from kvmeans.models.load import conversion_settings, load_model
from kvmeans.utils.args import UsageError, check_device, check_model_dir, check_out_dir, parse_kvm_arg


# ---- command line -----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans eval memory",
                                description="State rows, cache bytes, prefill time and decode speed vs length "
                                            "(vs a full-attention KV cache); --schedule: budgets only, no model.")
    p.add_argument("--model", action="append", default=[], metavar="DIR", help="model directory (repeatable)")
    p.add_argument("--preset", action="append", default=[], metavar="NAME",
                   help="a kvmeans.models preset with random weights (repeatable), e.g. kvm-120m, tiny-cpu")
    p.add_argument("--label", action="append", default=None, help="one per --model/--preset, in that order")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths N (default 256 1024 4096; schedule mode: 2^8 .. 2^20)")
    p.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens decoded after each prefill")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32",
                   help="model dtype (auto: as stored; presets: float32)")
    p.add_argument("--schedule", action="store_true", help="also (or only) draw the budgets' state-size curves")
    p.add_argument("--budget", action="append", default=None, metavar="SPEC",
                   help=f"schedule mode (repeatable): {BUDGET_FORMS} (default: the paper's three)")
    p.add_argument("--chunk-len", type=int, default=256, help="schedule mode: chunk length C (default 256)")
    p.add_argument("--n-bswa-chunks", type=int, default=2, help="schedule mode: window chunks n (default 2)")
    p.add_argument("--out", default="memory", help="output folder (default ./memory)")
    add_kvm_argument(p)
    return p


def _load(kind: str, name: str, device: str, dtype: str, kvm: Optional[dict] = None):
    from kvmeans.models.config import preset
    if kind == "preset":
        from kvmeans.models.transformer import KVMLanguageModel
        model = KVMLanguageModel(preset(name))
        if dtype not in ("auto", "float32"):
            model = model.to(getattr(torch, dtype))
        return model.to(device).eval()
    return load_model(name, dtype if dtype == "auto" else getattr(torch, dtype), device, kvm)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    prog = p.prog
    kvm = parse_kvm_arg(a.kvm)
    sources = [("model", d) for d in a.model] + [("preset", n) for n in a.preset]
    if not sources and not a.schedule:
        raise UsageError("give --model DIR and/or --preset NAME (e.g. --preset tiny-cpu), "
                         "or --schedule for budgets only")
    if kvm is not None and a.preset:
        raise UsageError("--kvm converts transformers --model folders; presets are KVM models already")
    if a.label is not None and len(a.label) != len(sources):
        raise UsageError(f"give one --label per --model/--preset ({len(sources)}), or none")
    if a.lengths is not None and min(a.lengths) < 1:
        raise UsageError(f"--lengths must be >= 1, got {min(a.lengths)}")
    if a.decode_tokens < 0 or a.batch_size < 1 or a.chunk_len < 1 or a.n_bswa_chunks < 1:
        raise UsageError("need --decode-tokens >= 0, --batch-size >= 1, --chunk-len >= 1 and --n-bswa-chunks >= 1")
    check_device("--device", a.device)
    check_out_dir("--out", a.out)
    from kvmeans.models.config import PRESETS
    for kind, name in sources:
        if kind == "preset" and name not in PRESETS:
            raise UsageError(f"--preset {name!r}: unknown; available: {', '.join(sorted(PRESETS))}")
        if kind == "model" and not Path(name).is_dir():
            raise UsageError(f"--model {name}: no such directory")
        if kind == "model":
            check_model_dir(name)
    if a.budget and not a.schedule:
        raise UsageError("--budget sets the --schedule curves (a model is measured under its own budget); "
                         "add --schedule")
    try:
        budgets = dict(parse_budget(s) for s in a.budget) if a.budget else None
    except ValueError as err:
        raise UsageError(str(err)) from None
    if a.threads is not None:
        if a.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    written: List[Path] = []
    if a.schedule:
        lengths = a.lengths or [2 ** k for k in range(8, 21)]
        try:
            rows = schedule_curves(lengths, budgets, a.chunk_len, a.n_bswa_chunks)
        except ValueError as err:
            raise UsageError(f"--budget {err}") from None
        labels = list((budgets or PAPER_BUDGETS).keys())
        table = [[n] + [next(_rows_cell(r) for r in rows if r["budget"] == b and r["N"] == n) for b in labels] + [n]
                 for n in lengths]
        print(format_table(["N"] + labels + ["full attention"], table))
        cfg = {"chunk_len": a.chunk_len, "n_bswa_chunks": a.n_bswa_chunks,
               "budgets": {k: repr(v) for k, v in (budgets or PAPER_BUDGETS).items()}}
        written += write_schedule_outputs(a.out, rows, cfg).values()
    if sources:
        lengths = a.lengths or [256, 1024, 4096]
        labels = a.label or [Path(n).name if k == "model" else n for k, n in sources]
        measured = []
        for label, (kind, name) in zip(labels, sources):
            model = _load(kind, name, a.device, a.dtype, kvm)
            cfg = _describe(model)
            print(f"[{label}] {kind} {name}: layers {cfg.mixers}, budget {cfg.budget}, "
                  f"Hkv {cfg.kv_heads}, D {cfg.qk_head_dim}, {_model_dtype(model)}")
            try:
                res = measure_model(model, lengths, a.decode_tokens, a.batch_size, a.seed)
            except torch.cuda.OutOfMemoryError as err:  # pragma: no cover - GPU only
                print(f"{prog}: [{label}] out of memory ({err}); lower --lengths or --batch-size", file=sys.stderr)
                return 1
            measured.append({"label": label, "source": name, "kind": kind, "budget": cfg.budget,
                             "budget_spec": cfg.budget_spec, "mixers": cfg.mixers,
                             "kv_heads": cfg.kv_heads, "head_dim": cfg.qk_head_dim, "num_layers": cfg.num_layers,
                             "chunk_len": cfg.chunk_len, "n_bswa_chunks": cfg.n_bswa_chunks,
                             "dtype": str(_model_dtype(model)),
                             "kvm_conversion": conversion_settings(model) if kind == "model" else None, "results": res})
            del model
        head = ["model", "N", "prefill s", "decode tok/s", "state rows", "cache", "full-attn KV", "ratio"]
        table = [[m["label"], r["N"], f"{r['prefill_s']:.3f}",
                  "" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}",
                  "" if r["state_rows"] is None else r["state_rows"], human_bytes(r["cache_bytes"]),
                  human_bytes(r["full_attn_kv_bytes"]), f"{r['cache_vs_full']:.3f}"]
                 for m in measured for r in m["results"]]
        print(format_table(head, table))
        from kvmeans.bench.report import env_info
        config = {"kvm": a.kvm, "lengths": lengths, "decode_tokens": a.decode_tokens, "batch_size": a.batch_size,
                  "seed": a.seed, "device": a.device, "dtype": a.dtype, "threads": torch.get_num_threads(),
                  "env": env_info(a.device),
                  "full_attn_kv_bytes": "2 * layers * batch * Hkv * N * head_dim * bytes(model dtype): keys + "
                                        "values only (no token-shift rows, no allocator slack)",
                  "cache_bytes": "ModelCache.nbytes after the prefill of N tokens (= KVMCache.nbytes): "
                                 "allocated buffers incl. spare capacity, token-shift and MLP-shift rows"}
        written += write_model_outputs(a.out, measured, config).values()
    print("wrote " + ", ".join(str(x) for x in written))
    return 0
