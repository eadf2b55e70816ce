"""``kvmeans bench pretrained``: a pretrained transformers causal LM with full attention, StreamingLLM,
training-free KVM (and a distilled KVM folder, and kvpress's presses from their own venv), side by side on
the same samples and at equal kept keys.

    kvmeans bench pretrained --model ~/.cache/kvmeans/models/smollm2-135m --out runs/side --samples-only
    ~/.cache/kvmeans/venvs/kvpress/bin/python benchmarks/kvpress/run_kvpress.py \\
        --samples runs/side/samples.jsonl --model ~/.cache/kvmeans/models/smollm2-135m --out runs/side/kvpress
    kvmeans bench pretrained --model ~/.cache/kvmeans/models/smollm2-135m --out runs/side \\
        --kvpress-results runs/side/kvpress/kvpress.json

Recall (``niah``, ``ruler``): every sample is a chat prompt split as kvpress splits it: the context (the
chat template's head and the haystack: what gets compressed) and the question (the question, the
template's tail and the answer prefix), both token ids written to ``OUT/samples.jsonl`` with their sha256.
``niah``: a prose haystack (:func:`kvmeans.eval.ruler.builtin_haystack`) of ``--niah-length`` context
tokens with RULER's needle (a 7-digit number under a word key) at 5 depths; ``ruler``: NIAH-S1/S2 from
:mod:`kvmeans.eval.ruler` at ``--ruler-lengths``. Greedy, ``--max-new-tokens``; a sample counts when every
reference is in the answer (RULER's ``string_match_all``). At compression ratio ``r`` every compressed arm
keeps ``int((1 - r) * C)`` keys, ``C`` the shortest context of the setting (kvpress keeps that many context
keys of each sample, plus the question and answer): StreamingLLM ``S`` sinks + the last ``keys - S`` tokens
(a true stream: the prefill runs under that mask too, the cache evicts as it goes, positions stay the
tokens' own); KVM (``--kvm SPEC``, its budget replaced) a window of ``n_bswa_chunks * chunk_len`` tokens +
``keys - window`` state rows (sinks among them).

Perplexity by position (``ppl``): ``--ppl-windows`` windows of Shakespeare (:func:`text_windows`) at each
``--ppl-lengths``, ``--ppl-keys`` kept keys for every compressed arm at every length, NLL bucketed by the
position of the predicted token (``[1, 256)``, then doubling).

Reported per row: the score, kept keys, cache bytes held after the context (measured: the cache's tensors),
prefill tokens/s (the context) and answer tokens/s (question and answer tokens over the time after the
context). Outputs (atomic): ``bench.csv``, ``bench.json`` (settings, env, rows, per-sample answers),
``samples.jsonl``; rewritten after every arm so a long run keeps what it measured.

The arms, the StreamingLLM mask and the forward per window are :mod:`kvmeans.pretrained.arms`' (shared with
``kvmeans eval ppl``).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvmeans.eval import ruler
from kvmeans.pretrained.arms import (
    Arm,
    distilled_arm,
    evict,
    kvm_arm,
    kvm_settings,
    run_windows,
    streaming_arm,
    streaming_mask,
)
from kvmeans.utils.args import UsageError
from kvmeans.utils.io import atomic_write_text

__all__ = ["Arm", "chat_parts", "niah_samples", "ruler_samples", "sample_sha256", "write_samples", "read_samples",
           "answer", "streaming_mask", "evict", "position_buckets", "ppl_row", "recall_rows", "merge_kvpress",
           "streaming_arm", "kvm_settings", "kvm_arm", "distilled_arm"]

NIAH_DEPTHS = (10, 30, 50, 70, 90)
DEFAULT_KVM = "chunk_len=32,n_bswa_chunks=4,sink_len=4"
ARMS = ("full", "streaming", "kvm")


# ---- samples -------------------------------------------------------------------------------------------------
def chat_parts(tokenizer, context: str, question: str) -> Tuple[str, str]:
    """kvpress's split of a chat prompt (its pipeline's ``preprocess``): ``(context text, question suffix)``;
    the model reads ``context + question + suffix + answer_prefix``. No template: BOS + context and ``"\\n"``."""
    if getattr(tokenizer, "chat_template", None) is None:
        return (tokenizer.bos_token or "") + context, "\n"
    sep = "#" * (len(context) + 10)
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + sep}], add_generation_prompt=True,
                                         tokenize=False)
    head, suffix = text.split(sep)
    return head, suffix


def sample_sha256(context_ids: Sequence[int], question_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([list(context_ids), list(question_ids)]).encode()).hexdigest()


def _sample(tokenizer, bench: str, length: int, index: int, depth: float, context: str, question: str,
            answer_prefix: str, answers: List[str]) -> Dict[str, Any]:
    head, suffix = chat_parts(tokenizer, context, question)
    q_text = question + suffix + answer_prefix
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)    # noqa: E731
    ctx, q = enc(head), enc(q_text)
    return {"id": f"{bench}-{length}-{index}", "bench": bench, "length": length, "index": index, "depth": depth,
            "context": head, "question": q_text, "context_ids": ctx, "question_ids": q, "answers": answers,
            "sha256": sample_sha256(ctx, q)}


def _niah_text(words: List[str], depth: float, key: str, value: str) -> Tuple[str, str, str]:
    """RULER's single-needle template over ``words`` of prose: (context, question, answer prefix)."""
    sents = ruler.split_sentences(" ".join(words))
    at = int(len(sents) * depth / 100)
    needle = ruler.NEEDLE.format(type_needle_v="numbers", key=key, value=value)
    hay = " ".join(sents[:at] + [needle] + sents[at:])
    template = ruler.TEMPLATE.replace("Some", "A").replace("are all", "is").replace("are", "is")
    text = template.format(type_needle_v="number", context=hay, query=key)
    cut = text.rfind("\nWhat ")
    prefix = ruler.ANSWER_PREFIX.replace(" are", " is").format(type_needle_v="number", query=key).strip()
    return text[:cut], text[cut:], prefix


