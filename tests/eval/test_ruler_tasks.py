"""`kvmeans eval ruler`: RULER's multi-needle NIAH tasks, vt, cwe and fwe generated offline. Golden files
against lm-eval's port where it defines a task as RULER does, the whole generators pinned, determinism by
seed, the answers where RULER puts them, budgets to the token, RULER's metrics on hand-made predictions,
the average over the tasks that ran, and the command end to end on a tiny model with a byte tokenizer."""
import collections
import json
import random
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("wonderwords")
pytest.importorskip("scipy")
tk = pytest.importorskip("tokenizers")

from kvmeans.cli.eval_ruler import main as ruler_main  # noqa: E402
from kvmeans.eval import ruler  # noqa: E402
from kvmeans.eval import ruler_tasks as rt  # noqa: E402
from kvmeans.eval.ruler_suite import averages, format_table  # noqa: E402
from kvmeans.eval.ruler_tasks import cwe, fwe, qa, vt  # noqa: E402
from kvmeans.train.tokenizers import EOT, gpt2_hf_tokenizer  # noqa: E402

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "ruler_tasks_golden.json").read_text(encoding="utf-8"))
NEW = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe",
       "fwe")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def tok():
    return gpt2_hf_tokenizer()


@pytest.fixture(scope="module")
def samples(tok):
    """Two samples of every new task at 1024 and 4096 tokens (seed 42)."""
    return {(t, n): rt.generate_samples(t, n, 2, tok) for t in NEW for n in (1024, 4096)}


# ---- golden files ---------------------------------------------------------------------------------------------
def test_needle_haystack_equals_lm_eval_port_byte_for_byte():
    for c in GOLDEN["reference"]["niah_needle"]:
        rng = random.Random(c["seed"])
        inp, _, answers, query, _ = ruler.generate_input_output(
            rng, c["num_haystack"], ruler.NEEDLE, type_haystack="needle", type_needle_k=c["type_needle_k"],
            type_needle_v=c["type_needle_v"], seed=c["seed"], num_needle_k=c["num_needle_k"],
            num_needle_v=c["num_needle_v"], num_needle_q=c["num_needle_q"])
        assert (inp, answers, query) == (c["input"], c["outputs"], c["query"])
        assert rng.random() == c["next_random"]


def test_fwe_text_equals_lm_eval_port_byte_for_byte():
    for c in GOLDEN["reference"]["fwe"]:
        rng = random.Random(c["seed"])
        text, answer = fwe.coded_text(fwe.vocabulary(rng, c["seed"], c["vocab_size"]), c["seed"], c["num_words"])
        assert (text, answer) == (c["text"], c["outputs"]) and rng.random() == c["next_random"]


def test_vt_chains_equal_lm_eval_port():
    import numpy as np
    for c in GOLDEN["reference"]["vt_chains"]:
        rng, nprng = random.Random(c["seed"]), np.random.RandomState(c["seed"])
        names, chains = vt._chains(rng, nprng, 1, 4, is_icl=False)
        assert (names, chains) == (c["names"], c["chains"])
        assert rng.random() == c["next_random"] and int(nprng.randint(0, 2 ** 31 - 1)) == c["next_np"]


def test_golden_pipeline_samples_are_reproduced(tok):
    assert ruler.builtin_haystack().sha256 == GOLDEN["builtin_haystack_sha256"]
    for case in GOLDEN["pipeline"]:
        got = rt.generate_samples(case["task"], case["max_length"], len(case["records"]), tok, seed=42)
        assert got == case["records"], f"{case['task']} @ {case['max_length']} changed"


# ---- determinism, budgets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["niah_multikey_2", "vt", "cwe", "fwe"])
def test_deterministic_per_seed_prefix_stable_and_seed_sensitive(tok, task):
    a = rt.generate_samples(task, 1024, 3, tok, seed=1)
    assert a == rt.generate_samples(task, 1024, 3, tok, seed=1)
    assert rt.generate_samples(task, 1024, 2, tok, seed=1) == a[:2]          # sample i ignores the count
    assert [r["input"] for r in rt.generate_samples(task, 1024, 3, tok, seed=2)] != [r["input"] for r in a]
    assert len({r["input"] for r in a}) == 3


