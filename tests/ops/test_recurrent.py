"""Any split of a sequence, token-by-token decode, and multi-token continuation == one naive call."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.utils.testing import assert_close, make_inputs

SQRT = StateBudget.power_law(2, 0.5, min_len=4)
CONFIGS = [
    dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=StateBudget.fixed(4)),
    dict(chunk_len=4, n_bswa_chunks=1, sink_len=0, rope_dim=0, budget=SQRT),
    dict(chunk_len=3, n_bswa_chunks=3, sink_len=2, rope_dim=4, budget=StateBudget.saturating(9)),
    dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=SQRT, value_radius=False, gate_appends=True),
]
T = 29


def call(inputs, lo, hi, state=None, **kw):
    part = {k: (v[:, :, lo:hi] if k in ("q", "k", "v", "gate") else v) for k, v in inputs.items()}
    return kvm_attention(part.pop("q"), part.pop("k"), part.pop("v"), part.pop("gate"), initial_state=state,
                         return_state=True, **part, **kw)


def assert_same_state(s0, s1, tol=1e-10):
    assert (s0.num_rows, s0.coverage, s0.seen_tokens, s0.window_len) == (s1.num_rows, s1.coverage, s1.seen_tokens,
                                                                        s1.window_len)
    for name, a, b in zip(("keys", "values", "radii", "wkeys", "wvalues", "wgates"), (*s0.rows(), *s0.window()),
                          (*s1.rows(), *s1.window())):
        assert_close(name, a, b, tol)


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("backend", ["chunked", "recurrent", "naive"])
def test_every_split_point(cfg, backend):
    inputs = make_inputs(T=T, Dv=6)
    y_ref, s_ref = call(inputs, 0, T, backend="naive", **cfg)
    with torch.no_grad():
        for t0 in range(1, T):
            y0, s = call(inputs, 0, t0, backend="chunked", **cfg)
            y1, s = call(inputs, t0, T, s, backend=backend, **cfg)
            assert_close(f"y split at {t0}", y_ref, torch.cat([y0, y1], 2), 1e-10)
            assert_same_state(s_ref, s)


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("steps", [(1,), (3,), (2, 5, 1, 7)])
def test_decode_and_multi_token_continuation(cfg, steps):
    inputs = make_inputs(T=T, Dv=6)
    y_ref, s_ref = call(inputs, 0, T, backend="naive", **cfg)
    ys, state, pos, i = [], None, 0, 0
    with torch.no_grad():
        while pos < T:
            end = min(T, pos + steps[i % len(steps)])
            y, state = call(inputs, pos, end, state, **cfg)        # auto: recurrent once a state exists
            ys.append(y)
            pos, i = end, i + 1
            if pos % cfg["chunk_len"] == 0:                          # states agree at every chunk boundary
                _, s_pref = call(inputs, 0, pos, backend="naive", **cfg)
                assert_same_state(s_pref, state)
    assert_close("y", y_ref, torch.cat(ys, 2), 1e-10)
    assert_same_state(s_ref, state)


@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_gradients_through_a_carried_state(cfg, backward, monkeypatch):
    """Backpropagation through time across calls (state not detached) == one call, with the chunked
    path's graph backward and its reverse state reconstruction (the carried state's gradient comes in
    through the final-state outputs and leaves through the base sums)."""
    import kvmeans.ops.chunk as chunk_mod
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    grads = []
    for split in (None, 13):
        inputs = make_inputs(T=T, Dv=6, requires_grad=True)
        if split is None:
            y, _ = call(inputs, 0, T, backend="naive", **cfg)
        else:
            y0, s = call(inputs, 0, split, **cfg)
            y1, s = call(inputs, split, T, s, **cfg)
            y = torch.cat([y0, y1], 2)
        grads.append(torch.autograd.grad((y * torch.cos(y)).sum(), list(inputs.values()), allow_unused=True,
                                         materialize_grads=True))
    for name, a, b in zip(make_inputs(T=2).keys(), *grads):
        assert_close("d" + name, a, b, 1e-10)


def test_decode_reuses_preallocated_buffers():
    cfg = dict(chunk_len=8, n_bswa_chunks=2, sink_len=1, budget=StateBudget.fixed(8))
    inputs = make_inputs(T=200, dtype=torch.float32)
    with torch.no_grad():
        _, state = call(inputs, 0, 40, **cfg)
        _, state = call(inputs, 40, 41, state, **cfg)
        ptrs = (state.keys.data_ptr(), state.window_keys.data_ptr())
        caps, nbytes = (state.row_capacity, state.window_capacity), state.nbytes
        for t in range(41, 200):
            _, state = call(inputs, t, t + 1, state, **cfg)
            assert (state.keys.data_ptr(), state.window_keys.data_ptr()) == ptrs     # no reallocation
        assert (state.row_capacity, state.window_capacity) == caps and state.num_rows == 8
        assert state.nbytes == nbytes                                                # flat memory


def test_growing_state_reallocates_geometrically():
    cfg = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, budget=StateBudget.power_law(4, 1.0))   # grows 4 rows/chunk
    inputs = make_inputs(T=400, dtype=torch.float32, B=1, H=2, Hkv=1)
    reallocations, last = 0, None
    with torch.no_grad():
        _, state = call(inputs, 0, 9, **cfg)
        for t in range(9, 400):
            _, state = call(inputs, t, t + 1, state, **cfg)
            reallocations += state.keys.data_ptr() != last
            last = state.keys.data_ptr()
    assert state.num_rows > 300 and reallocations <= 8


def test_recurrent_backend_refuses_autograd():
    inputs = make_inputs(T=12, requires_grad=True)
    _, s = call(inputs, 0, 8, chunk_len=4)
    with pytest.raises(ValueError, match="backend='recurrent' is an inference path"):
        call(inputs, 8, 9, s, chunk_len=4, backend="recurrent")
