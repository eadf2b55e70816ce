"""benchmarks/pretrained_schedules.py: full attention vs KVM fixed vs KVM sqrt(N) on one converted model."""
import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.eval.test_ruler_tasks import _with_byte_tokenizer  # noqa: E402

pytest.importorskip("transformers")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrained_schedules.py"
_spec = importlib.util.spec_from_file_location("pretrained_schedules", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

KVM = "chunk_len=32,n_bswa_chunks=2,sink_len=4"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=0, pad_token_id=0,
                                         max_position_embeddings=4096))
    return _with_byte_tokenizer(llama.eval(), tmp_path_factory.mktemp("schedules") / "llama")


def test_arms_share_the_samples_and_the_memory_shows_the_trade_off(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench.main(["--model", str(llama_dir), "--tasks", "niah_multikey_2", "--lengths", "1024", "2048",
                       "--samples", "2", "--max-new-tokens", "2", "--fixed", "32", "--kvm", KVM, "--out", str(out),
                       "--no-progress"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "schedules.json").read_text())
    labels = ["full attention", "KVM fixed:32", "KVM 1*sqrt(N)"]
    assert list(res["arms"]) == labels
    assert [res["arms"][k]["spec"] for k in labels] == [None, KVM + ",budget=fixed:32", KVM + ",budget=power_law:1:0.5"]
    conv = res["arms"]["KVM fixed:32"]["kvm_conversion"]
    assert conv["budget"]["kind"] == "fixed" and conv["budget"]["n"] == 32 and conv["chunk_len"] == 32
    assert res["arms"]["KVM 1*sqrt(N)"]["kvm_conversion"]["budget"]["kind"] == "power_law"
    assert res["arms"]["full attention"]["kvm_conversion"] is None
    hashes = {k: [s["input_sha256"] for s in a["samples"]] for k, a in res["arms"].items()}
    assert len(hashes[labels[0]]) == 4 and hashes[labels[0]] == hashes[labels[1]] == hashes[labels[2]]
    nb = {k: {int(n): b for n, b in a["cache_bytes"].items()} for k, a in res["arms"].items()}
    assert nb["full attention"][2048] == 2 * nb["full attention"][1024]          # a KV cache: linear
    assert nb["KVM fixed:32"][2048] == nb["KVM fixed:32"][1024] < nb["full attention"][1024]   # flat
    assert nb["KVM fixed:32"][2048] < nb["KVM 1*sqrt(N)"][2048] < nb["KVM 1*sqrt(N)"][1024] * 2  # grows, sublinearly
    for label in labels:
        assert label in printed
    firsts = [line[22:32].strip() for line in printed.splitlines()]
    assert firsts.count("NIAH-MK2") == firsts.count("mean") == firsts.count("cache KB") == 3
    rows = list(csv.DictReader((out / "schedules.csv").open()))
    assert len(rows) == 6 and {r["arm"] for r in rows} == set(labels)
    assert {int(r["cache_bytes"]) for r in rows if r["arm"] == "KVM fixed:32"} == {nb["KVM fixed:32"][1024]}
    assert res["table"] in printed


def test_a_budget_in_kvm_or_a_spec_that_cannot_apply_is_refused_before_any_arm(llama_dir, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.setattr(bench, "run_ruler", lambda *a, **k: pytest.fail("an arm ran before every spec was checked"))
    with pytest.raises(SystemExit):
        bench.main(["--model", str(llama_dir), "--kvm", "budget=fixed:64", "--out", str(tmp_path)])
    assert "leave the budget out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--model", str(llama_dir), "--kvm", "no_such_setting=1", "--out", str(tmp_path)])
    assert "--kvm no_such_setting=1" in capsys.readouterr().err
    # the fixed arm's 32 rows cannot hold 32 exact rows beside a chunk of 32: refused before the full arm runs
    assert bench.main(["--model", str(llama_dir), "--fixed", "32", "--kvm", KVM + ",exact_rows=32", "--out",
                       str(tmp_path / "o"), "--no-progress"]) == 2
    assert "exact_rows must be in [0, budget - chunk_len = 0]" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert bench.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--arms", "fixed",
                       "--no-progress"]) == 2
    assert "--model" in capsys.readouterr().err and not (tmp_path / "o").exists()
