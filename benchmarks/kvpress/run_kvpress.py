"""kvpress 0.5.5's presses on kvmeans' samples, run in kvpress' own venv (``setup.sh``; it imports no kvmeans).

    VENV/bin/python benchmarks/kvpress/run_kvpress.py --samples OUT/samples.jsonl --model DIR --out OUT/kvpress \\
        [--presses none streaming knorm snapkv tova merging_knorm expected_attention adakv_expected_attention
                   adakv_snapkv kvzip] [--ratios 0.5 0.75]

``samples.jsonl`` (from ``kvmeans bench pretrained``): one JSON object per line with ``id``, ``sha256``,
``bench``, ``length``, ``context_ids`` (what a press compresses: the chat template's head and the haystack),
``question_ids`` (question, template tail, answer prefix) and ``answers``. Each sample runs exactly as
kvpress' pipeline runs it (``KVPressTextGenerationPipeline._forward``): the context prefilled under the
press (it compresses each layer's keys/values to ``int((1 - ratio) * context)``), then the question and greedy
decoding over the compressed cache, with the ids given (no re-tokenization; the texts are re-encoded only to
check that this venv's tokenizer agrees). Scored with RULER's ``string_match_all`` (every reference found,
case-insensitively). Writes ``kvpress.json`` (settings, versions, rows, per-sample answers) and
``kvpress.csv`` (rows) atomically, after every (press, ratio).

    VENV/bin/python benchmarks/kvpress/run_kvpress.py --windows OUT/windows.jsonl --model DIR --out OUT/kvpress

``windows.jsonl`` (from ``kvmeans bench quality``): per window its ``ids``, ``context_len`` and ``keys``. Each
press compresses the prefilled context to ``keys`` keys (ratio ``1 - keys / context_len``), then the rest of the
window is scored teacher-forced over that cache at its own positions, appended uncompressed: the continuation
perplexity, one row per (press, cell), written as above. ``none`` (no press) checks the harness: it should give
the run's full-attention continuation perplexity.

The ``adakv_*`` presses (AdaKV's head-wise budgets around a scorer) and ``kvzip`` (KVzip: context reconstruction,
2-3 prefills) mask keys in kvpress' attention patch instead of removing them: their cache keeps every key, so
``kept_keys`` counts the unmasked keys per layer and kv head, and ``cache_bytes`` stays the full cache.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

PRESSES = ("none", "streaming", "knorm", "snapkv", "tova", "merging_knorm", "expected_attention",
           "adakv_expected_attention", "adakv_snapkv", "kvzip")


def make_press(name: str, ratio: float):
    """A kvpress press by short name at ``ratio`` (None for ``none``)."""
    import kvpress
    if name == "none":
        return None
    simple = {"streaming": kvpress.StreamingLLMPress, "knorm": kvpress.KnormPress, "snapkv": kvpress.SnapKVPress,
              "tova": kvpress.TOVAPress, "expected_attention": kvpress.ExpectedAttentionPress}
    if name in simple:
        return simple[name](compression_ratio=ratio)
    if name == "merging_knorm":
        return kvpress.MergingPress(press=kvpress.KnormPress(compression_ratio=ratio))
    if name.startswith("adakv_") and name[len("adakv_"):] in simple:
        return kvpress.AdaKVPress(press=simple[name[len("adakv_"):]](compression_ratio=ratio))
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio)
    raise ValueError(f"--presses: unknown {name!r}; choose from {', '.join(PRESSES)}")


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def correct(pred: str, refs) -> bool:
    """RULER's ``string_match_all`` for one sample: every reference in the post-processed prediction."""
    p = re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip().lower()
    return all(r.lower() in p for r in refs)


