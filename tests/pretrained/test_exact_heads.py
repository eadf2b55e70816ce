"""Per-head budgets of the reserve (KVMSpec.exact_heads, kvmeans.pretrained.heads): the caps share out exactly the
model's slots; equal caps are the plain reserve bit for bit; a head fills only its cap and its dead slots are never
read; any split equals one call; convert_hf measures copy scores on the original model, records them, and a saved
model reloads with them; decode, padding, crop; refused where it cannot run."""

import pytest
import torch

from kvmeans.pretrained.heads import head_caps
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention
from tests.pretrained.test_reserve import _assert_same_state, _qkv

tf = pytest.importorskip("transformers")
from kvmeans.pretrained.convert import KVMSpec, calibrates, convert_hf, load_converted, parse_kvm_spec  # noqa: E402
from tests.pretrained.test_convert import V, ids, tiny  # noqa: E402
from tests.pretrained.test_exact_rank import vllm_config_of  # noqa: E402
from tests.pretrained.test_reserve import (  # noqa: E402
    assert_crop_replays,
    assert_decode_matches,
    assert_left_padding_matches,
)

RUN = dict(scaling=8 ** -0.5, budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="none", exact_rows=6)


def test_caps_share_out_the_slots_between_floor_and_most():
    w = torch.tensor([[0.9, 0.0], [0.05, 0.02], [0.03, 0.03]], dtype=torch.float64)
    caps = head_caps(w, 48)
    assert caps.shape == (3, 2) and caps.dtype == torch.long
    assert 48 * 6 - 6 <= int(caps.sum()) <= 48 * 6              # rounded down, at most one slot per head
    assert int(caps.min()) >= 4 and int(caps.max()) <= 192     # HEAD_FLOOR x 48 = 4, HEAD_MOST x 48 = 192
    assert caps[0, 0] == 192                                    # the strongest head is capped at the most ...
    assert caps[1, 0] > caps[2, 0] == caps[2, 1] > caps[1, 1] > caps[0, 1] == 4     # ... the rest by weight
    torch.testing.assert_close(head_caps(torch.full((4, 2), 0.3), 10), torch.full((4, 2), 10))
    torch.testing.assert_close(head_caps(torch.zeros(4, 2), 10), torch.full((4, 2), 10))
    with pytest.raises(ValueError, match="exact_heads weights must be finite, >= 0"):
        head_caps(torch.tensor([[0.1, -1.0]]), 8)


