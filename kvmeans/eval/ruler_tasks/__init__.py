"""RULER's synthetic tasks, generated offline with the model's tokenizer: one registry over the task families.

=================  ===============================  ======  =================  ===========================
task               family (module)                  tokens  metric             label
=================  ===============================  ======  =================  ===========================
niah_single_1..3   NIAH (:mod:`kvmeans.eval.ruler`)  128     string_match_all   NIAH-S1..S3
niah_multikey_1..3 NIAH                             128     string_match_all   NIAH-MK1..MK3
niah_multivalue    NIAH                             128     string_match_all   NIAH-MV
niah_multiquery    NIAH                             128     string_match_all   NIAH-MQ
vt                 variable tracking (:mod:`.vt`)   30      string_match_all   VT
cwe                common words (:mod:`.cwe`)       120     string_match_all   CWE
fwe                frequent words (:mod:`.fwe`)     50      string_match_all   FWE
qa_1, qa_2         QA (:mod:`.qa`, your data)       32      string_match_part  QA-1, QA-2
=================  ===============================  ======  =================  ===========================

"tokens" is RULER's ``tokens_to_generate``: the budget is ``tokens(input + answer_prefix) + tokens <=
length`` and greedy decoding stops there. :data:`RULER_TASKS` is RULER's 13 (``synthetic.yaml``, lm-eval's
``ruler`` group); the paper's "RULER avg" is the mean over all 13. The QA tasks need SQuAD / HotpotQA, which
are not shipped: they run only from the user's files (:func:`kvmeans.eval.ruler_tasks.qa.load_qa_data`,
``--qa-data``), and :func:`check_task` says so otherwise.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from kvmeans.eval import ruler
from kvmeans.eval.ruler_tasks import cwe, fwe, qa, vt

__all__ = ["RULER_TASKS", "SYNTHETIC_TASKS", "QA_TASKS", "LABELS", "TOKENS_TO_GENERATE", "METRICS", "check_task",
           "generate_samples", "score"]

QA_TASKS = ("qa_1", "qa_2")
RULER_TASKS = tuple(ruler.NIAH_TASKS) + ("vt", "cwe", "fwe") + QA_TASKS
SYNTHETIC_TASKS = tuple(t for t in RULER_TASKS if t not in QA_TASKS)     # need no data set
LABELS = {**ruler.NIAH_LABELS, "vt": "VT", "cwe": "CWE", "fwe": "FWE", "qa_1": "QA-1", "qa_2": "QA-2"}
TOKENS_TO_GENERATE = {**{t: ruler.TOKENS_TO_GENERATE for t in ruler.NIAH_TASKS}, "vt": vt.TOKENS_TO_GENERATE,
                      "cwe": cwe.TOKENS_TO_GENERATE, "fwe": fwe.TOKENS_TO_GENERATE, "qa_1": qa.TOKENS_TO_GENERATE,
                      "qa_2": qa.TOKENS_TO_GENERATE}
METRICS = {**{t: "string_match_all" for t in SYNTHETIC_TASKS}, "qa_1": "string_match_part", "qa_2": "string_match_part"}
_FAMILIES = {"vt": vt, "cwe": cwe, "fwe": fwe}


def check_task(task: str, qa_data: Optional[Mapping[str, qa.QAData]] = None) -> None:
    """A one-line ``ValueError`` naming the option to fix unless ``task`` can be generated (``qa_data``:
    task -> :class:`~kvmeans.eval.ruler_tasks.qa.QAData` for the QA tasks)."""
    if task in QA_TASKS and task not in (qa_data or {}):
        data = "SQuAD 2.0's dev-v2.0.json" if task == "qa_1" else "HotpotQA's hotpot_dev_distractor_v1.json"
        raise ValueError(f"--tasks {task}: RULER's QA tasks need their data set, which kvmeans does not ship: pass "
                         f"your copy of {data} with --qa-data PATH, or drop {task}")
    if task not in RULER_TASKS:
        raise ValueError(f"--tasks: unknown task {task!r}; choose from {', '.join(SYNTHETIC_TASKS)}")


def generate_samples(task: str, max_length: int, num_samples: int, tokenizer, *, seed: int = ruler.DEFAULT_SEED,
                     haystack: Optional[ruler.EssayHaystack] = None,
                     qa_data: Optional[Mapping[str, qa.QAData]] = None) -> List[Dict[str, Any]]:
    """``num_samples`` RULER records of ``task`` at ``max_length`` tokens (``input``, ``answer_prefix``,
    ``outputs``, ``length`` = prompt tokens + the task's generated tokens, ``max_length``, ...).
    ``haystack``: the essay text of the essay NIAH tasks (default: the built-in, not RULER's essays);
    ``qa_data``: task -> the user's QA data set (:func:`kvmeans.eval.ruler_tasks.qa.load_qa_data`)."""
    check_task(task, qa_data)
    if num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    if task in ruler.NIAH_TASKS:
        return ruler.generate_samples(task, max_length, num_samples, tokenizer, seed=seed, haystack=haystack)
    if task in QA_TASKS:
        return qa.generate_samples(max_length, num_samples, ruler.token_counter(tokenizer), seed=seed,
                                   data=qa_data[task], task=task)
    return _FAMILIES[task].generate_samples(max_length, num_samples, ruler.token_counter(tokenizer), seed=seed,
                                            task=task)


def score(task: str, preds: List[str], refs: List[List[str]]):
    """``(score x100 rounded to 2 dp, per-sample values)`` with the task's RULER metric."""
    fn = ruler.string_match_part if METRICS[task] == "string_match_part" else ruler.string_match_all
    return fn(preds, refs)