def niah_samples(tokenizer, n: int = 20, context_tokens: int = 1024, depths: Sequence[float] = NIAH_DEPTHS,
                 seed: int = 0, haystack: Optional[ruler.EssayHaystack] = None) -> List[Dict[str, Any]]:
    """``n`` prose NIAH samples: sample i puts a 7-digit needle at ``depths[i % len(depths)]`` percent of a
    haystack drawn from a seeded offset of ``haystack`` (default the built-in prose), grown to the most words
    whose context ids (template head included) stay within ``context_tokens``."""
    words = (haystack or ruler.builtin_haystack()).words
    rng = random.Random(seed)
    out = []
    for i in range(n):
        key, value = rng.choice(ruler.word_keys()), str(rng.randint(10 ** 6, 10 ** 7 - 1))
        depth, start = depths[i % len(depths)], rng.randrange(len(words) // 2)

        def build(k: int):
            ctx, q, prefix = _niah_text(words[start:start + k], depth, key, value)
            return _sample(tokenizer, "niah", context_tokens, i, depth, ctx, q, prefix, [value])
        lo, hi, best = 1, 2 * context_tokens, None
        while lo <= hi:        # the most words that fit (token counts grow with words)
            mid = (lo + hi) // 2
            s = build(mid)
            if len(s["context_ids"]) <= context_tokens:
                best, lo = s, mid + 1
            else:
                hi = mid - 1
        if best is None:
            raise ValueError(f"--niah-length {context_tokens}: the template alone does not fit; use a larger length")
        out.append(best)
    return out


def ruler_samples(tokenizer, task: str, length: int, n: int, seed: int = ruler.DEFAULT_SEED) -> List[Dict[str, Any]]:
    """RULER's ``task`` records at ``length`` (any synthetic task: :func:`kvmeans.eval.ruler_tasks.generate_samples`)
    as chat samples, split as kvpress' RULER set splits them: the context is everything before the question
    (RULER's last line: "What ..." for the NIAH tasks, "Question: ..." for vt, cwe and fwe), the answer prefix
    RULER's, after the template's tail; ``max_new_tokens`` the task's RULER budget."""
    from kvmeans.eval import ruler_tasks
    out = []
    for r in ruler_tasks.generate_samples(task, length, n, tokenizer, seed=seed):
        cut = max(r["input"].rfind("\nWhat "), r["input"].rfind("\nQuestion: "))
        s = _sample(tokenizer, task, length, r["index"], r.get("depth"), r["input"][:cut], r["input"][cut:],
                    r.get("gen_prefix", r["answer_prefix"]), r["outputs"])
        out.append({**s, "max_new_tokens": ruler_tasks.TOKENS_TO_GENERATE[task]})
    return out


def write_samples(path, samples: Sequence[Dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))


def read_samples(path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# ---- running one prompt ---------------------------------------------------------------------------------------
def _stop_ids(model, tokenizer) -> set:
    eos = getattr(model.config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def answer(arm: Arm, context_ids: Sequence[int], question_ids: Sequence[int], max_new_tokens: int,
           stop: set) -> Dict[str, Any]:
    """Greedy answer of ``arm`` to one sample: prefill the context, read the cache's bytes, feed the question,
    then decode one token at a time (stopping at ``stop`` ids). Returns the new ids, the bytes, the context's
    seconds and the answer's (question and decoding, as kvpress' ``generate_answer``)."""
    from transformers import DynamicCache

    from kvmeans.models.hf_compat import cache_kwargs
    from kvmeans.pretrained.cache import cache_nbytes
    model = arm.model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache, key_pos, pos, new = DynamicCache(), torch.zeros(0, dtype=torch.long), 0, []

    def step(ids: List[int]):
        nonlocal key_pos, pos
        qpos = torch.arange(pos, pos + len(ids))
        kw = {}
        if arm.sinks is not None:
            key_pos = torch.cat([key_pos, qpos])
            kw["attention_mask"] = streaming_mask(key_pos, qpos, arm.sinks, arm.window, dtype).to(device)
        logits = model(input_ids=torch.tensor([ids], device=device), position_ids=qpos[None].to(device),
                       use_cache=True, logits_to_keep=1, **cache_kwargs(cache), **kw).logits
        pos += len(ids)
        if arm.sinks is not None:      # what the next query can still see
            key_pos = evict(cache, key_pos, (key_pos < arm.sinks) | (key_pos > pos - arm.window))
        return int(logits[0, -1].argmax())

    with torch.no_grad():
        t0 = time.perf_counter()
        step(list(context_ids))
        t1 = time.perf_counter()
        nbytes = cache_nbytes(cache)
        tok = step(list(question_ids))
        while tok not in stop and len(new) < max_new_tokens:
            new.append(tok)
            if len(new) < max_new_tokens:
                tok = step([tok])
        t3 = time.perf_counter()
    return {"ids": new, "cache_bytes": nbytes, "prefill_s": t1 - t0, "answer_s": t3 - t1}


# ---- perplexity by position -----------------------------------------------------------------------------------
def position_buckets(length: int, first: int = 256) -> List[Tuple[int, int]]:
    """Predicted-token positions ``[1, first), [first, 2 first), ...`` up to ``length``."""
    edges = [1]
    while edges[-1] < length:
        edges.append(min(length, first if len(edges) == 1 else 2 * edges[-1]))
    return list(zip(edges[:-1], edges[1:]))


def ppl_row(arm: Arm, windows: torch.Tensor, progress=None) -> Dict[str, Any]:
    """Perplexity of ``arm`` over ``windows [N, T]``, overall and per :func:`position_buckets` bucket."""
    [(nll_t, nbytes, secs)] = run_windows([arm], windows, cache=True,
                                          each=(lambda *_: progress(1)) if progress else None)
    length = windows.shape[1]
    row = {"bench": "ppl", "length": length, "ratio": None, "arm": arm.name, "kept_keys": arm.kept(length),
           "score": math.exp(nll_t.mean().item()), "samples": len(windows), "cache_bytes": nbytes,
           "prefill_tok_s": windows.numel() / secs, "answer_tok_s": None}
    for lo, hi in position_buckets(length):
        row[f"ppl_{lo}_{hi}"] = math.exp(nll_t[:, lo - 1:hi - 1].mean().item())
    return row


# ---- recall ---------------------------------------------------------------------------------------------------
def kept_keys(sample: Dict[str, Any], ratio: Optional[float]) -> Optional[int]:
    """The keys a compressed arm keeps of ``sample``'s context at compression ``ratio`` (kvpress's count;
    None without a ratio)."""
    return None if ratio is None else int((1 - ratio) * len(sample["context_ids"]))


def recall_rows(name: str, make: Callable[[Optional[int]], Arm], samples: Sequence[Dict[str, Any]], tokenizer,
                max_new_tokens: int, ratio: Optional[float] = None, progress=None
                ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """``(row, per-sample answers)`` on ``samples`` (one setting: same bench and length). Each sample runs on
    ``make(keys)`` with ``keys = int((1 - ratio) * its context length)`` (kvpress's count; None without
    ``ratio``), one arm per distinct ``keys``."""
    arms: Dict[Optional[int], Arm] = {}
    answers = []
    for s in samples:
        keys = kept_keys(s, ratio)
        if keys not in arms:
            arms[keys] = make(keys)
        arm = arms[keys]
        budget = s.get("max_new_tokens", max_new_tokens)          # a RULER task's own budget
        r = answer(arm, s["context_ids"], s["question_ids"], budget, _stop_ids(arm.model, tokenizer))
        answers.append({"id": s["id"], "sha256": s["sha256"], "arm": name, "ratio": ratio,
                        "kept_keys": arm.kept_keys if arm.kept_keys is not None else len(s["context_ids"]),
                        "pred": tokenizer.decode(r["ids"], skip_special_tokens=True), "new_tokens": len(r["ids"]),
                        **{k: r[k] for k in ("cache_bytes", "prefill_s", "answer_s")}})
        if progress:
            progress(1)
    return _recall_row(samples, answers, name, ratio), answers


def _recall_row(samples, answers, arm: str, ratio) -> Dict[str, Any]:
    _, per = ruler.string_match_all([a["pred"] for a in answers], [s["answers"] for s in samples])
    for a, f in zip(answers, per):
        a["correct"] = f == 1.0
    ctx = sum(len(s["context_ids"]) for s in samples)
    ans_s = sum(a["answer_s"] for a in answers)
    ans_tokens = sum(len(s["question_ids"]) + a["new_tokens"] for s, a in zip(samples, answers))
    return {"bench": samples[0]["bench"], "length": samples[0]["length"], "ratio": ratio, "arm": arm,
            "kept_keys": round(sum(a["kept_keys"] for a in answers) / len(answers)),
            "score": sum(a["correct"] for a in answers), "samples": len(samples),
            "cache_bytes": max(a["cache_bytes"] for a in answers),
            "prefill_tok_s": ctx / sum(a["prefill_s"] for a in answers),
            "answer_tok_s": ans_tokens / ans_s if ans_s > 0 else None}


def merge_kvpress(results: Dict[str, Any], samples: Sequence[Dict[str, Any]], tokenizer
                  ) -> Tuple[List[Dict], List[Dict]]:
    """Rows of a kvpress results file (``run_kvpress.py``) re-scored here, checking every answered sample is one
    of ``samples`` (same id and sha256 of its ids); a :class:`UsageError` naming ``--kvpress-results`` if not.
    kvpress returns text: its answers' token counts are the text re-encoded with ``tokenizer``."""
    by_id = {s["id"]: s for s in samples}
    groups: Dict[Tuple, List[Dict]] = {}
    for a in results["samples"]:
        s = by_id.get(a["id"])
        if s is None or s["sha256"] != a["sha256"]:
            raise UsageError(f"--kvpress-results: sample {a['id']} is not one of this run's samples (different ids); "
                             "run run_kvpress.py on this run's samples.jsonl (same --model and sample options)")
        a = {**a, "new_tokens": len(tokenizer.encode(a["pred"], add_special_tokens=False))}
        groups.setdefault((a["arm"], a["ratio"], s["bench"], s["length"]), []).append(a)
    rows, answers = [], []
    for key, group in groups.items():
        row = _recall_row([by_id[a["id"]] for a in group], group, key[0], key[1])
        rows.append(row)
        answers += group
    return rows, answers


def all_samples(tokenizer, a) -> List[Dict[str, Any]]:
    """Every recall sample of the selected benches (``niah`` then ``ruler``), deterministic in the options
    (``a.seed`` draws other samples of every bench; RULER's are seeded ``ruler.DEFAULT_SEED + a.seed``, so seed 0
    gives RULER's own)."""
    out = []
    if "niah" in a.benches:
        out += niah_samples(tokenizer, a.niah_samples, a.niah_length, seed=a.seed)
    if "ruler" in a.benches:
        for task in a.ruler_tasks:
            for length in a.ruler_lengths:
                out += ruler_samples(tokenizer, task, length, a.ruler_samples, seed=ruler.DEFAULT_SEED + a.seed)
    return out


def _settings(samples) -> List[List[Dict[str, Any]]]:
    groups: Dict[Tuple, List] = {}
    for s in samples:
        groups.setdefault((s["bench"], s["length"]), []).append(s)
    return list(groups.values())


def _fmt(v, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def tables(rows: Sequence[Dict[str, Any]]) -> str:
    from kvmeans.bench.report import format_table, human_bytes
    rec = sorted((r for r in rows if r["bench"] != "ppl"),
                 key=lambda r: (r["bench"], r["length"], r["ratio"] is not None, r["ratio"] or 0))
    out = []
    if rec:
        out.append(format_table(["bench", "length", "ratio", "arm", "kept", "recall", "cache", "prefill tok/s",
                                 "answer tok/s"],
                                [[r["bench"], r["length"], _fmt(r["ratio"]), r["arm"], r["kept_keys"],
                                  f"{r['score']}/{r['samples']}", human_bytes(r["cache_bytes"]),
                                  _fmt(r["prefill_tok_s"], ".0f"), _fmt(r["answer_tok_s"], ".1f")] for r in rec]))
    for length in sorted({r["length"] for r in rows if r["bench"] == "ppl"}):
        ppl = [r for r in rows if r["bench"] == "ppl" and r["length"] == length]
        full = next((r["score"] for r in ppl if r["arm"] == "full"), None)
        buckets = [k for k in ppl[0] if k.startswith("ppl_")]
        out.append(format_table(["ppl", "arm", "kept", "ppl", "x full"] + [b[4:].replace("_", "-") for b in buckets]
                                + ["cache", "tok/s"],
                                [[length, r["arm"], r["kept_keys"], f"{r['score']:.2f}",
                                  _fmt(full and r["score"] / full, ".3f")] + [f"{r[b]:.2f}" for b in buckets]
                                 + [human_bytes(r["cache_bytes"]), f"{r['prefill_tok_s']:.0f}"] for r in ppl]))
    return "\n\n".join(out)


def _write(out: Path, settings, info, rows, answers) -> None:
    from kvmeans.bench.report import write_csv, write_json
    fields = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(out / "bench.csv", fields, [{k: r.get(k) for k in fields} for r in rows])
    write_json(out / "bench.json", {"settings": settings, "env": info, "rows": rows, "answers": answers})


def _recall_setting(group, full: Arm, kvm, distilled, a, tok, record, bar) -> None:
    """Every arm on one recall setting (same bench and length): full, then per ratio StreamingLLM and KVM at
    kvpress' kept keys, then the distilled model; ``record(row, answers)`` after each."""
    model, length = full.model, group[0]["length"]
    runs: List[Tuple[str, Optional[float], Callable]] = [("full", None, lambda k: full)]
    for r in a.ratios:
        runs.append(("streaming", r, lambda k: streaming_arm(model, k, a.sinks)))
        if kvm is not None:
            runs.append(("kvm", r, lambda k: kvm_arm(model, k, kvm)))
    if distilled is not None:
        runs.append(("kvm distilled", None, lambda k: distilled_arm(distilled, length)))
    for name, r, make in [run for run in runs if run[0] in a.arms or run[0] == "kvm distilled"]:
        if bar is not None:
            bar.set_description(f"{group[0]['bench']} {length} {name} {r or ''}")
        record(*recall_rows(name, make, group, tok, a.max_new_tokens, r, bar.update if bar is not None else None))
