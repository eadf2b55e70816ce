"""kvmeans bench pretrained (full / StreamingLLM / KVM / kvpress side by side) on a tiny random-weight Llama."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("wonderwords")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import kvmeans  # noqa: E402
from kvmeans.cli import bench_pretrained as bp_cli  # noqa: E402
from kvmeans.eval import ruler  # noqa: E402
from kvmeans.pretrained import bench as bp  # noqa: E402
from kvmeans.pretrained import ppl as pp  # noqa: E402
from kvmeans.utils.args import UsageError  # noqa: E402

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KVPRESS_PY = Path.home() / ".cache/kvmeans/venvs/kvpress/bin/python"
RUNNER = Path(__file__).resolve().parents[2] / "benchmarks/kvpress/run_kvpress.py"
TINY = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, eos_token_id=257, bos_token_id=256)


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer (one id per byte) with ChatML specials and a chat template."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   chat_template=CHAT)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model, tok):
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


PER_KEY = 2 * 2 * 2 * 8 * 4      # K and V x layers x kv heads x head_dim x fp32 bytes


@pytest.mark.parametrize("task", ["niah_multikey_2", "niah_multivalue", "vt", "cwe", "fwe"])
def test_ruler_samples_of_every_synthetic_task_split_before_the_question(tok, task):
    """kvpress' RULER split: the context ends before RULER's question line, which opens the question part; the
    answers are RULER's and the answer budget the task's."""
    from kvmeans.eval import ruler_tasks
    length = 8192 if task == "cwe" else 4096      # one id per byte: cwe's smallest prompt is 6.7K tokens
    (s,) = bp.ruler_samples(tok, task, length, 1)
    assert s["question"].lstrip("\n").startswith(("What ", "Question: ")) and "\nQuestion: " not in s["question"][1:]
    assert s["max_new_tokens"] == ruler_tasks.TOKENS_TO_GENERATE[task] and s["answers"]
    rec = ruler_tasks.generate_samples(task, length, 1, tok)[0]
    assert s["answers"] == rec["outputs"] and rec["input"].endswith(s["question"].split("<|im_end|>")[0])


def test_samples_fit_their_budget_hold_the_needle_and_round_trip(tok, tmp_path):
    s = bp.niah_samples(tok, n=5, context_tokens=1200, seed=1)
    assert [x["depth"] for x in s] == list(bp.NIAH_DEPTHS)
    for x in s:
        assert 1150 <= len(x["context_ids"]) <= 1200
        assert x["answers"][0] in x["context"] and len(x["answers"][0]) == 7
        assert x["context_ids"] == tok.encode(x["context"], add_special_tokens=False)
        assert x["question"].endswith("mentioned in the provided text is")
        assert x["sha256"] == bp.sample_sha256(x["context_ids"], x["question_ids"])
    for x in s:         # the needle sits at its depth, counted in sentences of the haystack as RULER counts
        sents = ruler.split_sentences(x["context"].split("afterwards.\n", 1)[1])
        at = next(i for i, t in enumerate(sents) if x["answers"][0] in t)
        assert abs(at / (len(sents) - 1) - x["depth"] / 100) < 0.05
    assert s == bp.niah_samples(tok, n=5, context_tokens=1200, seed=1)
    assert s != bp.niah_samples(tok, n=5, context_tokens=1200, seed=2)
    bp.write_samples(tmp_path / "s.jsonl", s)
    assert bp.read_samples(tmp_path / "s.jsonl") == s


def test_chat_split_is_kvpress_split(tok):
    """context + question + answer prefix is exactly the chat prompt of (context + question)."""
    head, suffix = bp.chat_parts(tok, "the haystack", "\nthe question?")
    full = tok.apply_chat_template([{"role": "user", "content": "the haystack\nthe question?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert head + "\nthe question?" + suffix == full and head.endswith("the haystack")
    r = bp.ruler_samples(tok, "niah_single_1", 600, 2)
    assert [x["id"] for x in r] == ["niah_single_1-600-0", "niah_single_1-600-1"]
    assert all(x["question"].startswith("\nWhat is the special magic number") for x in r)


def test_seed_draws_another_ruler_sample_set_and_seed_0_is_rulers_own(tok):
    """``--seed`` reaches RULER's samples (a tuning split beside the default set); seed 0 is RULER's seed 42, so
    the sample sets of earlier runs are unchanged."""
    from types import SimpleNamespace
    a = SimpleNamespace(benches=["ruler"], ruler_tasks=["niah_single_1", "niah_multikey_2"], ruler_lengths=[600],
                        ruler_samples=2)
    default = bp.all_samples(tok, SimpleNamespace(**vars(a), seed=0))
    assert [x["context"] for x in default] == [x["context"] for t in a.ruler_tasks
                                               for x in bp.ruler_samples(tok, t, 600, 2)]
    other = bp.all_samples(tok, SimpleNamespace(**vars(a), seed=1))
    assert [x["id"] for x in other] == [x["id"] for x in default]
    assert all(o["context"] != d["context"] for o, d in zip(other, default))
    assert [x["context"] for x in bp.all_samples(tok, SimpleNamespace(**vars(a), seed=1))] == \
        [x["context"] for x in other]


def _greedy_reference(model, ids, n, mask_fn=None):
    """Greedy continuation recomputed from scratch each step (no cache), under ``mask_fn(T)`` if given."""
    ids = list(ids)
    out = []
    for _ in range(n):
        x = torch.tensor([ids])
        kw = {} if mask_fn is None else {"attention_mask": mask_fn(len(ids))}
        with torch.no_grad():
            t = int(model(input_ids=x, use_cache=False, **kw).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


def _square_mask(sinks, window):
    """``length -> `` StreamingLLM's mask over a whole window of that many tokens."""
    return lambda length: pp.streaming_mask(torch.arange(length), torch.arange(length), sinks, window)


