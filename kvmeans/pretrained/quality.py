"""The held-out quality protocol of converted models (``kvmeans bench quality``, docs/quality.md).

    kvmeans bench quality --models ~/.cache/kvmeans/models/smollm2-135m ~/.cache/kvmeans/models/qwen2.5-coder-0.5b \\
        --corpora shakespeare wikipedia django sotu --lengths 2048 8192 --windows 4 2 --out runs/quality

Cells are (model, corpus, length). A cell is a **tuning** cell when its model is the tuning model and its corpus
the tuning corpus (``--tune-model``, ``--tune-corpus``; default SmolLM2 and Shakespeare, where the settings were
chosen); every other cell is **held out**: its model, its kind of text or both were never used to choose
anything. The table says which is which.

In every cell every arm runs on the same windows (``n`` aligned windows of ``length`` tokens inside documents of
the corpus, seeded) and every compressed arm keeps the same number of keys, ``K = round(keep * length)``
(default 12.5%):

* ``full``: the model as is;
* ``streaming``: StreamingLLM, 4 sinks and the last ``K - 4`` tokens (the mask over the plain model, positions
  the tokens' own);
* ``kvm``: :func:`kvmeans.convert_hf` at ``K`` keys (``--kvm`` settings, their window shrunk to at most ``K / 2``
  and the rest a fixed state budget: :func:`kvmeans.pretrained.arms.kvm_settings`; a shrunk window is logged and
  what ran is recorded per ``K`` under ``settings.kvm_effective``);
* ``kvm-auto``: (``--auto``) the split :func:`kvmeans.pretrained.calibrate.calibrate` picks for the model on the
  built-in calibration text (once per model, at 260 keys), spent at the cell's ``K``;
* ``kvm-distilled``: a distilled folder per model (``--distilled``): its learned read-out, its own split of
  window, state and exact rows spent at ``K`` keys (:func:`distilled_settings`);
* kvpress' presses, run in their own venv on the windows written here (``windows.jsonl``,
  ``benchmarks/kvpress/run_kvpress.py --windows``) and merged with ``--kvpress-results``.

Two numbers per arm and cell, from one forward per window: the **window perplexity** (every next token of the
window, each arm within its kept keys all along) and the **continuation perplexity** (the last ``length // 8``
tokens, after the rest as context). A press compresses a prefilled context once, so it has only the second:
its context is compressed to ``K`` keys and the continuation is appended uncompressed (it ends with up to
``K + length // 8`` keys, an advantage the table notes).

Outputs under ``--out`` (atomic, rewritten after every cell): ``quality.json`` (settings, environment, rows),
``quality.csv``, ``windows.jsonl`` (the token ids of every window, for the presses).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from kvmeans.pretrained.arms import Arm, run_windows, streaming_arm
from kvmeans.utils.io import atomic_write_text
from kvmeans.utils.modules import copy_sharing_weights

__all__ = ["Cell", "cell_role", "kept_keys", "continuation_len", "cell_windows", "score_cell", "merge_kvpress",
           "format_tables", "write_outputs"]

SINKS = 4


@dataclass(frozen=True)
class Cell:
    model: str          # the model's name (its folder's name)
    corpus: str
    length: int
    windows: int
    role: str           # "tuning" or "held-out"

    @property
    def id(self) -> str:
        return f"{self.model}/{self.corpus}/{self.length}"


def cell_role(model: str, corpus: str, tune_model: str, tune_corpus: str) -> str:
    return "tuning" if (model, corpus) == (tune_model, tune_corpus) else "held-out"


def kept_keys(length: int, keep: float) -> int:
    """Keys every compressed arm keeps at ``length`` tokens: ``round(keep * length)``."""
    return max(SINKS + 1, round(keep * length))


def continuation_len(length: int) -> int:
    """The tokens scored after the context in the continuation perplexity: the last eighth of the window."""
    return max(1, length // 8)


def cell_windows(tokenizer, corpus: str, length: int, n: int, seed: int = 0,
                 cache: Optional[Dict[str, List[List[int]]]] = None) -> torch.Tensor:
    """``[n, length]`` ids: ``n`` aligned windows inside ``corpus``' documents, chosen by ``seed``
    (:func:`kvmeans.pretrained.ppl.sample_windows`; ``cache`` keeps a corpus' token ids between lengths)."""
    from kvmeans.pretrained.ppl import documents, sample_windows
    if cache is not None and corpus in cache:
        docs = cache[corpus]
    else:
        docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents(corpus)]
        if cache is not None:
            cache[corpus] = docs
    return sample_windows(docs, n, length, seed, where=f"corpus {corpus}", fix="lower --windows or --lengths")


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def score_cell(arms: Sequence[Arm], windows: torch.Tensor, cell: Cell,
               each: Optional[Callable[[int, Arm, torch.Tensor], None]] = None) -> List[Dict[str, Any]]:
    """One row per arm: window and continuation perplexity (and their ratio to the first arm, full attention),
    kept keys, seconds. The arms run window by window in turn (:func:`kvmeans.pretrained.arms.run_windows`)."""
    length, tail = windows.shape[1], continuation_len(windows.shape[1])
    results = run_windows(arms, windows, each=each)
    rows = []
    for arm, (nll, _, secs) in zip(arms, results):
        rows.append({"cell": cell.id, "model": cell.model, "corpus": cell.corpus, "length": length,
                     "role": cell.role, "arm": arm.name, "kept_keys": arm.kept(length),
                     "windows": windows.shape[0], "ppl": _ppl(nll), "ppl_continuation": _ppl(nll[:, -tail:]),
                     "seconds": round(secs, 2)})
    full = next((r for r in rows if r["arm"] == "full"), None)
    for r in rows:
        r["x_full"] = None if full is None else r["ppl"] / full["ppl"]
        r["x_full_continuation"] = None if full is None else r["ppl_continuation"] / full["ppl_continuation"]
    return rows


