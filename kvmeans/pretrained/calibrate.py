"""Automatic conversion settings: a short calibration pass on generic text (``convert_hf(model)`` with no settings).

At a given number of kept keys ``K`` (default 260: 12.7% of a 2048-token context), how to split them between the
exact window and the state, and how much of the state to keep as exact single-token rows, depends on the model:
a model whose heads read mostly nearby tokens wants a long window, one that retrieves wants state rows. The pass
scores a few splits (:data:`CANDIDATES`, written as shares of ``K`` so a choice carries to any ``K``) by the
next-token loss of the tokens past the first ``K`` of a few calibration windows, and keeps the best one; among
the splits within :data:`TIE` (1%) of the best tail perplexity it keeps the one with the most exact single-token
rows (:func:`choose`): perplexity cannot see retrieval, and exact rows are where a needle survives, so when the
loss does not tell the splits apart the choice keeps recall.

Calibration text (:func:`calibration_windows`): windows of the built-in Shakespeare distractor (plays) and of this
package's own Python source (code and English docstrings) frozen at one commit (``kvmeans/eval/data/
calibration_code.json.gz``, so that editing the package does not move the choice), tokenized by the model's
tokenizer; or token ids the caller passes. The choice, the candidates' losses and the text are recorded under
``calibration`` in ``config.kvm_conversion``.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvmeans.pretrained.nll import token_nll
from kvmeans.utils.modules import copy_sharing_weights

__all__ = ["Split", "CANDIDATES", "SPLIT_SIZES", "DEFAULT_KEYS", "TIE", "split_settings", "split_named",
           "calibration_windows", "choose", "calibrate"]

BUILT_IN = "kvmeans built-in: Shakespeare distractor plays + kvmeans' Python source frozen at df7be91, 1 window each"
DEFAULT_KEYS = 260          # 12.7% of 2048 tokens: the documented default (budget 132 + a 128-token window)
SINKS = 4
# the settings a split sets per kept keys (split_settings); `--kvm auto:NAME,...` takes any others
SPLIT_SIZES = ("budget", "chunk_len", "n_bswa_chunks", "sink_len", "exact_rows")
TIE = 0.01                  # tail perplexities within 1% count as a tie, broken by the most exact rows


@dataclasses.dataclass(frozen=True)
class Split:
    """A way to spend ``K`` kept keys: chunks of ``chunk_len``, a window of about ``window_share * K`` keys (whole
    chunks), the rest a fixed state budget of which ``exact_share`` are exact single-token rows."""
    chunk_len: int
    window_share: float
    exact_share: float

    @property
    def name(self) -> str:
        return f"C{self.chunk_len}-w{self.window_share:.2f}-e{self.exact_share:.2f}"


# window 128 / 192 / 224 keys of 260 (about half, three quarters, seven eighths), with and without exact rows; the
# last, most of a 68-row state exact, since 2026-11-28 (on the Qwen models it lowered the tail loss and raised
# recall; docs/quality.md#more-exact-rows-among-the-candidates)
CANDIDATES = (
    Split(32, 0.5, 0.0), Split(32, 0.5, 0.25),
    Split(32, 0.75, 0.0), Split(32, 0.75, 0.25),
    Split(16, 0.875, 0.0), Split(16, 0.875, 0.45),
    Split(16, 0.75, 0.75),
)


def split_settings(split: Split, keys: int, sink_len: int = SINKS) -> dict:
    """``convert_hf`` settings spending ``keys`` kept keys as ``split`` says: ``n_bswa_chunks`` whole chunks of
    window (at least one), a fixed ``budget`` of the rest (at least one chunk plus the sinks: the mean pool keeps the
    first chunk's rows) and ``exact_rows`` (at most ``budget - chunk_len``). Raises ``ValueError`` when ``keys``
    cannot hold one chunk of window and a budget."""
    from kvmeans.ops.budget import StateBudget
    C = split.chunk_len
    least = C + max(C, sink_len + 1)
    if keys < least:
        raise ValueError(f"keys={keys} cannot hold a {C}-token chunk of window and a state budget of at least "
                         f"{max(C, sink_len + 1)} rows; give keys >= {least} or a split with a shorter chunk_len")
    n = max(1, min(round(split.window_share * keys / C), (keys - max(C, sink_len + 1)) // C))
    budget = keys - n * C
    exact = min(round(split.exact_share * budget), budget - C)
    return {"chunk_len": C, "n_bswa_chunks": n, "sink_len": sink_len, "budget": StateBudget.fixed(budget),
            "exact_rows": max(0, exact)}


def _package_source() -> str:
    """This package's Python source, files in path order, frozen at one commit (code with English docstrings;
    ``kvmeans/eval/data/build_calibration_code.py``), checked against its recorded sha256."""
    path = Path(__file__).resolve().parents[1] / "eval" / "data" / "calibration_code.json.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    if hashlib.sha256(doc["text"].encode("utf-8")).hexdigest() != doc["sha256"]:
        raise ValueError(f"{path}: the calibration text does not match its sha256; reinstall kvmeans")
    return doc["text"]


def _plays() -> str:
    path = Path(__file__).resolve().parents[1] / "eval" / "data" / "shakespeare_distractor.json.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["text"]


def calibration_windows(tokenizer, length: int = 1024, per_text: int = 1) -> torch.Tensor:
    """``[2 * per_text, length]`` token ids: ``per_text`` windows of plays and of Python source each, taken from
    the middle of each text (tokenized with ``tokenizer``)."""
    out = []
    for text in (_plays(), _package_source()):
        ids = tokenizer(text[: 40 * length * (per_text + 1)], return_tensors="pt",
                        add_special_tokens=False).input_ids[0]
        if ids.numel() < length * per_text:
            raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than {per_text} x {length}")
        start = (ids.numel() - length * per_text) // 2
        out += [ids[start + i * length: start + (i + 1) * length] for i in range(per_text)]
    return torch.stack(out)


def _tokenizer_of(model):
    from transformers import AutoTokenizer
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path:
        raise ValueError("calibration needs token ids: the model has no name_or_path to load its tokenizer from; "
                         "pass calibration=<LongTensor [N, T]> or tokenizer=... to convert_hf, or give settings")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"calibration could not load the tokenizer of {path!r} ({e}); pass tokenizer=... or "
                         "calibration=<token ids> to convert_hf, or give settings") from e


def _tail_nll(model, windows: torch.Tensor, keys: int) -> float:
    """Mean next-token NLL of the tokens after the first ``keys`` of every window (where compression acts)."""
    return torch.cat([token_nll(model, w[None])[0, keys:] for w in windows]).double().mean().item()


def calibrate(model, keys: int = DEFAULT_KEYS, *, convert: Callable, windows: Optional[torch.Tensor] = None,
              tokenizer=None, length: int = 1024, candidates: Sequence[Split] = CANDIDATES,
              base: Optional[dict] = None, progress: bool = True, text: Optional[str] = None) -> dict:
    """Pick ``convert_hf`` settings for ``model`` at ``keys`` kept keys: every split in ``candidates`` converts a
    copy of ``model`` sharing its weights, with ``convert`` (:func:`kvmeans.convert_hf`, which calls this module:
    passed in, not imported), and is scored on ``windows`` (``[N, T]`` ids; default :func:`calibration_windows` with
    the model's tokenizer). ``base``: other settings every candidate gets; ``text``: what ``windows`` are, for the
    record. Returns the best settings with a ``calibration`` record (candidates, their losses, the text, seconds).
    ``model`` itself is not changed."""
    from kvmeans.utils.progress import progress_bar
    t0 = time.perf_counter()
    if windows is None:
        windows = calibration_windows(tokenizer or _tokenizer_of(model), length)
        text = BUILT_IN
    elif text is None:
        text = "caller's token ids"
    if windows.dim() != 2 or windows.shape[1] <= keys + 1:
        raise ValueError(f"calibration windows must be [N, T] with T > keys + 1 = {keys + 1}, got "
                         f"{tuple(windows.shape)}")
    was_training = model.training
    model.eval()
    scored: List[Dict] = []
    bar = progress_bar(len(candidates), enabled=progress, terminal=True, desc="calibrating KVM settings")
    for split in candidates:
        if bar is not None:
            bar.update()
        try:
            settings = {**(base or {}), **split_settings(split, keys)}
        except ValueError:
            continue
        trial = convert(copy_sharing_weights(model), **settings)
        scored.append({"split": split.name, "nll": _tail_nll(trial, windows, keys)})
        del trial
    model.train(was_training)
    if bar is not None:
        bar.close()
    if not scored:
        raise ValueError(f"keys={keys}: no calibration candidate fits; give more keys or settings")
    best = choose(scored, keys, candidates)
    chosen = {**(base or {}), **split_settings(split_named(best, candidates), keys)}
    chosen["calibration"] = {
        "keys": keys, "text": text, "windows": list(windows.shape), "chosen": best,
        "rule": f"lowest tail perplexity; within {TIE:.0%} of it, the most exact rows",
        "candidates": [{"split": s["split"], "tail_ppl": round(math.exp(s["nll"]), 4)} for s in scored],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return chosen


def choose(scored: Sequence[Dict], keys: int, candidates: Sequence[Split] = CANDIDATES, tie: float = TIE) -> str:
    """The name of the split to keep from ``scored`` (``[{"split": name, "nll": tail NLL}, ...]``): of those whose
    tail perplexity is within ``tie`` (a fraction) of the lowest, the one with the most exact rows at ``keys``,
    then the lower loss."""
    least = min(s["nll"] for s in scored)
    near = [s for s in scored if s["nll"] <= least + math.log1p(tie)]
    exact = {s["split"]: split_settings(split_named(s["split"], candidates), keys)["exact_rows"] for s in near}
    return min(near, key=lambda s: (-exact[s["split"]], s["nll"]))["split"]


def split_named(name: str, candidates: Sequence[Split] = CANDIDATES) -> Split:
    """The split of ``candidates`` called ``name`` (a calibration record's ``chosen``); ``ValueError`` naming the
    candidates when there is none."""
    found = [c for c in candidates if c.name == name]
    if not found:
        raise ValueError(f"no calibration split called {name!r}; give one of {', '.join(c.name for c in candidates)}")
    return found[0]

