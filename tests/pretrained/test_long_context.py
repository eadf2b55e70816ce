"""Bounded memory on converted models: segmented prefill == one call (every family, padding, the reserve ranked
across layers, the learned read-out), no tensor of the prompt's length beyond the ids, state tensors that hold
no hidden storage, cache bytes by kind, the compact mask and the generate cache."""
import pytest
import torch

tf = pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.pretrained.cache import ConvertedCacheLayer, cache_nbytes, cache_nbytes_by_kind  # noqa: E402
from kvmeans.pretrained.convert import convert_hf, converted_cache  # noqa: E402
from tests.pretrained.test_batch import left_pad  # noqa: E402
from tests.pretrained.test_convert import FAMILIES, SMALL, ids, tiny  # noqa: E402

SEG = 24                                 # a segment of 3 chunks: segment edges fall inside and on chunk edges


def logits_in_segments(model, x, segment, **kw):
    model.config.kvm_conversion["prefill_segment"] = segment
    try:
        return model(x, **kw)
    finally:
        model.config.kvm_conversion["prefill_segment"] = 0


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_segmented_prefill_equals_one_call(family):
    """All logits, the last ones only, and the cache it leaves: decoding on from it == one call over everything."""
    model = convert_hf(tiny(family), **SMALL, prefill_segment=0)
    x = ids(100)
    one = model(x, use_cache=True)
    seg = logits_in_segments(model, x, SEG, use_cache=True)
    torch.testing.assert_close(seg.logits, one.logits, rtol=0, atol=1e-5)
    last = logits_in_segments(model, x, SEG, use_cache=True, logits_to_keep=5)
    torch.testing.assert_close(last.logits, one.logits[:, -5:], rtol=0, atol=1e-5)
    nxt = ids(3, seed=9)
    want = model(nxt, **cache_kwargs(cache_from(one)), use_cache=True).logits
    got = model(nxt, **cache_kwargs(cache_from(last)), use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    no_cache = logits_in_segments(model, x, SEG, use_cache=False)
    assert cache_from(no_cache) is None
    torch.testing.assert_close(no_cache.logits, one.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", [dict(exact_rows=4, budget=16), dict(learned=True), dict(rope_mode="split")],
                         ids=["reserve-ranked-across-layers", "learned", "split"])
@torch.no_grad()
def test_segmented_prefill_of_a_padded_batch_equals_one_call(spec):
    model = convert_hf(tiny("llama"), **{**SMALL, **spec}, prefill_segment=0)
    for name, p in model.named_parameters():
        if ".kvm_" in name:                                     # a learned read-out away from its start
            p.add_(0.1 * torch.randn_like(p))
    x, mask = left_pad([ids(90, B=1, seed=3)[0], ids(61, B=1, seed=4)[0]])
    one = model(x, attention_mask=mask).logits
    seg = logits_in_segments(model, x, SEG, attention_mask=mask).logits
    torch.testing.assert_close(seg[mask.bool()], one[mask.bool()], rtol=0, atol=1e-5)


@torch.no_grad()
def test_generate_segments_the_prompt_and_returns_the_same_tokens():
    model = convert_hf(tiny("qwen2"), **SMALL, prefill_segment=0)
    x = ids(70, B=1)
    run = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = model.generate(x, **run)
    model.config.kvm_conversion["prefill_segment"] = SEG
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    try:
        assert torch.equal(model.generate(x, **run), want)
    finally:
        hook.remove()
    assert len(calls) == 12                      # the prompt in one call (segmented inside), then 11 steps


class _Largest(TorchDispatchMode):
    """The most elements of any floating-point tensor an op returns (ids, masks and positions are not counted)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
@torch.no_grad()
def test_no_float_tensor_grows_with_the_prompt(family):
    """``model(ids, use_cache=True, logits_to_keep=1)``: the largest activation at 16 segments == at 4."""
    model = convert_hf(tiny(family), **SMALL, prefill_segment=SEG)
    most = {}
    for T in (4 * SEG, 16 * SEG):
        with _Largest() as probe:
            model(ids(T, B=1), use_cache=True, logits_to_keep=1)
        most[T] = probe.most
    assert most[4 * SEG] == most[16 * SEG], most


@torch.no_grad()
def test_the_state_holds_no_storage_beyond_its_tensors():
    """After a long prefill and decode steps no state tensor is a view keeping a larger one alive (a view of a
    call's keys would keep the whole prompt), and the cache layers' placeholder keys hold nothing."""
    model = convert_hf(tiny("llama"), **{**SMALL, "exact_rows": 4, "budget": 16}, prefill_segment=SEG)
    cache = cache_from(model(ids(150), use_cache=True))
    for t in range(2):
        model(ids(1, seed=t), **cache_kwargs(cache), use_cache=True)
    for layer in cache.layers:
        assert isinstance(layer, ConvertedCacheLayer)
        assert layer.keys.untyped_storage().nbytes() == layer.values.untyped_storage().nbytes() == 0
        for _, st in layer.state.parts:
            for t in st._tensors():
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (t.shape, t.stride())


@torch.no_grad()
def test_cache_bytes_by_kind_are_flat_and_a_quarter_of_the_kv_cache():
    """Kinds add up to the total; with a window of 2 chunks and 16 rows (32 of 128 keys: 0.75 compression) the
    cache at a chunk edge holds the window's keys and values once and the rows' sums: ~0.25x the KV cache."""
    spec = dict(budget=16, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="pre_rope_fixed")
    model = convert_hf(tiny("llama"), **spec)
    plain = tiny("llama")
    by_len = {T: cache_from(model(ids(T, B=1), use_cache=True)) for T in (128, 256)}
    kinds = {T: cache_nbytes_by_kind(c) for T, c in by_len.items()}
    assert kinds[128] == kinds[256] and sum(kinds[128].values()) == cache_nbytes(by_len[128])
    assert kinds[128]["sinks"] > 0 and kinds[128]["recording"] == kinds[128]["kv"] == kinds[128]["reserve"] == 0
    full = cache_nbytes(cache_from(plain(ids(128, B=1), use_cache=True)))
    layer = by_len[128].layers[0].state.parts[0][1]
    window = (layer.buf_k.numel() + layer.buf_v.numel()) * 4 * len(by_len[128].layers)
    assert window == 16 * full / 128                   # the window's 16 tokens: keys and values, once
    assert 0.25 < cache_nbytes(by_len[128]) / full < 0.3


@torch.no_grad()
def test_the_full_attention_mask_covers_the_new_tokens_only_when_every_full_layer_is_converted():
    model = convert_hf(tiny("llama"), **SMALL)
    cache = cache_from(model(ids(40), use_cache=True))
    assert cache.get_mask_sizes(3, 0) == (3, 40)
    partial = convert_hf(tiny("llama"), **SMALL, layers=[0])     # layer 1 keeps full attention: full-size mask
    cache = cache_from(partial(ids(40), use_cache=True))
    assert cache.layers[0].get_mask_sizes(3) == (43, 0)


@torch.no_grad()
def test_generate_puts_the_converted_layers_in_its_cache_before_decoding():
    """Prompt lookup asks the cache to record before the first forward: it reaches the converted layers."""
    model = convert_hf(tiny("llama"), **SMALL)
    x = ids(40, B=1)
    run = dict(attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = model.generate(x, **run)
    out = model.generate(x, prompt_lookup_num_tokens=3, return_dict_in_generate=True, **run)
    assert torch.equal(out.sequences, want)
    assert all(layer.record_past for layer in cache_from(out).layers)
    assert all(not layer.record_past for layer in converted_cache(model).layers)
