"""KVMAttention layer, RoPE and token shift: config errors, shapes, parameter names, prefix
consistency (split calls and token-by-token decode equal one full call), gradients."""
import math

import pytest
import torch

from kvmeans.layers.attention import KVMAttention, KVMAttentionConfig
from kvmeans.layers.rope import RotaryEmbedding
from kvmeans.layers.token_shift import TokenShift, attention_shift_alphas, mlp_shift_alpha, token_shift
from kvmeans.ops.budget import StateBudget

# A budget above one chunk but small enough that T=29 forces merges (the gate only acts there).
TINY = dict(hidden_size=32, num_heads=4, num_kv_heads=2, chunk_len=4, n_bswa_chunks=2, budget=StateBudget.fixed(6))
BUDGETS = {"fixed6": StateBudget.fixed(6), "power_law": StateBudget.power_law(2.0, 0.5, min_len=4)}


def make_layer(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = KVMAttentionConfig(**{**TINY, "init_output_zero": False, **overrides})
    return KVMAttention(cfg)


def run_split(layer, x, cuts, **kw):
    """Feed ``x`` in pieces ending at ``cuts``; returns the concatenated outputs."""
    ys, state, begin = [], None, 0
    for end in (*cuts, x.shape[1]):
        y, state = layer(x[:, begin:end], state, **kw)[:2]
        ys.append(y)
        begin = end
    return torch.cat(ys, dim=1), state


# ---- config -------------------------------------------------------------------------------------
CONFIG_ERRORS = [
    (dict(hidden_size=0, num_heads=4), "hidden_size"),
    (dict(hidden_size=32, num_heads=0), "num_heads"),
    (dict(hidden_size=30, num_heads=4), "head_dim"),
    (dict(hidden_size=32, num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(hidden_size=32, num_heads=4, rope_dim=3), "rope_dim"),
    (dict(hidden_size=32, num_heads=4, rope_dim=10), "rope_dim"),
    (dict(hidden_size=32, num_heads=4, chunk_len=4, sink_len=4), "sink_len"),
    (dict(hidden_size=32, num_heads=4, n_bswa_chunks=0), "n_bswa_chunks"),
    (dict(hidden_size=32, num_heads=4, chunk_len=0), "chunk_len"),
    (dict(hidden_size=32, num_heads=4, head_dim=-1), "head_dim"),
    (dict(hidden_size=32, num_heads=4, layer_idx=2, num_layers=2), "layer_idx"),
]


@pytest.mark.parametrize("kwargs, name", CONFIG_ERRORS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(CONFIG_ERRORS)])
def test_config_errors_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"KVMAttentionConfig\.{name}\b"):
        KVMAttentionConfig(**kwargs)


def test_config_derived_defaults():
    cfg = KVMAttentionConfig(hidden_size=64, num_heads=4)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.value_head_dim, cfg.rope_dim) == (4, 16, 16, 8)
    assert KVMAttentionConfig(hidden_size=32, num_heads=4, sink_len=4, chunk_len=4, sinks=False).effective_sink_len == 0
    assert KVMAttentionConfig(hidden_size=32, num_heads=4, budget=8).budget(100) == 8


# ---- parameters -----------------------------------------------------------------------------------
def test_parameter_names_and_shapes():
    layer = make_layer(value_residual=True)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "x_q": (32,), "x_k": (16,), "x_v": (16,), "state_head_temp": (4,), "front_head_temp": (4,),
        "v_gate0": (1, 1, 16), "v_gate1.weight": (32, 32), "v_gate2.weight": (16, 32),
        "c_q.weight": (32, 32), "c_k.weight": (16, 32), "c_v.weight": (16, 32),
        "ln_q.weight": (8,), "ln_q.bias": (8,), "ln_k.weight": (8,), "ln_k.bias": (8,),
        "c_proj.weight": (32, 32), "ln_s_k.weight": (8,), "ln_s_k.bias": (8,), "key_weighting.weight": (2, 32)}


@pytest.mark.parametrize("flag, gone", [
    ("token_shift", {"x_q", "x_k", "x_v"}),
    ("qk_norm", {"ln_q.weight", "ln_q.bias", "ln_k.weight", "ln_k.bias"}),
    ("merge_gate", {"key_weighting.weight"}),
    ("head_temps", {"state_head_temp", "front_head_temp"}),
], ids=["token_shift", "qk_norm", "merge_gate", "head_temps"])
def test_ablation_switches_remove_parameters(flag, gone):
    full = {n for n, _ in make_layer().named_parameters()}
    ablated = {n for n, _ in make_layer(**{flag: False}).named_parameters()}
    assert gone <= full and full - ablated == gone
    assert not {"v_gate0", "v_gate1.weight", "v_gate2.weight"} & full


def test_output_projection_starts_at_zero():
    layer = KVMAttention(KVMAttentionConfig(**TINY))
    assert torch.count_nonzero(layer.c_proj.weight) == 0