def test_lengths_hit_the_token_budget(samples, tok):
    count = ruler.token_counter(tok)
    for (task, n), recs in samples.items():
        budget = rt.TOKENS_TO_GENERATE[task]
        for r in recs:
            assert r["length"] == count(r["input"] + r["answer_prefix"]) + budget <= n == r["max_length"]
        if task not in ("niah_multikey_1", "niah_multivalue", "niah_multiquery"):   # essay: 500-word steps
            assert max(r["length"] for r in recs) > 0.85 * n, (task, n, [r["length"] for r in recs])


def test_too_small_lengths_name_the_fix(tok):
    for task in ("vt", "cwe", "fwe"):
        with pytest.raises(ValueError, match=r"--lengths 150 is too small for %s" % task):
            rt.generate_samples(task, 150, 1, tok)
    with pytest.raises(ValueError, match=r"--tasks qa_1: .*SQuAD"):
        rt.generate_samples("qa_1", 4096, 1, tok)
    with pytest.raises(ValueError, match=r"--tasks: unknown task 'niah_single_4'"):
        rt.check_task("niah_single_4")
    assert len(rt.RULER_TASKS) == 13 and set(rt.RULER_TASKS) - set(rt.SYNTHETIC_TASKS) == {"qa_1", "qa_2"}


# ---- the answers, where RULER puts them -----------------------------------------------------------------------
def _needle(v, key, value):
    return ruler.NEEDLE.format(type_needle_v=v, key=key, value=value)


def test_multi_needle_tasks_place_answers_as_ruler(samples):
    for n in (1024, 4096):
        for r in samples[("niah_multikey_1", n)]:          # 4 keys, one asked for
            assert r["input"].count("One of the special magic numbers for ") == 4 and len(r["outputs"]) == 1
            assert _needle("numbers", r["query"], r["outputs"][0]) in r["input"]
            assert r["answer_prefix"] == f" The special magic number for {r['query']} mentioned in the provided text is"
        for r in samples[("niah_multivalue", n)]:          # one key, 4 values, all asked for
            assert len(r["outputs"]) == 4 and all(_needle("numbers", r["query"], v) in r["input"] for v in r["outputs"])
            assert r["input"].startswith("Some special magic numbers are hidden")
        for r in samples[("niah_multiquery", n)]:          # 4 keys, all asked for, "a, b, c, and d"
            keys = re.fullmatch(r"(\S+), (\S+), (\S+), and (\S+)", r["query"]).groups()
            assert [_needle("numbers", k, v) in r["input"] for k, v in zip(keys, r["outputs"])] == [True] * 4
        for task, v in (("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids")):
            for r in samples[(task, n)]:                   # distractor needle lines around the one asked for
                lines = r["input"].split("\n")[1:-1]
                assert len(lines) == r["num_haystack"] + 1 and all(x.startswith("One of the special magic")
                                                                   for x in lines)
                assert [x for x in lines if f" for {r['query']} is:" in x] == [_needle(v, r["query"], r["outputs"][0])]


def test_vt_chain_and_in_context_example(samples):
    for n in (1024, 4096):
        for r in samples[("vt", n)]:
            example, task_text = r["input"].split("\n\nMemorize and track", 1)
            names = r["outputs"]
            value = re.search(r"assigned the value (\d{5}) in the text above\.$", r["input"]).group(1)
            lines = task_text.split("\n")
            chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
            assert [x for x in lines if x.startswith("VAR ")] == chain     # in order, one line each
            assert lines.count(ruler.NOISE) == r["num_haystack"] and len(set(names)) == 5
            assert all(re.fullmatch(r"[A-Z]{5}", x) for x in names)
            assert r["answer_prefix"] == vt.ANSWER_PREFIX.format(num_v=5, query=value)
            # the example: 3-letter names, its own value and answer, ending the line before the task
            assert example.startswith("Memorize and track")      # RULER: the prefix's space, then " " + names
            assert re.search(r"they are:  ([A-Z]{3} ){4}[A-Z]{3}$", example)
            assert "12345" not in example


