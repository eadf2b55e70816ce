"""Loss by position: document selection in KVMTOK1 files (concat / cram / windows), segmented +
chunked-logits loss == one full forward, block statistics, JSON/CSV/PNG outputs, CLI errors."""
import csv
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvmeans.cli import main as kvmeans_cli  # noqa: E402
from kvmeans.eval.position_loss import block_stats, document_spans, open_token_data, per_position_nll  # noqa: E402
from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.hf import KVMForCausalLM  # noqa: E402
from kvmeans.train.data import TokenFile, write_token_file  # noqa: E402
from kvmeans.utils.testing import perturb_identity_init  # noqa: E402

V, EOS = 64, 0
ARCHS = {"kvm": dict(), "kvm+swa": dict(alt_mixer="swa", alt_every=2), "full": dict(mixer="full")}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)         # tiny matmuls on a shared 2-core machine
    yield
    torch.set_num_threads(n)


def tiny(arch="kvm", seed=0) -> KVMForCausalLM:
    torch.manual_seed(seed)
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, chunk_len=8,
                                         n_bswa_chunks=2, budget={"kind": "power_law", "factor": 2.0, "min_len": 8},
                                         swa_window=8, **ARCHS[arch]))
    perturb_identity_init(lm)   # the paper init makes blocks the identity
    return KVMForCausalLM.from_language_model(lm).eval()


def docs(lengths, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(1, V, size=n) for n in lengths]


def write_concat(path, lengths, seed=0):
    toks = np.concatenate([np.append(d, EOS) for d in docs(lengths, seed)])
    write_token_file(path, toks, vocab_size=V, tokenizer_id="test", eos_id=EOS, packing="concat")
    return TokenFile(path)


