"""transformers adapter: generate() (greedy, sampling, beams) == full recomputation, padding, the
KVMCache API, save/load (ours and the authors' layout), Auto classes, `kvmeans generate/convert`."""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from kvmeans.cli import main as cli  # noqa: E402
from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.hf import KVMConfig, KVMForCausalLM  # noqa: E402
from kvmeans.models.hf_cache import KVMCache  # noqa: E402
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.models.reference_checkpoint import (  # noqa: E402
    build_tiny_reference_checkpoint,
    convert_reference_checkpoint,
    read_converted_checkpoint,
)
from kvmeans.utils.testing import perturb_identity_init  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, chunk_len=8,
            n_bswa_chunks=2, budget={"kind": "fixed", "n": 16}, swa_window=8, bswa_chunks=2, bswa_sink_len=2,
            ovq_chunk_len=8, ovq_max_centroids=12)
ARCHS = {"kvm": dict(), "kvm+swa": dict(alt_mixer="swa", alt_every=2), "full": dict(mixer="full"),
         "bswa": dict(mixer="bswa"), "ovq+swa": dict(mixer="ovq", alt_mixer="swa", alt_every=2)}
GREEDY = dict(do_sample=False, pad_token_id=0)


def tiny(arch="kvm", seed=0, **overrides) -> KVMForCausalLM:
    torch.manual_seed(seed)
    lm = KVMLanguageModel(KVMModelConfig(**{**TINY, **ARCHS[arch], **overrides}))
    perturb_identity_init(lm)   # the paper init makes blocks the identity
    return KVMForCausalLM.from_language_model(lm).eval()


def left_pad(seqs, pad=0):
    """``([B, L] ids, [B, L] mask)`` with the sequences right-aligned."""
    L = max(len(s) for s in seqs)
    ids, mask = torch.full((len(seqs), L), pad), torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = s, 1
    return ids, mask


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (n,), generator=g) for n in lengths]


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


# ---- generate() against full recomputation ------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generate_equals_argmax_loop_on_full_forwards(arch):
    model, ids = tiny(arch), torch.stack(prompts([11, 11]))
    out = model.generate(ids, max_new_tokens=14, **GREEDY)      # 25 tokens: crosses 3 chunk boundaries
    cur = ids
    for _ in range(14):
        cur = torch.cat([cur, full_logits(model, cur)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, cur)


def test_sampling_is_reproducible_and_equals_uncached_sampling():
    model, ids = tiny("kvm+swa"), torch.stack(prompts([6, 6]))
    kw = dict(do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=12, pad_token_id=0)
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(123)
        runs.append(model.generate(ids, use_cache=use_cache, **kw))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert runs[0].shape == (2, 18) and int(runs[0].max()) < 64


@pytest.mark.parametrize("arch", ["kvm", "ovq+swa"])
def test_beam_search_with_cache_reordering_equals_uncached_beam_search(arch, monkeypatch):
    model = tiny(arch)
    ids, mask = left_pad(prompts([5, 9]))
    calls = []
    orig = KVMCache.reorder_cache
    monkeypatch.setattr(KVMCache, "reorder_cache", lambda self, idx: (calls.append(idx.clone()), orig(self, idx))[1])
    kw = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=10, **GREEDY)
    cached = model.generate(ids, **kw)
    assert len(calls) >= 9 and any(not torch.equal(c, torch.arange(len(c))) for c in calls)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))
    assert cached.shape == (4, 19) and int(cached.max()) < 64
    one = model.generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=10, **GREEDY)
    assert torch.equal(one, model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY))


@pytest.mark.parametrize("grouped", [False, True])
def test_reorder_cache_moves_every_layer_state(grouped):
    model, seqs = tiny("kvm+swa"), prompts([12, 12, 12] if not grouped else [12, 7, 12])
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        cache = cache_from(model(ids, attention_mask=mask))
        assert len(cache.groups) == (2 if grouped else 1)
        idx = torch.tensor([2, 0, 0, 1])
        cache.reorder_cache(idx)
        nxt = torch.tensor([[5], [6], [7], [8]])
        got = model(nxt, attention_mask=torch.cat([mask[idx], torch.ones(4, 1, dtype=torch.long)], 1),
                    **cache_kwargs(cache)).logits[:, -1]
    for j, i in enumerate(idx.tolist()):
        want = full_logits(model, torch.cat([seqs[i], nxt[j]])[None])[0, -1]
        torch.testing.assert_close(got[j], want, rtol=1e-4, atol=1e-5)
    assert cache.batch_size == 4 and cache.lengths.tolist() == [len(seqs[i]) + 1 for i in idx.tolist()]


