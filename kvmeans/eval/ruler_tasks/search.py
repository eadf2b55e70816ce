"""RULER's haystack sizing for the non-NIAH tasks: binary search for the largest size, then per-sample shrink.

Same shape as :func:`kvmeans.eval.ruler.generate_samples` (RULER HEAD's ``variable_tracking.py`` and
``common_words_extraction.py``): the caller gives the search's upper bound (each RULER script estimates it
its own way, with its own draws), :func:`kvmeans.eval.ruler.fit_haystack` finds the largest size whose probe
fits, and each sample starts there and shrinks by ``incremental`` (re-drawing) until it fits. Where RULER
would loop forever (not even ``incremental`` units fit) a ``ValueError`` names ``--lengths`` instead.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from ..ruler import fit_haystack

__all__ = ["too_small", "fit_size", "draw_samples", "split_prefix"]


def too_small(task: str, max_length: int, need: int) -> ValueError:
    return ValueError(f"--lengths {max_length} is too small for {task} with this tokenizer: its smallest RULER "
                      f"prompt plus the generated tokens take {need} tokens; use --lengths >= {need} "
                      "(RULER's lengths start at 4096)")


def fit_size(task: str, probe: Callable[[int], str], count: Callable[[str], int], max_length: int,
             incremental: int, tokens_to_generate: int, upper: int) -> int:
    """The largest size in ``[incremental, upper]`` whose ``probe`` fits ``max_length`` (RULER's search)."""
    best, probes = fit_haystack(probe, count, max_length, incremental, tokens_to_generate, upper=upper)
    if best is None:
        raise too_small(task, max_length, min(t for _, t in probes))
    return best


def draw_samples(task: str, make: Callable[[int], Tuple[str, List[str]]], count: Callable[[str], int],
                 max_length: int, num_samples: int, size: int, incremental: int, tokens_to_generate: int,
                 max_floor_retries: int = 100) -> List[Tuple[str, List[str], int, int]]:
    """``num_samples`` of ``(text, answers, length, size used)``: each starts at ``size`` and shrinks by
    ``incremental`` while ``count(text) + tokens_to_generate > max_length`` (RULER's retry loop)."""
    out = []
    for _ in range(num_samples):
        used, floor_tries, length = size, 0, None
        while True:
            try:
                text, answers = make(used)
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
                    raise too_small(task, max_length, length or max_length + 1)
        out.append((text, answers, length, used))
    return out


def split_prefix(task: str, index: int, text: str, answers: List[str], length: int, max_length: int,
                 used: int, answer_prefix: str) -> Dict[str, Any]:
    """One record: RULER cuts the answer prefix off at the last occurrence of its first 10 characters."""
    cut = text.rfind(answer_prefix[:10])
    return {"index": index, "task": task, "input": text[:cut], "answer_prefix": text[cut:], "outputs": answers,
            "length": length, "max_length": max_length, "num_haystack": used}