def test_cwe_common_words_repeat_as_ruler(samples):
    for n, (freq_cw, freq_ucw, ex_cw, ex_ucw, ex_n) in ((1024, (6, 1, 3, 1, 20)), (4096, (30, 3, 10, 3, 40))):
        for r in samples[("cwe", n)]:
            example, task_text = r["input"].split("\nBelow is a numbered list", 1)
            got = collections.Counter(re.findall(r"\d+\. (\S+)", task_text.split("\nQuestion:")[0]))
            assert {w: got[w] for w in r["outputs"]} == {w: freq_cw for w in r["outputs"]} and len(r["outputs"]) == 10
            assert set(got.values()) == {freq_cw, freq_ucw} and len(got) == r["num_haystack"]
            ex = collections.Counter(re.findall(r"\d+\. (\S+)", example.split("\nQuestion:")[0]))
            assert sorted(ex.values()) == [ex_ucw] * (ex_n - 10) + [ex_cw] * 10
            shown = example.split("most often in the list are: ")[-1]           # the example's own answer
            assert sorted(re.findall(r"\d+\. (\S+)", shown)) == sorted(w for w, c in ex.items() if c == ex_cw)
            assert r["answer_prefix"] == cwe.ANSWER_PREFIX


def test_fwe_answers_are_ranks_two_to_four(samples):
    for n in (1024, 4096):
        for r in samples[("fwe", n)]:
            words = r["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0].split(" ")
            top = [w for w, _ in collections.Counter(words).most_common(4)]
            assert top[0] == "..." and top[1:] == r["outputs"]
            assert r["answer_prefix"] == fwe.ANSWER_PREFIX


# ---- QA from the user's files ---------------------------------------------------------------------------------
WORDS = "river stone quiet lamp garden copper window orbit maple harbor candle silver meadow falcon thunder".split()


def _para(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    """A tiny SQuAD 2.0 file (3 articles x 4 paragraphs, one unanswerable question each) and a HotpotQA one."""
    rng, d = random.Random(0), tmp_path_factory.mktemp("qa")
    articles = []
    for a in range(3):
        paras = []
        for p in range(4):
            text = f"Article {a} paragraph {p} says the answer is ANS{a}{p}. " + _para(rng, 15)
            paras.append({"context": text, "qas": [
                {"question": f"What does article {a} paragraph {p} say?", "is_impossible": False,
                 "answers": [{"text": f"ANS{a}{p}", "answer_start": 0}, {"text": f"ans{a}{p} alt", "answer_start": 0}]},
                {"question": "Unanswerable?", "is_impossible": True, "answers": []}]})
        articles.append({"title": f"T{a}", "paragraphs": paras})
    (d / "dev-v2.0.json").write_text(json.dumps({"version": "v2.0", "data": articles}))
    hotpot = [{"_id": str(i), "question": f"Which bridge joins {i}?", "answer": f"BRIDGE{i}", "type": "bridge",
               "supporting_facts": [],
               "context": [[f"Title {i}-{j}", [f"Doc {i}-{j} mentions BRIDGE{i}. ", _para(rng, 5)]]
                           for j in range(10)]} for i in range(4)]
    (d / "hotpot_dev_distractor_v1.json").write_text(json.dumps(hotpot))
    return d / "dev-v2.0.json", d / "hotpot_dev_distractor_v1.json"


def test_qa_data_read_as_ruler(qa_files):
    squad, hotpot = map(qa.load_qa_data, qa_files)
    assert (squad.name, squad.task, len(squad.qas), len(squad.docs)) == ("squad", "qa_1", 12, 12)
    assert squad.docs == sorted(squad.docs) and squad.qas[5]["outputs"] == ["ANS11", "ans11 alt"]
    assert squad.docs[squad.qas[5]["context"][0]].startswith("Article 1 paragraph 1 ")
    assert sorted(squad.qas[5]["context"] + squad.qas[5]["more_context"]) == sorted(
        squad.docs.index(p) for p in squad.docs if p.startswith("Article 1 "))
    assert (hotpot.name, hotpot.task, len(hotpot.qas), len(hotpot.docs)) == ("hotpotqa", "qa_2", 4, 40)
    assert hotpot.docs[hotpot.qas[2]["context"][0]].startswith("Title 2-0\nDoc 2-0 mentions BRIDGE2. ")


def test_qa_samples_hold_their_documents_within_the_budget(qa_files, tok):
    count = ruler.token_counter(tok)
    data = {d.task: d for d in map(qa.load_qa_data, qa_files)}
    for task, n in (("qa_1", 1500), ("qa_1", 3000), ("qa_2", 3000)):
        recs = rt.generate_samples(task, n, 3, tok, qa_data=data)
        assert recs == rt.generate_samples(task, n, 3, tok, qa_data=data)
        for i, r in enumerate(recs):
            q = data[task].qas[i]                                   # sample i asks question i
            assert r["input"].endswith("Question: " + q["query"]) and r["outputs"] == q["outputs"]
            assert r["answer_prefix"] == qa.ANSWER_PREFIX
            for j in q["context"]:                                  # its own documents are all there
                assert re.search(r"Document \d+:\n" + re.escape(data[task].docs[j]), r["input"])
            assert len(re.findall(r"Document \d+:\n", r["input"])) == r["num_haystack"]
            assert r["length"] == count(r["input"] + r["answer_prefix"]) + 32 <= n
    with pytest.raises(ValueError, match=r"--samples 20: .* has 12 questions"):
        rt.generate_samples("qa_1", 3000, 20, tok, qa_data=data)
    assert rt.score("qa_1", ["it is ans00 alt", "no"], [["ANS00", "ans00 alt"], ["x"]])[0] == 50.0


def test_cli_runs_qa_from_the_given_files(byte_model_dir, qa_files, tmp_path, capsys):
    out = tmp_path / "out"
    assert ruler_main(["--model", str(byte_model_dir), "--qa-data", *map(str, qa_files), "--tasks", "qa_1", "qa_2",
                       "--lengths", "3000", "--samples", "2", "--max-new-tokens", "2", "--out", str(out),
                       "--no-progress"]) == 0
    res = json.loads((out / "ruler.json").read_text())
    assert ([s["task"] for s in res["scores"]] == ["qa_1", "qa_2"]
            and res["config"]["metrics"]["qa_1"] == "string_match_part")
    assert res["config"]["qa_data"]["qa_2"]["questions"] == 4 and res["averages"][0]["n_tasks"] == 2
    assert [x.split()[0] for x in capsys.readouterr().out.splitlines()[1:3]] == ["QA-1", "QA-2"]


# ---- metrics --------------------------------------------------------------------------------------------------
def test_metrics_on_hand_made_predictions():
    refs = [["alpha", "Beta"], ["gamma"], ["delta", "eps"]]
    preds = [" ALPHA and beta\x00", "nothing", "delta only"]
    assert ruler.string_match_all(preds, refs) == (50.0, [1.0, 0.0, 0.5])
    assert ruler.string_match_part(preds, refs) == (66.67, [1.0, 0.0, 1.0])
    assert rt.score("vt", preds, refs) == ruler.string_match_all(preds, refs)
    assert rt.METRICS["qa_2"] == "string_match_part" and rt.METRICS["cwe"] == "string_match_all"
    with pytest.raises(ValueError, match="predictions for"):
        ruler.string_match_part(["a"], [])


def test_average_over_the_tasks_that_ran():
    rows = [{"task": t, "length": 4096, "score": s, "samples": 1} for t, s in (("vt", 50.0), ("cwe", 20.0))]
    rows.append({"task": "vt", "length": 8192, "score": 10.0, "samples": 1})
    a4, a8 = averages(rows)
    assert (a4["length"], a4["score"], a4["tasks"], a4["n_tasks"],
            a4["complete"]) == (4096, 35.0, ["vt", "cwe"], 2, False)
    assert len(a4["missing"]) == 11 and "qa_1" in a4["missing"] and a8["score"] == 10.0
    full = averages([{"task": t, "length": 4096, "score": 1.0, "samples": 1} for t in rt.RULER_TASKS])[0]
    assert full["complete"] and full["missing"] == []


# ---- the command ----------------------------------------------------------------------------------------------
def _with_byte_tokenizer(model, d):
    """Save ``model`` into ``d`` with a byte-level tokenizer (one token per character of ASCII text)."""
    from kvmeans.train.tokenizers import save_tokenizer
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    btok = tk.Tokenizer(tk.models.BPE(vocab={EOT: 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}}, merges=[]))
    btok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    btok.decoder = tk.decoders.ByteLevel()
    btok.add_special_tokens([EOT])
    model.save_pretrained(d)
    save_tokenizer(btok, d)
    return d


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    """A tiny KVM model with a byte-level tokenizer."""
    from kvmeans.models import KVMLanguageModel, KVMModelConfig
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.utils.testing import perturb_identity_init
    torch.manual_seed(0)
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=264, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         chunk_len=32, n_bswa_chunks=2, budget={"kind": "fixed", "n": 32}))
    perturb_identity_init(lm)
    return _with_byte_tokenizer(KVMForCausalLM.from_language_model(lm, eos_token_id=0, pad_token_id=0),
                                tmp_path_factory.mktemp("ruler_model") / "tiny-bytes")


