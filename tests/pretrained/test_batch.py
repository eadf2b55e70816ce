"""Converted transformers models (kvmeans.convert_hf) on left-padded batches (each row gets exactly what it
gets alone: its chunk grid starts at its first real token, pads enter no state) and crop (assisted and
prompt-lookup decoding return the greedy tokens; crop then continue equals never having gone past)."""
import pytest
import torch

tf = pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.pretrained.cache import ConvertedCacheLayer  # noqa: E402
from kvmeans.pretrained.convert import convert_hf  # noqa: E402
from tests.cli.test_kvm_flag import _lm_eval, _niah  # noqa: E402
from tests.models.test_assisted import count_rollbacks, draft_tokens  # noqa: E402
from tests.pretrained.test_convert import FAMILIES, SMALL, V, tiny  # noqa: E402

LENGTHS = (61, 44, 29)         # chunk grids offset by 17 and 32 tokens (chunk_len 8): boundaries differ per row
GREEDY = dict(do_sample=False, pad_token_id=0)
KVM = "budget=fixed:8,chunk_len=8,n_bswa_chunks=2,sink_len=2"              # SMALL as an eval --kvm spec


def rows(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


def left_pad(seqs, pad=0):
    width = max(len(s) for s in seqs)
    x = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, s in enumerate(seqs):
        x[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return x, mask


def positions(mask):
    """HF's position_ids under left padding (what generate passes): the first real token is 0."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_left_padded_batch_logits_equal_each_row_alone(family):
    model = convert_hf(tiny(family), **SMALL)
    seqs = rows()
    x, mask = left_pad(seqs, pad=7)
    out = model(x, attention_mask=mask, position_ids=positions(mask), use_cache=True)
    w = x.shape[1]
    for i, s in enumerate(seqs):
        alone = model(s[None]).logits[0]
        torch.testing.assert_close(out.logits[i, w - len(s):], alone, rtol=0, atol=1e-5)
    # the cache counts columns (pads included), as transformers slices inputs by it
    layer = cache_from(out).layers[model.config.kvm_conversion["layers"][0]]
    assert isinstance(layer, ConvertedCacheLayer) and layer.get_seq_length() == w and len(layer.state.parts) == 3


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_generate_on_a_left_padded_batch_equals_each_row_alone(family):
    model = convert_hf(tiny(family), **SMALL)
    seqs = rows()
    x, mask = left_pad(seqs)
    out = model.generate(x, attention_mask=mask, max_new_tokens=12, **GREEDY)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long),
                               max_new_tokens=12, **GREEDY)
        assert torch.equal(out[i, x.shape[1]:], alone[0, len(s):]), i


@torch.no_grad()
def test_pads_never_reach_the_state_or_the_window():
    """Pad ids and a batch-mate's length change nothing in a row: the same row padded by 3 or by 40 columns
    of different pad ids gives the same logits and generation."""
    model = convert_hf(tiny("llama"), **SMALL)
    s, other = rows((50, 90))
    a, ma = left_pad([s, other[:53]], pad=3)
    b, mb = left_pad([s, other], pad=99)
    la = model(a, attention_mask=ma, position_ids=positions(ma)).logits[0, -50:]
    lb = model(b, attention_mask=mb, position_ids=positions(mb)).logits[0, -50:]
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    ga = model.generate(a, attention_mask=ma, max_new_tokens=10, **GREEDY)[0, a.shape[1]:]
    gb = model.generate(b, attention_mask=mb, max_new_tokens=10, **GREEDY)[0, b.shape[1]:]
    assert torch.equal(ga, gb)


# ---- crop -------------------------------------------------------------------------------------------

def logits(model, x, cache):
    return model(x, **cache_kwargs(cache), use_cache=True).logits


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@torch.no_grad()
def test_crop_then_continue_equals_never_having_gone_past(family):
    """Prefill, a 7-token draft that crosses a chunk boundary (and a state update), crop 6 of it, continue
    with other tokens: the logits equal a cache that never saw the rejected tokens."""
    model = convert_hf(tiny(family), **SMALL)
    x = torch.randint(1, V, (1, 80), generator=torch.Generator().manual_seed(4))
    draft = torch.randint(1, V, (1, 7), generator=torch.Generator().manual_seed(5))
    want_cache = tf.DynamicCache(config=model.config)
    logits(model, x[:, :45], want_cache)
    want = logits(model, x[:, 45:], want_cache)
    cache = tf.DynamicCache(config=model.config)
    cache.activate_past_recording()              # as generate does (Gemma3's plain sliding layers need it)
    logits(model, x[:, :44], cache)
    logits(model, torch.cat((x[:, 44:45], draft[:, 1:]), 1), cache)        # 44..51: crosses 48
    cache.crop(-6)
    assert cache.get_seq_length() == 45
    torch.testing.assert_close(logits(model, x[:, 45:], cache), want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_crop_before_the_snapshot_is_refused_in_one_line():
    model = convert_hf(tiny("llama"), **SMALL)
    cache = tf.DynamicCache(config=model.config)
    x = torch.randint(1, V, (1, 50))
    logits(model, x[:, :40], cache)              # snapshot before the last 32 tokens: at column 8
    logits(model, x[:, 40:], cache)
    with pytest.raises(ValueError, match="at the least") as err:
        cache.crop(-45)
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_what_crop_keeps_stays_bounded_and_the_last_call_can_be_undone():
    """Decoding 80 tokens one by one, then a 100-token call: a converted layer keeps the inputs of at most
    3 * replay_limit tokens, and crop still undoes the last call's last 32."""
    model = convert_hf(tiny("llama"), **SMALL)
    x = torch.randint(1, V, (1, 230), generator=torch.Generator().manual_seed(6))
    cache = tf.DynamicCache(config=model.config)
    logits(model, x[:, :40], cache)
    state = cache.layers[0].state
    for t in range(40, 120):
        logits(model, x[:, t:t + 1], cache)
        assert sum(c[0].shape[2] for c in state._calls) <= 3 * state.replay_limit
    logits(model, x[:, 120:220], cache)
    assert sum(c[0].shape[2] for c in state._calls) <= 3 * state.replay_limit
    cache.crop(-32)
    want_cache = tf.DynamicCache(config=model.config)
    logits(model, x[:, :188], want_cache)
    torch.testing.assert_close(logits(model, x[:, 188:230], cache), logits(model, x[:, 188:230], want_cache),
                               rtol=0, atol=1e-5)


@torch.no_grad()
def test_assisted_decoding_with_a_converted_draft_equals_greedy(monkeypatch):
    model = convert_hf(tiny("llama"), **SMALL)
    x = torch.randint(1, V, (1, 45), generator=torch.Generator().manual_seed(2))
    want = model.generate(x, max_new_tokens=30, **GREEDY)
    draft = draft_tokens(convert_hf(tiny("llama", seed=7), **SMALL), 5)
    seen = count_rollbacks(monkeypatch, ConvertedCacheLayer)
    out = model.generate(x, max_new_tokens=30, assistant_model=draft, **GREEDY)
    assert torch.equal(out, want)
    assert any(a // 8 != b // 8 for a, b in seen), seen           # some rollbacks crossed a chunk boundary


@torch.no_grad()
def test_prompt_lookup_on_repetitive_text_equals_greedy(monkeypatch):
    model = convert_hf(tiny("llama"), **SMALL)
    x = torch.arange(1, 12).repeat(4)[None]                        # 44 tokens: a phrase four times
    want = model.generate(x, max_new_tokens=30, **GREEDY)
    seen = count_rollbacks(monkeypatch, ConvertedCacheLayer)
    out = model.generate(x, max_new_tokens=30, prompt_lookup_num_tokens=5, **GREEDY)
    assert torch.equal(out, want)
    assert seen                                                    # some lookups were wrong and undone


# ---- the eval runners batch converted models ---------------------------------------------------------

def generate_batches(monkeypatch):
    """Batch size of every ``generate`` call of a (converted) Llama."""
    sizes, generate = [], tf.LlamaForCausalLM.generate

    def spy(self, *args, **kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        sizes.append(int(x.shape[0]))
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(tf.LlamaForCausalLM, "generate", spy)
    return sizes


def test_niah_batches_a_converted_model_and_equals_batch_one(llama_dir, tmp_path, monkeypatch):
    one = _niah(llama_dir, tmp_path / "one", "--batch-size", "1", "--kvm", KVM)
    sizes = generate_batches(monkeypatch)
    three = _niah(llama_dir, tmp_path / "three", "--batch-size", "3", "--kvm", KVM)
    assert sizes == [3]
    assert len({s["tokens"] for s in three["samples"]}) > 1                  # prompts of different lengths
    assert [s["outputs"] for s in three["samples"]] == [s["outputs"] for s in one["samples"]]


def test_lm_eval_generate_until_batches_a_converted_model_and_equals_batch_one(llama_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, one = _lm_eval(llama_dir, batch_size=1, kvm=KVM)
    sizes = generate_batches(monkeypatch)
    _, three = _lm_eval(llama_dir, batch_size=3, kvm=KVM)
    assert max(sizes) > 1
    assert three["kvm_toy_gen"] == one["kvm_toy_gen"]


@torch.no_grad()
def test_beam_search_on_a_left_padded_batch_equals_each_row_alone():
    """Beam search reorders rows across the parts (rows of different lengths) in every step."""
    model = convert_hf(tiny("llama"), **SMALL)
    seqs = rows()
    x, mask = left_pad(seqs)
    run = dict(max_new_tokens=10, num_beams=3, **GREEDY)
    out = model.generate(x, attention_mask=mask, **run)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), **run)
        assert torch.equal(out[i, x.shape[1]:], alone[0, len(s):]), i
