"""RULER's haystack sizing for the non-NIAH tasks: binary search for the largest size, then per-sample shrink.

Same shape as :func:`kvmeans.eval.ruler.generate_samples` (RULER HEAD's ``variable_tracking.py`` and
``common_words_extraction.py``): the caller gives the search's upper bound (each RULER script estimates it
its own way, with its own draws), :func:`kvmeans.eval.ruler.fit_haystack` finds the largest size whose probe
fits, and each sample starts there and shrinks by ``incremental`` (re-drawing) until it fits. Where RULER
would loop forever (not even ``incremental`` units fit) a ``ValueError`` names ``--lengths`` instead.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from kvmeans.eval.ruler import fit_haystack

__all__ = ["too_small", "fit_size", "draw_samples", "split_prefix"]


def too_small(task: str, max_length: int, need: int, units: int) -> ValueError:
    return ValueError(f"--lengths {max_length} is too small for {task} with this tokenizer: a prompt with {units} "
                      f"haystack units (RULER's smallest step) plus the generated tokens takes {need} tokens; use "
                      f"--lengths >= {need} (RULER's lengths start at 4096)")


def fit_size(task: str, probe: Callable[[int], str], count: Callable[[str], int], max_length: int,
             incremental: int, tokens_to_generate: int, upper: int) -> int:
    """The largest size in ``[incremental, upper]`` whose ``probe`` fits ``max_length`` (RULER's search)."""
    best, probes = fit_haystack(probe, count, max_length, incremental, tokens_to_generate, upper=upper)
    if best is None:
        units, need = min(probes, key=lambda p: p[1])
        raise too_small(task, max_length, need, units)
    return best


def draw_samples(task: str, make: Callable[[int, int], Tuple[str, List[str]]], count: Callable[[str], int],
                 max_length: int, num_samples: int, size: int, incremental: int, tokens_to_generate: int,
                 max_floor_retries: int = 100) -> List[Tuple[str, List[str], int, int]]:
    """``num_samples`` of ``(text, answers, length, size used)``: sample ``i`` is ``make(i, n)``, ``n`` from
    ``size`` down by ``incremental`` while ``count(text) + tokens_to_generate > max_length`` (RULER's retry loop)."""
    out = []
    for index in range(num_samples):
        used, floor_tries, length = size, 0, None
        while True:
            try:
                text, answers = make(index, used)
                length = count(text) + tokens_to_generate
                if length <= max_length:
                    break
            except ValueError:               # RULER's bare except: too few units for what is inserted
                pass
            if used > incremental:
                used -= incremental
            else:
                floor_tries += 1
                if floor_tries > max_floor_retries:
                    raise too_small(task, max_length, length or max_length + 1, used)
        out.append((text, answers, length, used))
    return out


def split_prefix(task: str, index: int, text: str, answers: List[str], length: int, max_length: int,
                 used: int, answer_prefix: str) -> Dict[str, Any]:
    """One record: RULER cuts the answer prefix off at the last occurrence of its first 10 characters."""
    cut = text.rfind(answer_prefix[:10])
    return {"index": index, "task": task, "input": text[:cut], "answer_prefix": text[cut:], "outputs": answers,
            "length": length, "max_length": max_length, "num_haystack": used}
