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
    ((q, k, v), dict(state_norm_weight=torch.ones(4)), ValueError, r"state_norm_weight must be a tensor of shape \[8\]"),
    ((q, k, v), dict(chunk_len=4, budget=StateBudget.fixed(2)), ValueError, "would shrink the state"),
    ((q, k, v), dict(budget="big"), TypeError, "budget must be a StateBudget"),
    ((q, k, v), dict(backend="cuda"), ValueError, "backend must be one of"),
    ((q, k, v), dict(initial_state="state"), TypeError, "initial_state must be a KVMState"),
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
