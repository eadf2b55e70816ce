"""RULER needle-in-a-haystack data (the eight niah_* tasks), generated offline, and its scorer. No model here.

A port of NVIDIA RULER's ``scripts/data/synthetic/niah.py`` (current HEAD) for the three single-needle
tasks of the paper's Table (RULER ``scripts/synthetic.yaml``; :data:`TASKS`, what ``kvmeans eval niah`` runs):

============== ============================== ========== ================== ==============
task           haystack                       key        value              table label
============== ============================== ========== ================== ==============
niah_single_1  ``noise``: a filler repeated   word       7-digit number     NIAH-S1
niah_single_2  ``essay``                      word       7-digit number     NIAH-S2
niah_single_3  ``essay``                      word       UUID4              NIAH-S3
============== ============================== ========== ================== ==============

and the five multi-needle tasks of ``kvmeans eval ruler`` (:data:`NIAH_TASKS` adds them; ``needle`` = a
haystack of distractor needle sentences with random keys and values, drawn from the same stream):

================ ========== ======= ======= ========================
task             haystack   key     value   needles (k / v / q)
================ ========== ======= ======= ========================
niah_multikey_1  essay      word    number  4 keys, 1 queried
niah_multikey_2  needle     word    number  1 (the rest: distractors)
niah_multikey_3  needle     UUID    UUID    1 (the rest: distractors)
niah_multivalue  essay      word    number  4 values of one key
niah_multiquery  essay      word    number  4 keys, all 4 queried
================ ========== ======= ======= ========================

Reproduced exactly: the needle sentence (:data:`NEEDLE`), the task template and answer prefix
(:data:`TEMPLATE`, :data:`ANSWER_PREFIX`) with RULER's singularisation for one value ("Some"->"A",
"are all"->"is", "are"->"is", "answers"->"answer", "numbers"->"number"), the filler (:data:`NOISE`), the
keys (sorted unique "adjective-noun" over wonderwords' ``adjectivelist.txt`` x ``nounlist.txt``; see
:func:`word_keys`), 7-digit values (``randint(10**6, 10**7 - 1)``), UUID4 values
(``uuid.UUID(int=rng.getrandbits(128), version=4)``), the depth grid (:data:`DEPTHS`, RULER's
``np.round(np.linspace(0, 100, 40))``), the essay handling (whitespace-normalised words, the first N words,
the text repeated when more words are needed than exist, needle inserted between two sentences at
``int(num_sentences * depth / 100)``), the noise handling (``[NOISE] * N`` lines, needle inserted at a
random line, joined by ``"\\n"``), the needle handling (``N`` distractor needle lines, each with a fresh random
key and value, then the needles inserted as for noise) and RULER's order of random draws.

**Budget** (the model's own tokenizer, no special tokens added, as RULER's ``text_to_tokens``):
``tokens(input + answer_prefix) + tokens_to_generate <= max_length`` (``tokens_to_generate`` = 128);
``record["length"]`` is that left-hand side. ``input + answer_prefix`` is exactly the prompt the model
is given (lm-eval's ``input + " " + gen_prefix``).

**Haystack-size rule: RULER's binary search** (not lm-eval's linear increments). Per (task, length):
``incremental`` = 500 words (essay) or 25 lines (noise, needle; 5 below 4096 tokens); estimate tokens per unit
from one sample of ``incremental`` units; binary-search ``N`` in ``[incremental, max(3 * L / per_unit,
2 * incremental)]`` for the largest size whose probe sample fits. Each sample then starts at ``N`` and
shrinks by ``incremental`` (re-drawing, as RULER does) until it fits. The search result is maximal:
the probe at ``N`` fits and the probe at ``N + 1`` did not (:func:`fit_haystack` returns the probes).
*Extension* (RULER loops forever there, lm-eval issue #2963): when not even ``incremental`` units fit,
the search is repeated over ``[1, incremental]`` and samples shrink by 1 unit; when 1 unit does not fit
either, a ``ValueError`` names ``--lengths`` and the smallest length that works. This only changes
lengths RULER cannot generate (e.g. the essay tasks below about 800 tokens).

**Seeding: RULER's convention.** Each (task, length) gets a fresh ``random.Random(seed)`` (default seed
42, RULER's ``--random_seed``); every draw -- the size-estimate sample, each binary-search probe, each
sample and each shrink retry -- comes from that stream in RULER's order, and the needle shuffle uses a
separate ``random.Random(seed)`` as RULER does. So sample ``i`` does not depend on ``num_samples`` (the
first k samples are the same for any count), and with the same tokenizer, seed and haystack text the
noise task (S1) is, by construction, what RULER's own script writes (the per-sample builder is checked
byte for byte against lm-eval's port in ``tests/data/niah_golden.json``; RULER's script itself is not run
here). Samples do depend on the tokenizer (through the search probes), as in RULER.

Deviations from RULER (documented, deliberate):

* Sentence splitting (essay): :func:`split_sentences`, a regex splitter that needs no NLTK data, instead
  of NLTK's ``sent_tokenize`` (``punkt_tab``). It only moves the sentence boundaries the needle can be
  put at; the essay text itself is unchanged.
* Essay text: RULER's S2/S3 use Paul Graham's essays (``PaulGrahamEssays.json``), which are copyrighted
  and not shipped. Pass the file you hold with :func:`load_haystack` (``--haystack-file``) for the paper's
  S2/S3. The default, :func:`builtin_haystack`, is a **built-in distractor corpus that is not RULER's**:
  public-domain Shakespeare dialogue (see ``kvmeans/eval/data/README.md``). S2/S3 scores on it are not
  comparable with the paper.
* Word keys come from wonderwords 3.0.1 (pinned by the ``eval`` extra); :data:`WORD_KEYS_SHA256` detects
  a changed list. RULER used the 2.x lists through a private helper; we read the two asset files with
  ``importlib.resources``.

Scoring: RULER's ``postprocess_pred`` (strip, control characters -> ``"\\n"``, strip) and
``string_match_all`` (per sample the fraction of reference strings found, case-insensitively, in the
prediction; x100, rounded to 2 decimals).
"""
from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import os
import random
import re
import uuid
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["TASKS", "TASK_LABELS", "NIAH_TASKS", "NIAH_LABELS", "NEEDLE", "TEMPLATE", "ANSWER_PREFIX", "NOISE",
           "DEPTHS", "TOKENS_TO_GENERATE", "DEFAULT_SEED", "WORD_KEYS_SHA256", "BUILTIN_HAYSTACK", "word_keys",
           "split_sentences", "EssayHaystack", "builtin_haystack", "load_haystack", "token_counter",
           "generate_input_output", "fit_haystack", "generate_samples", "postprocess_pred", "string_match_all",
           "string_match_part"]