def test_full_arm_answers_like_greedy_and_holds_every_key(model):
    ctx, q = list(range(3, 123)), [40, 41, 42]
    r = bp.answer(bp.Arm("full", model), ctx, q, 6, stop=set())
    assert r["ids"] == _greedy_reference(model, ctx + q, 6)
    assert r["cache_bytes"] == len(ctx) * PER_KEY


def test_streaming_arm_equals_a_masked_stream_and_evicts(model):
    """The evicting cache gives the same tokens as recomputing under StreamingLLM's mask; it holds
    sinks + window - 1 keys after the context."""
    ctx, q = [(7 * i) % 250 for i in range(150)], [40, 41, 42]
    r = bp.answer(bp.streaming_arm(model, 36, sinks=4), ctx, q, 6, stop=set())
    ref = _greedy_reference(model, ctx + q, 6, _square_mask(4, 32))
    assert r["ids"] == ref
    assert r["ids"] != _greedy_reference(model, ctx + q, 6)        # compression changed something here
    assert r["cache_bytes"] == 35 * PER_KEY


def test_kvm_arm_keeps_its_keys_and_bounded_bytes(model):
    kvm = {"chunk_len": 8, "n_bswa_chunks": 4, "sink_len": 2}
    arm = bp.kvm_arm(model, 64, kvm)
    conv = arm.model.config.kvm_conversion
    assert (conv["chunk_len"], conv["n_bswa_chunks"], conv["budget"]["n"]) == (8, 4, 32)
    assert arm.model is not model and not getattr(model.config, "kvm_conversion", None)
    small = bp.kvm_arm(model, 20, kvm).model.config.kvm_conversion        # window shrunk to <= keys // 2
    assert small["chunk_len"] * small["n_bswa_chunks"] <= 10 and small["budget"]["n"] >= 10
    short = bp.answer(arm, list(range(3, 203)), [40], 2, stop=set())["cache_bytes"]
    long = bp.answer(arm, [(5 * i) % 250 for i in range(600)], [40], 2, stop=set())["cache_bytes"]
    assert short == long < 200 * PER_KEY
    with pytest.raises(UsageError, match="--kvm: 6 kept keys"):
        bp.kvm_arm(model, 6, {"chunk_len": 8, "n_bswa_chunks": 1, "sink_len": 4})


def test_kvm_arm_checks_exact_rows_against_the_budget_it_sets(model):
    kvm = {"chunk_len": 8, "n_bswa_chunks": 4, "sink_len": 2, "exact_rows": 140}   # > KVMSpec's default budget
    conv = bp.kvm_arm(model, 200, kvm).model.config.kvm_conversion                # 168 rows beside 32 window keys
    assert (conv["budget"]["n"], conv["exact_rows"]) == (168, 140)
    with pytest.raises(bp.UsageError, match=r"exact_rows=140 does not fit 100 kept keys .*at most budget - "
                                            r"chunk_len = 60\); lower exact_rows"):
        bp.kvm_arm(model, 100, kvm)                                                # 68 rows: too few
    assert bp.kvm_settings(12, {"chunk_len": 8, "n_bswa_chunks": 2, "sink_len": 2})["budget"].n == 8   # no reserve