# ---- padding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["kvm", "kvm+swa", "bswa", "ovq+swa"])
def test_left_padded_batch_generation_equals_per_sequence(arch):
    model, seqs = tiny(arch), prompts([4, 13, 9, 13])
    ids, mask = left_pad(seqs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=10, **GREEDY)
        assert torch.equal(out[i, ids.shape[1]:], alone[0, len(s):]), f"row {i}"


@pytest.mark.parametrize("arch", ["kvm", "full", "ovq+swa"])
def test_right_padded_scoring_equals_per_sequence(arch):
    model, seqs = tiny(arch), prompts([7, 19, 12])
    L = max(len(s) for s in seqs)
    ids, mask = torch.zeros(3, L, dtype=torch.long), torch.zeros(3, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
    total, count = 0.0, 0
    for i, s in enumerate(seqs):
        want = full_logits(model, s[None])[0]
        torch.testing.assert_close(out.logits[i, :len(s)], want, rtol=1e-4, atol=1e-5)
        assert not out.logits[i, len(s):].any()                       # pads: zero logits
        total += torch.nn.functional.cross_entropy(want[:-1], s[1:], reduction="sum").item()
        count += len(s) - 1
    assert out.logits.dtype == torch.float32 and cache_from(out) is None   # labels: no cache by default
    assert out.loss.item() == pytest.approx(total / count, rel=1e-4)


def test_multi_token_continuation_equals_full_forward():
    model, seqs = tiny("kvm+swa"), prompts([30, 22])
    with torch.no_grad():                      # no padding: splits 7 + 9 + 1 + 13
        ids = torch.stack([seqs[0], seqs[0].flip(0)])
        parts, cache = [], None
        for a, b in ((0, 7), (7, 16), (16, 17), (17, 30)):
            out = model(ids[:, a:b], **cache_kwargs(cache))
            parts.append(out.logits)
            cache = cache_from(out)
        torch.testing.assert_close(torch.cat(parts, 1), full_logits(model, ids), rtol=1e-4, atol=1e-5)
        assert cache.get_seq_length() == 30 and cache.to_model_cache().seen_tokens == 30
        # left-padded prefill, then a multi-token continuation with the mask extended
        ids, mask = left_pad([seqs[0][:9], seqs[1][:16]])
        cache = cache_from(model(ids, attention_mask=mask))
        more = torch.stack([seqs[0][9:14], seqs[1][16:21]])
        mask2 = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1)
        got = model(more, attention_mask=mask2, **cache_kwargs(cache)).logits
    for i, n in enumerate((14, 21)):
        torch.testing.assert_close(got[i], full_logits(model, seqs[i][None, :n])[0, -5:], rtol=1e-4, atol=1e-5)


def test_generate_continues_a_returned_cache():
    model, ids = tiny("kvm"), torch.stack(prompts([6, 6]))
    first = model.generate(ids, max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    again = model.generate(first.sequences, **cache_kwargs(cache_from(first)), max_new_tokens=6, **GREEDY)
    assert torch.equal(again, model.generate(ids, max_new_tokens=11, **GREEDY))


def test_chunked_prefill_and_a_user_dynamic_cache_give_the_same_tokens():
    model = tiny("kvm+swa")
    ids, mask = left_pad(prompts([5, 19]))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    assert torch.equal(want, model.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=4,
                                            **GREEDY))
    extra = torch.zeros(2, 4, dtype=torch.long)    # over-padded: the first prefill chunk is all pads
    over = model.generate(torch.cat([extra, ids], 1), attention_mask=torch.cat([extra, mask], 1), max_new_tokens=6,
                          prefill_chunk_size=4, **GREEDY)
    assert torch.equal(over[:, 4:], want)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **cache_kwargs(DynamicCache()),
                         return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, want) and isinstance(cache_from(out), KVMCache)


def test_cache_api_memory_and_refusals():
    model = tiny("kvm+swa")
    out = model(torch.stack(prompts([20, 20])))
    cache = cache_from(out)
    assert isinstance(cache, KVMCache) and len(cache) == 4 and cache.get_seq_length() == 20
    report = cache.report()
    assert [r["mixer"] for r in report] == ["swa", "kvm", "swa", "kvm"]
    assert cache.nbytes == sum(r["nbytes"] for r in report) == sum(layer.nbytes for layer in cache.layers) > 0
    assert "total" in cache.summary()
    cache.crop(0)
    with pytest.raises(ValueError, match="activate_past_recording"):   # rollback needs recording on
        cache.crop(-1)
    assert cache_from(model(torch.tensor([[1, 2]]), **cache_kwargs(DynamicCache()))).get_seq_length() == 2
    with pytest.raises(TypeError, match="KVMCache"):
        model(torch.tensor([[1]]), **cache_kwargs(_non_empty_dynamic_cache()))
    one = cache_from(model(torch.tensor([[1]])))
    with pytest.raises(ValueError, match="attention_mask has 3 columns"):
        model(torch.tensor([[1]]), attention_mask=torch.ones(1, 3), **cache_kwargs(one))
    with pytest.raises(NotImplementedError):
        model(inputs_embeds=torch.zeros(1, 2, 32))
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4 and cache.to_model_cache().batch_size == 4
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes == 0


