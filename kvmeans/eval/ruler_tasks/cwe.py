"""RULER ``cwe`` (common words extraction), generated offline: a port of RULER HEAD's
``common_words_extraction.py`` (``synthetic.yaml``: ``freq_cw=30, freq_ucw=3, num_cw=10``; one few-shot example).

A numbered list ``1. word 2. word ...`` in which 10 words appear 30 times and the others 3 times (below 4096
tokens: 6 and 1); the answer is the 10 common words (:func:`kvmeans.eval.ruler.string_match_all`). The
prompt starts with one solved example (40 words, 10x/3x; below 4096 tokens 20 words, 3x/1x). 120 tokens are
generated.

Reproduced: the template and answer prefix, the word pool (sorted unique wonderwords nouns + adjectives +
verbs, shuffled once with ``random.Random(seed)``; :func:`words`), ``random.sample`` of the words and a fresh
``random.Random(seed)`` shuffle of the list (so every list of a given size has the same order pattern, as in
RULER), the example joined to its answer by one space and to the task by a newline, the budget
``tokens(example + task + answer prefix) + 120 <= length``, and the binary search (estimate from one
4096-word sample, upper bound ``int(length // tokens_per_word) * 2``, ``incremental`` = 10 words) in RULER's
order of draws (``random.Random(seed)`` for RULER's seeded global ``random``, fresh per (task, length)).

Not shipped: RULER's ``english_words.json``, which RULER samples from when a list needs more distinct words
than the pool has (lengths around 128K tokens); such a length is a ``ValueError`` here.
"""
from __future__ import annotations

import random
from functools import lru_cache
from typing import Any, Callable, Dict, List, Tuple

from kvmeans.eval.ruler import _wonderwords_list
from kvmeans.eval.ruler_tasks.search import draw_samples, fit_size, split_prefix

__all__ = ["TEMPLATE", "ANSWER_PREFIX", "TOKENS_TO_GENERATE", "words", "generate_input_output", "generate_samples"]

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
TOKENS_TO_GENERATE = 120
FREQ_CW, FREQ_UCW, NUM_CW, NUM_FEWSHOT = 30, 3, 10, 1
ESTIMATE_WORDS = 4096


@lru_cache(maxsize=4)
def words(seed: int) -> Tuple[str, ...]:
    """RULER's pool: sorted unique nouns + adjectives + verbs of wonderwords, shuffled by ``Random(seed)``."""
    pool = sorted(set(_wonderwords_list("nounlist.txt") + _wonderwords_list("adjectivelist.txt")
                      + _wonderwords_list("verblist.txt")))
    random.Random(seed).shuffle(pool)
    return tuple(pool)


def _numbered(items: List[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def _example(rng: random.Random, seed: int, num_words: int, common_repeats: int, uncommon_repeats: int
             ) -> Tuple[str, List[str]]:
    pool = words(seed)
    if num_words > len(pool):
        raise OverflowError(f"cwe needs {num_words} distinct words; the wonderwords pool has {len(pool)} (RULER then "
                            "samples its english_words.json, not shipped): use a shorter --lengths")
    chosen = rng.sample(pool, num_words)
    common, uncommon = chosen[:NUM_CW], chosen[NUM_CW:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(listed)
    return _numbered(listed), common


def generate_input_output(rng: random.Random, seed: int, num_words: int, max_length: int) -> Tuple[str, List[str]]:
    """RULER's ``generate_input_output``: ``(few-shot example + "\\n" + template + answer prefix, common words)``."""
    short = max_length < 4096
    shots = [_example(rng, seed, 20, 3, 1) if short else _example(rng, seed, 40, 10, 3) for _ in range(NUM_FEWSHOT)]
    context, answer = (_example(rng, seed, num_words, 6, 1) if short
                       else _example(rng, seed, num_words, FREQ_CW, FREQ_UCW))
    template = TEMPLATE + ANSWER_PREFIX
    shown = "\n".join(template.format(context=c, query="") + " " + _numbered(a) for c, a in shots)
    return shown + "\n" + template.format(context=context, query=""), answer


def generate_samples(max_length: int, num_samples: int, count: Callable[[str], int], *, seed: int,
                     task: str = "cwe") -> List[Dict[str, Any]]:
    """``num_samples`` RULER ``cwe`` records at ``max_length`` (fields as
    :func:`kvmeans.eval.ruler.generate_samples`)."""
    rng, inc = random.Random(seed), 10

    def make(n):
        return generate_input_output(rng, seed, n, max_length)

    per_word = count(make(ESTIMATE_WORDS)[0]) / ESTIMATE_WORDS
    upper = max(int(max_length // per_word) * 2, inc * 2)
    try:
        size = fit_size(task, lambda n: make(n)[0], count, max_length, inc, TOKENS_TO_GENERATE, upper)
    except OverflowError as err:
        raise ValueError(f"--lengths {max_length}: {err}") from None
    rows = draw_samples(task, lambda i, n: make(n), count, max_length, num_samples, size, inc, TOKENS_TO_GENERATE)
    return [split_prefix(task, i, text, answer, length, max_length, used, ANSWER_PREFIX)
            for i, (text, answer, length, used) in enumerate(rows)]