@pytest.mark.parametrize("T", [57, 121])
def test_equal_caps_are_the_plain_reserve_bit_for_bit(T):
    q, k, v = _qkv(T=T)
    plain, capped = ConvertedKVMState(), ConvertedKVMState()
    want = converted_kvm_attention(q, k, v, plain, **RUN)
    got = converted_kvm_attention(q, k, v, capped, **RUN, exact_caps=torch.tensor([6, 6]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _assert_same_state(capped, plain)


def test_a_head_fills_only_its_cap_and_its_dead_slots_are_never_read():
    q, k, v = _qkv(T=121)
    st = ConvertedKVMState()
    out = converted_kvm_attention(q, k, v, st, **RUN, exact_caps=torch.tensor([2, 10]))
    assert st.reserve_count.shape[-1] == 10                     # the largest cap
    filled = (st.reserve_count > 0).sum(-1)                     # [B, Hkv]
    assert filled[:, 0].tolist() == [2, 2] and filled[:, 1].tolist() == [10, 10]
    dead = st.reserve_score.isposinf()                          # the slots sort by score: dead ones first
    assert dead.sum(-1).tolist() == [[8, 0], [8, 0]] and bool((st.reserve_count[dead] == 0).all())
    # the dead slots' contents do not reach the output: fill them with anything, the next step reads the same
    other = st.copy()
    other.reserve_key, other.reserve_value = st.reserve_key.clone(), st.reserve_value.clone()
    other.reserve_key[dead], other.reserve_value[dead] = 100.0, -50.0
    step = _qkv(T=122, seed=3)
    a = converted_kvm_attention(*(t[:, :, -1:] for t in step), st, **RUN, exact_caps=torch.tensor([2, 10]))
    b = converted_kvm_attention(*(t[:, :, -1:] for t in step), other, **RUN, exact_caps=torch.tensor([2, 10]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    uncapped = converted_kvm_attention(q, k, v, ConvertedKVMState(), **RUN)
    assert (out - uncapped).abs().max() > 1e-4                  # the caps change what is read


@pytest.mark.parametrize("caps", [[2, 10], [0, 12], [9, 3]])
def test_any_split_equals_one_call(caps):
    q, k, v = _qkv(T=121)
    run = {**RUN, "exact_caps": torch.tensor(caps), "exact_lead": 1}
    one = ConvertedKVMState()
    full = converted_kvm_attention(q, k, v, one, **run)
    for cuts in ([37], [5, 6, 7, 40, 41, 90], list(range(1, 121))):
        st, parts, prev = ConvertedKVMState(), [], 0
        for cut in cuts + [121]:
            parts.append(converted_kvm_attention(q[:, :, prev:cut], k[:, :, prev:cut], v[:, :, prev:cut], st, **run))
            prev = cut
        torch.testing.assert_close(torch.cat(parts, 2), full, rtol=0, atol=1e-12)
        _assert_same_state(st, one, atol=1e-12)


def test_the_op_refuses_caps_it_cannot_use():
    q, k, v = _qkv(T=20)
    with pytest.raises(ValueError, match=r"exact_caps must be \[Hkv=2\].*needs exact_rows > 0"):
        converted_kvm_attention(q, k, v, ConvertedKVMState(), **{**RUN, "exact_rows": 0},
                                exact_caps=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"exact_caps must be \[Hkv=2\]"):
        converted_kvm_attention(q, k, v, ConvertedKVMState(), **RUN, exact_caps=torch.tensor([2, 2, 2]))


class _CharTokenizer:
    """What ``copy_scores`` needs of a tokenizer: ``tok(text, add_special_tokens=False)["input_ids"]``."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % V for c in text]}


SPEC = dict(budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2, exact_rows=6)


@torch.no_grad()
def test_convert_measures_records_and_reloads_the_head_weights(tmp_path):
    plain = tiny("llama")
    model = convert_hf(tiny("llama"), **SPEC, exact_heads="copy", tokenizer=_CharTokenizer())
    assert plain.config._attn_implementation == model.config._attn_implementation     # restored after the probe
    weights = model.config.kvm_conversion["exact_heads"]
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(weights) == n_layers and all(len(r) == kv and all(0 <= w <= 1 for w in r) for r in weights)
    caps = [m.kvm_exact_caps for m in model.modules() if getattr(m, "kvm_spec", None) is not None]
    assert len(caps) == n_layers and sum(int(c.sum()) for c in caps) <= 6 * kv * n_layers
    x = ids(100)
    full = model(x).logits
    uniform = convert_hf(tiny("llama"), **SPEC)(x).logits
    if len({int(c) for cs in caps for c in cs}) > 1:            # unequal caps read other rows
        assert (full - uniform).abs().max() > 1e-6
    short = ids(16)                                             # nothing compressed: the original model
    torch.testing.assert_close(model(short).logits, plain(short).logits, rtol=1e-4, atol=1e-4)
    assert_decode_matches(model, x, full)
    assert_left_padding_matches(model)
    assert_crop_replays(model)
    model.save_pretrained(tmp_path)
    loaded = load_converted(tmp_path)
    assert [list(r) for r in loaded.config.kvm_conversion["exact_heads"]] == [list(r) for r in weights]
    torch.testing.assert_close(loaded(x).logits, full, rtol=0, atol=0)


def test_given_weights_set_the_caps_and_bad_ones_are_refused():
    n = tiny("llama").config.num_hidden_layers
    strong = tuple((1.0, 0.0) if i == 0 else (0.0, 0.0) for i in range(n))
    model = convert_hf(tiny("llama"), **SPEC, exact_heads=strong, exact_floor=0.0)
    caps = [m.kvm_exact_caps.tolist() for m in model.modules() if getattr(m, "kvm_spec", None) is not None]
    assert caps[0][0] == 24 and caps[1] == [0, 0]               # the most (4 x 6) to the one head, the floor (0) else
    with pytest.raises(ValueError, match="this conversion has"):
        convert_hf(tiny("llama"), **SPEC, exact_heads=((1.0, 0.0),))
    assert KVMSpec(exact_heads=((1.0, 0.0),)).exact_heads is None          # no reserve: nothing to share out
    assert convert_hf(tiny("llama"), budget=24, chunk_len=8, exact_heads="copy").config.kvm_conversion[
        "exact_heads"] is None                                  # nor to measure (no tokenizer needed)
    with pytest.raises(ValueError, match="convert_hf measures the weights"):
        KVMSpec(exact_rows=4, exact_heads="copy")
    assert parse_kvm_spec("exact_rows=8,exact_heads=copy") == {"exact_rows": 8, "exact_heads": "copy"}
    assert parse_kvm_spec("exact_rows=8,exact_heads=uniform") == {"exact_rows": 8, "exact_heads": "uniform"}
    with pytest.raises(ValueError, match="exact_heads must be copy .* or uniform"):
        parse_kvm_spec("exact_rows=8,exact_heads=all")
    assert parse_kvm_spec("exact_heads=copy") == {"exact_heads": "copy"}     # exact_rows may come later (auto)
    with pytest.raises(ValueError, match="measures the original model's heads"):
        convert_hf(model, **SPEC, exact_heads="copy", tokenizer=_CharTokenizer())
    assert KVMSpec.from_dict({"budget": 64, "exact_rows": 8}).exact_heads is None      # saved before the field


def test_vllm_refuses_it_at_start_up():
    from kvmeans.serve.vllm_plugin import _refusals
    config = vllm_config_of(KVMSpec(**SPEC, exact_heads=((0.5, 0.1),) * 2), n_layers=2)
    with pytest.raises(ValueError, match="exact_heads .* is not served yet"):
        _refusals(config)


def test_the_bench_takes_it_beside_a_named_split():
    from kvmeans.cli.bench_pretrained import _named_split
    from kvmeans.pretrained.arms import kvm_settings
    kvm = _named_split("auto:C16-w0.75-e0.75,exact_heads=copy")
    assert kvm["exact_heads"] == "copy" and kvm["split"].name == "C16-w0.75-e0.75"
    got = kvm_settings(2048, kvm)
    assert got["exact_heads"] == "copy" and got["exact_rows"] > 0


def test_a_model_without_a_tokenizer_is_told_how_to_go_on():
    from kvmeans.pretrained.calibrate import split_named, split_settings
    with pytest.raises(ValueError, match="exact_heads='copy'.*tokenizer.*exact_heads='uniform'"):
        convert_hf(tiny("llama"), **split_settings(split_named("C16-w0.75-e0.75"), 260), exact_heads="copy")


def test_the_floor_is_a_setting_recorded_and_reloaded(tmp_path):
    n = tiny("llama").config.num_hidden_layers
    strong = tuple((1.0, 0.0) if i == 0 else (0.0, 0.0) for i in range(n))
    spec = dict(budget=40, chunk_len=8, n_bswa_chunks=2, sink_len=2, exact_rows=12)
    for floor, least in ((0.0, 0), (0.25, 3), (0.5, 6), (1.0, 12)):
        model = convert_hf(tiny("llama"), **spec, exact_heads=strong, exact_floor=floor)
        caps = torch.stack([m.kvm_exact_caps for m in model.modules() if getattr(m, "kvm_spec", None) is not None])
        assert int(caps.min()) == least and int(caps.sum()) <= 12 * caps.numel()
        assert model.config.kvm_conversion["exact_floor"] == floor
    x = ids(90)
    model.save_pretrained(tmp_path)                              # floor 1: every head 12, the uniform reserve
    torch.testing.assert_close(load_converted(tmp_path)(x).logits, convert_hf(tiny("llama"), **spec)(x).logits,
                               rtol=0, atol=0)
    assert parse_kvm_spec("exact_rows=8,exact_heads=copy,exact_floor=0.25")["exact_floor"] == 0.25
    for bad in ("x", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="exact_floor must be"):
            parse_kvm_spec(f"exact_rows=8,exact_floor={bad}")
    # a floor alone keeps the automatic setting on, as exact_heads does
    assert calibrates(parse_kvm_spec("exact_floor=0.25")) and not calibrates(parse_kvm_spec("exact_rows=8"))
    # saved before the setting: the floor those folders were converted with
    assert KVMSpec.from_dict({"budget": 64, "exact_rows": 8, "exact_heads": [[1.0, 0.0]]}).exact_floor == 1 / 12
