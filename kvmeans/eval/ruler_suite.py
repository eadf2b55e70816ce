"""``kvmeans eval ruler``: RULER's synthetic tasks on a causal LM, generated offline with its tokenizer.

    kvmeans eval ruler --model DIR --lengths 4096 8192 [--tasks niah_single_1 vt cwe ...] [--samples 500]

Data: :mod:`kvmeans.eval.ruler_tasks` (the eight NIAH tasks, ``vt``, ``cwe``, ``fwe``, and ``qa_1`` /
``qa_2`` from your SQuAD / HotpotQA files given with ``--qa-data``; RULER's templates, samplers, seed 42 and
budget ``tokens(prompt) + tokens_to_generate <= length`` with the model's tokenizer). The prompt is
``input + answer_prefix``; greedy decoding of up to the task's ``tokens_to_generate`` (128 / 30 / 120 / 50 /
32), stopping at EOS; score = the task's RULER metric x100 per (task, length). Batching, padding and
converted models (``--kvm SPEC``: one prompt at a time) as in ``kvmeans eval niah``.

The RULER average per length is the mean over the tasks that ran at that length; the paper's "RULER avg"
is over all 13 tasks (the QA ones included), so the table, the CSV and the JSON say which tasks it covers.
Output: ``ruler.json`` (config, haystack, per-(task, length) scores, averages, per-sample predictions) and
``ruler.csv`` (``task,length,samples,metric,score``; one ``ruler_avg`` row per length) in ``--out``
(default ``results/ruler/<model>-<timestamp>``).
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from kvmeans.eval import ruler
from kvmeans.eval import ruler_tasks as rt
from kvmeans.eval.niah import (
    BUILTIN_HAYSTACK_NOTE,
    aligned_rows,
    column_label,
    generate_batch,
    haystack_for,
    prompt_ids,
    write_json_and_csv,
)
from kvmeans.eval.ruler_tasks.qa import QAData
from kvmeans.utils.progress import progress_bar

__all__ = ["run_ruler", "averages", "format_table", "write_results"]


def _check_args(tasks, lengths, samples, batch_size, max_new_tokens, qa_data=None):
    for t in tasks:
        rt.check_task(t, qa_data)
    if not tasks:
        raise ValueError("--tasks: give at least one task")
    if not lengths:
        raise ValueError("--lengths: give at least one length, e.g. --lengths 4096 8192")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1 (it only caps each task's RULER budget), got {max_new_tokens}")


def run_ruler(model, tokenizer, tasks: Sequence[str] = rt.SYNTHETIC_TASKS, lengths: Sequence[int] = (4096,),
              samples: int = 500, batch_size: int = 8, seed: int = ruler.DEFAULT_SEED,
              haystack_file: Optional[str] = None, max_new_tokens: Optional[int] = None,
              qa_data: Optional[Mapping[str, QAData]] = None, progress: bool = True) -> Dict[str, Any]:
    """Generate RULER data for ``tasks`` x ``lengths`` with ``tokenizer`` and score ``model``; the results dict.

    ``model``/``tokenizer`` as :func:`kvmeans.eval.niah.run_niah`. ``max_new_tokens`` caps every task's
    ``tokens_to_generate`` (smoke tests; the data keep RULER's budgets). ``qa_data``: task -> the QA data
    set (:func:`kvmeans.eval.ruler_tasks.qa.load_qa_data`) for qa_1 / qa_2. Result keys: ``config``,
    ``haystack``, ``scores`` (per (task, length): ``task``, ``label``, ``length``, ``samples``, ``metric``,
    ``score``, ``mean_length``, ``max_prompt_tokens``), ``averages`` (see :func:`averages`), ``samples``.
    """
    tasks, lengths = list(dict.fromkeys(tasks)), [int(n) for n in lengths]
    _check_args(tasks, lengths, samples, batch_size, max_new_tokens, qa_data)
    hay = haystack_for(tasks, haystack_file)
    bar = progress_bar(len(tasks) * len(lengths) * samples, progress, unit="sample")
    scores, per_sample = [], []
    t0 = time.perf_counter()
    try:
        for task in tasks:
            budget = rt.TOKENS_TO_GENERATE[task]
            for length in lengths:
                if bar is not None:
                    bar.set_description(f"{rt.LABELS[task]} {length}: data")
                recs = rt.generate_samples(task, length, samples, tokenizer, seed=seed, haystack=hay, qa_data=qa_data)
                if bar is not None:
                    bar.set_description(f"{rt.LABELS[task]} {length}")
                ids, n_tok = prompt_ids(tokenizer, recs, task, length, budget)
                new = budget if max_new_tokens is None else min(budget, max_new_tokens)
                preds = generate_batch(model, tokenizer, ids, batch_size, new, bar)
                score, per = rt.score(task, preds, [r["outputs"] for r in recs])
                scores.append({"task": task, "label": rt.LABELS[task], "length": length, "samples": len(recs),
                               "metric": rt.METRICS[task], "score": score, "max_new_tokens": new,
                               "mean_length": round(sum(r["length"] for r in recs) / len(recs), 1),
                               "max_prompt_tokens": max(n_tok)})
                for r, p, v in zip(recs, preds, per):
                    per_sample.append({"task": task, "length": length, "index": r["index"], "tokens": r["length"],
                                       "num_haystack": r["num_haystack"], "outputs": r["outputs"], "pred": p,
                                       "score": v,
                                       "input_sha256": hashlib.sha256(r["input"].encode("utf-8")).hexdigest()})
    finally:
        if bar is not None:
            bar.close()
    config = {"tasks": tasks, "lengths": lengths, "samples": samples, "batch_size": batch_size, "seed": seed,
              "max_new_tokens": max_new_tokens, "tokens_to_generate": {t: rt.TOKENS_TO_GENERATE[t] for t in tasks},
              "metrics": {t: rt.METRICS[t] for t in tasks}, "decoding": "greedy",
              "qa_data": {t: d.describe() for t, d in (qa_data or {}).items() if t in tasks},
              "seeding": f"RULER: fresh random.Random({seed}) (and numpy RandomState({seed}) for vt) "
                         "per (task, length)",
              "sentence_splitter": "kvmeans regex splitter (not NLTK punkt)",
              "word_keys_sha256": ruler.WORD_KEYS_SHA256,
              "tokenizer": type(tokenizer).__name__, "tokenizer_name": getattr(tokenizer, "name_or_path", None),
              "elapsed_s": round(time.perf_counter() - t0, 2)}
    return {"config": config, "haystack": hay.describe() if hay is not None else None, "scores": scores,
            "averages": averages(scores), "samples": per_sample}


def averages(scores: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per length: the mean score over the tasks that ran (``score``), those ``tasks``, ``missing`` (RULER's
    13 minus them) and ``complete`` (all 13 ran: comparable with the paper's "RULER avg")."""
    out = []
    for length in sorted({s["length"] for s in scores}):
        rows = [s for s in scores if s["length"] == length]
        ran = [s["task"] for s in rows]
        out.append({"length": length, "score": round(sum(s["score"] for s in rows) / len(rows), 2), "tasks": ran,
                    "n_tasks": len(ran), "missing": [t for t in rt.RULER_TASKS if t not in ran],
                    "complete": len(set(ran)) == len(rt.RULER_TASKS)})
    return out


def _coverage(avg: Dict[str, Any]) -> str:
    if avg["complete"]:
        return f"all {len(rt.RULER_TASKS)} RULER tasks (comparable with the paper's RULER avg)"
    return (f"{avg['n_tasks']} of RULER's {len(rt.RULER_TASKS)} tasks, missing {', '.join(avg['missing'])}: "
            "NOT comparable with the paper's RULER avg (all 13)")


def format_table(results: Dict[str, Any]) -> str:
    """Rows = tasks (RULER's order), columns = lengths then the row mean; last row the RULER average."""
    lengths = sorted({s["length"] for s in results["scores"]})
    builtin = bool((results.get("haystack") or {}).get("builtin"))
    cell = {(s["task"], s["length"]): s["score"] for s in results["scores"]}
    head = ["task"] + [column_label(n) for n in lengths] + ["mean"]
    rows = []

    def row(label, vals):
        got = [v for v in vals if v is not None]
        return [label] + ["-" if v is None else f"{v:.2f}" for v in vals] + \
            [f"{sum(got) / len(got):.2f}" if got else "-"]

    for task in [t for t in rt.RULER_TASKS if any(k[0] == t for k in cell)]:
        essay = ruler.NIAH_TASKS.get(task, {}).get("type_haystack") == "essay"
        rows.append(row(rt.LABELS[task] + ("*" if builtin and essay else ""), [cell.get((task, n)) for n in lengths]))
    avg = {a["length"]: a for a in results["averages"]}
    rows.append(row("RULER avg", [avg[n]["score"] for n in lengths]))
    table = aligned_rows([head] + rows)
    lines = table[:-1] + ["-" * len(table[0]), table[-1]]   # the average row under a rule
    n = {s["samples"] for s in results["scores"]}
    lines.append(f"RULER metrics x100 (string_match_all; QA: string_match_part), "
                 f"{'/'.join(map(str, sorted(n)))} samples per cell, greedy")
    for text in dict.fromkeys(_coverage(a) for a in results["averages"]):
        lines.append(f"RULER avg over {text}")
    if builtin and any(r[0].endswith("*") for r in rows):
        lines.append(BUILTIN_HAYSTACK_NOTE)
    return "\n".join(lines)


def write_results(results: Dict[str, Any], out: os.PathLike) -> Path:
    """Write ``ruler.json`` and ``ruler.csv`` (``task,length,samples,metric,score`` + ``ruler_avg`` rows) atomically."""
    rows = [[s["task"], s["length"], s["samples"], s["metric"], f"{s['score']:.2f}"] for s in results["scores"]]
    rows += [["ruler_avg", a["length"], "", f"mean of {a['n_tasks']}/{len(rt.RULER_TASKS)} tasks: "
              + " ".join(a["tasks"]), f"{a['score']:.2f}"] for a in results["averages"]]
    return write_json_and_csv(out, "ruler", results, ["task", "length", "samples", "metric", "score"], rows)
