"""RULER ``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA) from the user's own copy of the data sets: a port of RULER
HEAD's ``qa.py``. Nothing is shipped or downloaded: pass the files with ``--qa-data``.

The files are RULER's: SQuAD 2.0's dev set (``dev-v2.0.json``, RULER's ``json/squad.json``) and HotpotQA's
dev set in the distractor setting (``hotpot_dev_distractor_v1.json``, RULER's ``json/hotpotqa.json``);
:func:`load_qa_data` tells them apart by their structure. Documents = the unique paragraphs (SQuAD) or
``title + "\\n" + sentences`` (HotpotQA), sorted; the questions in file order (SQuAD: answerable ones only);
sample ``i`` asks question ``i``. A prompt holds the question's own documents (SQuAD: its paragraph, then
other paragraphs of the same article, then random others; HotpotQA: its 10 paragraphs, then random others),
shuffled with a fresh ``random.Random(seed)``, numbered ``Document {i}:``; the answer is any of the
question's reference answers (:func:`kvmeans.eval.ruler.string_match_part`). 32 tokens are generated.

Reproduced: the template and answer prefix, the document pools, the draws (``random.Random(seed)`` for
RULER's seeded global ``random``), the budget ``tokens(prompt) + 32 <= length``, and the binary search on
question 0 (estimate from ``incremental`` = 10 documents, upper bound 3x), each sample shrinking by 10
documents until it fits.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, Union

from kvmeans.eval.ruler_tasks.search import draw_samples, fit_size, split_prefix

__all__ = ["TEMPLATE", "ANSWER_PREFIX", "TOKENS_TO_GENERATE", "QAData", "load_qa_data", "generate_input_output",
           "generate_samples"]

TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
            "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
ANSWER_PREFIX = " Answer:"
TOKENS_TO_GENERATE = 32
DOCUMENT_PROMPT = "Document {i}:\n{document}"
TASK_OF = {"squad": "qa_1", "hotpotqa": "qa_2"}


@dataclass
class QAData:
    """A QA data set as RULER reads it: ``qas`` (``query``, ``outputs``, ``context``, ``more_context``
    document indices) and ``docs``; ``name`` is ``squad`` or ``hotpotqa``."""
    name: str
    qas: List[Dict[str, Any]]
    docs: List[str]
    source: str = ""
    sha256: str = ""

    @property
    def task(self) -> str:
        return TASK_OF[self.name]

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "source": self.source, "sha256": self.sha256, "questions": len(self.qas),
                "documents": len(self.docs)}


def _read_squad(data: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[str]]:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = index[p["context"]]
            for q in p["qas"]:
                if not q["is_impossible"]:
                    qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                "context": [own], "more_context": [i for i in more if i != own]})
    return qas, docs


def _read_hotpotqa(data: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[str]]:
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return qas, docs


def load_qa_data(path: Union[str, os.PathLike]) -> QAData:
    """SQuAD 2.0 dev (a JSON object with ``data``) or HotpotQA dev distractor (a JSON list of questions with
    ``context``), as RULER reads them; a ``ValueError`` naming ``--qa-data`` for anything else."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--qa-data {path}: no such file (SQuAD 2.0 dev-v2.0.json or HotpotQA "
                         "hotpot_dev_distractor_v1.json)")
    raw = p.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            name, (qas, docs) = "squad", _read_squad(data)
        elif isinstance(data, list) and data and isinstance(data[0], dict) and "context" in data[0]:
            name, (qas, docs) = "hotpotqa", _read_hotpotqa(data)
        else:
            raise ValueError("neither SQuAD 2.0 ({'data': [...]}) nor HotpotQA ([{'question', 'answer', "
                             "'context'}, ...])")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--qa-data {path}: {err}") from None
    if not qas:
        raise ValueError(f"--qa-data {path}: no answerable questions")
    return QAData(name, qas, docs, source=str(p), sha256=hashlib.sha256(raw).hexdigest())


def generate_input_output(rng: random.Random, seed: int, data: QAData, index: int, num_docs: int
                          ) -> Tuple[str, List[str]]:
    """RULER's ``generate_input_output``: ``(template + answer prefix, reference answers)`` for question
    ``index`` with ``num_docs`` documents (``ValueError`` when fewer than its own)."""
    q = data.qas[index]
    own, more, docs = q["context"], q.get("more_context", []), data.docs
    if num_docs < len(docs):
        if num_docs - len(own) > len(more):
            taken = set(own + more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(others, max(0, num_docs - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, num_docs - len(own))
        shown = [docs[i] for i in chosen]
    else:
        shown = (docs * ((num_docs + len(docs) - 1) // len(docs)))[:num_docs]
    random.Random(seed).shuffle(shown)
    context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(shown))
    return (TEMPLATE + ANSWER_PREFIX).format(context=context, query=q["query"]), q["outputs"]


def generate_samples(max_length: int, num_samples: int, count: Callable[[str], int], *, seed: int, data: QAData,
                     task: str) -> List[Dict[str, Any]]:
    """``num_samples`` RULER QA records (questions 0..n-1) at ``max_length``."""
    if num_samples > len(data.qas):
        raise ValueError(f"--samples {num_samples}: {data.source} has {len(data.qas)} questions")
    rng, inc = random.Random(seed), 10

    def make(index, n):
        return generate_input_output(rng, seed, data, index, n)

    upper = max(int(max_length / (count(make(0, inc)[0]) / inc) * 3), inc * 2)
    size = fit_size(task, lambda n: make(0, n)[0], count, max_length, inc, TOKENS_TO_GENERATE, upper)
    rows = draw_samples(task, make, count, max_length, num_samples, size, inc, TOKENS_TO_GENERATE)
    return [split_prefix(task, i, text, answers, length, max_length, used, ANSWER_PREFIX)
            for i, (text, answers, length, used) in enumerate(rows)]
