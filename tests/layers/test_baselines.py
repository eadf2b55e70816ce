"""Baseline mixers (full, SWA, BSWA, OVQ): masks and OVQ against slow transcriptions of reference
4.8-4.11, split calls == one call, bounded caches, state operations, parameter names, config errors."""
import math

import pytest
import torch

from kvmeans.layers.attention import AttentionConfig
from kvmeans.layers.baselines import (
    BlockSlidingWindowAttention,
    BSWAConfig,
    FullAttention,
    SlidingWindowAttention,
    SWAConfig,
)
from kvmeans.layers.ovq import OVQAttention, OVQConfig, ovq_dict_size

BASE = dict(hidden_size=32, num_heads=4, num_kv_heads=2, init_output_zero=False, value_residual=True)
T = 37


def make(kind, seed=0, **kw):
    torch.manual_seed(seed)
    if kind == "full":
        layer = FullAttention(AttentionConfig(**BASE, **kw))
    elif kind == "swa":
        layer = SlidingWindowAttention(SWAConfig(**BASE, **{"window": 7, "query_block": 5, **kw}))
    elif kind == "bswa":
        layer = BlockSlidingWindowAttention(BSWAConfig(**BASE, **{"chunk_len": 4, "n_chunks": 2, "sink_len": 2,
                                                                  "query_block": 3, **kw}))
    else:
        layer = OVQAttention(OVQConfig(**BASE, **{"chunk_len": 4, "max_centroids": 6, **kw}))
    with torch.no_grad():
        layer.v_gate1.weight.normal_(std=0.3)          # make the value-residual mix data dependent
    return layer


def run_split(layer, x, cuts, v_first=None):
    ys, state, begin = [], None, 0
    for end in (*cuts, x.shape[1]):
        vf = None if v_first is None else v_first[:, begin:end]
        y, state = layer(x[:, begin:end], state, v_first=vf)
        ys.append(y)
        begin = end
    return torch.cat(ys, dim=1), state


