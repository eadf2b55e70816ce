"""Bad input gets a clear error naming the argument and the fix."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention

q = torch.randn(1, 4, 10, 8)
k = torch.randn(1, 2, 10, 8)
v = torch.randn(1, 2, 10, 8)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((q[0], k, v), {}, ValueError, r"q must be 4-D \[B, H, T, D\]"),
    ((q, k[..., 0], v), {}, ValueError, r"k must be 4-D"),
    ((q, torch.randn(1, 3, 10, 8), torch.randn(1, 3, 10, 8)), {}, ValueError, "not a multiple of k's Hkv=3"),
    ((q, k[:, :, :9], v), {}, ValueError, "sequence lengths differ"),
    ((q, k, v[:, :1]), {}, ValueError, "v has 1 heads but k has 2"),
    ((q, k.double(), v), {}, TypeError, "k has dtype torch.float64 but q has torch.float32"),
    ((q, k, v, torch.ones(1, 2, 9)), {}, ValueError, r"gate must be \[B, Hkv, T\]"),
    ((q, k, v), dict(chunk_len=0), ValueError, "chunk_len must be a positive int"),
    ((q, k, v), dict(n_bswa_chunks=0), ValueError, "n_bswa_chunks must be an int >= 1"),
    ((q, k, v), dict(chunk_len=4, sink_len=4, budget=4), ValueError, "sink_len=4 leaves no mergeable state row"),
    ((q, k, v), dict(rope_dim=9), ValueError, r"rope_dim must be an int in \[0, D=8\]"),
    ((q, k, v), dict(state_temp=torch.ones(2)), ValueError, r"state_temp must be a tensor of shape \[4\]"),
    ((q, k, v), dict(state_norm_weight=torch.ones(4)), ValueError,
     r"state_norm_weight must be a tensor of shape \[8\]"),
    ((q, k, v), dict(chunk_len=4, budget=StateBudget.fixed(2)), ValueError, "would shrink the state"),
    ((q, k, v), dict(budget="big"), TypeError, "budget must be a StateBudget"),
    ((q, k, v), dict(backend="cuda"), ValueError, "backend must be one of"),
    ((q, k, v), dict(initial_state="state"), TypeError, "initial_state must be a KVMState"),
    # every scalar: non-finite, out of range or wrong-typed values name the argument
    ((q, k, v), dict(chunk_len=4.0), ValueError, "chunk_len must be a positive int"),
    ((q, k, v), dict(chunk_len=True), ValueError, "chunk_len must be a positive int"),
    ((q, k, v), dict(n_bswa_chunks=2.5), ValueError, "n_bswa_chunks must be an int >= 1"),
    ((q, k, v), dict(chunk_len=4, budget=4, sink_len=True), ValueError, "sink_len must be an int"),
    ((q, k, v), dict(chunk_len=4, budget=4, sink_len=-1), ValueError, "sink_len must be an int"),
    ((q, k, v), dict(chunk_len=4, budget=4, sink_len=1.0), ValueError, "sink_len must be an int"),
    ((q, k, v), dict(rope_dim=True), ValueError, "rope_dim must be an int"),
    ((q, k, v), dict(scale=float("nan")), ValueError, "scale must be a finite number > 0, got nan"),
    ((q, k, v), dict(scale=float("inf")), ValueError, "scale must be a finite number > 0"),
    ((q, k, v), dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    ((q, k, v), dict(scale="0.1"), ValueError, "scale must be a finite number > 0"),
    ((q, k, v), dict(state_norm_eps=0.0), ValueError, "state_norm_eps must be a finite number > 0"),
    ((q, k, v), dict(state_norm_eps=-1e-5), ValueError, "state_norm_eps must be a finite number > 0"),
    ((q, k, v), dict(state_norm_eps=float("nan")), ValueError, "state_norm_eps must be a finite number > 0"),
    ((q, k, v), dict(value_radius="no"), TypeError, "value_radius must be a bool, got 'no'"),
    ((q, k, v), dict(gate_keys=None), TypeError, "gate_keys must be a bool"),
    ((q, k, v), dict(gate_values=2), TypeError, "gate_values must be a bool"),
    ((q, k, v), dict(gate_appends="False"), TypeError, "gate_appends must be a bool"),
    ((q, k, v), dict(return_state="yes"), TypeError, "return_state must be a bool"),
    ((q, k, v), dict(backend=["auto"]), ValueError, "backend must be one of"),
    ((q, k, v), dict(numerics=None), ValueError, "numerics must be one of"),
    ((q, k, v), dict(budget=True), TypeError, "got a bool"),
    ((q, k, v), dict(chunk_len=4, budget=3), ValueError, r"budget=3 \(fixed\) would shrink the state"),
    ((q, k, v), dict(chunk_len=4, budget=StateBudget.fixed(3)), ValueError, r"budget=3 \(fixed\) would shrink"),
    ((q, k, v), dict(chunk_len=2, budget=lambda t: float("inf")), TypeError,
     "returned inf; a budget must return a finite"),
    ((q, k, v), dict(chunk_len=2, budget=lambda t: float("nan")), TypeError, "returned nan"),
    # degenerate shapes: only T may be 0
    ((q[:0], k[:0], v[:0]), {}, ValueError, r"B \(batch\) is 0"),
    ((q[..., :0], k[..., :0], v), {}, ValueError, r"D \(head dim\) is 0"),
    ((q, k, v[..., :0]), {}, ValueError, r"Dv \(value dim\) is 0"),
    ((q[:, :0], k, v), {}, ValueError, r"H \(q heads\) is 0"),
    ((q.to("meta"), k.to("meta"), v.to("meta")), {}, ValueError, "q is a meta tensor"),
])
def test_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvm_attention(*args, **kwargs)


def test_state_from_another_config():
    _, s = kvm_attention(q, k, v, chunk_len=4, budget=4, return_state=True)
    with pytest.raises(ValueError, match="initial_state was built with chunk_len=4 but this call uses chunk_len=2"):
        kvm_attention(q, k, v, chunk_len=2, budget=4, initial_state=s)
    with pytest.raises(ValueError, match=r"initial_state holds \[batch, kv_heads, head_dim, value_dim\]"):
        kvm_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), chunk_len=4,
                      budget=4, initial_state=s)
    with pytest.raises(ValueError, match=r"convert it with state.to\(torch.float64\)"):
        kvm_attention(q.double(), k.double(), v.double(), chunk_len=4, budget=4, initial_state=s)


def test_carried_state_larger_than_a_fixed_budget():
    _, s = kvm_attention(q, k, v, chunk_len=2, budget=StateBudget.power_law(4, 1.0), return_state=True)
    assert s.num_rows > 4
    with pytest.raises(ValueError, match=f"carried state's {s.num_rows} rows"):
        kvm_attention(q, k, v, chunk_len=2, budget=StateBudget.fixed(4), initial_state=s)


def test_empty_sequence():
    y, s = kvm_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], return_state=True)
    assert y.shape == (1, 4, 0, 8) and s.seen_tokens == 0


def test_flags_accept_the_authors_ints():
    y0 = kvm_attention(q, k, v, chunk_len=4, budget=4, gate_keys=True, value_radius=True)
    y1 = kvm_attention(q, k, v, chunk_len=4, budget=4, gate_keys=1, value_radius=1)
    assert torch.equal(y0, y1)
