"""``--kvm SPEC`` on the eval commands: a plain transformers folder converted on the fly (tiny random Llama)."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from kvmeans.cli.eval import main as eval_main  # noqa: E402
from kvmeans.train.tokenizers import gpt2_hf_tokenizer  # noqa: E402

WIDE = "budget=fixed:64,chunk_len=256,n_bswa_chunks=4,sink_len=4"      # window covers every input: exact
SMALL = "budget=fixed:8,chunk_len=8,n_bswa_chunks=2,sink_len=2"


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvmtext")
    paths = []
    for i in range(2):
        p = d / f"doc{i}.txt"
        p.write_text(" ".join(f"word{(i * 7 + j * 13) % 97}" for j in range(400)), encoding="utf-8")
        paths.append(str(p))
    return paths


def _ppl(llama_dir, texts, out, *extra):
    assert eval_main(["ppl", "--model", str(llama_dir), "--length", "64", "--windows", "2", "--arms", "full",
                      "--text", *texts, "--out", str(out), *extra]) == 0
    return json.loads((out / "ppl.json").read_text())


def test_ppl_kvm_arm_equals_full_inside_the_window_and_differs_with_a_small_budget(llama_dir, texts, tmp_path):
    wide = _ppl(llama_dir, texts, tmp_path / "wide", "--kvm", WIDE)
    full, kvm = wide["rows"]
    assert kvm["arm"] == "kvm" and kvm["ppl"] == pytest.approx(full["ppl"], rel=1e-7)
    assert wide["settings"]["kvm"] == WIDE and wide["settings"]["kvm_conversion"]["chunk_len"] == 256
    small = _ppl(llama_dir, texts, tmp_path / "small", "--kvm", SMALL)
    full, kvm = small["rows"]
    assert abs(kvm["ppl"] / full["ppl"] - 1) > 1e-6        # random weights: near-uniform, small but real
    assert kvm["kept_keys"] == 8 + 16 and full["kept_keys"] == 64
    assert "kvm" in (tmp_path / "small" / "ppl.csv").read_text()


@pytest.mark.parametrize("cmd", ["ppl", "niah"])
def test_bad_spec_is_one_line_exit_2_before_loading(cmd, llama_dir, tmp_path, capsys):
    assert eval_main([cmd, "--model", str(llama_dir), "--kvm", "budget=fixed:8,bogus=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kvm" in err[0] and "bogus" in err[0]


def _niah(model_dir, out, *extra):
    assert eval_main(["niah", "--model", str(model_dir), "--tasks", "niah_single_1", "--lengths", "256",
                      "--samples", "3", "--max-new-tokens", "4", "--no-progress", "--out", str(out), *extra]) == 0
    return json.loads((out / "niah.json").read_text())


def test_niah_kvm_equals_the_plain_model_inside_the_window(llama_dir, tmp_path):
    plain = _niah(llama_dir, tmp_path / "plain", "--batch-size", "1")
    wide = _niah(llama_dir, tmp_path / "wide", "--batch-size", "3", "--kvm", WIDE)
    assert [s["pred"] for s in wide["samples"]] == [s["pred"] for s in plain["samples"]]
    assert wide["config"]["kvm"] == WIDE and wide["config"]["kvm_conversion"]["n_bswa_chunks"] == 4
    assert plain["config"]["kvm"] is None and plain["config"]["kvm_conversion"] is None


def test_saved_converted_folder_loads_converted_and_refuses_a_second_spec(llama_dir, tmp_path, capsys):
    from kvmeans.models.load import load_model
    from kvmeans.utils.args import parse_kvm_arg
    model = load_model(str(llama_dir), torch.float32, "cpu", parse_kvm_arg(SMALL))
    conv = tmp_path / "converted"
    model.save_pretrained(conv)
    gpt2_hf_tokenizer().save_pretrained(conv)
    got = _niah(conv, tmp_path / "out")
    assert got["config"]["kvm"] is None and got["config"]["kvm_conversion"]["budget"]["n"] == 8
    capsys.readouterr()
    assert eval_main(["niah", "--model", str(conv), "--lengths", "256", "--kvm", SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "converted already" in err[0] and "drop --kvm" in err[0]


def test_kvm_native_model_refuses_a_spec(tmp_path, capsys):
    from kvmeans.models import KVMLanguageModel, KVMModelConfig
    from kvmeans.models.hf import KVMForCausalLM
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=50257, hidden_size=32, num_layers=1, num_heads=2,
                                         num_kv_heads=1, chunk_len=32, n_bswa_chunks=2))
    KVMForCausalLM.from_language_model(lm).save_pretrained(tmp_path / "kvm")
    gpt2_hf_tokenizer().save_pretrained(tmp_path / "kvm")
    assert eval_main(["niah", "--model", str(tmp_path / "kvm"), "--lengths", "256", "--kvm", SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a KVM model already" in err[0]


def _position_loss(llama_dir, tmp_path, name, *extra):
    from kvmeans.train.data import write_token_file
    data = tmp_path / "data" / "val.bin"
    if not data.exists():
        toks = torch.randint(1, 1000, (200,), generator=torch.Generator().manual_seed(0)).numpy()
        write_token_file(data, toks, vocab_size=50257, tokenizer_id="test", eos_id=None, packing="concat")
    out = tmp_path / name
    assert eval_main(["position-loss", "--model", str(llama_dir), "--data", str(data.parent), "--ctx", "64",
                      "--block", "16", "--segment", "24", "--batch-size", "2", "--windows", "--out", str(out),
                      *extra]) == 0
    return json.loads((out / "position_loss.json").read_text())


def test_position_loss_on_a_plain_model_and_with_kvm(llama_dir, tmp_path):
    plain = _position_loss(llama_dir, tmp_path, "plain")
    model = LlamaForCausalLM.from_pretrained(llama_dir).eval()     # segments with a cache = one forward
    toks = torch.randint(1, 1000, (200,), generator=torch.Generator().manual_seed(0))
    ids = torch.stack([toks[s:s + 65] for s in (0, 65, 130)])
    with torch.no_grad():
        want = F.cross_entropy(model(ids[:, :-1]).logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(0)
    torch.testing.assert_close(torch.tensor(plain["models"][0]["per_position"]["sums"], dtype=torch.float64),
                               want.double(), rtol=1e-5, atol=1e-5)
    wide = _position_loss(llama_dir, tmp_path, "wide", "--kvm", WIDE)
    small = _position_loss(llama_dir, tmp_path, "small", "--kvm", SMALL)
    sums = {k: torch.tensor(r["models"][0]["per_position"]["sums"]) for k, r in
            (("plain", plain), ("wide", wide), ("small", small))}
    torch.testing.assert_close(sums["wide"], sums["plain"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sums["small"][24:], sums["plain"][24:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums["small"][:16], sums["plain"][:16], rtol=1e-5, atol=1e-5)   # inside the window
    assert wide["config"]["kvm"] == WIDE and wide["models"][0]["kvm_conversion"]["chunk_len"] == 256
    assert plain["models"][0]["kvm_conversion"] is None


def _memory(llama_dir, tmp_path, name, *extra):
    out = tmp_path / name
    assert eval_main(["memory", "--model", str(llama_dir), "--lengths", "64", "256", "--decode-tokens", "2",
                      "--out", str(out), *extra]) == 0
    return json.loads((out / "memory.json").read_text())


def test_memory_of_a_plain_model_is_its_kv_cache_and_with_kvm_stays_bounded(llama_dir, tmp_path):
    plain = _memory(llama_dir, tmp_path, "plain")["models"][0]
    for r in plain["results"]:      # a plain cache holds exactly every key and value
        assert r["cache_bytes"] == r["full_attn_kv_bytes"] == 2 * 2 * 1 * 2 * r["N"] * 8 * 4
        assert [x["kv_rows"] for x in r["layers"]] == [r["N"]] * 2
    got = _memory(llama_dir, tmp_path, "small", "--kvm", SMALL)
    small = got["models"][0]
    assert got["config"]["kvm"] == SMALL and small["kvm_conversion"]["budget"]["n"] == 8
    assert small["mixers"] == ["kvm", "kvm"] and "fixed" in small["budget"]
    at64, at256 = small["results"]
    assert at64["state_rows"] == at256["state_rows"] == 8
    assert at256["cache_bytes"] < at256["full_attn_kv_bytes"] / 4
    assert at256["cache_bytes"] == at64["cache_bytes"]          # flat: rows and window, not N


def test_memory_kvm_refuses_presets(capsys):
    assert eval_main(["memory", "--preset", "tiny-cpu", "--kvm", SMALL]) == 2
    assert "presets are KVM models already" in capsys.readouterr().err


def _lm_eval(pretrained, batch_size=3, **kw):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from pathlib import Path

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvmeans.eval.harness as H
    toy = Path(__file__).parents[1] / "data" / "lmeval_toy"
    lm = H.KVMLM(pretrained=str(pretrained), batch_size=batch_size, device="cpu", **kw)
    res = simple_evaluate(model=lm, tasks=["kvm_toy_mc", "kvm_toy_gen"], log_samples=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(toy), include_defaults=False))
    return lm, {t: [s["resps"] for s in sorted(res["samples"][t], key=lambda s: s["doc_id"])]
                for t in ("kvm_toy_mc", "kvm_toy_gen")}


def test_lm_eval_kvm_converts_a_plain_folder_and_matches_it_inside_the_window(llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plain_lm, plain = _lm_eval(llama_dir)
    wide_lm, wide = _lm_eval(llama_dir, kvm=WIDE)
    assert getattr(plain_lm.model.config, "kvm_conversion", None) is None
    assert wide_lm.model.config.kvm_conversion["chunk_len"] == 256
    assert wide["kvm_toy_gen"] == plain["kvm_toy_gen"]
    for a, b in zip(wide["kvm_toy_mc"], plain["kvm_toy_mc"]):
        assert [x[0][0] for x in a] == pytest.approx([x[0][0] for x in b], rel=1e-5)


def test_lm_eval_kvm_flag_becomes_a_model_arg_and_a_bad_spec_is_one_line(llama_dir, capsys):
    from kvmeans.cli.eval_lm_eval import translate_args
    assert translate_args(["--model", str(llama_dir), "--kvm", SMALL, "--tasks", "x"]) == \
        ["run", "--model", "kvm", "--model_args", f"pretrained={llama_dir}", "--model_args", f'kvm="{SMALL}"',
         "--tasks", "x"]
    assert eval_main(["lm-eval", "--model", str(llama_dir), "--kvm", "bogus=1", "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kvm bogus=1" in err[0]


def test_generate_kvm_on_a_plain_folder_reports_a_bounded_cache(llama_dir, capsys):
    from kvmeans.cli import main as kvmeans_cli
    prompt = " ".join(f"word{i}" for i in range(60))
    sizes = {}
    for name, extra in (("plain", []), ("small", ["--kvm", SMALL])):
        assert kvmeans_cli(["generate", "--model", str(llama_dir), "--prompt", prompt, "--max-new-tokens", "8",
                            *extra]) == 0
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[cache:")][0]
        sizes[name] = line
    n = len(gpt2_hf_tokenizer()(prompt)["input_ids"]) + 7          # the last token is not fed back
    assert f"{n} tokens seen" in sizes["plain"] and f"{n} tokens seen" in sizes["small"]
    assert sizes["plain"].startswith(f"[cache: {2 * 2 * 2 * n * 8 * 4 / 1024:.1f} KiB")
    kib = {k: float(v.split()[1]) for k, v in sizes.items()}
    assert sizes["small"].split()[2] == "KiB," and kib["small"] < kib["plain"] / 3     # 8 rows + window, not n