def run_sample(pipe, press, sample, max_new_tokens: int) -> dict:
    """kvpress' ``_forward`` for one question, timed in two parts, with the compressed cache's bytes."""
    import contextlib

    import torch
    from transformers import DynamicCache
    model = pipe.model
    ctx = torch.tensor([sample["context_ids"]], device=model.device)
    question = torch.tensor([sample["question_ids"]], device=model.device)
    cache = DynamicCache()
    with torch.no_grad():
        t0 = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=ctx, past_key_values=cache)
        t1 = time.perf_counter()
        kept = kept_keys(model, cache)
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        text = pipe.generate_answer(question_ids=question, cache=cache, context_length=ctx.shape[1],
                                    max_new_tokens=max_new_tokens)
        t2 = time.perf_counter()
    return {"pred": text, "kept_keys": kept, "cache_bytes": nbytes, "prefill_s": t1 - t0, "answer_s": t2 - t1}


def kept_keys(model, cache):
    """Keys per layer (and kv head) the prefilled ``cache`` keeps (batch 1). A head-wise press masks keys (kvpress'
    attention patch: ``masked_key_indices`` per layer) instead of dropping them, so its cache holds every key and
    the masked ones are taken off here (a float: the mean over layers and kv heads)."""
    length = cache.get_seq_length()
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    if all(m is None for m in masks):
        return length
    dropped = sum(0 if m is None else m[0].numel() for m in masks)
    return length - dropped / (len(masks) * model.config.num_key_value_heads)