# ---- shapes ---------------------------------------------------------------------------------------
def test_gqa_shapes():
    layer = make_layer(value_head_dim=6)
    y, state = layer(torch.randn(3, 11, 32))
    assert y.shape == (3, 11, 32)
    assert state.seen_tokens == 11 and state.keys.shape[:2] == (3, 2) and state.values.shape[-1] == 6
    assert state.extras["shift_q"].shape == (3, 32) and state.extras["shift_v"].shape == (3, 12)


def test_value_residual_anchor():
    layer = make_layer(value_residual=True)
    with torch.no_grad():
        layer.v_gate1.weight.normal_()                  # make the mix data dependent
    x = torch.randn(2, 7, 32)
    y, _ = layer(x)
    y_self, _ = layer(x, v_first=layer.c_v(x))          # own projection as anchor: the mix is a no-op
    y_other, _ = layer(x, v_first=torch.randn_like(layer.c_v(x)))
    torch.testing.assert_close(y, y_self)
    assert not torch.allclose(y, y_other)


def test_bad_inputs_raise():
    layer = make_layer()
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(2, 5, 31))
    _, state = layer(torch.randn(2, 5, 32))
    state.extras.clear()
    with pytest.raises(ValueError, match="token-shift predecessors"):
        layer(torch.randn(2, 1, 32), state)


# ---- prefix consistency -----------------------------------------------------------------------------
VARIANTS = {
    "default": {},
    "value_residual": dict(value_residual=True),
    "nope_nosink_noshift": dict(rope_dim=0, sinks=False, token_shift=False, qk_norm=False),
    "no_gate_no_temps": dict(merge_gate=False, head_temps=False, value_radius=False),
}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_calls_equal_full_forward(variant, budget):
    layer = make_layer(budget=BUDGETS[budget], **VARIANTS[variant])
    x = torch.randn(2, 29, 32)
    with torch.no_grad():
        y_full, state_full = layer(x)[:2]
        for cuts in [(1,), (3,), (4,), (6,), (13,), (28,), (5, 9, 22)]:
            y_split, state = run_split(layer, x, cuts)
            torch.testing.assert_close(y_split, y_full, rtol=1e-5, atol=1e-5, msg=f"cuts={cuts}")
            assert state.seen_tokens == 29 and state.num_rows == state_full.num_rows


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_token_by_token_decode_equals_full_forward(budget):
    layer = make_layer(budget=BUDGETS[budget])
    x = torch.randn(2, 29, 32)
    with torch.no_grad():
        y_full = layer(x)[0]
        y_steps, _ = run_split(layer, x, tuple(range(1, 29)))
    torch.testing.assert_close(y_steps, y_full, rtol=1e-5, atol=1e-5)


def test_position_offset_moves_the_continuation():
    layer = make_layer()
    x = torch.randn(1, 10, 32)
    with torch.no_grad():
        _, state = layer(x[:, :6])
        y_default = layer(x[:, 6:], state.clone())[0]
        y_same = layer(x[:, 6:], state.clone(), position_offset=6)[0]
        y_far = layer(x[:, 6:], state.clone(), position_offset=106)[0]
    torch.testing.assert_close(y_same, y_default)
    assert not torch.allclose(y_far, y_default, atol=1e-4)  # window keys now look 100 tokens older


# ---- gradients --------------------------------------------------------------------------------------
def test_gradients_reach_every_parameter():
    layer = make_layer(value_residual=True)
    x = torch.randn(2, 29, 32)
    v_first = torch.randn(2, 29, 16)  # an external anchor, else the value-residual mix has no effect
    with torch.no_grad():
        layer.v_gate1.weight.normal_(std=0.1)  # zero at init, which would block v_gate2's gradient
    y = layer(x, v_first=v_first)[0]
    (y * torch.randn_like(y)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ---- RoPE -------------------------------------------------------------------------------------------
def slow_rope(x, positions, rope_dim, theta):
    """The formula of docs/reference-conventions.md §4.5, pair by pair in float64."""
    out = x.double().clone()
    half = rope_dim // 2
    for j in range(half):
        f = theta ** (-j / (half - 1)) if half > 1 else 1.0
        for t, p in enumerate(positions.tolist()):
            c, s = math.cos(p * f), math.sin(p * f)
            x0, x1 = x[..., t, 2 * j].double(), x[..., t, 2 * j + 1].double()
            out[..., t, 2 * j] = x0 * c + x1 * s
            out[..., t, 2 * j + 1] = x1 * c - x0 * s
    return out


@pytest.mark.parametrize("rope_dim, theta", [(2, 10000.0), (4, 10000.0), (8, 500.0), (16, 10000.0)])
def test_rope_matches_slow_formula(rope_dim, theta):
    x = torch.randn(2, 3, 7, 16)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1000])
    out = RotaryEmbedding(rope_dim, theta).apply_rotary(x, positions)
    torch.testing.assert_close(out.double(), slow_rope(x, positions, rope_dim, theta), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[..., rope_dim:], x[..., rope_dim:], rtol=0, atol=0)


