"""RULER ``fwe`` (frequent words extraction), generated offline: a port of RULER's ``freq_words_extraction.py``
(``synthetic.yaml``: ``alpha=2.0``; coded words of 6 letters, vocabulary ``length // 50``).

A text of coded words whose counts follow a Zipf law (word of rank ``k`` appears ``int(N * k**-alpha /
zeta(alpha))`` times; rank 1 is replaced by the noise word ``...``); the answer is the words of ranks 2-4
(:func:`kvmeans.eval.ruler.string_match_all`). 50 tokens are generated.

Reproduced: the template and answer prefix, the vocabulary (``random.choices`` of lower-case letters, made
unique, sorted, shuffled with a fresh ``random.Random(seed)``), the word list shuffled with a fresh
``random.Random(seed)`` each time, RULER's linear size search (start at ``length // 6`` words, grow by
``length // 32`` while the prompt is shorter than the length, step back once; each sample then shrinks by
``length // 32`` until it fits) and its order of draws (``random.Random(seed)`` for RULER's seeded global
``random``, fresh per (task, length)).

Budget deviation (so that every task means the same by a length): RULER (and lm-eval's port) size the
prompt itself to ``length`` tokens, so prompt + 50 generated tokens can pass ``length``; here the search runs
at ``length - 50`` (``length`` in the records is prompt + 50 <= ``length``, as for the other tasks).
"""
from __future__ import annotations

import random
import string
from typing import Any, Callable, Dict, List, Tuple

from kvmeans.eval.ruler_tasks.search import split_prefix

__all__ = ["TEMPLATE", "ANSWER_PREFIX", "TOKENS_TO_GENERATE", "vocabulary", "coded_text", "generate_samples"]

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?")
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
TOKENS_TO_GENERATE = 50
ALPHA, CODED_WORDLEN = 2.0, 6


def vocabulary(rng: random.Random, seed: int, vocab_size: int, coded_wordlen: int = CODED_WORDLEN) -> List[str]:
    """RULER's coded vocabulary: ``vocab_size`` unique random words, sorted, shuffled by ``Random(seed)``;
    [0] = '...'."""
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    return vocab


def coded_text(vocab: List[str], seed: int, num_words: int, alpha: float = ALPHA) -> Tuple[str, List[str]]:
    """RULER's ``gen_text``: ``(template + answer prefix, the words of ranks 2-4)`` for about ``num_words`` words."""
    import numpy as np
    from scipy.special import zeta

    k = np.arange(1, len(vocab) + 1)
    counts = (num_words * (k ** -alpha) / zeta(alpha)).astype(int)
    listed = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(seed).shuffle(listed)
    return (TEMPLATE + ANSWER_PREFIX).format(context=" ".join(listed), query=""), vocab[1:4]


def _too_small(task: str, max_length: int) -> ValueError:
    return ValueError(f"--lengths {max_length} is too small for {task} with this tokenizer: even a one-word coded "
                      f"text does not fit with {TOKENS_TO_GENERATE} generated tokens; use a larger --lengths "
                      "(RULER's lengths start at 4096)")


def generate_samples(max_length: int, num_samples: int, count: Callable[[str], int], *, seed: int,
                     task: str = "fwe") -> List[Dict[str, Any]]:
    """``num_samples`` RULER ``fwe`` records at ``max_length`` (fields as
    :func:`kvmeans.eval.ruler.generate_samples`)."""
    rng = random.Random(seed)
    budget = max_length - TOKENS_TO_GENERATE
    if budget < 32:
        raise _too_small(task, max_length)
    vocab_size, inc = budget // 50, budget // 32
    if vocab_size < 4:
        raise _too_small(task, max_length)

    vocab = vocabulary(rng, seed, vocab_size)                    # RULER's first call: grow, then step back
    n = budget // CODED_WORDLEN
    while count(coded_text(vocab, seed, n)[0]) < budget:
        n += inc
    size = n - inc

    records = []
    for index in range(num_samples):
        vocab, used = vocabulary(rng, seed, vocab_size), size
        text, answer = coded_text(vocab, seed, used)
        while count(text) > budget:
            used -= inc
            if used <= 0:
                raise _too_small(task, max_length)
            text, answer = coded_text(vocab, seed, used)
        records.append(split_prefix(task, index, text, answer, count(text) + TOKENS_TO_GENERATE, max_length, used,
                                    ANSWER_PREFIX))
    return records