def continuation_nll(model, press, record) -> tuple:
    """``(sum of the NLL of the window's tokens after its context, their count, keys kept after the context)``:
    the context prefilled under ``press``, then the rest teacher-forced over the compressed cache."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache
    ids = torch.tensor([record["ids"]], device=model.device)
    n = record["context_len"]
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            last = model(input_ids=ids[:, :n], past_key_values=cache, logits_to_keep=1).logits[:, -1:]
        kept = kept_keys(model, cache)
        # the tokens' own positions, as kvpress' pipeline passes them for a question: after compression the cache
        # holds `kept` keys, and positions inferred from its length would put the continuation at `kept`
        positions = torch.arange(n, ids.shape[1] - 1, device=model.device).unsqueeze(0)
        rest = model(input_ids=ids[:, n:-1], past_key_values=cache, position_ids=positions).logits
    logits = torch.cat((last, rest), 1).float()
    nll = F.cross_entropy(logits[0], ids[0, n:], reduction="sum")
    return float(nll), ids.shape[1] - n, kept


def run_windows(model, records, presses, out: Path, settings: dict) -> None:
    """Every press on every window (see the module docstring); one row per (press, cell)."""
    import math
    cells = {}
    for r in records:
        cells.setdefault(r["cell"], []).append(r)
    rows = []
    for name in presses:
        for cell, group in cells.items():
            total = count = 0.0
            kept, t0 = [], time.perf_counter()
            for r in group:
                ratio = 1 - r["keys"] / r["context_len"]
                nll, m, k = continuation_nll(model, make_press(name, ratio), r)
                total, count = total + nll, count + m
                kept.append(k)
            first = group[0]
            rows.append({"cell": cell, "press": name, "model": first["model"], "corpus": first["corpus"],
                         "length": first["length"], "role": first["role"], "windows": len(group),
                         "kept_keys": round(sum(kept) / len(kept)), "ppl_continuation": math.exp(total / count),
                         "seconds": round(time.perf_counter() - t0, 2)})
            write_results(out, settings, rows, [])
            print(f"{name} {cell}: continuation ppl {rows[-1]['ppl_continuation']:.2f} (kept {rows[-1]['kept_keys']} "
                  "keys)", flush=True)


def row_of(press: str, ratio, bench: str, length: int, group) -> dict:
    return {"bench": bench, "length": length, "ratio": ratio, "arm": f"kvpress {press}",
            "kept_keys": round(sum(a["kept_keys"] for a in group) / len(group)),
            "score": sum(a["correct"] for a in group), "samples": len(group),
            "cache_bytes": max(a["cache_bytes"] for a in group),
            "prefill_tok_s": sum(a["context_tokens"] for a in group) / sum(a["prefill_s"] for a in group),
            "answer_s": sum(a["answer_s"] for a in group) / len(group)}


def write_results(out: Path, settings: dict, rows: list, answers: list) -> None:
    atomic_write(out / "kvpress.json", json.dumps({"settings": settings, "rows": rows, "samples": answers},
                                                  indent=1) + "\n")
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    atomic_write(out / "kvpress.csv", buf.getvalue())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", help="samples.jsonl written by kvmeans bench pretrained")
    src.add_argument("--windows", help="windows.jsonl written by kvmeans bench quality (continuation perplexity)")
    p.add_argument("--model", required=True, help="the same transformers model folder")
    p.add_argument("--out", required=True, help="folder for kvpress.json and kvpress.csv")
    p.add_argument("--presses", nargs="+", default=list(PRESSES), choices=PRESSES)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    p.add_argument("--benches", nargs="+", help="only these benches of the samples (e.g. niah)")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="most tokens an answer may have, for samples without a budget of their own")
    p.add_argument("--threads", type=int)
    a = p.parse_args(argv)
    if not all(0 < r < 1 for r in a.ratios):
        p.error(f"--ratios must lie in (0, 1), got {a.ratios}")
    if a.windows:
        return _main_windows(a)
    samples = [json.loads(line) for line in Path(a.samples).read_text(encoding="utf-8").splitlines() if line.strip()]
    samples = [s for s in samples if not a.benches or s["bench"] in a.benches]
    if not samples:
        p.error(f"--samples {a.samples}: no samples (of --benches {a.benches})")
    import kvpress  # noqa: F401  (registers the pipeline and patches attention)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    mismatched = [s["id"] for s in samples if tok.encode(s["context"], add_special_tokens=False) != s["context_ids"]
                  or tok.encode(s["question"], add_special_tokens=False) != s["question_ids"]]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    import importlib.metadata as md
    settings = {**vars(a), "versions": {n: md.version(n) for n in ("kvpress", "torch", "transformers")},
                "tokenizer_mismatches": mismatched, "loadavg": open("/proc/loadavg").read().strip()}
    print(f"kvpress {settings['versions']['kvpress']}, transformers {transformers.__version__}: "
          f"{len(samples)} samples; "
          f"this tokenizer re-encodes {len(samples) - len(mismatched)}/{len(samples)} texts to the same ids",
          flush=True)
    groups = {}
    for s in samples:
        groups.setdefault((s["bench"], s["length"]), []).append(s)
    rows, answers = [], []
    runs = [(name, r) for name in a.presses for r in ([None] if name == "none" else a.ratios)]
    for name, ratio in runs:
        for (bench, length), group in groups.items():
            got = []
            for s in group:
                budget = s.get("max_new_tokens", a.max_new_tokens)        # a RULER task's own budget
                r = run_sample(pipe, make_press(name, ratio or 0.0), s, budget)
                got.append({"id": s["id"], "sha256": s["sha256"], "arm": f"kvpress {name}", "ratio": ratio,
                            "correct": correct(r["pred"], s["answers"]), "context_tokens": len(s["context_ids"]), **r})
            rows.append(row_of(name, ratio, bench, length, got))
            answers += got
            write_results(Path(a.out), settings, rows, answers)
            print(f"{name} {ratio} {bench} {length}: {rows[-1]['score']}/{len(group)} "
                  f"(kept {rows[-1]['kept_keys']} keys)", flush=True)
    return 0


def _main_windows(a) -> int:
    import kvpress  # noqa: F401  (registers the presses' attention hooks)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if a.threads:
        torch.set_num_threads(a.threads)
    records = [json.loads(x) for x in Path(a.windows).read_text(encoding="utf-8").splitlines() if x.strip()]
    records = [r for r in records if r["model"] == Path(a.model).name]      # this model's cells
    if not records:
        raise SystemExit(f"--windows {a.windows}: no window of model {Path(a.model).name}")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    import importlib.metadata as md
    settings = {**vars(a), "versions": {n: md.version(n) for n in ("kvpress", "torch", "transformers")},
                "loadavg": open("/proc/loadavg").read().strip()}
    run_windows(model, records, list(a.presses), Path(a.out), settings)    # "none": the harness against full
    return 0


if __name__ == "__main__":
    sys.exit(main())
