"""``kvmeans eval niah``: RULER's single-needle NIAH tasks (niah_single_1/2/3) on a causal LM, offline.

    kvmeans eval niah --model DIR --lengths 4096 8192 16384 32768 --samples 500 [--out DIR]

Data: :mod:`kvmeans.eval.ruler` (RULER's generator, binary-search haystack size, seed 42, budget
``tokens(prompt) + 128 <= length`` measured with the model's own tokenizer). The prompt is
``input + answer_prefix`` (lm-eval's ``input + " " + gen_prefix``); greedy decoding of up to 128 new
tokens, stopping at EOS; score = RULER's ``string_match_all`` x 100 per (task, length).

Batching: the samples of one (task, length) are sorted by prompt length (longest first) and generated
``--batch-size`` at a time with left padding and an attention mask (``KVMForCausalLM`` and a transformers
model converted to KVM, ``--kvm SPEC`` or a saved converted folder, give every row the tokens it gets alone).
Output: ``niah.json`` (config with ``kvm``, the spec, and ``kvm_conversion``, the settings applied;
haystack; per-(task, length) scores; per-sample predictions) and ``niah.csv`` (``task,length,samples,score``)
in ``--out`` (default ``results/niah/<model>-<timestamp>``), and a table like the paper's (rows
NIAH-S1/S2/S3, one column per length, and the mean).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from kvmeans.eval import ruler
from kvmeans.utils.io import atomic_write_text
from kvmeans.utils.progress import progress_bar

__all__ = ["run_niah", "format_table", "write_results"]


def device_of(model):
    dev = getattr(model, "device", None)
    if dev is None:
        try:
            dev = next(model.parameters()).device
        except (AttributeError, StopIteration):
            dev = "cpu"
    return dev


def generate_batch(model, tokenizer, ids: List[List[int]], batch_size: int, max_new_tokens: int, bar=None) -> List[str]:
    """Greedy continuations of the prompts ``ids`` (left-padded batches, longest first); texts in order."""
    import torch

    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    stop = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    device = device_of(model)
    out: List[Optional[str]] = [None] * len(ids)
    for s in range(0, len(order), batch_size):
        rows = order[s:s + batch_size]
        width = max(len(ids[i]) for i in rows)
        x = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            x[r, width - len(ids[i]):] = torch.tensor(ids[i], dtype=torch.long)
            mask[r, width - len(ids[i]):] = 1
        with torch.no_grad():
            y = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                               do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad)
        y = y.sequences if hasattr(y, "sequences") else y
        for r, i in enumerate(rows):
            new = [int(t) for t in y[r, width:].tolist()]
            for j, t in enumerate(new):
                if t in stop:
                    new = new[:j]
                    break
            out[i] = tokenizer.decode(new, skip_special_tokens=True)
        if bar is not None:
            bar.update(len(rows))
    return out  # type: ignore[return-value]


def haystack_for(tasks: Sequence[str], haystack_file: Optional[str]) -> Optional[ruler.EssayHaystack]:
    """The essay haystack (``haystack_file`` or the built-in one) when a NIAH task in ``tasks`` reads it, else None."""
    if not any(ruler.NIAH_TASKS.get(t, {}).get("type_haystack") == "essay" for t in tasks):
        return None
    return ruler.load_haystack(haystack_file) if haystack_file else ruler.builtin_haystack()


def _check_args(tasks, lengths, samples, batch_size, max_new_tokens):
    bad = [t for t in tasks if t not in ruler.TASKS]
    if bad:
        raise ValueError(f"--tasks: unknown {', '.join(bad)}; choose from {', '.join(ruler.TASKS)}")
    if not lengths:
        raise ValueError("--lengths: give at least one length, e.g. --lengths 4096 8192")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if not 1 <= max_new_tokens <= ruler.TOKENS_TO_GENERATE:
        raise ValueError(f"--max-new-tokens must be in 1..{ruler.TOKENS_TO_GENERATE} (the budget reserves "
                         f"{ruler.TOKENS_TO_GENERATE}), got {max_new_tokens}")


BUILTIN_HAYSTACK_NOTE = ("* essay haystack = kvmeans' built-in Shakespeare distractor corpus, NOT RULER's Paul Graham "
                         "essays: not comparable with the paper (use --haystack-file)")


def prompt_ids(tokenizer, recs: List[Dict[str, Any]], task: str, length: int, budget: int):
    """``(ids, n_tokens)`` of each sample's prompt (input + answer prefix, no special tokens); an error if one
    leaves fewer than ``budget`` of ``length`` tokens for the answer."""
    ids = [tokenizer(r["input"] + r["answer_prefix"], add_special_tokens=False)["input_ids"] for r in recs]
    n_tok = [len(x) for x in ids]
    over = [i for i, n in enumerate(n_tok) if n + budget > length]
    if over:   # the generator measured these very prompts: a tokenizer that is not deterministic?
        raise RuntimeError(f"{task} @ {length}: sample {over[0]} has {n_tok[over[0]]} prompt tokens, "
                           f"over the budget {length} - {budget}")
    return ids, n_tok


def aligned_rows(rows: List[List[str]]) -> List[str]:
    """Table rows as lines: first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]