def test_a_reserve_that_a_cell_cannot_hold_is_refused_before_any_arm_runs(model_dir, tmp_path, monkeypatch):
    """400-token NIAH at 0.75 keeps 100 keys (68 state rows): exact_rows=64 fits 0.5 (200 keys) but not 0.75."""
    ran = []
    monkeypatch.setattr(bp, "recall_rows", lambda *a, **k: ran.append(a) or pytest.fail("an arm ran"))
    argv = ["--model", str(model_dir), "--out", str(tmp_path / "run"), "--benches", "niah", "--niah-samples", "1",
            "--niah-length", "400", "--no-progress", "--kvm", "chunk_len=8,n_bswa_chunks=4,sink_len=2,exact_rows=64"]
    with pytest.raises(bp.UsageError, match="exact_rows=64 does not fit"):
        bp_cli.main(argv)
    assert not ran and not (tmp_path / "run" / "bench.json").exists()


def test_exact_rows_are_checked_against_the_kept_keys_not_the_default_budget(model_dir, tmp_path):
    """The bench sets the budget per kept keys, so ``exact_rows`` above KVMSpec's default budget (128) runs where the
    kept keys hold it (198 keys at 0.5: a 16-token window and 182 rows, at most 166 exact)."""
    argv = ["--model", str(model_dir), "--out", str(tmp_path / "run"), "--benches", "niah", "--niah-samples", "1",
            "--niah-length", "400", "--no-progress", "--arms", "kvm", "--max-new-tokens", "2", "--ratios", "0.5",
            "--kvm", "chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=150"]
    bp_cli.main(argv)
    got = json.loads((tmp_path / "run" / "bench.json").read_text())["settings"]["kvm_effective"]
    assert got == {"198": {"chunk_len": 8, "n_bswa_chunks": 2, "budget": 182, "exact_rows": 150}}
    with pytest.raises(ValueError, match="exact_rows must be in"):         # outside a bench: checked at once
        kvmeans.parse_kvm_spec("chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=150")


def test_a_shrunk_window_is_said_and_recorded(model_dir, tmp_path, capsys):
    """400-token NIAH at 0.75 keeps 99 keys here: a 96-token window is shrunk to 48 (at most keys // 2); the run says
    so on stderr and records what the KVM arm ran per kept keys in bench.json."""
    argv = ["--model", str(model_dir), "--out", str(tmp_path / "run"), "--benches", "niah", "--niah-samples", "1",
            "--niah-length", "400", "--no-progress", "--arms", "kvm", "--max-new-tokens", "2",
            "--kvm", "chunk_len=8,n_bswa_chunks=12,sink_len=2"]
    bp_cli.main(argv)
    assert "--kvm: at 99 kept keys the window is 6 chunks of 8 tokens (48" in capsys.readouterr().err
    got = json.loads((tmp_path / "run" / "bench.json").read_text())["settings"]["kvm_effective"]
    assert got == {"99": {"chunk_len": 8, "n_bswa_chunks": 6, "budget": 51, "exact_rows": 0},       # ratio 0.75
                   "198": {"chunk_len": 8, "n_bswa_chunks": 12, "budget": 102, "exact_rows": 0}}    # 0.5: as given


