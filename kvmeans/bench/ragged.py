"""Ragged-batch benchmark: greedy ``generate`` of left-padded prompts of distinct lengths vs equal lengths.

``kvmeans bench ragged [--lengths 40 49 ... 103] [--new-tokens 48] [--repeats 3]`` (``--help``).
The model is ``--preset`` (default ``tiny-cpu``: 4 layers, width 128) with random weights (each block's
output projection drawn, so no block is the identity). One repeat times, in turn, ``generate`` on the
ragged batch (``--lengths``, left-padded) and on as many prompts of their mean length, each for
``--new-tokens`` tokens and for one token (the prefill); the table gives the medians, the decode time per
step (the difference over ``--new-tokens - 1`` steps), the backbone calls per generated token (1 when every
step is one call; one per distinct prompt length when the batch is split by length) and the ratios.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import List

import torch

from kvmeans.utils.args import UsageError

DEFAULT_LENGTHS = [40, 49, 58, 67, 76, 85, 94, 103]


def build_model(preset: str, seed: int = 0):
    """A :class:`~kvmeans.models.hf.KVMForCausalLM` of ``preset`` with random non-identity blocks (eval mode)."""
    from kvmeans.models import KVMLanguageModel
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.utils.testing import perturb_identity_init
    torch.manual_seed(seed)
    lm = perturb_identity_init(KVMLanguageModel.from_preset(preset))
    return KVMForCausalLM.from_language_model(lm).eval()


def left_padded(lengths: List[int], vocab: int, seed: int = 1):
    """``(ids [B, L], mask [B, L])``: random prompts of ``lengths``, right-aligned (left padding with 0)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids, mask = torch.zeros(len(lengths), L, dtype=torch.long), torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, L - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, L - n:] = 1
    return ids, mask


def time_generate(model, ids, mask, new_tokens: int):
    """``(seconds, backbone calls)`` of one greedy ``generate`` of exactly ``new_tokens`` tokens."""
    calls, inner = [0], model.transformer.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)
    model.transformer.forward = counted
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, calls[0]
    finally:
        del model.transformer.forward


def run(lengths: List[int] = DEFAULT_LENGTHS, new_tokens: int = 48, repeats: int = 3, preset: str = "tiny-cpu") -> dict:
    """Time greedy ``generate`` of a left-padded batch of prompts of ``lengths`` against one of equal lengths
    (their mean), ``repeats`` times after a warm-up; print the table; return the medians, ratio and calls per
    token."""
    a = SimpleNamespace(lengths=list(lengths), new_tokens=new_tokens, repeats=repeats, preset=preset)
    if min(a.lengths) < 1 or a.new_tokens < 1 or a.repeats < 1:
        raise UsageError(f"--lengths, --new-tokens and --repeats must be >= 1, got {a.lengths}, {a.new_tokens}, "
                         f"{a.repeats}")
    try:
        model = build_model(a.preset)
    except ValueError as err:
        raise UsageError(f"--preset: {err}") from None
    vocab = model.config.vocab_size
    mean = round(sum(a.lengths) / len(a.lengths))
    batches = {"ragged": left_padded(a.lengths, vocab), "equal": left_padded([mean] * len(a.lengths), vocab)}
    times = {(k, n): [] for k in batches for n in (a.new_tokens, 1)}
    calls = {}
    for r in range(a.repeats + 1):                   # the first round warms up
        for name, (ids, mask) in batches.items():
            for n in (a.new_tokens, 1):
                t, c = time_generate(model, ids, mask, n)
                if r:
                    times[name, n].append(t)
                if n == a.new_tokens:
                    calls[name] = c
    med = {k: statistics.median(v) for k, v in times.items()}
    total = {k: med[k, a.new_tokens] for k in batches}
    step = {k: (med[k, a.new_tokens] - med[k, 1]) / max(a.new_tokens - 1, 1) for k in batches}
    out = dict(ragged_s=total["ragged"], equal_s=total["equal"], ratio=total["ragged"] / total["equal"],
               step_ratio=step["ragged"] / step["equal"], calls_per_token={k: calls[k] / a.new_tokens for k in calls})
    print(f"# {len(a.lengths)} prompts, {a.new_tokens} new tokens, preset {a.preset}, torch threads "
          f"{torch.get_num_threads()}; median of {a.repeats}")
    print(f"{'batch':>8} {'lengths':>14} {'total s':>9} {'prefill s':>10} {'decode ms/step':>15} {'calls/token':>12}")
    span = f"{min(a.lengths)}-{max(a.lengths)}"
    for name, lens in (("ragged", span), ("equal", f"{len(a.lengths)} x {mean}")):
        print(f"{name:>8} {lens:>14} {total[name]:>9.3f} {med[name, 1]:>10.3f} {1e3 * step[name]:>15.2f} "
              f"{out['calls_per_token'][name]:>12.2f}")
    print(f"ragged / equal = {out['ratio']:.2f}x (decode steps {out['step_ratio']:.2f}x)")
    return out