# ---- slow references ------------------------------------------------------------------------------
def dense_mask(kind, layer, n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    c = layer.config
    if kind == "full":
        return j <= i
    if kind == "swa":
        return (j <= i) & (j > i - c.window)
    return (j <= i) & ((j // c.chunk_len >= i // c.chunk_len - c.n_chunks + 1) | (j < c.sink_len))


def slow_ovq(q, k, v, beta, L, N, eps=1e-5):
    """Reference 4.11 chunk by chunk in float64, with the authors' learning-rate form of the update."""
    B, H, n, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    q = q / (q.norm(dim=-1, keepdim=True) + eps) * (beta.view(1, H, 1, 1) * math.sqrt(D))
    k = k / (k.norm(dim=-1, keepdim=True) + eps)
    dk, dv = torch.zeros(B, Hkv, N, D, dtype=q.dtype), torch.zeros(B, Hkv, N, v.shape[-1], dtype=q.dtype)
    cnt = torch.zeros(B, Hkv, N, dtype=q.dtype)
    sizes = [0]
    for c in range(1, -(-n // L) + 1):
        t = min(n, c * L)
        sizes.append(max(sizes[-1], min(int(t * N / (t + N)), N)))
    y = torch.zeros(B, H, n, v.shape[-1], dtype=q.dtype)
    for c in range(len(sizes) - 1):
        s, e, d = c * L, min(n, (c + 1) * L), sizes[c]
        for b in range(B):
            for h in range(H):
                kv = h // g
                for t in range(s, e):
                    logits = torch.cat((q[b, h, t] @ dk[b, kv, :d].T + cnt[b, kv, :d].log(),
                                        q[b, h, t] @ k[b, kv, s:t + 1].T))
                    p = logits.softmax(0)
                    y[b, h, t] = p @ torch.cat((dv[b, kv, :d], v[b, kv, s:t + 1]))
        if e - s < L:
            break
        num_new = sizes[c + 1] - d
        for b in range(B):
            for h in range(Hkv):
                kc, vc = k[b, h, s:e], v[b, h, s:e]
                if d == 0:
                    assign = torch.zeros(L, dtype=torch.long)
                    sim = kc @ kc[0]
                    sim[0] = float("inf")
                    low = sim.topk(num_new - 1, largest=False).indices
                    assign[low] = torch.arange(1, num_new)
                else:
                    best, assign = (kc @ dk[b, h, :d].T).max(-1)
                    low = best.topk(num_new, largest=False).indices
                    assign[low] = torch.arange(d, d + num_new)
                cnt[b, h].index_add_(0, assign, torch.ones(L, dtype=q.dtype))
                lr = (1.0 / cnt[b, h, assign]).unsqueeze(-1)
                dk[b, h].index_add_(0, assign, -lr * (dk[b, h, assign] - kc))
                dv[b, h].index_add_(0, assign, -lr * (dv[b, h, assign] - vc))
    return y


@pytest.mark.parametrize("kind", ["full", "swa", "bswa"])
def test_masks_match_dense_reference(kind):
    layer = make(kind).double()
    x = torch.randn(2, T, 32, dtype=torch.float64)
    with torch.no_grad():
        y, _ = layer(x)
        q, k, v, _, _ = layer._prepare(x)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense_mask(kind, layer, T))
    torch.testing.assert_close(y, layer._project_out(ref))


def test_ovq_matches_slow_reference():
    layer = make("ovq").double()
    with torch.no_grad():
        layer.beta.uniform_(0.5, 1.5)
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    with torch.no_grad():
        y, state = layer(x)
        q, k, v, _, _ = layer._prepare(x)
        ref = slow_ovq(q, k, v, layer.beta, 4, 6)
    torch.testing.assert_close(y, layer._project_out(ref))
    assert state.size == ovq_dict_size(28, 6) and state.pending_len == 2 and state.seen_tokens == 30


def test_ovq_dict_sizes_plateau():
    sizes = [ovq_dict_size(c * 256, 1024) for c in range(200)]
    assert sizes[:3] == [0, 204, 341] and all(a <= b <= 1024 for a, b in zip(sizes, sizes[1:]))
    assert max(b - a for a, b in zip(sizes, sizes[1:])) <= 256


# ---- prefix consistency and caches --------------------------------------------------------------------
KINDS = ["full", "swa", "bswa", "ovq"]


@pytest.mark.parametrize("kind", KINDS)
def test_split_calls_equal_full_forward(kind):
    layer = make(kind)
    x, v_first = torch.randn(2, T, 32), torch.randn(2, T, 16)
    with torch.no_grad():
        y_full, _ = layer(x, v_first=v_first)
        for cuts in [(1,), (4,), (7,), (2, 3, 11, 12, 29), tuple(range(1, T))]:
            y_split, state = run_split(layer, x, cuts, v_first)
            torch.testing.assert_close(y_split, y_full, rtol=1e-5, atol=1e-5, msg=f"cuts={cuts}")
            assert state.seen_tokens == T


@pytest.mark.parametrize("kind", ["swa", "bswa", "ovq"])
def test_cache_memory_is_bounded(kind):
    layer = make(kind)
    sizes = []
    with torch.no_grad():
        _, state = layer(torch.randn(1, 3, 32))
        for _ in range(40):
            _, state = layer(torch.randn(1, 1, 32), state)
            sizes.append(state.nbytes)
        _, state = layer(torch.randn(1, 50, 32), state)       # a long call leaves the same footprint
    assert len(set(sizes)) == 1 and state.nbytes == sizes[0]
    if kind == "swa":
        assert state.length == 6
    if kind == "bswa":
        assert state.n_sinks == 2 and state.length <= 2 + 2 * 4 - 1


def test_full_cache_grows_geometrically():
    layer = make("full")
    caps = []
    with torch.no_grad():
        _, state = layer(torch.randn(1, 5, 32))
        for _ in range(40):
            _, state = layer(torch.randn(1, 1, 32), state)
            caps.append(state.keys.shape[2])
    assert state.length == 45 and sorted(set(caps)) == [10, 20, 40, 80]


@pytest.mark.parametrize("kind", KINDS)
def test_state_reorder_index_select_clone(kind):
    layer = make(kind)
    x = torch.randn(3, 13, 32)
    with torch.no_grad():
        y_full, _ = layer(x)
        _, state = layer(x[:, :9])
        snapshot = state.clone()
        y_a, _ = layer(x[[2, 0], 9:], state.index_select(torch.tensor([2, 0])))
        y_b, _ = layer(x[[2, 0], 9:], state.reorder_(torch.tensor([2, 0])))
        y_c, _ = layer(x[:, 9:], snapshot)
    torch.testing.assert_close(y_a, y_full[[2, 0], 9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_b, y_a)
    torch.testing.assert_close(y_c, y_full[:, 9:], rtol=1e-5, atol=1e-5)
    assert state.seen_tokens == 13 and snapshot.seen_tokens == 13
    with pytest.raises(ValueError, match="batch"):
        layer(x[:1, :1], snapshot)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    layer = make(kind)
    x, v_first = torch.randn(2, 21, 32), torch.randn(2, 21, 16)
    y, state = layer(x, v_first=v_first)
    (y * torch.randn_like(y)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    _, state = layer(x[:, :5], state.detach())   # a graph-free continuation still works


def test_parameter_names():
    full = {n for n, _ in make("full").named_parameters()}
    assert full == {"x_q", "x_k", "x_v", "v_gate0", "v_gate1.weight", "v_gate2.weight", "c_q.weight", "c_k.weight",
                    "c_v.weight", "ln_q.weight", "ln_q.bias", "ln_k.weight", "ln_k.bias", "c_proj.weight"}
    assert {n for n, _ in make("swa").named_parameters()} == full
    assert {n for n, _ in make("bswa").named_parameters()} == full
    ovq = dict(make("ovq").named_parameters())
    assert set(ovq) == (full - {"ln_q.weight", "ln_q.bias", "ln_k.weight", "ln_k.bias"}) | {"beta"}
    assert torch.equal(ovq["beta"], torch.ones(4))
    assert make("ovq").config.rope_dim == 0


@pytest.mark.parametrize("cls, kwargs, name", [
    (SWAConfig, dict(window=0), "window"),
    (BSWAConfig, dict(n_chunks=0), "n_chunks"),
    (BSWAConfig, dict(sink_len=-1), "sink_len"),
    (OVQConfig, dict(rope_dim=4), "rope_dim"),
    (OVQConfig, dict(qk_norm=True), "qk_norm"),
    (OVQConfig, dict(max_centroids=0), "max_centroids"),
])
def test_config_errors_name_the_field(cls, kwargs, name):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name}\b"):
        cls(hidden_size=32, num_heads=4, **kwargs)