# ---- RULER's constants (scripts/data/synthetic/constants.py, niah.py, synthetic.yaml) -------------------------
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int): no value of 100*i/39 is a tie
DEPTHS: List[int] = [int(round(i * 100 / 39)) for i in range(40)]
TOKENS_TO_GENERATE = 128
DEFAULT_SEED = 42

# task -> (haystack, key type, value type); RULER's names ("noise" is lm-eval's "repeat")
TASKS: Dict[str, Dict[str, str]] = {
    "niah_single_1": {"type_haystack": "noise", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_2": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "uuids"},
}
TASK_LABELS = {"niah_single_1": "NIAH-S1", "niah_single_2": "NIAH-S2", "niah_single_3": "NIAH-S3"}
# all eight RULER NIAH tasks (``kvmeans eval ruler``); TASKS above stays what ``kvmeans eval niah`` runs
NIAH_TASKS: Dict[str, Dict[str, Any]] = {
    **TASKS,
    "niah_multikey_1": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_k": 4},
    "niah_multikey_2": {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_multikey_3": {"type_haystack": "needle", "type_needle_k": "uuids", "type_needle_v": "uuids"},
    "niah_multivalue": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_v": 4},
    "niah_multiquery": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_q": 4},
}
NIAH_LABELS = {**TASK_LABELS, "niah_multikey_1": "NIAH-MK1", "niah_multikey_2": "NIAH-MK2",
               "niah_multikey_3": "NIAH-MK3", "niah_multivalue": "NIAH-MV", "niah_multiquery": "NIAH-MQ"}

# sha256 of "\n".join(word_keys()) for wonderwords 3.0.1 (6,171,620 keys = 910 adjectives x 6,782 nouns)
WORD_KEYS_SHA256 = "e5e6a09ed20903cb4abfcde8b89d1a40d4133a6fcff97001c690c21d97af3007"
WORD_KEYS_COUNT = 6171620

BUILTIN_HAYSTACK = "shakespeare_distractor.json.gz"   # under kvmeans/eval/data/; NOT RULER's essays


# ---- word keys ----------------------------------------------------------------------------------------------
def _wonderwords_list(name: str) -> List[str]:
    try:
        base = resources.files("wonderwords")
    except ModuleNotFoundError:
        raise ImportError("RULER word keys need the word lists of `wonderwords`: pip install wonderwords==3.0.1 "
                          "(or pip install 'kvmeans[eval]')") from None
    with base.joinpath("assets", name).open("r", encoding="utf-8") as f:   # as wonderwords' own reader
        return [w.rstrip() for w in f.readlines()]


class _WordKeys(Sequence):
    """``sorted(set(f"{a}-{n}" for a in adjectives for n in nouns))`` without building its 6.2M strings.

    Adjective "families" (a root and the adjectives that start with ``root + "-"``, e.g. "blue" and
    "blue-eyed", whose keys interleave) are materialised and sorted; every other adjective is a block of
    ``len(nouns)`` keys in noun order. Families, ordered by ``root + "-"``, never interleave with each
    other (their keys first differ inside the roots). ``random.choice`` on this sequence draws what it
    draws on RULER's list.
    """

    def __init__(self, adjectives: List[str], nouns: List[str]):
        self.nouns = sorted(set(nouns))
        adjs = sorted(set(adjectives), key=lambda a: a + "-")
        families: Dict[str, List[str]] = {}
        for a in sorted(adjs, key=len):                       # shortest first: a root precedes its extensions
            root = next((r for r in families if a.startswith(r + "-")), a)
            families.setdefault(root, []).append(a)
        self._units: List[Union[str, List[str]]] = []          # an adjective (lazy block) or a sorted list
        starts = [0]
        for root in sorted(families, key=lambda r: r + "-"):
            members = families[root]
            unit = root if len(members) == 1 else sorted({f"{a}-{n}" for a in members for n in self.nouns})
            self._units.append(unit)
            starts.append(starts[-1] + (len(self.nouns) if isinstance(unit, str) else len(unit)))
        self._starts = starts

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("word key index out of range")
        u = bisect.bisect_right(self._starts, i) - 1
        unit, off = self._units[u], i - self._starts[u]
        return f"{unit}-{self.nouns[off]}" if isinstance(unit, str) else unit[off]

    def iter_blocks(self):
        """The keys in order, one list per unit (for hashing without holding them all)."""
        for unit in self._units:
            yield [f"{unit}-{n}" for n in self.nouns] if isinstance(unit, str) else unit

    def sha256(self) -> str:
        h = hashlib.sha256()
        for k, block in enumerate(self.iter_blocks()):
            h.update((("\n" if k else "") + "\n".join(block)).encode("utf-8"))
        return h.hexdigest()


@lru_cache(maxsize=1)
def word_keys() -> _WordKeys:
    """RULER's word keys: sorted unique "adjective-noun" over wonderwords' ``adjectivelist.txt`` x
    ``nounlist.txt`` (read with ``importlib.resources``), as a lazy sequence (len 6,171,620 for 3.0.1)."""
    return _WordKeys(_wonderwords_list("adjectivelist.txt"), _wonderwords_list("nounlist.txt"))


# ---- sentence splitter (replaces NLTK punkt) -------------------------------------------------------------------
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr prof rev gen col capt lt sgt gov sen rep hon vs etc e.g i.e cf viz al fig figs no nos vol "
    "vols p pp ch sec ed eds inc ltd co corp dept est approx jan feb mar apr jun jul aug sep sept oct nov dec mt ft"
    .split())
# a run of terminators, optional closing quotes/brackets, whitespace, then (optional opener +) the next sentence
_BOUNDARY = re.compile(r"""([.!?]+)(["'\u2019\u201d)\]]*)(\s+)(?=\S)""")
_NEXT_START = re.compile(r"""["'\u2018\u201c(\[]*[A-Z0-9]""")


def split_sentences(text: str) -> List[str]:
    """Split ``text`` into sentences with no NLTK data (stands in for ``nltk.sent_tokenize``).

    A boundary is whitespace after a run of ``.``, ``!`` or ``?`` (plus any closing quotes or brackets).
    ``!`` and ``?`` always end a sentence; ``.`` does when the next word starts (after an optional opening
    quote or bracket) with a capital letter or a digit, and the word before it is not a common
    abbreviation ("Mr.", "e.g.", "etc.", ...) or a single-letter initial ("J."). Sentences are returned
    stripped; for text whose whitespace is single spaces, ``" ".join(split_sentences(t)) == t.strip()``.
    """
    text = text.strip()
    out: List[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end(2)
        if "!" not in m.group(1) and "?" not in m.group(1):
            if not _NEXT_START.match(text, m.end()):
                continue
            word = text[start:m.start(1)].rsplit(None, 1)[-1] if text[start:m.start(1)].strip() else ""
            word = word.lstrip("\"'(\u2018\u201c[").lower()
            if m.group(1) == "." and (word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())):
                continue
        out.append(text[start:end])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


# ---- haystacks ------------------------------------------------------------------------------------------------
class EssayHaystack:
    """An essay haystack: RULER's ``re.sub(r"\\s+", " ", text).split(" ")`` words, with the sentence split
    of the first ``N`` words (repeated past the end, as RULER HEAD does) cached per ``N``.

    ``name``/``sha256``/``source`` describe the text for the results file."""

    def __init__(self, text: str, name: str = "custom", source: str = "", builtin: bool = False):
        if not text.strip():
            raise ValueError(f"haystack {name!r} has no text")
        self.words = re.sub(r"\s+", " ", text).split(" ")
        self.name, self.source, self.builtin = name, source, builtin
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._sents: Dict[int, List[str]] = {}

    def __len__(self) -> int:
        return len(self.words)

    def text(self, n: int) -> str:
        w = self.words
        if n <= len(w):
            return " ".join(w[:n])
        reps = (n + len(w) - 1) // len(w)
        return " ".join((w * reps)[:n])

    def sentences(self, n: int) -> List[str]:
        s = self._sents.get(n)
        if s is None:
            if len(self._sents) > 64:
                self._sents.clear()
            s = self._sents[n] = split_sentences(self.text(n).strip())
        return s

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "words": len(self.words), "source": self.source,
                "builtin": self.builtin,
                "comparable_with_paper": not self.builtin}


