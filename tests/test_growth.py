"""Data-dependent growth (StateBudget.novelty): the rule on hand-built keys, its edges, and every path == naive."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.utils.testing import make_inputs

C, N_BSWA, D = 4, 2, 8


def h(i):
    """Zero-mean orthogonal directions (LN_s keeps them, up to scale): e_2i - e_2i+1, and w = e0 + e1 - e2 - e3."""
    x = torch.zeros(D, dtype=torch.float64)
    if i == "w":
        x[:4] = torch.tensor([1.0, 1, -1, -1])
    else:
        x[2 * i], x[2 * i + 1] = 1, -1
    return x


def hand_built(*block):
    """13 tokens: the first chunk seeds rows h0..h3 (row 0 a sink); ``block`` = tokens 4..7, which enter the
    state when token 12 arrives (bswa_begin(13) = 8); tokens 8..12 stay in the window."""
    keys = [h(0), h(1), h(2), h(3), *block] + [h(0)] * 5
    k = torch.stack(keys).view(1, 1, 13, D)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 13, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 13, D, generator=g, dtype=torch.float64)
    return q, k, v


def grow(q, k, v, threshold, cap, backend="naive", **kw):
    return kvm_attention(q, k, v, chunk_len=C, n_bswa_chunks=N_BSWA, sink_len=1, budget=StateBudget.novelty(threshold, cap),
                         return_state=True, backend=backend, **kw)


# token 4: half h1 plus w (novelty 1 - 1/3), token 5: w (novelty 1), tokens 6, 7: copies of rows 2 and 3 (novelty 0)
MIXED = (0.5 * h(1) + h("w"), h("w"), h(2), h(3))


def test_novel_token_appended_duplicates_merge():
    q, k, v = hand_built(*MIXED)
    _, st = grow(q, k, v, 0.8, 64)           # only token 5 is novel enough
    assert st.row_count.tolist() == [[5]] and st.num_rows == 5
    keys = st.rows()[0][0, 0]
    kbar = lambda x: torch.nn.functional.layer_norm(x, (D,), eps=1e-5)
    torch.testing.assert_close(keys[4], kbar(h("w")) + kbar(MIXED[0]))   # token 4 joined the new row of token 5
    torch.testing.assert_close(keys[2], 2 * kbar(h(2)))                # the duplicates merged into their rows
    torch.testing.assert_close(keys[3], 2 * kbar(h(3)))
    torch.testing.assert_close(st.radii[0, 0, 4], v[0, 0, 5].norm())   # the new row's radius is its token's |v|


def test_most_novel_first_within_the_cap():
    q, k, v = hand_built(*MIXED)
    _, st = grow(q, k, v, 0.5, 6)            # both tokens 4 and 5 qualify and fit: new rows in token order
    kbar = lambda x: torch.nn.functional.layer_norm(x, (D,), eps=1e-5)
    assert st.row_count.tolist() == [[6]]
    torch.testing.assert_close(st.rows()[0][0, 0, 4:6], torch.stack([kbar(MIXED[0]), kbar(h("w"))]))
    _, st = grow(q, k, v, 0.5, 5)            # one fits: the more novel (token 5), though token 4 comes first
    assert st.row_count.tolist() == [[5]]
    torch.testing.assert_close(st.rows()[0][0, 0, 4], kbar(h("w")) + kbar(MIXED[0]))


def test_cap_respected_and_threshold_two_never_grows():
    q, k, v = hand_built(*MIXED)
    for threshold, cap in ((0.5, 4), (2.0, 64)):
        _, st = grow(q, k, v, threshold, cap)
        assert st.row_count.tolist() == [[4]] and st.num_rows == 4
    inputs = make_inputs(T=61, D=D)
    for cap in (4, 7, 9):                    # threshold 0: every token not a copy of a row is novel
        _, st = grow(inputs["q"], inputs["k"], inputs["v"], 0.0, cap)
        assert st.row_count.eq(cap).all() and st.num_rows == cap


@pytest.mark.parametrize("spec,match", [
    (dict(threshold=-0.1, cap=8), r"threshold must be a number in \[0, 2\]"),
    (dict(threshold=2.5, cap=8), r"threshold must be a number in \[0, 2\]"),
    (dict(threshold=float("nan"), cap=8), r"threshold must be a number in \[0, 2\]"),
    (dict(threshold=0.5, cap=0), "cap must be >= 1"),
])
def test_budget_refuses_bad_settings(spec, match):
    with pytest.raises(ValueError, match=match):
        StateBudget.novelty(**spec)


def test_entry_refuses_cap_below_chunk_and_unsupported_paths():
    q, k, v = hand_built(*MIXED)
    with pytest.raises(ValueError, match="cap=3 is below the initial state of chunk_len=4"):
        grow(q, k, v, 0.5, 3)
    with pytest.raises(ValueError, match="backend='triton' does not support a novelty budget"):
        grow(q, k, v, 0.5, 8, backend="triton")
    with pytest.raises(ValueError, match="numerics='reference' does not support a novelty budget"):
        grow(q, k, v, 0.5, 8, numerics="reference")
    _, st = grow(q, k, v, 0.5, 8)
    with pytest.raises(ValueError, match="continue it with a StateBudget.novelty budget"):
        kvm_attention(q, k, v, chunk_len=C, n_bswa_chunks=N_BSWA, budget=8, initial_state=st)


def test_spec_and_config_forms():
    from kvmeans.models.config import KVMModelConfig, with_budget, preset
    from kvmeans.ops.budget import parse_budget_spec
    assert parse_budget_spec("novelty:0.3:64") == StateBudget.novelty(0.3, 64)
    with pytest.raises(ValueError, match=r"novelty:THRESHOLD:CAP"):
        parse_budget_spec("novelty:0.3")
    cfg = KVMModelConfig(budget={"kind": "novelty", "threshold": 0.3, "n": 64})
    assert cfg.state_budget() == StateBudget.novelty(0.3, 64)
    assert KVMModelConfig.from_dict(cfg.to_dict()).state_budget() == StateBudget.novelty(0.3, 64)
    small = preset("tiny-cpu", chunk_len=32)
    assert with_budget(small, "novelty:0.4:48").state_budget() == StateBudget.novelty(0.4, 48)
    with pytest.raises(ValueError, match="novelty 16 rows would shrink"):
        with_budget(small, "novelty:0.4:16")