def window_records(cell: Cell, windows: torch.Tensor, keep: float) -> List[Dict[str, Any]]:
    """What a press needs of each window: its ids, the context length and the keys to compress the context to."""
    tail = continuation_len(windows.shape[1])
    return [{"cell": cell.id, "model": cell.model, "corpus": cell.corpus, "length": cell.length, "role": cell.role,
             "window": i, "ids": w.tolist(), "context_len": windows.shape[1] - tail,
             "keys": kept_keys(cell.length, keep)} for i, w in enumerate(windows)]


def merge_kvpress(rows: List[Dict[str, Any]], kvpress_rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows of ``run_kvpress.py --windows`` (per press and cell: ``ppl_continuation``) merged as arms
    ``kvpress:<press>`` beside this run's rows of the same cell, with their ratio to this run's full attention."""
    out = list(rows)
    full = {r["cell"]: r for r in rows if r["arm"] == "full"}
    for k in kvpress_rows:
        ref = full.get(k["cell"])
        out.append({**{f: k.get(f) for f in ("cell", "model", "corpus", "length", "role", "kept_keys", "windows",
                                             "seconds")},
                    "arm": f"kvpress:{k['press']}", "ppl": None, "x_full": None,
                    "ppl_continuation": k["ppl_continuation"],
                    "x_full_continuation": None if ref is None else k["ppl_continuation"] / ref["ppl_continuation"]})
    return out


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_tables(rows: Sequence[Dict[str, Any]]) -> str:
    """Per model: one line per (corpus, length, role), one column per arm: window ppl (x full), then the
    continuation ppl (x full)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        arms = list(dict.fromkeys(r["arm"] for r in mine))
        head = ["corpus", "length", "role", "keys"] + arms
        for metric, ratio, title in (("ppl", "x_full", "window perplexity"),
                                     ("ppl_continuation", "x_full_continuation", "continuation perplexity")):
            lines = []
            for cell in dict.fromkeys(r["cell"] for r in mine):
                by_arm = {r["arm"]: r for r in mine if r["cell"] == cell}
                any_row = next(iter(by_arm.values()))
                keys = next((r["kept_keys"] for r in by_arm.values() if r["arm"] != "full"), any_row["kept_keys"])
                lines.append([any_row["corpus"], str(any_row["length"]), any_row["role"], str(keys)] + [
                    "-" if a not in by_arm or by_arm[a][metric] is None else
                    f"{by_arm[a][metric]:.2f} ({_fmt(by_arm[a][ratio], '.3f')}x)" for a in arms])
            widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
            out.append(f"{model}: {title} (x full attention)")
            out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
            out.extend("  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in lines)
            out.append("")
    return "\n".join(out)


def write_outputs(out: Path, settings: Dict[str, Any], rows: Sequence[Dict[str, Any]]) -> None:
    fields = ["cell", "model", "corpus", "length", "role", "arm", "kept_keys", "windows", "ppl", "x_full",
              "ppl_continuation", "x_full_continuation", "seconds"]
    atomic_write_text(out / "quality.json", json.dumps({"settings": settings, "rows": list(rows)}, indent=2))
    lines = [",".join(fields)] + [",".join("" if r.get(f) is None else str(r.get(f)) for f in fields) for r in rows]
    atomic_write_text(out / "quality.csv", "\n".join(lines) + "\n")


def distilled_settings(stored: Dict[str, Any], keys: int) -> Dict[str, Any]:
    """The ``load_converted`` settings of a distilled folder (its ``kvm_conversion``, ``stored``) at ``keys`` kept
    keys: its own split of window, state and exact rows, as shares (:class:`~kvmeans.pretrained.calibrate.Split`),
    spent at ``keys``; its other settings as stored."""
    from kvmeans.pretrained.calibrate import Split, split_settings
    budget = stored["budget"]
    if isinstance(budget, dict) and budget.get("kind") != "fixed":
        raise ValueError(f"a distilled folder with a {budget.get('kind')} budget has no fixed split to carry to "
                         f"{keys} kept keys; distil with a fixed budget")
    rows = int(budget["n"] if isinstance(budget, dict) else budget)
    window = stored["n_bswa_chunks"] * stored["chunk_len"]
    split = Split(stored["chunk_len"], window / (window + rows), stored.get("exact_rows", 0) / rows)
    at_keys = split_settings(split, keys, sink_len=stored["sink_len"])
    return {**{k: v for k, v in stored.items() if k not in ("layers", "calibration", *at_keys)}, **at_keys}


def run_protocol(models: Sequence[str], corpora: Sequence[str], lengths: Sequence[int], windows: Sequence[int],
                 keep: float, kvm: Optional[dict], distilled: Dict[str, str], tune_model: str, tune_corpus: str,
                 out: Path, seed: int = 0, log: Callable[[str], None] = print,
                 settings: Optional[Dict[str, Any]] = None, auto: bool = False) -> List[Dict[str, Any]]:
    """Every cell of ``models x corpora x lengths`` (see the module docstring); returns the rows and writes the
    outputs after every cell."""
    from transformers import AutoModelForCausalLM

    from kvmeans.models.load import load_hf_tokenizer
    from kvmeans.pretrained.arms import converted_arm, effective_record, kvm_settings, shrink_note
    from kvmeans.pretrained.calibrate import BUILT_IN, calibrate, calibration_windows, split_named, split_settings
    from kvmeans.pretrained.convert import convert_hf, load_converted
    from kvmeans.pretrained.heads import AUTOMATIC
    rows: List[Dict[str, Any]] = []
    records: List[Dict[str, Any]] = []
    settings = {} if settings is None else settings      # the caller writes it again: calibration records stay
    for model_dir in models:
        name = Path(model_dir).name
        tok = load_hf_tokenizer(model_dir)
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        max_len = getattr(plain.config, "max_position_embeddings", None)
        token_cache: Dict[str, List[List[int]]] = {}
        split = None
        if auto:        # once per model, on the built-in calibration text (never on the corpora scored here)
            chosen = calibrate(plain, convert=convert_hf, windows=calibration_windows(tok), text=BUILT_IN)
            split = split_named(chosen["calibration"]["chosen"])
            settings.setdefault("calibration", {})[name] = chosen["calibration"]
            log(f"{name}: calibrated split {split.name} ({chosen['calibration']['seconds']} s)")
        for length, n in zip(lengths, windows):
            if max_len and length > max_len:
                log(f"{name}: skipping length {length} (beyond its {max_len} positions)")
                continue
            keys = kept_keys(length, keep)
            arms = [Arm("full", plain), streaming_arm(plain, keys, SINKS)]
            def converted(settings):            # the arms share plain's weights: no model copy per arm
                return convert_hf(copy_sharing_weights(plain), **settings)
            if kvm is not None:
                got = kvm_settings(keys, kvm)
                note = shrink_note(keys, kvm, got)
                if note:
                    log(f"{name}: {note}")
                settings.setdefault("kvm_effective", {})[str(keys)] = effective_record(got)
                arms.append(converted_arm("kvm", converted(got), length))
            if split is not None:
                arms.append(converted_arm("kvm-auto", converted({**split_settings(split, keys),
                                                                 "exact_heads": AUTOMATIC}), length))
            if name in distilled:               # its learned read-out at this cell's kept keys
                with open(Path(distilled[name]) / "config.json", encoding="utf-8") as f:
                    stored = json.load(f)["kvm_conversion"]
                conv = load_converted(distilled[name], settings=distilled_settings(stored, keys),
                                      dtype=torch.float32).eval()
                arms.append(converted_arm("kvm-distilled", conv, length))
            for corpus in corpora:
                cell = Cell(name, corpus, length, n, cell_role(name, corpus, tune_model, tune_corpus))
                ids = cell_windows(tok, corpus, length, n, seed, token_cache)
                records.extend(window_records(cell, ids, keep))
                t0 = time.perf_counter()
                new = score_cell(arms, ids, cell)
                rows.extend(new)
                log(f"{cell.id} ({cell.role}, {keys} keys, {time.perf_counter() - t0:.0f} s): " + ", ".join(
                    f"{r['arm']} {r['ppl']:.2f}/{r['ppl_continuation']:.2f}" for r in new))
                write_outputs(out, settings, rows)
                atomic_write_text(out / "windows.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return rows
