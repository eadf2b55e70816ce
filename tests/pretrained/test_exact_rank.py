"""The reserve ranked by attention (KVMSpec.exact_rank="attention", kvmeans.pretrained.op): a token the queries
asked for keeps its slot where novelty would keep others; the score is the window-only softmax's most, complete
before a block routes; any split, decode, padding, crop and save/load equal one call; vLLM refuses it."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvmeans.ops.budget import StateBudget
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention

tf = pytest.importorskip("transformers")
from kvmeans.pretrained.convert import KVMSpec, convert_hf, load_converted, parse_kvm_spec  # noqa: E402
from tests.pretrained.test_convert import ids, tiny  # noqa: E402
from tests.pretrained.test_reserve import (  # noqa: E402
    _assert_same_state,
    _qkv,
    assert_crop_replays,
    assert_decode_matches,
    assert_left_padding_matches,
)

RANKED = dict(budget=16, chunk_len=8, n_bswa_chunks=2, sink_len=2, exact_rows=6, exact_rank="attention",
              exact_scope="layer")


def _asked_for(T=120, D=8):
    """Keys of one direction except two novel ones (40, 48: orthogonal) and token 60 (close to the rest); the
    queries of positions 61-66 ask for token 60. Values carry each token's position in channel 0."""
    k = torch.zeros(1, 2, T, D, dtype=torch.float64)
    k[..., 0] = 1
    k[0, :, 40], k[0, :, 48] = F.one_hot(torch.tensor([1, 2]), D).double()
    k[0, :, 60, 3] = 0.5
    q = k.repeat_interleave(2, 1).clone()
    q[0, :, 61:67] = 20 * F.one_hot(torch.tensor(3), D).double()
    v = torch.zeros(1, 2, T, D, dtype=torch.float64)
    v[..., 0] = torch.arange(T, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("rank, slots, kept", [("novelty", 2, [40, 48]), ("attention", 2, [60])])
def test_the_asked_for_token_keeps_its_slot_only_when_ranked_by_attention(rank, slots, kept):
    q, k, v = _asked_for()
    st = ConvertedKVMState()
    converted_kvm_attention(q, k, v, st, scaling=1.0, budget=12, chunk_len=8, n_bswa_chunks=2, sink_len=1,
                            rope_mode="none", exact_rows=slots, exact_rank=rank)
    slots = sorted(st.reserve_value[0, 0, :, 0].tolist())
    assert set(kept) <= set(slots), slots
    assert slots == sorted(st.reserve_value[0, 1, :, 0].tolist())     # one ranking for every kv head
    if rank == "novelty":
        assert st.buf_att is None
    else:                   # it got nearly all of the attention of the queries that asked for it
        assert st.reserve_score.max() > 0.9


def test_the_score_is_the_attention_of_the_last_chunk_of_queries_that_see_the_token():
    """buf_att of the buffered tokens after a call: each block gets, from the queries of the chunk n - 1 after it
    (the last that see it), the softmax over each query's window alone, summed over those queries and averaged
    over the kv group's heads; blocks whose last chunk has not come yet hold what its queries so far gave."""
    q, k, v = _qkv(B=1, T=43)
    C, n, G = 8, 3, 2
    st = ConvertedKVMState()
    converted_kvm_attention(q, k, v, st, scaling=8 ** -0.5, budget=16, chunk_len=C, n_bswa_chunks=n, sink_len=2,
                            rope_mode="none", exact_rows=4, exact_rank="attention")
    want = torch.zeros(1, 2, 43, dtype=torch.float64)
    for p in range(43):
        first = (p // C) * C - (n - 1) * C              # the window of query p: [max(first, 0), p]
        if first < 0:
            continue
        for h in range(4):
            p_att = (q[0, h, p] @ k[0, h // G, first:p + 1].T * 8 ** -0.5).softmax(-1)
            want[0, h // G, first:first + C] += p_att[:C] / G
    base = st.seen - st.buf_att.shape[-1]
    assert base > 0 and float(want[..., base:].amax()) > 0.1
    torch.testing.assert_close(st.buf_att, want[..., base:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("exact_rows,chunk_len,n_bswa_chunks,sink_len,budget,T", [
    (3, 8, 2, 2, 24, 121),
    (12, 8, 2, 0, 24, 121),
    (5, 4, 3, 1, StateBudget.power_law(2.0, 0.5), 95),
])
def test_any_split_equals_one_call(exact_rows, chunk_len, n_bswa_chunks, sink_len, budget, T):
    q, k, v = _qkv(T=T)
    run = dict(scaling=8 ** -0.5, budget=budget, chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks,
               sink_len=sink_len, rope_mode="none", exact_rows=exact_rows, exact_rank="attention")
    one = ConvertedKVMState()
    full = converted_kvm_attention(q, k, v, one, **run)
    novelty = converted_kvm_attention(q, k, v, ConvertedKVMState(), **{**run, "exact_rank": "novelty"})
    assert (full - novelty).abs().max() > 1e-3                              # the ranking changes the read
    for cuts in ([37], [5, 6, 7, 40, 41, 90], list(range(1, T))):
        st, parts, prev = ConvertedKVMState(), [], 0
        for cut in cuts + [T]:
            parts.append(converted_kvm_attention(q[:, :, prev:cut], k[:, :, prev:cut], v[:, :, prev:cut], st, **run))
            prev = cut
        torch.testing.assert_close(torch.cat(parts, 2), full, rtol=0, atol=1e-12)
        _assert_same_state(st, one, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("scope", ["layer", "model"])
def test_converted_llama_decodes_pads_crops_and_saves_like_one_forward(tmp_path, scope):
    model = convert_hf(tiny("llama"), **{**RANKED, "exact_scope": scope})
    x = ids(100)
    full = model(x).logits
    other = convert_hf(tiny("llama"), **{**RANKED, "exact_scope": scope, "exact_rank": "novelty"})(x).logits
    assert (full - other).abs().max() > 1e-5
    assert_decode_matches(model, x, full)
    assert_left_padding_matches(model)
    assert_crop_replays(model)
    model.save_pretrained(tmp_path)
    loaded = load_converted(tmp_path)
    assert loaded.config.kvm_conversion["exact_rank"] == "attention"
    torch.testing.assert_close(loaded(x).logits, full, rtol=0, atol=0)


def test_spec_parses_saves_and_refuses():
    assert parse_kvm_spec("exact_rows=8,exact_rank=attention") == {"exact_rows": 8, "exact_rank": "attention"}
    assert KVMSpec.from_dict({"budget": 64, "exact_rows": 8}).exact_rank == "novelty"    # saved before the field
    with pytest.raises(ValueError, match=r"exact_rank must be one of \('novelty', 'attention'\).*got 'loud'"):
        KVMSpec(exact_rank="loud")
    with pytest.raises(ValueError, match="exact_rank must be one of"):
        converted_kvm_attention(*_qkv(T=9), ConvertedKVMState(), scaling=1.0, budget=8, chunk_len=4,
                                n_bswa_chunks=1, sink_len=1, rope_mode="none", exact_rows=2, exact_rank="loud")


def vllm_config_of(spec: KVMSpec, n_layers: int) -> SimpleNamespace:
    """What ``vllm_plugin._refusals`` reads of a vLLM config, for a folder converted with ``spec`` in every layer."""
    hf = SimpleNamespace(kvm_conversion={**spec.to_dict(), "layers": list(range(n_layers))},
                         num_hidden_layers=n_layers)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, model="m", model_impl="auto"),
        cache_config=SimpleNamespace(enable_prefix_caching=False), speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def test_vllm_refuses_it_at_start_up():
    """The state slots of the vLLM layers hold no per-token scores: refused with the fix (no vLLM needed)."""
    from kvmeans.serve.vllm_plugin import _refusals
    config = vllm_config_of(KVMSpec(**{**RANKED, "exact_scope": "layer"}), n_layers=2)
    hf = config.model_config.hf_text_config
    with pytest.raises(ValueError, match="exact_rank='attention'.*exact_rank=novelty"):
        _refusals(config)
    hf.kvm_conversion["exact_rank"] = "novelty"
    _refusals(config)
