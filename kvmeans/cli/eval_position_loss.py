"""``kvmeans eval position-loss``: mean loss per position block (see :mod:`kvmeans.eval.position_loss`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvmeans.cli._common import add_budget_argument, add_kvm_argument
from kvmeans.eval.position_loss import document_spans, evaluate_models, format_table, open_token_data, write_outputs
from kvmeans.models.load import conversion_settings, load_model
from kvmeans.utils.args import check_device, check_model_dir, check_out_dir, parse_budget_arg, parse_kvm_arg


# ---- command line ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans eval position-loss",
                                description="Mean loss per position block over documents at least --ctx tokens "
                                            "long; several models in one plot (JSON, CSV, PNG).")
    p.add_argument("--model", action="append", required=True, metavar="DIR",
                   help="model directory (ours, the authors' layout or transformers); repeat for several models")
    p.add_argument("--label", action="append", default=None, help="curve label per --model (default: folder name)")
    p.add_argument("--data", required=True, help="KVMTOK1 token file, or a `kvmeans data prepare` folder")
    p.add_argument("--split", default="val", help="which <split>.bin of a --data folder (default val)")
    p.add_argument("--ctx", type=int, default=32768, help="tokens scored per document (default 32768)")
    p.add_argument("--block", type=int, default=1024, help="positions per block (default 1024)")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents (file order)")
    p.add_argument("--batch-size", type=int, default=1, help="documents per forward (default 1)")
    p.add_argument("--segment", type=int, default=2048, help="tokens per forward call, cache carried (default 2048)")
    p.add_argument("--logits-chunk", type=int, default=256, help="positions per LM-head/loss slice (default 256)")
    p.add_argument("--eos-id", type=int, default=None, help="document delimiter id (default: the file header's)")
    p.add_argument("--windows", action="store_true",
                   help="ignore document boundaries: score consecutive windows of ctx+1 tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32")
    p.add_argument("--out", default="position-loss", help="output folder (default ./position-loss)")
    add_kvm_argument(p)
    add_budget_argument(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    prog = p.prog
    kvm = parse_kvm_arg(a.kvm)
    budget = parse_budget_arg(a.budget)
    for name in ("ctx", "block", "batch_size", "segment", "logits_chunk"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.max_docs is not None and a.max_docs < 1:
        p.error(f"--max-docs must be >= 1, got {a.max_docs}")
    if a.label is not None and len(a.label) != len(a.model):
        p.error(f"give one --label per --model ({len(a.model)} models, {len(a.label)} labels), or none")
    check_device("--device", a.device)
    check_out_dir("--out", a.out)
    try:
        tf = open_token_data(a.data, a.split)
        spans, info = document_spans(tf, a.ctx + 1, eos_id=a.eos_id, windows=a.windows, max_docs=a.max_docs)
    except (FileNotFoundError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if not spans:
        if info["mode"] == "windows":
            why = f"the file has {len(tf)} tokens, fewer than one window of --ctx + 1 = {a.ctx + 1}"
        else:
            why = (f"none of its {info['documents']} documents (delimited by eos_id={info['eos_id']}"
                   f"{', and cram windows' if tf.packing == 'cram' else ''}) has --ctx + 1 = {a.ctx + 1} tokens; "
                   f"the longest has {info['longest']}")
        print(f"{prog}: error: --data {tf.path}: {why}. Lower --ctx (e.g. --ctx {max(1, info['longest'] - 1)}), use "
              "longer documents, or --windows to score the stream as windows", file=sys.stderr)
        return 2
    for d in a.model:
        check_model_dir(d)
    dtype = a.dtype if a.dtype == "auto" else getattr(torch, a.dtype)
    labels = a.label or [Path(d).name or str(d) for d in a.model]
    print(f"{len(spans)} documents of >= {a.ctx + 1} tokens ({info['mode']}; {info['long_enough']} long enough "
          f"of {info['documents']}), ctx {a.ctx}, blocks of {a.block}, segments of {a.segment}")
    results = []
    for label, d in zip(labels, a.model):
        model = load_model(d, dtype, a.device, kvm, budget)
        try:
            results += evaluate_models([(label, d, model)], tf, spans, a.ctx, a.block, a.batch_size, a.segment,
                                       a.logits_chunk, a.device)
            results[-1]["kvm_conversion"] = conversion_settings(model)
        except ValueError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        del model
    config = {"data": str(tf.path), "tokenizer_id": tf.header.get("tokenizer_id"), "ctx": a.ctx, "block": a.block,
              "num_docs": len(spans), "selection": info, "max_docs": a.max_docs, "segment": a.segment,
              "logits_chunk": a.logits_chunk, "batch_size": a.batch_size, "dtype": a.dtype, "device": a.device,
              "kvm": a.kvm, "budget": a.budget, "doc_starts": [s for s, _ in spans],
              "loss": "nats; position i predicts token i+1"}
    paths = write_outputs(a.out, results, config)
    print(format_table(results))
    print("wrote " + ", ".join(str(x) for x in paths.values()))
    return 0
