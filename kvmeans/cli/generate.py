"""``kvmeans generate``: generate text with a saved model, streaming tokens, then tokens/s and cache memory."""
from __future__ import annotations

import argparse
from typing import List

from kvmeans.cli._common import add_budget_argument, add_kvm_argument, need_hf
from kvmeans.models.load import load_model, load_model_tokenizer
from kvmeans.utils.args import UsageError, check_device, check_model_dir, parse_budget_arg, parse_kvm_arg


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans generate", description="Generate text with a saved model (KVM, or "
                                "transformers: --kvm converts it; streams tokens, then prints tokens/s and the "
                                "cache's memory)")
    p.add_argument("--model", required=True, help="model directory (ours or the authors' layout) with a tokenizer")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32")
    p.add_argument("--cache-report", action="store_true", help="print the per-layer cache table")
    add_kvm_argument(p)
    add_budget_argument(p)
    a = p.parse_args(argv)
    kvm = parse_kvm_arg(a.kvm)
    budget = parse_budget_arg(a.budget)
    if a.max_new_tokens < 1 or a.temperature < 0 or not 0 < a.top_p <= 1:
        p.error("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    check_model_dir(a.model)
    device = check_device("--device", a.device)
    if not need_hf("generate"):
        return 2
    import time

    import torch
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    from kvmeans.models.hf_cache import format_bytes
    from kvmeans.models.hf_compat import cache_from

    hf_logging.disable_progress_bar()
    tok = load_model_tokenizer(a.model)
    ids = tok(a.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:                      # before the model loads
        raise UsageError(f"--prompt {a.prompt!r} encodes to no tokens; give some text")
    dtype = a.dtype if a.dtype == "auto" else getattr(torch, a.dtype)
    model = load_model(a.model, dtype, device, kvm, budget)
    ids = ids.to(device)
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= vocab:
        raise UsageError(f"--model {a.model}: the prompt has token id {int(ids.max())} but the model has {vocab} "
                         "embeddings: the folder's tokenizer is not this model's; save the model's own tokenizer in it")
    stamps: List[float] = []

    class Streamer(TextStreamer):   # prints the prompt then each token; records arrival times (1st put: prompt)
        def put(self, value):
            stamps.append(time.perf_counter())
            super().put(value)

    eos = model.config.eos_token_id if model.config.eos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    sample = dict(do_sample=True, temperature=a.temperature, top_p=a.top_p) if a.temperature > 0 else \
        dict(do_sample=False)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True,
                             streamer=Streamer(tok, skip_special_tokens=True), **sample)
    t1 = time.perf_counter()
    n = out.sequences.shape[1] - ids.shape[1]
    first = stamps[1] if len(stamps) > 1 else t1
    decode = f", decode {(n - 1) / (t1 - first):.1f} tok/s" if n > 1 and t1 > first else ""
    cache = cache_from(out)
    print(f"\n\n[{n} tokens in {t1 - t0:.2f} s: {n / (t1 - t0):.1f} tok/s (prompt {ids.shape[1]} tokens, "
          f"first token after {first - t0:.2f} s{decode})]")
    if cache is not None and not hasattr(cache, "mixers"):      # a transformers model's cache (converted or not)
        from kvmeans.pretrained.cache import cache_nbytes
        print(f"[cache: {format_bytes(cache_nbytes(cache))}, {cache.get_seq_length()} tokens seen]")
    elif cache is not None:
        print(f"[cache: {format_bytes(cache.nbytes)} over {len(cache.mixers)} layers "
              f"({', '.join(sorted(set(cache.mixers)))}), {cache.get_seq_length()} tokens seen]")
        if a.cache_report:
            print(cache.summary())
    return 0
