"""finite_tokens: uncopied when every token is finite (a sum that overflows included), exact flags otherwise."""
import torch

from kvmeans.ops.masking import finite_tokens


def test_finite_tokens_are_returned_uncopied():
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 6)
    k[0, 0, 0] = 3e38                         # finite, but the sum of all entries overflows to inf
    k[0, 0, 1] = 3e38
    out_k, out_v, bad = finite_tokens(k, v)
    assert bad is None and out_k is k and out_v is v


def test_non_finite_tokens_are_flagged_and_zeroed():
    k, v = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.randn(2, 3, 5, 6, dtype=torch.float64)
    k[1, 2, 3, 0], v[0, 1, 4, 5], v[0, 0, 0, 0] = float("nan"), float("inf"), -float("inf")
    out_k, out_v, bad = finite_tokens(k, v)
    want = torch.zeros(2, 3, 5, dtype=torch.bool)
    want[1, 2, 3] = want[0, 1, 4] = want[0, 0, 0] = True
    assert torch.equal(bad, want)
    assert torch.isfinite(out_k).all() and torch.isfinite(out_v).all()
    assert (out_k[want] == 0).all() and (out_v[want] == 0).all()
    assert torch.equal(out_k[~want], k[~want]) and torch.equal(out_v[~want], v[~want])
