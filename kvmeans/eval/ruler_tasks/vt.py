"""RULER ``vt`` (variable tracking), generated offline: a port of RULER HEAD's ``variable_tracking.py``.

One chain of 4 hops (``synthetic.yaml``: ``num_chains=1, num_hops=4``) hidden in the ``noise`` haystack:
``VAR ABCDE = 12345`` then ``VAR FGHIJ = VAR ABCDE `` ... each at a random line of the repeated filler
(lines joined by ``"\\n"``); the question asks for every variable holding the value; the answer is the 5
variable names (:func:`kvmeans.eval.ruler.string_match_all`). 30 tokens are generated.

Reproduced: the template and answer prefix (including RULER's "assgined"), 5-letter upper-case names
(3 letters and the value 12345 for the in-context example), values ``np.random.randint(10000, 99999)``,
RULER's in-context example (one sample generated first at ``max_seq_length=500`` with 5-line steps and no
generation budget, its answer appended after one space and a newline; each sample gets a copy with its 5
names and its value re-drawn and put before the task text, followed by a newline), the budget
``tokens(example + task + answer prefix) + 30 <= length``, the binary search (estimate from one sample of
``incremental`` lines; upper bound 3x; ``incremental`` = 10 lines, 5 below 4096 tokens) and the order of draws:
``random.Random(seed)`` stands in for RULER's seeded global ``random``, ``numpy.random.RandomState(seed)``
for its seeded global ``np.random`` (the same legacy generator), fresh per (task, length).

Deviation: when the in-context example does not fit in 500 tokens even with 5 lines (long-token tokenizers,
e.g. a character-level one), RULER loops forever; here the 5-line example is used as it is.
"""
from __future__ import annotations

import random
import string
from typing import Any, Callable, Dict, List, Tuple

from kvmeans.eval.ruler import NOISE
from kvmeans.eval.ruler_tasks.search import draw_samples, fit_size, split_prefix

__all__ = ["TEMPLATE", "ANSWER_PREFIX", "TOKENS_TO_GENERATE", "generate_input_output", "generate_samples"]

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                 "are assgined the value {query}, they are: ")
TOKENS_TO_GENERATE = 30
NUM_CHAINS, NUM_HOPS = 1, 4
ICL_MAX_LENGTH = 500


def _chains(rng: random.Random, nprng, num_chains: int, num_hops: int, is_icl: bool):
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range((num_hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names_out, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        these = names[i:i + num_hops + 1]
        names_out.append(these)
        value = "12345" if is_icl else str(nprng.randint(10000, 99999))
        chains.append([f"VAR {these[0]} = {value}"]
                      + [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)])
    return names_out, chains


def generate_input_output(rng: random.Random, nprng, num_noises: int, num_chains: int = NUM_CHAINS,
                          num_hops: int = NUM_HOPS, is_icl: bool = False) -> Tuple[str, List[str]]:
    """RULER's ``generate_input_output`` (noise haystack): ``(template + answer prefix, the chain's names)``."""
    names, chains = _chains(rng, nprng, num_chains, num_hops, is_icl)
    value = chains[0][0].split("=")[-1].strip()
    lines = [NOISE] * num_noises
    for chain in chains:
        positions = sorted(rng.sample(range(len(lines)), len(chain)))    # ValueError if too few lines
        for pos, j in zip(positions, range(len(chain))):
            lines.insert(pos + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    text = (TEMPLATE + ANSWER_PREFIX).format(context=context, query=value, num_v=num_hops + 1)
    return text, names[0]


def _randomize_icl(rng: random.Random, nprng, example: str, num_hops: int = NUM_HOPS) -> str:
    for item in example.strip().split()[-num_hops - 1:]:
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return example.replace("12345", str(nprng.randint(10000, 99999)))


def _icl_example(rng, nprng, count: Callable[[str], int]) -> str:
    """RULER's first call (``max_seq_length=500``, 5-line steps, no generation budget), answer appended."""
    inc = 5

    def make(n):
        return generate_input_output(rng, nprng, n, is_icl=True)

    upper = max(int(ICL_MAX_LENGTH / (count(make(inc)[0]) / inc) * 3), inc * 2)
    try:
        size = fit_size("vt", lambda n: make(n)[0], count, ICL_MAX_LENGTH, inc, 0, upper)
        (text, names, _, _), = draw_samples("vt", lambda i, n: make(n), count, ICL_MAX_LENGTH, 1, size, inc, 0)
    except ValueError:          # does not fit 500 tokens with this tokenizer: keep the smallest example
        text, names = make(inc)
    return text + " " + " ".join(names) + "\n"


def generate_samples(max_length: int, num_samples: int, count: Callable[[str], int], *, seed: int,
                     task: str = "vt") -> List[Dict[str, Any]]:
    """``num_samples`` RULER ``vt`` records at ``max_length`` (fields as
    :func:`kvmeans.eval.ruler.generate_samples`)."""
    import numpy as np

    rng, nprng = random.Random(seed), np.random.RandomState(seed)
    example = _icl_example(rng, nprng, count)
    example_tokens = count(example)
    inc = 5 if max_length < 4096 else 10

    def task_text(n):
        return generate_input_output(rng, nprng, n)[0]

    def make(index, n):
        text, names = generate_input_output(rng, nprng, n)
        return _randomize_icl(rng, nprng, example) + "\n" + text, names

    upper = max(int(max_length / (count(task_text(inc)) / inc) * 3), inc * 2)
    size = fit_size(task, task_text, lambda t: count(t) + example_tokens, max_length, inc, TOKENS_TO_GENERATE, upper)
    rows = draw_samples(task, make, count, max_length, num_samples, size, inc, TOKENS_TO_GENERATE)
    return [split_prefix(task, i, text, names, length, max_length, used, ANSWER_PREFIX)
            for i, (text, names, length, used) in enumerate(rows)]