def _builtin_path():
    return resources.files("kvmeans.eval").joinpath("data", BUILTIN_HAYSTACK)


@lru_cache(maxsize=1)
def builtin_haystack() -> EssayHaystack:
    """The shipped essay-like distractor corpus: public-domain Shakespeare dialogue, NOT RULER's Paul Graham
    essays (S2/S3 scores with it are not comparable with the paper). See ``kvmeans/eval/data/README.md``."""
    with _builtin_path().open("rb") as f:
        meta = json.loads(gzip.decompress(f.read()).decode("utf-8"))
    return EssayHaystack(meta["text"], name=meta["name"], source=meta["source"], builtin=True)


def load_haystack(path: Union[str, os.PathLike]) -> EssayHaystack:
    """An essay haystack from a file: RULER's ``PaulGrahamEssays.json`` (``{"text": ...}``), a JSON list of
    strings or of ``{"text": ...}`` rows (joined by spaces, as lm-eval does), a ``.jsonl`` of such rows, or
    plain text (any other suffix). The file's sha256 goes into the results."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--haystack-file {path}: no such file (expected RULER's PaulGrahamEssays.json "
                                "or a .txt)")
    raw = p.read_bytes()
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            obj = json.loads(raw.decode("utf-8"))
            if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                text = obj["text"]
            elif isinstance(obj, list):
                text = " ".join(r["text"] if isinstance(r, dict) else str(r) for r in obj)
            else:
                raise ValueError('expected {"text": "..."} (RULER\'s PaulGrahamEssays.json) or a list of texts')
        elif suffix == ".jsonl":
            rows = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
            text = " ".join(r["text"] if isinstance(r, dict) else str(r) for r in rows)
        else:
            text = raw.decode("utf-8")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--haystack-file {path}: {err}") from None
    h = EssayHaystack(text, name=p.name, source=str(p))
    h.sha256 = hashlib.sha256(raw).hexdigest()          # of the file as given
    return h


# ---- tokenizer ------------------------------------------------------------------------------------------------
def token_counter(tokenizer) -> Callable[[str], int]:
    """``text -> number of tokens`` with no special tokens added (RULER's ``text_to_tokens``), for a
    transformers tokenizer, a ``tokenizers.Tokenizer`` or any callable ``text -> int``."""
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "token_to_id") and not callable(tokenizer):
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "convert_tokens_to_ids"):   # transformers
        return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"cannot count tokens with {type(tokenizer).__name__}")


# ---- one sample -----------------------------------------------------------------------------------------------
def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return rng.choice(word_keys())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be 'numbers', 'words' or 'uuids', got {kind!r}")


def generate_input_output(rng: random.Random, num_haystack: int, haystack: Union[str, EssayHaystack], *,
                          type_haystack: str, type_needle_k: str, type_needle_v: str, seed: int = DEFAULT_SEED,
                          num_needle_k: int = 1, num_needle_v: int = 1, num_needle_q: int = 1
                          ) -> Tuple[str, str, List[str], str, float]:
    """RULER's ``generate_input_output`` with its draws from ``rng``: ``(input, answer_prefix, answers,
    query, depth)``. ``input + answer_prefix`` is the prompt. ``depth``: the essay depth drawn from
    :data:`DEPTHS` (percent), or for noise/needle ``100 * line / num_haystack`` (first needle)."""
    num_needle_k = max(num_needle_k, num_needle_q)
    keys, values, needles = [], [], []
    for _ in range(num_needle_k):
        keys.append(_random_value(rng, type_needle_k))
        value = []
        for _ in range(num_needle_v):
            value.append(_random_value(rng, type_needle_v))
            needles.append(NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)

    if type_haystack == "essay":
        if not isinstance(haystack, EssayHaystack):
            raise TypeError("the essay haystack must be an EssayHaystack")
        sents = haystack.sentences(num_haystack)
        drawn = rng.sample(DEPTHS, len(needles))
        positions = [0] + sorted(int(len(sents) * (d / 100)) for d in drawn) + [len(sents)]
        parts = []
        for i in range(1, len(positions)):
            parts.append(" ".join(sents[positions[i - 1]:positions[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
        depth = float(drawn[0])
    elif type_haystack in ("noise", "needle"):
        if not isinstance(haystack, str):
            raise TypeError(f"the {type_haystack} haystack is one string (NOISE or NEEDLE)")
        if type_haystack == "noise":
            lines = [haystack] * num_haystack
        else:                                          # distractors: RULER draws key then value, line by line
            lines = [haystack.format(type_needle_v=type_needle_v, key=_random_value(rng, type_needle_k),
                                     value=_random_value(rng, type_needle_v)) for _ in range(num_haystack)]
        indexes = sorted(rng.sample(range(num_haystack), len(needles)), reverse=True)   # ValueError if too few
        for index, needle in zip(indexes, needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
        depth = round(100 * indexes[-1] / num_haystack, 2)
    else:
        raise ValueError(f"haystack type must be 'noise', 'needle' or 'essay', got {type_haystack!r}")

    indices = rng.sample(range(num_needle_k), num_needle_q)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, tv = TEMPLATE + ANSWER_PREFIX, type_needle_v
    if num_needle_q * num_needle_v == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        tv = type_needle_v[:-1]
    text = template.format(type_needle_v=tv, context=context, query=query)
    cut = text.rfind(ANSWER_PREFIX[:10])               # RULER splits the answer prefix off the same way
    return text[:cut], text[cut:], answers, query, depth


# ---- haystack size ---------------------------------------------------------------------------------------------
def _incremental(type_haystack: str, max_length: int) -> int:
    if type_haystack == "essay":
        return 500
    return 5 if max_length < 4096 else 25


def fit_haystack(gen: Callable[[int], str], count_tokens: Callable[[str], int], max_length: int,
                 incremental: int, tokens_to_generate: int = TOKENS_TO_GENERATE, upper: Optional[int] = None
                 ) -> Tuple[Optional[int], List[Tuple[int, int]]]:
    """RULER's binary search: ``(largest N whose probe fits or None, [(N, tokens + generated), ...])``.

    ``gen(N)`` builds one sample's prompt with ``N`` haystack units (drawing from the shared stream).
    The estimate sample (``incremental`` units) comes first, as in RULER; it is not in the probe list.
    ``upper``: search ``[incremental, upper]`` with no estimate sample (our small-length fallback).
    """
    if upper is None:
        per_unit = count_tokens(gen(incremental)) / incremental
        upper = max(int((max_length / per_unit) * 3), incremental * 2)
    lo, hi = incremental, upper
    best, probes = None, []
    while lo <= hi:
        mid = (lo + hi) // 2
        total = count_tokens(gen(mid)) + tokens_to_generate
        probes.append((mid, total))
        if total <= max_length:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best, probes


def _too_small(task: str, max_length: int, need: Optional[int], tokens_to_generate: int) -> ValueError:
    if need is None:
        return ValueError(f"--lengths {max_length} is too small for {task}: {tokens_to_generate} tokens are generated "
                          f"after the prompt, so a length must exceed {tokens_to_generate} by the prompt's size "
                          f"(RULER's lengths start at 4096)")
    return ValueError(f"--lengths {max_length} is too small for {task} with this tokenizer: the RULER template, "
                      f"needle and answer prefix with one haystack unit take {need - tokens_to_generate} tokens and "
                      f"{tokens_to_generate} are generated; use --lengths >= {need} (RULER's lengths start at 4096)")


def generate_samples(task: str, max_length: int, num_samples: int, tokenizer, *, seed: int = DEFAULT_SEED,
                     haystack: Optional[EssayHaystack] = None, tokens_to_generate: int = TOKENS_TO_GENERATE,
                     max_floor_retries: int = 100) -> List[Dict[str, Any]]:
    """``num_samples`` RULER records for ``task`` at ``max_length`` tokens (see the module docstring).

    ``tokenizer``: the model's tokenizer (transformers or ``tokenizers``) or ``text -> token count``.
    ``haystack``: the essay haystack for S2/S3 (default :func:`builtin_haystack`, not RULER's essays).
    Record fields: ``index``, ``task``, ``input``, ``outputs`` (references), ``length`` (prompt tokens +
    ``tokens_to_generate``), ``max_length``, ``answer_prefix`` (RULER's, leading space), ``gen_prefix``
    (lm-eval's, no leading space), ``query``, ``depth`` (percent), ``num_haystack`` (units used).
    """
    if task not in NIAH_TASKS:
        raise ValueError(f"--tasks: unknown task {task!r}; choose from {', '.join(NIAH_TASKS)}")
    if num_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {num_samples}")
    if max_length <= tokens_to_generate:
        raise _too_small(task, max_length, None, tokens_to_generate)
    spec = NIAH_TASKS[task]
    kind = spec["type_haystack"]
    hay: Union[str, EssayHaystack] = {"noise": NOISE, "needle": NEEDLE}.get(kind) or haystack or builtin_haystack()
    count = token_counter(tokenizer)
    rng = random.Random(seed)

    def make(n: int):
        return generate_input_output(rng, n, hay, seed=seed, **spec)

    def prompt(n: int) -> str:
        inp, prefix, *_ = make(n)
        return inp + prefix

    inc = _incremental(kind, max_length)
    best, _ = fit_haystack(prompt, count, max_length, inc, tokens_to_generate)
    if best is None:            # RULER would loop forever here (#2963): search again from one unit
        best, probes = fit_haystack(prompt, count, max_length, 1, tokens_to_generate, upper=inc)
        if best is None:
            one = min((t for n, t in probes if n == 1), default=None)
            raise _too_small(task, max_length, one or count(prompt(1)) + tokens_to_generate, tokens_to_generate)
        inc = 1

    records = []
    for index in range(num_samples):
        used, floor_tries, length = best, 0, None
        while True:
            try:
                inp, prefix, answers, query, depth = make(used)
                length = count(inp + prefix) + tokens_to_generate
                if length <= max_length:
                    break
            except ValueError:           # RULER's bare except: too few units for the needles
                pass
            if used > inc:
                used -= inc
            else:
                floor_tries += 1
                if floor_tries > max_floor_retries:
                    raise _too_small(task, max_length, length, tokens_to_generate)
        if not answers or answers[0] not in inp:
            raise RuntimeError(f"{task}: the needle is not in the generated input (sample {index})")
        records.append({"index": index, "task": task, "input": inp, "outputs": answers, "length": length,
                        "max_length": max_length, "answer_prefix": prefix, "gen_prefix": prefix.strip(),
                        "query": query, "depth": depth, "num_haystack": used})
    return records


# ---- scoring --------------------------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred: str) -> str:
    """RULER's ``postprocess_pred``: strip, replace control characters by ``"\\n"``, strip again."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def _string_match(preds: Sequence[str], refs: Sequence[Sequence[str]], part: bool) -> Tuple[float, List[float]]:
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")
    if not preds:
        raise ValueError("no predictions to score")
    per = []
    for pred, ref in zip(preds, refs):
        if not ref:
            raise ValueError("a sample has no reference strings")
        p = postprocess_pred(pred).lower()
        found = [r.lower() in p for r in ref]
        per.append(float(any(found)) if part else sum(found) / len(ref))
    return round(sum(per) / len(per) * 100, 2), per


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> Tuple[float, List[float]]:
    """RULER's ``string_match_all``: ``(100 * mean fraction, rounded to 2 dp; per-sample fractions)``; a
    sample's fraction is the share of its references found case-insensitively in its (post-processed)
    prediction."""
    return _string_match(preds, refs, part=False)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> Tuple[float, List[float]]:
    """RULER's ``string_match_part`` (the QA tasks): as :func:`string_match_all` but a sample scores 1 when
    any one of its references is found (RULER's max over references), else 0."""
    return _string_match(preds, refs, part=True)