def test_rope_int_offset_equals_positions_and_bf16_rounding():
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(rope(x, 3), rope(x, torch.arange(3, 8)))
    cos, sin = RotaryEmbedding(8, reference_bf16=True).cos_sin(3, 5, "cpu", torch.float32)
    torch.testing.assert_close(cos, cos.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(cos, rope.cos_sin(3, 5, "cpu", torch.float32)[0])


def test_rope_preserves_pair_norms():
    x = torch.randn(2, 3, 9, 12)
    out = RotaryEmbedding(8)(x, torch.arange(9) * 37)
    pair_norm = lambda t: t[..., :8].unflatten(-1, (4, 2)).norm(dim=-1)
    torch.testing.assert_close(pair_norm(out), pair_norm(x))


def test_rope_scores_depend_on_relative_position():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    def score(p, s):
        return (rope(q.view(1, 1, 1, 8), torch.tensor([p])) * rope(k.view(1, 1, 1, 8), torch.tensor([s]))).sum()
    for p, s in [(5, 2), (40, 0), (7, 7)]:
        for shift in (1, 13, 250):
            torch.testing.assert_close(score(p + shift, s + shift), score(p, s), rtol=1e-5, atol=1e-5)  # fp32 angles


def test_rope_rejects_bad_dims():
    with pytest.raises(ValueError, match="rope_dim"):
        RotaryEmbedding(3)
    with pytest.raises(ValueError, match="rope_dim"):
        RotaryEmbedding(10)(torch.randn(1, 1, 2, 8), 0)


# ---- token shift ------------------------------------------------------------------------------------
def test_token_shift_predecessor_modes():
    x, alpha = torch.randn(2, 5, 6), torch.rand(6)
    first, zero = token_shift(x, alpha, predecessor="first"), token_shift(x, alpha, predecessor="zero")
    torch.testing.assert_close(first[:, 0], x[:, 0])
    torch.testing.assert_close(zero[:, 0], x[:, 0] * (1 - alpha))
    torch.testing.assert_close(first[:, 1:], zero[:, 1:])
    torch.testing.assert_close(first[:, 3], x[:, 3] + alpha * (x[:, 2] - x[:, 3]))


@pytest.mark.parametrize("predecessor", ["first", "zero"])
def test_token_shift_carried_prev_equals_full_sequence(predecessor):
    shift = TokenShift(6, torch.rand(6), predecessor)
    x = torch.randn(2, 9, 6)
    full, last = shift(x)
    torch.testing.assert_close(last, x[:, -1])
    parts, prev = [], None
    for piece in x.split([4, 1, 4], dim=1):
        y, prev = shift(piece, prev)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)


def test_shift_alpha_ramps():
    a_q, a_k, a_v = attention_shift_alphas(8, 4, 6, layer_idx=1, num_layers=4)
    rho = 0.75
    torch.testing.assert_close(a_q, torch.tensor([1 - (i / 8) ** (0.2 * rho) for i in range(8)]))
    torch.testing.assert_close(a_k, torch.tensor([1 - (i / 4) ** (0.7 * rho) for i in range(4)]))
    assert a_v.shape == (6,) and a_v[0] == 1 and bool((a_v.diff() < 0).all())
    torch.testing.assert_close(mlp_shift_alpha(5, 1, 4), torch.tensor([1 - (i / 5) ** rho ** 4 for i in range(5)]))


def test_mixed_numerics_layer_in_bfloat16():
    """numerics="mixed" reaches kvm_attention: a bf16 layer's output differs from exact by bf16 rounding only,
    and its carried state is exact's."""
    x = torch.randn(2, 29, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    (y0, s0), (y1, s1) = (make_layer(numerics=m).bfloat16()(x)[:2] for m in ("exact", "mixed"))
    assert not torch.equal(y0, y1)
    assert (y0.float() - y1.float()).norm() <= 2e-2 * y0.float().norm()
    assert all(torch.equal(a, b) for a, b in zip(s0.rows(), s1.rows()))


def test_layer_gradients_same_with_both_chunked_backwards(monkeypatch):
    """The layer's parameter gradients do not depend on how the chunked op keeps its backward state."""
    import kvmeans.ops.chunk as chunk_mod
    x = torch.randn(2, 29, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for mode in ("graph", "reconstruct"):
        monkeypatch.setattr(chunk_mod, "BACKWARD", mode)
        layer = make_layer(budget=BUDGETS["power_law"]).double()
        y, state = layer(x)[:2]
        (y.pow(2).sum() + state.rows()[0].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-9, atol=1e-12, msg=n)
