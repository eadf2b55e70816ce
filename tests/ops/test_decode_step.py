"""The one-token decode step (kvmeans.ops.recurrent): one read of [read-out rows ; window], buffers of at most L
window tokens, the same outputs and state as the naive spec."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.utils.testing import assert_close, make_inputs

BUDGETS = {"fixed": StateBudget.fixed(8), "sqrt": StateBudget.power_law(2, 0.5, min_len=8),
           "saturating": StateBudget.saturating(20)}


def _step(x, a, b, state, **cfg):
    part = {k: (v[:, :, a:b] if k in ("q", "k", "v", "gate") else v) for k, v in x.items()}
    return kvm_attention(part.pop("q"), part.pop("k"), part.pop("v"), part.pop("gate"), initial_state=state,
                         return_state=True, **part, **cfg)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("prefill", [16, 21])
def test_one_token_steps_equal_naive(budget, prefill):
    """Token-by-token decode after a prefill (B=2, GQA, temperatures, LN affine): every output and the final
    state equal one naive call; a clone taken mid-chunk (buffers not its own) continues the same way."""
    cfg = dict(chunk_len=8, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=BUDGETS[budget])
    x = make_inputs(T=90, Dv=6)
    ref, s_ref = _step(x, 0, 90, None, backend="naive", **cfg)
    with torch.no_grad():
        ys, state = [_step(x, 0, prefill, None, **cfg)[0]], None
        _, state = _step(x, 0, prefill, None, **cfg)
        for t in range(prefill, 90):
            if t == 61:
                state = state.clone()
            y, state = _step(x, t, t + 1, state, **cfg)
            ys.append(y)
    assert_close("y", ref, torch.cat(ys, 2), 1e-10)
    assert (state.num_rows, state.coverage, state.window_len) == (s_ref.num_rows, s_ref.coverage, s_ref.window_len)
    for a, b in zip((*state.rows(), *state.window()), (*s_ref.rows(), *s_ref.window())):
        assert_close("state", b, a, 1e-10)


def test_decode_after_a_whole_chunk_prefill_reallocates_nothing():
    """A prefill ending on a chunk boundary, then 40 one-token steps: the window buffer holds at most L = n*C
    tokens (a leaving block is absorbed before the token that pushes it out is written), so no step reallocates."""
    cfg = dict(chunk_len=8, n_bswa_chunks=2, sink_len=1, budget=8)
    x = make_inputs(T=72, dtype=torch.float32)
    with torch.no_grad():
        _, state = _step(x, 0, 32, None, **cfg)
        ptrs = (state.keys.data_ptr(), state.window_keys.data_ptr())
        for t in range(32, 72):
            _, state = _step(x, t, t + 1, state, **cfg)
            assert (state.keys.data_ptr(), state.window_keys.data_ptr()) == ptrs, f"reallocated at step {t}"
    assert state.window_capacity == 16


def test_nan_token_reaches_only_the_one_token_steps_that_see_it():
    """A NaN key at position 21 of sequence 1, kv head 0 (C=4, n=2): one-token steps before it are the clean
    outputs, the steps of that head's queries that see it are NaN, everything else equals the clean run."""
    cfg = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, budget=4)
    x = make_inputs(T=40, dtype=torch.float32)
    bad = dict(x, k=x["k"].clone())
    bad["k"][1, 0, 21] = float("nan")

    def run(inputs):
        with torch.no_grad():
            y, state = _step(inputs, 0, 12, None, **cfg)
            ys = [y]
            for t in range(12, 40):
                y, state = _step(inputs, t, t + 1, state, **cfg)
                ys.append(y)
        return torch.cat(ys, 2)
    clean, y = run(x), run(bad)
    assert_close("before the NaN", clean[:, :, :21], y[:, :, :21], 1e-5)
    assert_close("other sequence", clean[0], y[0], 1e-5)
    assert torch.isnan(y[1, :2, 21:]).any(-1).all()         # in the window, then merged into the state
    assert_close("the other kv head's queries", clean[1, 2:], y[1, 2:], 1e-5)
