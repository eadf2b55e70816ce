"""``kvmeans eval ppl``: perplexity of a transformers model, full attention vs StreamingLLM vs KVM (see
:mod:`kvmeans.pretrained.ppl`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvmeans.cli._common import add_kvm_argument
from kvmeans.models.load import load_hf_tokenizer
from kvmeans.pretrained.arms import Arm, kvm_spec_arm, saved_arm
from kvmeans.pretrained.ppl import _saved_conversion, evaluate, parse_arms, text_windows
from kvmeans.utils.args import UsageError, check_out_dir, parse_kvm_arg
from kvmeans.utils.weights import CorruptWeightsError, named_weight_errors


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans eval ppl", description="Perplexity of an HF causal LM over windows of "
                                "long real text: full attention vs StreamingLLM (sinks + window), same windows")
    p.add_argument("--model", required=True, help="HF model folder (e.g. from `kvmeans models fetch smollm2-135m`)")
    p.add_argument("--length", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--windows", type=int, default=6, help="number of windows (default 6)")
    p.add_argument("--seed", type=int, default=0, help="window selection seed")
    p.add_argument("--text", nargs="+", metavar="FILE", help="text files as documents instead of Shakespeare")
    p.add_argument("--arms", default="full,streaming:4+256", help="comma-separated: full, streaming:S+W "
                   "(S sink tokens + the last W tokens); default full,streaming:4+256")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--out", help="folder for ppl.csv and ppl.json")
    add_kvm_argument(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        specs = parse_arms(a.arms)
    except ValueError as err:
        raise UsageError(f"--arms {a.arms}: {err}") from None
    if a.length < 2 or a.windows < 1:
        p.error(f"need --length >= 2 and --windows >= 1, got {a.length} and {a.windows}")
    kvm = parse_kvm_arg(a.kvm)
    if not (Path(a.model) / "config.json").is_file():
        raise UsageError(f"--model {a.model}: no config.json there; give an HF model folder "
                         "(`kvmeans models fetch smollm2-135m` prints one)")
    if a.out:
        check_out_dir("--out", a.out)
    for f in a.text or []:
        if not Path(f).is_file():
            raise UsageError(f"--text {f}: no such file; give text files")
    saved = _saved_conversion(a.model, kvm)
    if a.threads is not None:
        torch.set_num_threads(max(1, a.threads))
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from kvmeans.bench.report import env_info, format_env, format_table, write_csv, write_json
    hf_logging.disable_progress_bar()
    tok = load_hf_tokenizer(a.model)
    try:
        windows = text_windows(tok, a.text or "shakespeare", a.windows, a.length, a.seed)
    except ValueError as err:
        p.error(str(err))
    try:
        with named_weight_errors(a.model):
            model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    except CorruptWeightsError as err:
        raise UsageError(f"--model {a.model}: {err}") from None
    arms = [Arm(name, model, sinks=sinks, window=window) for name, sinks, window in specs]
    if kvm is not None:
        arms.append(kvm_spec_arm(model, kvm, a.length))
    if saved is not None:
        arms.append(saved_arm(a.model, a.length))
    info = env_info()
    print(format_env(info), flush=True)
    rows = evaluate(arms, windows, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    headers = ["arm", "ppl", "kept_keys", "cache_fraction", "seconds"]
    print(format_table(headers, [[r["arm"], f"{r['ppl']:.2f}", r["kept_keys"], f"{r['cache_fraction']:.3f}",
                                  f"{r['seconds']:.1f}"] for r in rows]))
    if a.out:
        settings = {"model": a.model, "length": a.length, "windows": a.windows, "seed": a.seed,
                    "source": a.text or "shakespeare", "arms": a.arms, "kvm": a.kvm,
                    "kvm_conversion": arms[-1].model.config.kvm_conversion if kvm or saved else None}
        write_csv(Path(a.out) / "ppl.csv", list(rows[0]), rows)
        write_json(Path(a.out) / "ppl.json", {"settings": settings, "env": info, "rows": rows})
        print(f"wrote {Path(a.out) / 'ppl.csv'} and ppl.json")
    return 0