def test_cli_kvm_spec_converts_a_plain_model(tmp_path_factory, tmp_path):
    """--kvm SPEC: a window that covers the prompt gives the plain model's predictions; the JSON records it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=0, pad_token_id=0))
    d = _with_byte_tokenizer(llama.eval(), tmp_path_factory.mktemp("ruler_llama") / "llama")
    wide = "budget=fixed:64,chunk_len=256,n_bswa_chunks=4,sink_len=4"
    runs = {}
    for name, extra in (("plain", []), ("kvm", ["--kvm", wide])):
        assert ruler_main(["--model", str(d), "--tasks", "niah_multikey_2", "fwe", "--lengths", "1024", "--samples",
                           "2", "--max-new-tokens", "3", "--no-progress", "--out", str(tmp_path / name), *extra]) == 0
        runs[name] = json.loads((tmp_path / name / "ruler.json").read_text())
    assert [s["pred"] for s in runs["kvm"]["samples"]] == [s["pred"] for s in runs["plain"]["samples"]]
    assert runs["kvm"]["config"]["kvm"] == wide and runs["kvm"]["config"]["kvm_conversion"]["chunk_len"] == 256
    assert runs["plain"]["config"]["kvm"] is None and runs["plain"]["config"]["kvm_conversion"] is None


def test_cli_writes_table_csv_json_with_the_average_and_task_list(byte_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    tasks = ["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"]
    assert ruler_main(["--model", str(byte_model_dir), "--tasks", *tasks, "--lengths", "2560", "--samples", "2",
                       "--max-new-tokens", "2", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].split() == ["task", "2560", "mean"]
    assert [x.split()[0] for x in lines[1:6]] == ["NIAH-S1", "NIAH-MK2", "VT", "CWE", "FWE"]
    res = json.loads((out / "ruler.json").read_text())
    avg = res["averages"][0]
    assert avg["tasks"] == tasks and avg["n_tasks"] == 5 and not avg["complete"] and "qa_2" in avg["missing"]
    assert avg["score"] == round(sum(s["score"] for s in res["scores"]) / 5, 2)
    assert any(x.startswith("RULER avg") and f"{avg['score']:.2f}" in x for x in lines)
    assert "RULER avg over 5 of RULER's 13 tasks, missing niah_single_2" in printed and "NOT comparable" in printed
    assert res["config"]["tasks"] == tasks and res["config"]["tokens_to_generate"]["cwe"] == 120
    assert res["config"]["kvm"] is None and res["haystack"] is None and len(res["samples"]) == 10
    for s in res["samples"]:
        assert s["tokens"] <= 2560 and isinstance(s["pred"], str) and 0 <= s["score"] <= 1
    csv_lines = (out / "ruler.csv").read_text().splitlines()
    assert csv_lines[0] == "task,length,samples,metric,score" and len(csv_lines) == 7
    assert [r.split(",")[0] for r in csv_lines[1:]] == tasks + ["ruler_avg"]
    assert csv_lines[-1] == (f"ruler_avg,2560,,mean of 5/13 tasks: {' '.join(tasks)},{avg['score']:.2f}")
    assert format_table(res) in printed


def test_cli_refuses_qa_and_small_lengths_in_one_line(byte_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ruler_main(["--model", str(byte_model_dir), "--tasks", "qa_1", "--out", str(tmp_path / "o")])
    assert "--tasks qa_1: RULER's QA tasks need their data set, which kvmeans does not ship: pass your copy of " \
           "SQuAD 2.0's dev-v2.0.json with --qa-data PATH" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 2}')
    with pytest.raises(SystemExit):
        ruler_main(["--model", str(byte_model_dir), "--qa-data", str(bad)])
    assert f"--qa-data {bad}: neither SQuAD 2.0" in capsys.readouterr().err
    assert ruler_main(["--model", str(byte_model_dir), "--tasks", "vt", "--lengths", "600",
                       "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmeans eval ruler: error: --lengths 600 is too small for vt") and "\n" not in err
