"""Write tests/data/ruler_tasks_golden.json (checked by tests/test_ruler_tasks.py).

    python tests/data/ruler_tasks_make_golden.py

Two parts:

* ``reference``: pieces of lm-eval's port of RULER (lm-eval 0.4.x, ``lm_eval/tasks/ruler``) where it defines
  the task as RULER HEAD does, run with the global ``random`` / ``np.random`` seeded as RULER does; ours must
  reproduce them byte for byte, with the same number of draws:
  ``niah_needle`` (``prepare_niah.generate_input_output`` with the ``needle`` haystack of niah_multikey_2/3),
  ``fwe`` (``fwe_utils.generate_input_output`` with a given word count: vocabulary, Zipf counts, shuffles) and
  ``vt_chains`` (``vt_utils.generate_chains``: names and values). Where lm-eval's port differs from RULER HEAD
  (vt's noise joining and in-context example, cwe's word pool and shuffles) there is no reference part.
  Needs lm-eval, nltk, wonderwords, scipy and datasets importable (prepare_niah tries to download punkt_tab
  at import; it may fail, harmlessly).
* ``pipeline``: our full ``generate_samples`` of every new task (seed 42) with the offline GPT-2 tokenizer at
  small lengths: pins the whole generators against accidental change.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from kvmeans.eval import ruler, ruler_tasks
from kvmeans.eval.ruler_tasks import fwe, vt
from kvmeans.train.tokenizers import gpt2_hf_tokenizer

OUT = Path(__file__).with_name("ruler_tasks_golden.json")
NEEDLE_CASES = [(1, "words", "numbers", 30, 1, 1, 1), (42, "uuids", "uuids", 25, 1, 1, 1),
                (3, "words", "numbers", 12, 4, 1, 4)]          # (seed, key, value, lines, k, v, q)
FWE_CASES = [(42, 300, 10), (7, 2000, 80)]                      # (seed, words, vocabulary size)
VT_CASES = [0, 42]
PIPELINE_CASES = [("niah_multikey_1", 1024, 2), ("niah_multikey_2", 1024, 2), ("niah_multikey_3", 1024, 2),
                  ("niah_multivalue", 1024, 2), ("niah_multiquery", 1024, 2), ("vt", 1024, 2), ("vt", 4096, 1),
                  ("cwe", 1024, 2), ("cwe", 4096, 1), ("fwe", 1024, 2)]


class _Counted:
    """lm-eval calls ``tokenizer(text).input_ids``; one id per character keeps its loops short."""

    def __call__(self, text):
        return type("Enc", (), {"input_ids": list(text)})()


def reference_part():
    import lm_eval.tasks.ruler.fwe_utils as F
    import lm_eval.tasks.ruler.prepare_niah as P
    import lm_eval.tasks.ruler.vt_utils as V
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE

    assert TEMPLATE == ruler.TEMPLATE and P.NEEDLE == ruler.NEEDLE
    assert F.CONFIG["template"] == fwe.TEMPLATE and F.CONFIG["answer_prefix"] == fwe.ANSWER_PREFIX
    assert V.CONFIG["variable_tracking"]["template"] == vt.TEMPLATE
    assert V.CONFIG["variable_tracking"]["answer_prefix"] == vt.ANSWER_PREFIX
    needle = []
    for seed, tk, tv, n, k, v, q in NEEDLE_CASES:
        random.seed(seed)
        text, answers, query = P.generate_input_output(
            n, P.NEEDLE, type_haystack="needle", num_needle_k=k, type_needle_k=tk, num_needle_v=v, type_needle_v=tv,
            template=TEMPLATE, num_needle_q=q, random_seed=seed)
        needle.append({"seed": seed, "type_needle_k": tk, "type_needle_v": tv, "num_haystack": n, "num_needle_k": k,
                       "num_needle_v": v, "num_needle_q": q, "input": text, "outputs": answers, "query": query,
                       "next_random": random.random()})
    fwe_ref = []
    for seed, words, vocab_size in FWE_CASES:
        F.SEED = seed
        random.seed(seed)
        text, answer, _ = F.generate_input_output(10 ** 9, _Counted(), num_words=words, vocab_size=vocab_size)
        fwe_ref.append({"seed": seed, "num_words": words, "vocab_size": vocab_size, "text": text, "outputs": answer,
                        "next_random": random.random()})
    F.SEED = 42
    chains = []
    for seed in VT_CASES:
        random.seed(seed)
        np.random.seed(seed)
        names, chain = V.generate_chains(1, 4)
        chains.append({"seed": seed, "names": names, "chains": chain, "next_random": random.random(),
                       "next_np": int(np.random.randint(0, 2 ** 31 - 1))})
    return {"niah_needle": needle, "fwe": fwe_ref, "vt_chains": chains}


def pipeline_part():
    tok = gpt2_hf_tokenizer()
    return [{"task": t, "max_length": L, "records": ruler_tasks.generate_samples(t, L, n, tok, seed=42)}
            for t, L, n in PIPELINE_CASES]


if __name__ == "__main__":
    data = {"about": __doc__.strip().splitlines()[0], "tokenizer": "gpt2 (kvmeans.train.tokenizers, offline)",
            "builtin_haystack_sha256": ruler.builtin_haystack().sha256, "reference": reference_part(),
            "pipeline": pipeline_part()}
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")
