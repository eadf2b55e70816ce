"""Head-parallel CPU prefill (kvmeans.ops.chunk.lanes) == the serial chunked path == naive: outputs, carried state,
the decode that follows; and it stays off where it must."""
import os
import threading

import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.ops.chunk import lanes
from kvmeans.ops.state import joint_buffers
from kvmeans.utils.testing import TOLERANCES, assert_close, make_inputs

SQRT = StateBudget.power_law(2, 0.5, min_len=4)

# (B, H, Hkv, T, C, n, sink, budget, rope_dim, D, Dv): kv heads split evenly and unevenly, sequences split (one kv
# head), MHA, a growing budget, values narrower than keys (the masked SDPA read instead of the joined flash read)
CASES = [
    (1, 8, 4, 70, 8, 2, 1, StateBudget.fixed(12), 4, 8, 8),
    (1, 6, 3, 61, 4, 2, 1, StateBudget.fixed(8), 2, 8, 8),
    (3, 2, 1, 50, 5, 3, 2, SQRT, 0, 8, 8),
    (2, 4, 2, 45, 4, 2, 1, SQRT, 2, 8, 6),
    (1, 4, 4, 33, 8, 1, 0, StateBudget.fixed(8), 0, 16, 16),
]


@pytest.fixture
def threads(monkeypatch):
    """Two torch threads, and no size threshold: every call below splits."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(lanes, "MIN_LANE_WORK", 0)
    yield 2
    torch.set_num_threads(n)


def call(x, state, case, **extra):
    _, _, _, _, C, n, S, budget, r, _, _ = case
    return kvm_attention(x["q"], x["k"], x["v"], x["gate"], chunk_len=C, n_bswa_chunks=n, sink_len=S, rope_dim=r,
                         budget=budget, state_norm_weight=x["state_norm_weight"], state_norm_bias=x["state_norm_bias"],
                         state_temp=x["state_temp"], bswa_temp=x["bswa_temp"], initial_state=state, return_state=True,
                         **extra)


def pieces(x, cuts):
    """The inputs cut along time at ``cuts`` (prefill in pieces, then one-token steps)."""
    bounds = [0, *cuts, x["q"].shape[2]]
    seq = {"q", "k", "v", "gate"}
    return [{k: (v[:, :, a:b] if k in seq else v) for k, v in x.items()} for a, b in zip(bounds, bounds[1:])]


def run(x, case, cuts, **extra):
    ys, state = [], None
    for part in pieces(x, cuts):
        y, state = call(part, state, case, **extra)
        ys.append(y)
    return torch.cat(ys, 2), state


def state_tensors(s):
    return [*s.rows(), *s.window()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}Hkv{c[2]}T{c[3]}C{c[4]}{c[7]!r}"[:48])
def test_lanes_equal_serial_and_naive(case, dtype, threads, monkeypatch):
    B, H, Hkv, T, C, n, S, budget, r, D, Dv = case
    x = make_inputs(B=B, H=H, Hkv=Hkv, T=T, D=D, Dv=Dv, dtype=dtype, seed=T)
    cuts = [T // 3, T - 3, T - 2, T - 1]        # two prefills (the second continues a state), three decode steps
    calls = []
    real = lanes.run_lanes
    monkeypatch.setattr(lanes, "run_lanes", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    with torch.no_grad():
        y_par, s_par = run(x, case, cuts, backend="chunked")
        assert len(calls) >= 2, "the prefills did not take the head-parallel path"
        monkeypatch.setattr(lanes, "MIN_LANE_WORK", 1 << 62)
        y_ser, s_ser = run(x, case, cuts, backend="chunked")
        y_ref, s_ref = run(x, case, cuts, backend="naive")
    assert (s_par.num_rows, s_par.seen_tokens, s_par.coverage) == (s_ser.num_rows, s_ser.seen_tokens, s_ser.coverage)
    tight = 1e-12 if dtype == torch.float64 else 1e-6
    assert_close("y vs serial", y_ser, y_par, tight)
    for name, a, b in zip(("keys", "values", "radii", "wkeys", "wvalues", "wgates"), state_tensors(s_ser),
                          state_tensors(s_par)):
        assert_close(f"state {name} vs serial", a, b, tight)
    assert_close("y vs naive", y_ref, y_par, TOLERANCES[dtype])
    for a, b in zip(state_tensors(s_ref), state_tensors(s_par)):
        assert_close("state vs naive", a, b, TOLERANCES[dtype])


def test_joined_state_is_owned_and_laid_out_for_decode(threads):
    """After a split prefill the state's buffers are its own, with the read-out rows right before the window (the
    one-read decode layout), as after the serial path."""
    case = CASES[0]
    x = make_inputs(B=1, H=8, Hkv=4, T=70, D=8, dtype=torch.float32)
    with torch.no_grad():
        _, s = call(x, None, case)
    assert s._owned and joint_buffers(s) is not None
    assert s.keys.is_contiguous() and s.keys.shape[:2] == (1, 4)


def test_split_choice():
    q = torch.zeros(1, 8, 4096, 64)
    state = lambda B, Hkv: kvm_attention(torch.zeros(B, Hkv, 1, 8), torch.zeros(B, Hkv, 1, 8),
                                         torch.zeros(B, Hkv, 1, 8), chunk_len=4, budget=4, return_state=True)[1]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dim, parts = lanes.lane_split(q, torch.zeros(1, 3, 1, 64), state(1, 3), "torch")
        assert dim == 1 and parts == [slice(0, 1), slice(1, 3)]
        dim, parts = lanes.lane_split(q[:, :2].expand(4, -1, -1, -1), torch.zeros(4, 1, 1, 64), state(4, 1), "torch")
        assert dim == 0 and parts == [slice(0, 2), slice(2, 4)]
        assert lanes.lane_split(q, torch.zeros(1, 8, 1, 64), state(1, 8), "triton") is None
        assert lanes.lane_split(q[:, :1], torch.zeros(1, 1, 1, 64), state(1, 1), "torch") is None   # one lane
        assert lanes.lane_split(q[:, :, :16], torch.zeros(1, 8, 1, 64), state(1, 8), "torch") is None  # small
        torch.set_num_threads(1)
        assert lanes.lane_split(q, torch.zeros(1, 8, 1, 64), state(1, 8), "torch") is None
    finally:
        torch.set_num_threads(n)


def test_ragged_state_runs_whole():
    from kvmeans.ops.state import KVMState
    st = [kvm_attention(torch.zeros(1, 2, t, 8), torch.zeros(1, 2, t, 8), torch.zeros(1, 2, t, 8), chunk_len=4,
                        budget=4, return_state=True)[1] for t in (3, 9)]
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert lanes.lane_split(torch.zeros(2, 2, 4096, 64), torch.zeros(2, 2, 1, 64), KVMState.stack(st),
                                "torch") is None
    finally:
        torch.set_num_threads(n)


def test_workers_keep_the_callers_thread_count(threads):
    """Making the pool leaves ``torch.get_num_threads()`` as it was, here and in threads started later; the workers
    themselves run one intra-op thread each."""
    lanes._workers(3)
    pool = lanes._workers(2)
    assert torch.get_num_threads() == 2
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [2]
    assert pool.submit(torch.get_num_threads).result() == 1
    assert lanes._workers(2) is pool


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_workers_may_use_every_core_when_their_maker_is_pinned(threads):
    """A thread inherits its maker's affinity: a pool made by a thread pinned to one core (vLLM pins each OpenMP
    thread) must not put every worker on that core."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        pool = lanes._workers(4)
        assert pool.submit(os.sched_getaffinity, 0).result() >= allowed
    finally:
        os.sched_setaffinity(0, allowed)


def test_grad_calls_never_split(threads, monkeypatch):
    monkeypatch.setattr(lanes, "run_lanes", lambda *a, **k: pytest.fail("a grad call took the split path"))
    x = make_inputs(B=1, H=4, Hkv=2, T=30, D=8, dtype=torch.float64, requires_grad=True)
    y, _ = call(x, None, CASES[3])
    y.sum().backward()
    assert x["q"].grad is not None


def test_a_forked_child_makes_its_own_pool(threads):
    """A child forked after the pool exists has none of its threads: it makes a new pool instead of waiting on the
    parent's forever."""
    import multiprocessing as mp
    lanes._workers(2)
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as p:
        assert p.apply_async(_split_prefill_in_child).get(timeout=120) == (2, True)


def _split_prefill_in_child():
    torch.set_num_threads(2)
    x = make_inputs(B=1, H=8, Hkv=4, T=70, D=8, dtype=torch.float32)
    lanes.MIN_LANE_WORK = 0
    with torch.no_grad():
        y, _ = call(x, None, CASES[0])
    return torch.get_num_threads(), bool(torch.isfinite(y).all())
