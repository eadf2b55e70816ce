"""kvm_attention's entry: scalar settings are checked once per distinct setting (a decode step re-checks
nothing), and that cache never lets a bad value through nor swaps the budget given."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.ops import backends, checks

torch.manual_seed(0)
q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
GOOD = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=4, budget=4, state_norm_eps=1e-5, scale=0.5,
            value_radius=True, gate_keys=True, gate_values=True, gate_appends=False, backend="auto",
            numerics="exact")


@pytest.mark.parametrize("bad,exc,match", [
    (dict(chunk_len=4.0), ValueError, "chunk_len must be a positive int"),      # == 4, a float
    (dict(n_bswa_chunks=True), ValueError, "n_bswa_chunks must be an int"),    # == 1, a bool
    (dict(sink_len=True), ValueError, "sink_len must be an int"),
    (dict(rope_dim=4.0), ValueError, "rope_dim must be an int"),
    (dict(rope_dim=9), ValueError, r"rope_dim must be an int in \[0, D=8\]"),
    (dict(budget=True), TypeError, "got a bool"),                               # == 1
    (dict(budget=StateBudget.fixed(2)), ValueError, "would shrink the state"),
    (dict(state_norm_eps=-1e-5), ValueError, "state_norm_eps must be a finite number > 0"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number > 0, got nan"),
    (dict(value_radius=2), TypeError, "value_radius must be a bool"),
    (dict(gate_appends=None), TypeError, "gate_appends must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(numerics=["exact"]), ValueError, "numerics must be one of"),        # unhashable: checked uncached
    (dict(chunk_len=[4]), ValueError, "chunk_len must be a positive int"),
])
def test_a_bad_value_after_a_good_one_is_still_refused(bad, exc, match):
    good = kvm_attention(q, k, v, **GOOD)
    for _ in range(2):                          # also once it was refused before
        with pytest.raises(exc, match=match):
            kvm_attention(q, k, v, **{**GOOD, **bad})
    assert torch.equal(kvm_attention(q, k, v, **GOOD), good)


def test_the_scalar_checks_run_once_per_setting(monkeypatch):
    calls = []
    real = checks._check_config
    monkeypatch.setattr(checks, "_check_config", lambda *a: calls.append(a) or real(*a))
    checks._checked_scalars.cache_clear()
    kw = {**GOOD, "chunk_len": 5, "budget": 5}
    _, state = kvm_attention(q, k, v, return_state=True, **kw)
    with torch.no_grad():
        for t in range(3):                         # decode steps
            kvm_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], initial_state=state, **kw)
    assert len(calls) == 2                         # return_state differs: two settings
    with pytest.raises(ValueError, match="chunk_len must be a positive int"):
        kvm_attention(q, k, v, **{**kw, "chunk_len": 5.0})
    assert len(calls) == 3                         # a new type is a new setting


def test_default_temperatures_are_one_tensor_usable_under_autograd():
    seen = []
    real = backends.naive_kvm_attention
    backends.naive_kvm_attention = lambda *a, **kw: seen.append(kw["state_temp"]) or real(*a, **kw)
    try:
        with torch.inference_mode():                # the first call made the shared ones here
            kvm_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], chunk_len=4, budget=4, backend="naive")
        qg = q.clone().requires_grad_()
        kvm_attention(qg, k, v, chunk_len=4, budget=4, backend="naive").sum().backward()
    finally:
        backends.naive_kvm_attention = real
    assert seen[0] is seen[1] and torch.equal(seen[0], torch.ones(4)) and not seen[0].is_inference()
    assert torch.isfinite(qg.grad).all()


class _AnyBudget:
    """Equal to (and hashing like) every other: the cache must still use the budget given, not an equal one."""

    def __init__(self, rows):
        self.rows, self.asked = rows, 0

    def __call__(self, ctx_len):
        self.asked += 1
        return self.rows

    def __eq__(self, other):
        return isinstance(other, _AnyBudget)

    def __hash__(self):
        return 0


class _Unhashable:
    __hash__ = None

    def __call__(self, ctx_len):
        return 6


def test_the_budget_used_is_the_one_given():
    ql, kl, vl = torch.randn(1, 4, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)   # blocks leave
    first, second = _AnyBudget(4), _AnyBudget(6)
    _, s1 = kvm_attention(ql, kl, vl, chunk_len=4, budget=first, return_state=True)
    _, s2 = kvm_attention(ql, kl, vl, chunk_len=4, budget=second, return_state=True)
    assert first.asked and second.asked and (s1.num_rows, s2.num_rows) == (4, 6)
    _, s3 = kvm_attention(ql, kl, vl, chunk_len=4, budget=_Unhashable(), return_state=True)
    assert s3.num_rows == 6
