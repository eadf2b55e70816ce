"""Properties of the spec itself (naive.py): what the paper says KVM is."""
import pytest
import torch
import torch.nn.functional as F

from kvmeans import StateBudget, kvm_attention
from kvmeans.ops.routing import readout
from kvmeans.utils.testing import assert_close, make_inputs


def naive(inputs, **kw):
    x = dict(inputs)
    return kvm_attention(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("gate"), backend="naive", return_state=True,
                         **x, **kw)


@pytest.mark.parametrize("T", [1, 5, 8, 12])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_short_sequences_are_causal_attention_with_bswa_temp(T, Hkv):
    """T <= L: plain causal attention, keys scaled by the per-head bswa_temp."""
    x = make_inputs(T=T, Hkv=Hkv)
    y, _ = naive(x, chunk_len=4, n_bswa_chunks=3)
    rep = 4 // Hkv
    k = x["k"].repeat_interleave(rep, 1) * x["bswa_temp"].view(1, 4, 1, 1)
    ref = F.scaled_dot_product_attention(x["q"], k, x["v"].repeat_interleave(rep, 1), is_causal=True)
    assert_close("y", ref, y, 1e-12)


def test_causal():
    x = make_inputs(T=40)
    y, _ = naive(x, chunk_len=4, budget=StateBudget.power_law(2, 0.5))
    for name in ("q", "k", "v", "gate"):
        x2 = dict(x)
        x2[name] = x[name].clone()
        x2[name][:, :, 23:] += 1.0
        y2, _ = naive(x2, chunk_len=4, budget=StateBudget.power_law(2, 0.5))
        assert torch.equal(y[:, :, :23], y2[:, :, :23])
        assert not torch.equal(y[:, :, 23:], y2[:, :, 23:])


@pytest.mark.parametrize("sink_len", [0, 1, 3])
def test_sink_rows_never_change(sink_len):
    x = make_inputs(T=60)
    _, s = naive(x, chunk_len=4, sink_len=sink_len, budget=StateBudget.fixed(4), rope_dim=2)
    _, s4 = naive({k: (v[:, :, :4] if k in "q k v gate".split() else v) for k, v in x.items()}, chunk_len=4,
                  sink_len=sink_len, rope_dim=2)
    K, V, _ = s.rows()
    K4, V4, _ = s4.rows()
    assert torch.equal(K[:, :, :sink_len], K4[:, :, :sink_len])
    assert not torch.equal(K[:, :, sink_len:], K4[:, :, sink_len:])     # the others did absorb merges


def test_readout_restores_the_stored_radius():
    x = make_inputs(T=60)
    _, s = naive(x, chunk_len=4, budget=StateBudget.power_law(2, 0.5))
    K, V, R = s.rows()
    _, v_hat = readout(K, V, R, True, x["state_norm_weight"], x["state_norm_bias"], 1e-5)
    assert_close("|v_hat|", R, v_hat.norm(dim=-1), 1e-12)
    assert not torch.allclose(V.norm(dim=-1), R)                        # merges moved the raw sums


def test_rope_channels_do_not_reach_the_state():
    x = make_inputs(T=30)
    _, s = naive(x, chunk_len=4, rope_dim=4)
    x2 = dict(x)
    x2["k"] = x["k"].clone()
    x2["k"][..., :4] += torch.randn_like(x["k"][..., :4])
    _, s2 = naive(x2, chunk_len=4, rope_dim=4)
    assert torch.equal(s.rows()[0], s2.rows()[0])


def test_merge_gate_scales_merged_contributions():
    """Scaling every gate by c (> 0) leaves routing alone and scales what merges add (one update:
    later updates route against sums that the gate changed)."""
    x = make_inputs(T=16)
    fixed = StateBudget.fixed(4)
    _, s1 = naive(x, chunk_len=4, sink_len=1, budget=fixed)
    _, s3 = naive(dict(x, gate=x["gate"] * 3.0), chunk_len=4, sink_len=1, budget=fixed)
    _, s0 = naive({k: (v[:, :, :4] if k in "q k v gate".split() else v) for k, v in x.items()}, chunk_len=4,
                  budget=fixed)
    merged1 = s1.rows()[1] - s0.rows()[1]
    merged3 = s3.rows()[1] - s0.rows()[1]
    assert_close("3x merged values", 3 * merged1, merged3, 1e-12)


def test_golden_output():
    """Frozen output of the spec on a fixed input: catches unintended drift of the semantics."""
    x = make_inputs(T=24, seed=7)
    y, s = naive(x, chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=StateBudget.power_law(2, 0.5))
    assert s.num_rows == 8 and s.coverage == 16
    got = [round(v, 8) for v in (y.sum().item(), y[0, 1, -1].sum().item(), s.keys.sum().item(), s.radii.sum().item())]
    assert got == [-75.28702527, -0.68240375, -45.42359727, 90.73364394]
