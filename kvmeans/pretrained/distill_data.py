"""Distillation data: long-text sequences for training, with the perplexity eval's windows held out.

``kvmeans eval ppl`` draws its windows with :func:`kvmeans.pretrained.ppl.text_windows` (``n`` aligned
slots of ``length`` tokens, chosen by ``seed``). Distillation trains only on the documents that hold none of
those windows, so the same eval measures text the student never saw (whole documents are held out, not just
the windows, so no neighbouring context leaks either).
"""
from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple, Union

import torch

from kvmeans.pretrained.ppl import documents, window_slots

__all__ = ["data_sources", "heldout_documents", "training_sequences"]

Source = Union[str, Sequence[str]]


def heldout_documents(token_docs: List[List[int]], n: int, length: int, seed: int) -> List[int]:
    """Indices of the documents holding the ``n`` eval windows of ``length`` tokens that ``text_windows(...,
    n, length, seed)`` draws from these tokenized documents (the same slots and the same RNG draw)."""
    slots = window_slots(token_docs, length)
    if len(slots) < n:
        raise ValueError(f"the data holds {len(slots)} windows of {length} tokens, fewer than the {n} held out; "
                         "lower --holdout-windows or --holdout-length, or add text")
    return sorted({i for i, _ in random.Random(seed).sample(slots, n)})


def data_sources(data: Sequence[str]) -> List[Tuple[str, Source]]:
    """``[(label, source), ...]`` of ``--data`` items: each corpus name (``"shakespeare"``, ``"factbook"``, ...:
    :mod:`kvmeans.eval.corpora`) is a source of its own; the text files, together, are one source ``"files"``."""
    from kvmeans.eval.corpora import CORPORA
    if isinstance(data, str):
        data = [data]
    named = [d for d in data if d == "shakespeare" or d in CORPORA]
    files = [d for d in data if d not in named]
    if len(set(named)) != len(named):
        raise ValueError(f"a corpus is named twice in {list(data)}; name each once")
    return [(d, d) for d in named] + ([("files", files)] if files else [])


def training_sequences(tokenizer, source: Source, seq_len: int,
                       holdout: Tuple[int, int, int]) -> Tuple[torch.Tensor, Dict[str, List[int]]]:
    """``([N, seq_len] token ids, {source: held-out document indices})``: aligned non-overlapping slots of the
    documents of every source of ``source`` (corpus names and/or text files, :func:`data_sources`; tokenized
    without special tokens) outside the held-out ones, sources in the order given. ``holdout = (n, length,
    seed)``: per source, the documents holding the ``n`` windows of ``length`` tokens that ``text_windows(...,
    source, n, length, seed)`` (and ``kvmeans bench quality``'s windows with that ``n``) draw; a source too short
    for ``n`` such windows holds nothing out (``n = 0``: hold nothing out)."""
    n, length, seed = holdout
    seqs: List[List[int]] = []
    held: Dict[str, List[int]] = {}
    for label, src in data_sources(source):
        docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents(src)]
        held[label] = heldout_documents(docs, n, length, seed) if 0 < n <= len(window_slots(docs, length)) else []
        seqs += [ids[s:s + seq_len] for i, ids in enumerate(docs) if i not in held[label]
                 for s in range(0, len(ids) - seq_len + 1, seq_len)]
    if not seqs:
        raise ValueError(f"no document outside the held-out ones has {seq_len} tokens; lower --seq-len or add text")
    return torch.tensor(seqs, dtype=torch.long), held