# ---- documents ----------------------------------------------------------------------------------
def test_document_spans_concat(tmp_path):
    tf = write_concat(tmp_path / "d.bin", [10, 70, 3, 65, 66, 100])
    spans, info = document_spans(tf, 66)
    offs = np.cumsum([0] + [n + 1 for n in [10, 70, 3, 65, 66, 100]])
    assert spans == [(int(offs[1]), 70), (int(offs[4]), 66), (int(offs[5]), 100)]
    assert info == {"mode": "eos", "eos_id": EOS, "documents": 6, "long_enough": 3, "longest": 100}
    assert all(EOS not in np.asarray(tf.tokens[a:a + n]) for a, n in spans)
    assert document_spans(tf, 66, max_docs=2)[0] == spans[:2]
    # windows: consecutive ctx + 1 slices of the stream, boundaries ignored
    w, winfo = document_spans(tf, 66, windows=True)
    assert w == [(i * 66, 66) for i in range(len(tf) // 66)] and winfo["mode"] == "windows"


def test_document_spans_cram_cut_at_windows(tmp_path):
    # cram windows of 41 tokens: a window holding one long document has no EOS, the next one must
    # not be glued to it
    a, b, c = docs([41, 41, 12], seed=3)
    toks = np.concatenate([a, b, np.append(c, EOS), docs([28], seed=4)[0]])
    write_token_file(tmp_path / "c.bin", toks, vocab_size=V, tokenizer_id="t", eos_id=EOS, packing="cram", seq_len=40)
    spans, info = document_spans(TokenFile(tmp_path / "c.bin"), 30)
    assert spans == [(0, 41), (41, 41)] and info["longest"] == 41


# ---- numerics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_segmented_chunked_loss_equals_one_full_forward(arch):
    model = tiny(arch)
    rows = torch.from_numpy(np.stack(docs([61, 61], seed=5))).long()
    x, y = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").double()
    for segment, chunk in [(60, 60), (13, 5), (8, 7), (1000, 256)]:
        got = per_position_nll(model, x, y, segment=segment, logits_chunk=chunk)
        assert got.shape == (2, 60) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # also takes the bare KVMLanguageModel
    torch.testing.assert_close(per_position_nll(KVMLanguageModel(model.config.to_model_config()), x, y, 16, 4).shape,
                               torch.Size([2, 60]))


def test_block_stats_weighted_and_partial_last_block():
    b = block_stats([1.0, 3.0, 2.0, 2.0, 5.0], [1, 1, 2, 2, 1], 2)
    assert b["start"] == [0, 2, 4] and b["end"] == [2, 4, 5] and b["count"] == [2, 4, 1]
    assert b["sum"] == [4.0, 4.0, 5.0] and b["mean"] == [2.0, 1.0, 5.0]


# ---- command ------------------------------------------------------------------------------------
def test_cli_two_models_writes_json_csv_png(tmp_path, capsys):
    data = tmp_path / "data"
    write_concat(data / "val.bin", [40, 70, 90, 20, 67], seed=1)
    dirs = []
    for arch in ("kvm", "full"):
        tiny(arch).save_pretrained(tmp_path / arch)
        dirs += ["--model", str(tmp_path / arch)]
    out = tmp_path / "out"
    rc = kvmeans_cli(["eval", "position-loss", *dirs, "--label", "KVM", "--label", "GPTA", "--data", str(data),
                      "--ctx", "64", "--block", "16", "--segment", "24", "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "KVM" in printed and "GPTA" in printed and "48-63" in printed
    res = json.loads((out / "position_loss.json").read_text())
    assert res["config"]["num_docs"] == 3 and res["config"]["ctx"] == 64
    tf = open_token_data(data)
    spans, _ = document_spans(tf, 65)
    for r, arch in zip(res["models"], ("kvm", "full")):
        assert r["label"] == {"kvm": "KVM", "full": "GPTA"}[arch] and r["num_docs"] == 3
        pp = r["per_position"]
        assert len(pp["sums"]) == 64 and pp["counts"] == [3] * 64
        # the sums are those of one full forward per document
        model = KVMForCausalLM.from_pretrained(tmp_path / arch).eval()
        want = np.zeros(64)
        for a, _ in spans:
            ids = torch.from_numpy(np.asarray(tf.tokens[a:a + 65], dtype=np.int64))[None]
            with torch.no_grad():
                lg = model(ids[:, :-1], use_cache=False).logits[0]
            want += torch.nn.functional.cross_entropy(lg, ids[0, 1:], reduction="none").double().numpy()
        np.testing.assert_allclose(pp["sums"], want, rtol=1e-5, atol=1e-5)
        assert r["blocks"]["start"] == [0, 16, 32, 48] and r["blocks"]["count"] == [48] * 4
        np.testing.assert_allclose(r["blocks"]["mean"], want.reshape(4, 16).sum(1) / 48, rtol=1e-6)
        assert r["mean_loss"] == pytest.approx(want.sum() / (3 * 64), rel=1e-6)
    rows = list(csv.DictReader(open(out / "position_loss.csv")))
    assert len(rows) == 8 and rows[0]["label"] == "KVM" and rows[0]["block_start"] == "0"
    assert float(rows[-1]["mean_loss"]) == pytest.approx(res["models"][1]["blocks"]["mean"][-1])
    png = (out / "position_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_cli_errors_name_the_argument(tmp_path, capsys):
    write_concat(tmp_path / "short.bin", [10, 30, 20])
    tiny().save_pretrained(tmp_path / "m")
    base = ["eval", "position-loss", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]
    assert kvmeans_cli(base + ["--data", str(tmp_path / "short.bin"), "--ctx", "64"]) == 2
    err = capsys.readouterr().err
    assert "--ctx" in err and "longest has 30" in err and "--windows" in err
    assert kvmeans_cli(base + ["--data", str(tmp_path / "nope.bin")]) == 2
    assert "--data" in capsys.readouterr().err
    assert kvmeans_cli(base + ["--data", str(tmp_path), "--ctx", "8"]) == 2          # folder without val.bin
    assert "val.bin" in capsys.readouterr().err
    big = tmp_path / "big.bin"
    write_token_file(big, np.arange(200) % 100, vocab_size=100, tokenizer_id="t", eos_id=None)
    assert kvmeans_cli(base + ["--data", str(big), "--ctx", "16", "--block", "8"]) == 2   # vocab 100 > 64
    assert "embeddings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvmeans_cli(base + ["--data", str(big), "--label", "a", "--label", "b"])
    assert not (tmp_path / "o").exists()