def test_kvm_auto_spends_a_calibration_split_at_each_kept_keys_without_shrinking(model_dir, tmp_path, capsys):
    """``--kvm auto:NAME`` runs the split's shares of each cell's kept keys as convert_hf(model) would (a 0.75
    window, not at most half); ``--kvm auto`` calibrates once on the built-in text and records the pick."""
    from kvmeans.pretrained.calibrate import split_named, split_settings
    common = ["--model", str(model_dir), "--benches", "niah", "--niah-samples", "1", "--niah-length", "400",
              "--no-progress", "--arms", "kvm", "--max-new-tokens", "2"]
    bp_cli.main(common + ["--out", str(tmp_path / "named"), "--kvm", "auto:C16-w0.75-e0.75"])
    assert "--kvm:" not in capsys.readouterr().err
    res = json.loads((tmp_path / "named" / "bench.json").read_text())
    split = split_named("C16-w0.75-e0.75")
    for keys, got in res["settings"]["kvm_effective"].items():
        want = split_settings(split, int(keys))
        assert got == {"chunk_len": 16, "n_bswa_chunks": want["n_bswa_chunks"], "budget": want["budget"].n,
                       "exact_rows": want["exact_rows"]}
    assert res["settings"]["kvm_effective"]["198"]["n_bswa_chunks"] * 16 == 144 > 198 // 2
    assert res["settings"]["kvm_settings"] == {"auto": "C16-w0.75-e0.75", "exact_heads": "copy"}
    conv = [a for a in res["answers"] if a["ratio"] == 0.5][0]
    assert conv["kept_keys"] == 198
    bp_cli.main(common + ["--out", str(tmp_path / "cal"), "--kvm", "auto", "--ratios", "0.5"])
    res = json.loads((tmp_path / "cal" / "bench.json").read_text())
    chosen = res["settings"]["calibration"]["chosen"]
    assert len(res["settings"]["calibration"]["candidates"]) == 7
    want = split_settings(split_named(chosen), 198)
    assert res["settings"]["kvm_effective"]["198"]["budget"] == want["budget"].n
    assert res["settings"]["kvm_settings"] == {"auto": chosen, "exact_heads": "copy"}
    for bad, msg in (("auto:C99-w0.10-e0.00", "no calibration split called 'C99-w0.10-e0.00'; give one of C32"),
                     ("auto:C16-w0.75-e0.75,exact_rows=4", "'auto' sets budget, chunk_len, n_bswa_chunks, sink_len"),
                     ("auto,chunk_len=8", "--kvm auto,chunk_len=8: 'auto' sets budget"),
                     ("auto:C16-w0.75-e0.75,exact_scope=all", "exact_scope must be one of"),
                     ("auto:,exact_join=1", "give auto, or auto:NAME with NAME one of C32"),
                     ("auto,auto", "'auto' sets budget"),
                     ("auto,keys=300", "keys=N does not apply to a benchmark"),
                     ("auto:C16-w0.75-e0.75,keys=300", "keys=N does not apply to a benchmark")):
        with pytest.raises(UsageError, match=msg):
            bp_cli.main(common + ["--out", str(tmp_path / "bad"), "--kvm", bad])


def test_kvm_auto_takes_other_settings_beside_the_split(model_dir, tmp_path, monkeypatch):
    """``--kvm auto:NAME,exact_scope=first,exact_join=1``: the split's sizes at each kept keys plus those settings,
    as convert_hf gets them and as bench.json records them; ``--kvm auto,...`` calibrates with them."""
    from kvmeans.pretrained.calibrate import split_named, split_settings
    seen = []
    real = bp.kvm_arm
    monkeypatch.setattr(bp, "kvm_arm", lambda model, keys, kvm: seen.append(bp.kvm_settings(keys, kvm)) or
                        real(model, keys, kvm))
    common = ["--model", str(model_dir), "--benches", "niah", "--niah-samples", "1", "--niah-length", "400",
              "--no-progress", "--arms", "kvm", "--max-new-tokens", "2", "--ratios", "0.5"]
    bp_cli.main(common + ["--out", str(tmp_path / "named"), "--kvm", "auto:C16-w0.75-e0.75,exact_scope=first,"
                          "exact_join=1,exact_lead=2"])
    res = json.loads((tmp_path / "named" / "bench.json").read_text())
    assert res["settings"]["kvm_settings"] == {"auto": "C16-w0.75-e0.75", "exact_heads": "copy",
                                               "exact_scope": "first", "exact_join": True, "exact_lead": 2}
    want = split_settings(split_named("C16-w0.75-e0.75"), 198)
    assert seen == [{**want, "exact_scope": "first", "exact_join": True, "exact_lead": 2, "exact_heads": "copy"}]
    assert res["settings"]["kvm_effective"]["198"]["exact_rows"] == want["exact_rows"] > 0
    calls = []
    monkeypatch.setattr(bp_cli, "_calibrated_split", lambda model, tok, base: calls.append(base) or
                        (split_named("C32-w0.50-e0.25"), {"chosen": "C32-w0.50-e0.25"}))
    bp_cli.main(common + ["--out", str(tmp_path / "cal"), "--kvm", "auto,exact_scope=first"])
    assert calls == [{"exact_scope": "first", "exact_heads": "copy"}]
    res = json.loads((tmp_path / "cal" / "bench.json").read_text())
    assert res["settings"]["kvm_settings"] == {"auto": "C32-w0.50-e0.25", "exact_scope": "first",
                                               "exact_heads": "copy"}
    assert seen[-1] == {**split_settings(split_named("C32-w0.50-e0.25"), 198), "exact_scope": "first",
                        "exact_heads": "copy"}


