"""Novelty-preserving routing of converted layers (KVMSpec.novel_rows, kvmeans.pretrained.routing): which
pairs merge, which tokens keep a row, the budget plan kept, and any prefill/decode split equal to one forward."""
import pytest
import torch
import torch.nn.functional as F

from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention
from kvmeans.pretrained.routing import merge_closest_pairs, route_novel

tf = pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.pretrained.convert import KVMSpec, convert_hf, parse_kvm_spec  # noqa: E402


def _rows(*keys):
    k = torch.tensor(keys, dtype=torch.float32)[None, None]                  # [1, 1, m, D]
    v = torch.arange(k.shape[2], dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2).clone()
    return k, v, torch.ones(k.shape[:-1])


def test_merge_closest_pairs_merges_the_most_similar_non_sink_rows_and_keeps_the_order():
    # row 0 (sink) equals row 1, which must not matter; rows 2 and 4 are the closest non-sink pair
    k, v, c = _rows([1, 0, 0], [1, 0, 0], [0, 1, 0.1], [0, 0, 1], [0, 1, 0.12], [1, 1, 1])
    k2, v2, c2 = merge_closest_pairs(k, v, c, 1, sink_len=1)
    assert c2.tolist() == [[[1, 1, 2, 1, 1]]]
    torch.testing.assert_close(k2[0, 0, 2], k[0, 0, 2] + k[0, 0, 4])
    torch.testing.assert_close(v2[0, 0, :, 0], torch.tensor([0., 1, 2 + 4, 3, 5]))
    assert c.tolist() == [[[1.] * 6]]                                       # inputs untouched


def test_merge_closest_pairs_lets_a_merged_row_merge_again():
    k, v, c = _rows([1, 0], [0, 1], [0.1, 1], [0.2, 1], [1, -1])
    _, _, c2 = merge_closest_pairs(k, v, c, 2, sink_len=0)
    assert c2.tolist() == [[[1, 3, 1]]]


def test_route_novel_gives_the_novel_token_its_own_row():
    rows = torch.tensor([[1., 0, 0], [0, 1, 0], [0, 1, 0.2]])[None, None]
    sel = F.normalize(torch.tensor([[0, 1, 0.15], [0, 0, 1], [1, 0.1, 0], [0, 1, 0.01]])[None, None], dim=-1)
    # token 1 is far from every row: a new row (3); the others join their closest non-sink row (sink: row 0)
    assert route_novel(rows, sel, 1, sink_len=1).tolist() == [[[2, 3, 1, 1]]]
    assert route_novel(rows, sel, 2, sink_len=1).tolist() == [[[2, 3, 4, 1]]]


def _needle_stream(T=96, D=8, needle=50):
    """Every token the same key/value except one orthogonal 'needle' token."""
    k = torch.zeros(1, 1, T, D, dtype=torch.float64)
    k[..., 0] = 1
    k[..., needle, :] = 0
    k[..., needle, 1] = 1
    v = k.clone()
    return k, v


@pytest.mark.parametrize("novel_rows", [0, 2])
def test_a_needle_keeps_its_own_row_only_with_novel_rows(novel_rows):
    k, v = _needle_stream()
    q = k.clone()
    st = ConvertedKVMState()
    converted_kvm_attention(q, k, v, st, scaling=1.0, budget=12, chunk_len=8, n_bswa_chunks=2, sink_len=1,
                            rope_mode="none", novel_rows=novel_rows)
    assert st.num_rows == 12 and st.covered == 80 and float(st.count.sum()) == 80
    row = int((st.key_sum[0, 0, :, 1] > 0).nonzero()[0])                   # the row holding the needle
    needle_alone = float(st.count[0, 0, row]) == 1 and float(st.key_sum[0, 0, row, 0]) == 0
    assert needle_alone == bool(novel_rows)                                  # KVM's routing merges it away


@pytest.mark.parametrize("novel_rows", [1, 3, 8])
def test_any_split_equals_one_call(novel_rows):
    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 120, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, T, D, dtype=torch.float64), torch.randn(B, Hkv, T, D, dtype=torch.float64)
    run = dict(scaling=D ** -0.5, budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="none",
               novel_rows=novel_rows)
    one = ConvertedKVMState()
    full = converted_kvm_attention(q, k, v, one, **run)
    assert one.num_rows == 24
    base = converted_kvm_attention(q, k, v, ConvertedKVMState(), **{**run, "novel_rows": 0})
    assert (full - base).abs().max() > 1e-3                                  # the option changes the routing
    for cuts in ([37], [5, 6, 7, 40, 41, 100], list(range(1, T))):
        st, parts, prev = ConvertedKVMState(), [], 0
        for cut in cuts + [T]:
            parts.append(converted_kvm_attention(q[:, :, prev:cut], k[:, :, prev:cut], v[:, :, prev:cut], st, **run))
            prev = cut
        torch.testing.assert_close(torch.cat(parts, 2), full, rtol=0, atol=1e-12)
        torch.testing.assert_close(st.count, one.count)


@torch.no_grad()
def test_converted_llama_with_novel_rows_continues_like_one_forward_and_parses():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    model = convert_hf(tf.AutoModelForCausalLM.from_config(cfg).eval(), budget=16, chunk_len=8, n_bswa_chunks=2,
                       sink_len=2, novel_rows=3)
    x = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    full = model(x).logits
    first = model(x[:, :29], use_cache=True)
    rest = model(x[:, 29:], **cache_kwargs(cache_from(first)), use_cache=True)
    torch.testing.assert_close(torch.cat((first.logits, rest.logits), 1), full, rtol=0, atol=1e-5)
    assert model.config.kvm_conversion["novel_rows"] == 3
    assert parse_kvm_spec("novel_rows=4") == {"novel_rows": 4}
    with pytest.raises(ValueError, match="novel_rows must be in"):
        KVMSpec(chunk_len=8, novel_rows=9)
