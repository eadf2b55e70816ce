"""Write tests/data/niah_golden.json (checked by tests/test_niah.py).

    python tests/data/niah_make_golden.py

Two parts:

* ``reference``: samples from lm-eval's own port of RULER's generator
  (``lm_eval.tasks.ruler.prepare_niah.generate_input_output``, lm-eval 0.4.x) for fixed seeds and haystack
  sizes, with the global ``random`` seeded as RULER does and our sentence splitter standing in for NLTK's
  (no punkt data here). Our ``generate_input_output`` must reproduce them byte for byte: the needle, template,
  singularisation, key/value samplers, insertion and the order of random draws are RULER's. Needs lm-eval,
  nltk, wonderwords and datasets importable (the import tries to download punkt_tab; it may fail, harmlessly).
* ``pipeline``: our full ``generate_samples`` (binary search, shrink, seed 42) with the offline GPT-2
  tokenizer at small lengths: pins the whole generator against accidental change.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from kvmeans.eval import ruler
from kvmeans.train.tokenizers import gpt2_hf_tokenizer

OUT = Path(__file__).with_name("niah_golden.json")

REFERENCE_CASES = [  # (seed, type_haystack, type_needle_k, type_needle_v, num_haystack, k, v, q)
    (0, "noise", "words", "numbers", 3, 1, 1, 1),
    (42, "noise", "words", "numbers", 25, 1, 1, 1),
    (7, "essay", "words", "numbers", 60, 1, 1, 1),
    (42, "essay", "words", "uuids", 400, 1, 1, 1),
    (3, "essay", "words", "numbers", 300, 4, 1, 1),     # multikey-style: plural paths, 4 needles
    (5, "noise", "words", "numbers", 30, 1, 4, 1),      # multivalue-style
    (9, "essay", "words", "numbers", 250, 4, 1, 4),     # multiquery-style
]
PIPELINE_CASES = [("niah_single_1", 512, 2), ("niah_single_2", 512, 2), ("niah_single_3", 512, 2),
                  ("niah_single_1", 1024, 1)]


def reference_part():
    import lm_eval.tasks.ruler.prepare_niah as P
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE

    assert TEMPLATE == ruler.TEMPLATE and P.NEEDLE == ruler.NEEDLE and list(map(int, P.DEPTHS)) == ruler.DEPTHS
    keys = ruler.word_keys()
    assert len(P.WORDS) == len(keys) and all(P.WORDS[i] == keys[i] for i in range(0, len(keys), 997))

    P.cached_sent_tokenize = ruler.split_sentences          # NLTK punkt is not available offline
    hay = ruler.builtin_haystack()
    out = []
    for seed, kind, tk, tv, n, k, v, q in REFERENCE_CASES:
        random.seed(seed)
        text, answers, query = P.generate_input_output(
            n, hay.words if kind == "essay" else ruler.NOISE, type_haystack="essay" if kind == "essay" else "repeat",
            num_needle_k=k, type_needle_k=tk, num_needle_v=v, type_needle_v=tv, template=TEMPLATE,
            num_needle_q=q, random_seed=seed)
        out.append({"seed": seed, "type_haystack": kind, "type_needle_k": tk, "type_needle_v": tv, "num_haystack": n,
                    "num_needle_k": k, "num_needle_v": v, "num_needle_q": q, "input": text, "outputs": answers,
                    "query": query, "next_random": random.random()})
    return out


def pipeline_part():
    tok = gpt2_hf_tokenizer()
    return [{"task": t, "max_length": L, "records": ruler.generate_samples(t, L, n, tok, seed=42)}
            for t, L, n in PIPELINE_CASES]


if __name__ == "__main__":
    data = {"about": __doc__.strip().splitlines()[0], "builtin_haystack_sha256": ruler.builtin_haystack().sha256,
            "word_keys_sha256": ruler.WORD_KEYS_SHA256, "tokenizer": "gpt2 (kvmeans.train.tokenizers, offline)",
            "reference": reference_part() if "--no-reference" not in sys.argv else
            json.loads(OUT.read_text())["reference"],
            "pipeline": pipeline_part()}
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")