def test_recall_rows_use_kvpress_kept_keys_per_sample(model, tok):
    s = bp.niah_samples(tok, n=2, context_tokens=400, seed=0)
    s[1] = {**s[1], "context_ids": s[1]["context_ids"][:350]}
    made = []
    row, ans = bp.recall_rows("streaming", lambda k: made.append(k) or bp.streaming_arm(model, k, 4), s, tok, 3, 0.75)
    assert made == [int(0.25 * len(s[0]["context_ids"])), int(0.25 * 350)]
    assert [a["kept_keys"] for a in ans] == made and row["kept_keys"] == round(sum(made) / 2)
    assert row["score"] == 0 and row["samples"] == 2 and row["ratio"] == 0.75
    assert row["cache_bytes"] == (made[0] - 1) * PER_KEY


def test_position_buckets_and_ppl_row(model):
    assert bp.position_buckets(2048) == [(1, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert bp.position_buckets(300) == [(1, 256), (256, 300)]
    w = torch.randint(0, 256, (2, 300))
    full = bp.ppl_row(bp.Arm("full", model), w)
    assert full["score"] == pytest.approx(pp.perplexity(model, w), rel=1e-5)
    assert full["cache_bytes"] == 300 * PER_KEY and full["kept_keys"] == 300
    nll = torch.cat([pp.token_nll(model, x[None]) for x in w])
    assert full["ppl_256_300"] == pytest.approx(math.exp(nll[:, 255:].double().mean().item()), rel=1e-5)
    st = bp.ppl_row(bp.streaming_arm(model, 64, 4), w)
    assert st["score"] == pytest.approx(pp.perplexity(model, w, _square_mask(4, 60)(300)), rel=1e-5)
    assert st["cache_bytes"] == 63 * PER_KEY and st["kept_keys"] == 64
    assert st["ppl_1_256"] != pytest.approx(full["ppl_1_256"], rel=1e-6)


def test_merge_kvpress_rescores_and_refuses_other_samples(tok):
    s = bp.niah_samples(tok, n=2, context_tokens=400, seed=0)
    ans = [{"id": x["id"], "sha256": x["sha256"], "arm": "kvpress knorm", "ratio": 0.5, "kept_keys": 100,
            "pred": f" it is {x['answers'][0]}." if i == 0 else " 12.", "correct": True, "new_tokens": 3,
            "cache_bytes": 10, "prefill_s": 1.0, "answer_s": 0.5} for i, x in enumerate(s)]
    rows, got = bp.merge_kvpress({"rows": [], "samples": ans}, s, tok)
    assert len(rows) == 1 and rows[0]["score"] == 1 and rows[0]["arm"] == "kvpress knorm"
    assert [a["correct"] for a in got] == [True, False]          # re-scored here, not trusted
    bad = [dict(ans[0], sha256="0" * 64)]
    with pytest.raises(UsageError, match="--kvpress-results: sample niah-400-0 is not one of this run"):
        bp.merge_kvpress({"rows": [], "samples": bad}, s, tok)


def test_command_writes_samples_table_and_merges(model_dir, tmp_path, capsys, monkeypatch):
    # the runs below ask for the same ppl windows; the first call tokenizes all the plays (7 s), the others reuse it
    from kvmeans.pretrained import ppl
    real_windows, memo = ppl.text_windows, {}

    def text_windows(tok, *args):
        key = (tok.name_or_path, *args)
        if key not in memo:
            memo[key] = real_windows(tok, *args)
        return memo[key]
    monkeypatch.setattr(ppl, "text_windows", text_windows)
    out = tmp_path / "run"
    common = ["--model", str(model_dir), "--out", str(out), "--benches", "niah", "ppl", "--niah-samples", "2",
              "--niah-length", "400", "--ppl-lengths", "300", "--ppl-keys", "80", "--max-new-tokens", "2",
              "--kvm", "chunk_len=8,n_bswa_chunks=2,sink_len=2", "--no-progress"]
    assert bp_cli.main(common + ["--samples-only"]) == 0
    samples = bp.read_samples(out / "samples.jsonl")
    assert len(samples) == 2 and not (out / "bench.json").exists()
    kv = tmp_path / "kvpress.json"
    kv.write_text(json.dumps({"rows": [], "samples": [
        {"id": x["id"], "sha256": x["sha256"], "arm": "kvpress tova", "ratio": 0.75, "kept_keys": 75,
         "pred": "x", "cache_bytes": 75 * PER_KEY, "prefill_s": 1.0, "answer_s": 1.0}
        for x in samples]}))
    assert bp_cli.main(common + ["--kvpress-results", str(kv)]) == 0
    res = json.loads((out / "bench.json").read_text())
    arms = [(r["bench"], r["arm"], r["ratio"]) for r in res["rows"]]
    assert arms == [("niah", "kvpress tova", 0.75), ("niah", "full", None)] + \
        [("niah", a, r) for r in (0.5, 0.75) for a in ("streaming", "kvm")] + \
        [("ppl", a, None) for a in ("full", "streaming", "kvm")]
    assert {a["id"] for a in res["answers"]} == {x["id"] for x in samples}
    assert (out / "bench.csv").read_text().startswith("bench,length,ratio,arm,kept_keys,score")
    printed = capsys.readouterr().out
    assert "kvpress tova" in printed and "x full" in printed
    assert bp_cli.main(common + ["--kvpress-results", str(kv), "--arms"]) == 0          # merge only: no model run
    assert [r["arm"] for r in json.loads((out / "bench.json").read_text())["rows"]] == ["kvpress tova"]
    assert bp_cli.main(common + ["--arms", "kvm", "--ratios", "0.75"]) == 0
    assert [(r["bench"], r["arm"]) for r in json.loads((out / "bench.json").read_text())["rows"]] == \
        [("niah", "kvm"), ("ppl", "kvm")]
    with pytest.raises(SystemExit):
        bp_cli.main(common + ["--ratios", "1.5"])


@pytest.mark.slow
@pytest.mark.skipif(not KVPRESS_PY.exists(), reason="kvpress venv not built (benchmarks/kvpress/setup.sh)")
def test_kvpress_runner_reads_our_samples(tok, tmp_path):
    """The runner (kvpress' venv) answers our samples by id with kvpress' presses, and its file merges here."""
    torch.manual_seed(0)
    # queries in one half-space: kvpress' attention patch masks a key by a fake key that every query misses,
    # and finds none for a random model's queries
    m = LlamaForCausalLM(LlamaConfig(**TINY, attention_bias=True)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.bias.fill_(2.0)
    model_dir = tmp_path / "tiny"
    m.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    s = bp.niah_samples(tok, n=2, context_tokens=400, seed=0)
    bp.write_samples(tmp_path / "s.jsonl", s)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(KVPRESS_PY), str(RUNNER), "--samples", str(tmp_path / "s.jsonl"), "--model", str(model_dir),
                    "--out", str(tmp_path / "kv"), "--presses", "none", "knorm", "adakv_expected_attention",
                    "--ratios", "0.5", "--max-new-tokens", "3"], check=True, env=env, capture_output=True)
    res = json.loads((tmp_path / "kv" / "kvpress.json").read_text())
    assert res["settings"]["tokenizer_mismatches"] == []
    n = len(s[0]["context_ids"])
    # AdaKV masks keys instead of dropping them: it holds the whole cache and is counted by its masks
    assert [r["kept_keys"] for r in res["rows"]] == [n, n // 2, n // 2]
    assert res["rows"][2]["cache_bytes"] == res["rows"][0]["cache_bytes"] > res["rows"][1]["cache_bytes"]
    rows, _ = bp.merge_kvpress(res, s, tok)
    assert [r["arm"] for r in rows] == ["kvpress none", "kvpress knorm", "kvpress adakv_expected_attention"]
    # no compression in kvpress == our full arm on the same ids
    full = bp.answer(bp.Arm("full", LlamaForCausalLM.from_pretrained(model_dir).eval()), s[0]["context_ids"],
                     s[0]["question_ids"], 3, stop={257})
    assert res["samples"][0]["pred"] == tok.decode(full["ids"], skip_special_tokens=True)
    assert sys.executable != str(KVPRESS_PY)


def test_routed_through_kvmeans_bench(tmp_path, capsys):
    from kvmeans.cli import main as cli
    # routed to this command: a one-line --model error
    assert cli(["bench", "pretrained", "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmeans bench pretrained: error: --model") and err.count("\n") == 1, err