def run_niah(model, tokenizer, tasks: Sequence[str] = tuple(ruler.TASKS), lengths: Sequence[int] = (4096,),
             samples: int = 500, batch_size: int = 8, seed: int = ruler.DEFAULT_SEED,
             haystack_file: Optional[str] = None, max_new_tokens: int = ruler.TOKENS_TO_GENERATE,
             progress: bool = True) -> Dict[str, Any]:
    """Generate RULER NIAH data with ``tokenizer`` and score ``model`` on it; returns the results dict.

    ``model``: anything with a transformers-style ``generate(input_ids=, attention_mask=, max_new_tokens=,
    do_sample=False, eos_token_id=, pad_token_id=)`` (e.g. ``KVMForCausalLM``), already on its device.
    ``tokenizer``: the model's transformers tokenizer (the budget is measured with it).
    ``max_new_tokens`` < 128 only shortens generation (smoke tests); the data keep RULER's 128-token budget.
    Result keys: ``config``, ``haystack`` (essay tasks), ``scores`` (one row per (task, length):
    ``task``, ``label``, ``length``, ``samples``, ``score``, ``mean_length``, ``max_prompt_tokens``), ``samples``
    (per sample: ``task``, ``length`` (the task length), ``index``, ``tokens`` (prompt + 128), ``depth``,
    ``num_haystack``, ``query``, ``outputs``, ``pred``, ``score``, ``input_sha256``).
    """
    tasks, lengths = list(tasks), [int(n) for n in lengths]
    _check_args(tasks, lengths, samples, batch_size, max_new_tokens)
    hay = haystack_for(tasks, haystack_file)
    bar = progress_bar(len(tasks) * len(lengths) * samples, progress, unit="sample")
    scores, per_sample = [], []
    t0 = time.perf_counter()
    try:
        for task in tasks:
            for length in lengths:
                if bar is not None:
                    bar.set_description(f"{ruler.TASK_LABELS[task]} {length}: data")
                recs = ruler.generate_samples(task, length, samples, tokenizer, seed=seed, haystack=hay)
                if bar is not None:
                    bar.set_description(f"{ruler.TASK_LABELS[task]} {length}")
                ids, n_tok = prompt_ids(tokenizer, recs, task, length, ruler.TOKENS_TO_GENERATE)
                preds = generate_batch(model, tokenizer, ids, batch_size, max_new_tokens, bar)
                score, fractions = ruler.string_match_all(preds, [r["outputs"] for r in recs])
                scores.append({"task": task, "label": ruler.TASK_LABELS[task], "length": length, "samples": len(recs),
                               "score": score, "mean_length": round(sum(r["length"] for r in recs) / len(recs), 1),
                               "max_prompt_tokens": max(n_tok)})
                for r, p, f in zip(recs, preds, fractions):
                    per_sample.append({"task": task, "length": length, "index": r["index"], "tokens": r["length"],
                                       "depth": r["depth"], "num_haystack": r["num_haystack"], "query": r["query"],
                                       "outputs": r["outputs"], "pred": p, "score": f,
                                       "input_sha256": hashlib.sha256(r["input"].encode("utf-8")).hexdigest()})
    finally:
        if bar is not None:
            bar.close()
    config = {"tasks": tasks, "lengths": lengths, "samples": samples, "batch_size": batch_size, "seed": seed,
              "max_new_tokens": max_new_tokens, "tokens_to_generate_budget": ruler.TOKENS_TO_GENERATE,
              "decoding": "greedy", "metric": "string_match_all x100 (RULER)",
              "haystack_size_rule": "RULER binary search (kvmeans.eval.ruler)",
              "seeding": f"RULER: fresh random.Random({seed}) per (task, length)",
              "sentence_splitter": "kvmeans regex splitter (not NLTK punkt)",
              "word_keys_sha256": ruler.WORD_KEYS_SHA256, "tokenizer": type(tokenizer).__name__,
              "tokenizer_name": getattr(tokenizer, "name_or_path", None),
              "elapsed_s": round(time.perf_counter() - t0, 2)}
    return {"config": config, "haystack": hay.describe() if hay is not None else None, "scores": scores,
            "samples": per_sample}


def column_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def format_table(results: Dict[str, Any]) -> str:
    """The paper-style table: rows NIAH-S1/S2/S3, one column per length, then the mean of the row."""
    lengths = sorted({s["length"] for s in results["scores"]})
    hay = results.get("haystack") or {}
    builtin = bool(hay.get("builtin"))
    cell = {(s["task"], s["length"]): s["score"] for s in results["scores"]}
    head = ["task"] + [column_label(n) for n in lengths] + ["mean"]
    rows = []
    for task in [t for t in ruler.TASKS if any(k[0] == t for k in cell)]:
        label = ruler.TASK_LABELS[task] + ("*" if builtin and ruler.TASKS[task]["type_haystack"] == "essay" else "")
        vals = [cell.get((task, n)) for n in lengths]
        got = [v for v in vals if v is not None]
        rows.append([label] + ["-" if v is None else f"{v:.2f}" for v in vals] +
                    [f"{sum(got) / len(got):.2f}" if got else "-"])
    lines = aligned_rows([head] + rows)
    n = {s["samples"] for s in results["scores"]}
    lines.append(f"RULER string_match_all x100, {'/'.join(map(str, sorted(n)))} samples per cell, greedy")
    if builtin and any(r[0].endswith("*") for r in rows):
        lines.append(BUILTIN_HAYSTACK_NOTE)
    return "\n".join(lines)


def write_results(results: Dict[str, Any], out: os.PathLike) -> Path:
    """Write ``niah.json`` and ``niah.csv`` (``task,length,samples,score``) atomically into ``out``."""
    return write_json_and_csv(out, "niah", results, ["task", "length", "samples", "score"],
                              [[s["task"], s["length"], s["samples"], f"{s['score']:.2f}"] for s in results["scores"]])


def write_json_and_csv(out: os.PathLike, stem: str, results: Dict[str, Any], header: List[str], rows) -> Path:
    """``<stem>.json`` (the whole results dict) and ``<stem>.csv`` (``header`` + ``rows``), atomically, into ``out``."""
    d = Path(out)
    atomic_write_text(d / f"{stem}.json", json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    atomic_write_text(d / f"{stem}.csv", buf.getvalue())
    return d