def _non_empty_dynamic_cache():
    c = DynamicCache()
    c.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    return c


# ---- save / load ----------------------------------------------------------------------------------
def test_save_pretrained_round_trip_and_auto_classes(tmp_path):
    from safetensors.torch import load_file
    model, ids = tiny("kvm+swa"), torch.stack(prompts([10, 10]))
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert keys == set(dict(model.named_parameters())) and all(k.split(".")[0] in ("transformer", "lm_head")
                                                                for k in keys)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kvmeans"
    assert isinstance(AutoConfig.from_pretrained(tmp_path), KVMConfig)
    for cls in (KVMForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path)
        assert type(loaded) is KVMForCausalLM and not loaded.training
        assert loaded.config.to_model_config() == model.config.to_model_config()
        assert torch.equal(full_logits(loaded, ids), full_logits(model, ids))


def test_tied_embeddings_round_trip(tmp_path):
    model = tiny("kvm", tie_embeddings=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(tmp_path)
    loaded = KVMForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = torch.stack(prompts([9]))
    assert torch.equal(full_logits(loaded, ids), full_logits(model, ids))


def _reference_path_logits(ref_dir, tmp_path, ids):
    """The authors' checkpoint through convert.py and KVMLanguageModel (fp32)."""
    convert_reference_checkpoint(ref_dir, tmp_path / "via-convert")
    config, sd = read_converted_checkpoint(tmp_path / "via-convert")
    lm = KVMLanguageModel(config)
    lm.load_state_dict({k: v.float() for k, v in sd.items()})
    with torch.no_grad():
        return lm.eval()(ids)[0]


@pytest.mark.parametrize("flags", [{}, dict(alt_layer_every=2, alt_token_mixer="swa")])
def test_authors_layout_loads_with_from_pretrained(tmp_path, flags):
    ref = tmp_path / "ref"
    build_tiny_reference_checkpoint(ref, seed=3, **flags)
    ids = torch.randint(0, 128, (2, 21))
    model = KVMForCausalLM.from_pretrained(ref, dtype=torch.float32)
    assert type(model) is KVMForCausalLM and model.dtype == torch.float32 and not model.training
    assert torch.equal(full_logits(model, ids), _reference_path_logits(ref, tmp_path, ids))
    assert KVMForCausalLM.from_pretrained(ref).dtype == torch.bfloat16     # "auto": as stored
    assert model.generate(ids, max_new_tokens=3, **GREEDY).shape == (2, 24)


def test_cli_convert_then_from_pretrained(tmp_path, capsys):
    ref, dst = tmp_path / "ref", tmp_path / "ours"
    build_tiny_reference_checkpoint(ref, seed=4)
    assert cli(["convert", str(ref), str(dst)]) == 0
    assert "loads with KVMForCausalLM.from_pretrained" in capsys.readouterr().out
    ids = torch.randint(0, 128, (1, 17))
    model = KVMForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert torch.equal(full_logits(model, ids), _reference_path_logits(ref, tmp_path, ids))
    # a user mistake: one line, exit 2
    assert cli(["convert", str(tmp_path / "missing"), str(tmp_path / "x"), "--no-check"]) == 2


def test_cli_generate_smoke(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast
    words = "the cat sat on a mat and the dog ran to the red ball while a bird sang".split()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()     # joins words with spaces
    tok.train_from_iterator([" ".join(words)] * 3, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<eos>"]))
    assert tok.get_vocab_size() <= 64
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(tmp_path)
    tiny("kvm+swa").save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt", "the cat sat", "--max-new-tokens", "6"]
    assert cli(args + ["--cache-report"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat sat") and "tok/s" in out and "cache:" in out and "total" in out
    assert cli(args + ["--temperature", "0.7", "--top-p", "0.9", "--seed", "1"]) == 0
    first = capsys.readouterr().out.split("\n\n[")[0]
    assert cli(args + ["--temperature", "0.7", "--top-p", "0.9", "--seed", "1"]) == 0
    assert capsys.readouterr().out.split("\n\n[")[0] == first


def test_config_has_no_positional_limit():
    from kvmeans.models.hf import KVMConfig
    assert KVMConfig().max_position_embeddings == 2 ** 30      # what lm-eval reads for its max length
    assert KVMConfig(max_position_embeddings=4096).max_position_embeddings == 4096
