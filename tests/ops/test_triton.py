"""backend="triton" == naive: outputs, final state, every gradient; kernels against explicit torch references.

Without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set by conftest.py
(and again below, for runs without it) before kvmeans imports Triton.
Default run: tiny shapes (< 1 min on 2 cores). Broader sweep:
``TRITON_INTERPRET=1 python -m pytest -m slow tests/test_triton.py``; compiled kernels on a GPU:
``python -m pytest -m gpu tests/test_triton.py`` (plus the default tests, which then run compiled on CUDA).
"""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import kvmeans.ops.chunk as chunk_mod  # noqa: E402
from kvmeans import StateBudget, kvm_attention  # noqa: E402
from kvmeans.ops.chunk import plan as plan_mod  # noqa: E402
from kvmeans.ops.triton import attention as tri_attn  # noqa: E402
from kvmeans.ops.triton import available, unavailable_reason  # noqa: E402
from kvmeans.ops.triton.attention import chunk_attention  # noqa: E402
from kvmeans.ops.triton.decode import decode_attention  # noqa: E402
from kvmeans.utils.testing import TOLERANCES, assert_close, make_inputs  # noqa: E402

DEV = torch.device("cpu" if tri_attn.INTERPRETED else "cuda")
if not available(DEV):
    pytest.skip(f"Triton kernels cannot run: {unavailable_reason(DEV)}", allow_module_level=True)

NAMES = ["q", "k", "v", "gate", "state_norm_weight", "state_norm_bias", "state_temp", "bswa_temp"]
TOL = TOLERANCES[torch.float32]
SQRT = StateBudget.power_law(3, 0.5, min_len=8)

# (T, C, n, sink, budget, H, Hkv, rope_dim): T < C, T == L, a fixed budget that fills, a growing one
CASES = [
    (5, 8, 2, 1, StateBudget.fixed(8), 4, 2, 4),
    (16, 8, 2, 0, StateBudget.fixed(8), 4, 4, 0),
    (37, 8, 2, 1, StateBudget.fixed(8), 4, 2, 4),
    (70, 8, 2, 2, SQRT, 4, 2, 4),
]
SLOW_CASES = [
    (37, 8, 2, 0, SQRT, 4, 1, 4),
    (37, 8, 2, 2, StateBudget.fixed(12), 4, 4, 0),
    (70, 8, 2, 1, StateBudget.fixed(8), 4, 1, 4),
    (70, 8, 3, 1, StateBudget.saturating(20), 4, 2, 8),
    (41, 4, 1, 1, lambda t: 4 + t // 5, 2, 2, 2),
    (50, 5, 3, 1, StateBudget.fixed(12), 4, 2, 2),
]


def case_id(c):
    T, C, n, S, b, H, Hkv, r = c
    return f"T{T}-C{C}-n{n}-S{S}-{b!r}-H{H}-Hkv{Hkv}-r{r}"[:60]


def inputs_for(T, H, Hkv, dtype=torch.float32, requires_grad=False, seed=0, D=16, Dv=12):
    x = make_inputs(H=H, Hkv=Hkv, T=T, D=D, Dv=Dv, dtype=dtype, seed=seed)
    return {k: v.to(DEV).requires_grad_(requires_grad) for k, v in x.items()}


def call(backend, inputs, lo, hi, case, state=None, **extra):
    T, C, n, S, budget, H, Hkv, r = case
    part = {k: (v[:, :, lo:hi] if k in ("q", "k", "v", "gate") else v) for k, v in inputs.items()}
    return kvm_attention(part.pop("q"), part.pop("k"), part.pop("v"), part.pop("gate"), chunk_len=C, n_bswa_chunks=n,
                         sink_len=S, rope_dim=r, budget=budget, initial_state=state, return_state=True,
                         backend=backend, **part, **extra)


def outputs_and_grads(backend, case, grad=True, **extra):
    T, H, Hkv = case[0], case[5], case[6]
    inputs = inputs_for(T, H, Hkv, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y, state = call(backend, inputs, 0, T, case, **extra)
    if not grad:
        return y, state, {}
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    rows = state.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    grads = torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)
    return y, state, dict(zip(NAMES, grads))


def compare(ref, out, tol=TOL):
    (y0, s0, g0), (y1, s1, g1) = ref, out
    assert (s0.num_rows, s0.coverage, s0.seen_tokens, s0.window_len) == \
        (s1.num_rows, s1.coverage, s1.seen_tokens, s1.window_len)
    assert_close("y", y0, y1, tol)
    for name, a, b in zip(("state keys", "state values", "radii", "window keys", "window values", "window gates"),
                          (*s0.rows(), *s0.window()), (*s1.rows(), *s1.window())):
        assert_close(name, a, b, tol)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_close("d" + name, g0[name], g1[name], tol)


# ---- the kernels against explicit references ---------------------------------------------------
def attention_reference(q, sk, sv, rows, wk, wv, st, bt, q_start, q_lo, q_hi, k_start, C, n, scale):
    """Per query, per head: softmax over [its chunk's visible state rows ; its causal window]."""
    B, H, TQ, _ = q.shape
    rep = H // wk.shape[1]
    out = q.new_zeros(B, H, TQ, wv.shape[-1])
    kpos = torch.arange(k_start, k_start + wk.shape[2], device=q.device)
    for t in range(TQ):
        p = q_start + t
        if not q_lo <= p < q_hi:
            continue
        c, g = p // C, p // C - q_lo // C
        win = (kpos <= p) & (kpos >= (c + 1 - n) * C)
        for h in range(H):
            keys, vals = wk[:, h // rep][:, win] * bt[h], wv[:, h // rep][:, win]
            if sk is not None and int(rows[g]):
                r = int(rows[g])
                keys = torch.cat([sk[:, g, h // rep, :r] * st[h], keys], 1)
                vals = torch.cat([sv[:, g, h // rep, :r], vals], 1)
            w = torch.softmax((keys @ q[:, h, t].unsqueeze(-1)).squeeze(-1) * scale, -1)
            out[:, h, t] = (w.unsqueeze(-1) * vals).sum(1)
    return out


@pytest.mark.parametrize("with_state", [True, False])
def test_attention_kernel_matches_reference(with_state):
    """Unaligned query range, window starting mid-chunk, chunks seeing 0..M rows, D / Dv not powers of two, GQA."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, Dv, C, n, M = 2, 6, 2, 12, 10, 4, 2, 7
    q_start, q_lo, q_hi, k_start = 8, 9, 27, 2
    G = (q_hi - 1) // C - q_lo // C + 1
    r = lambda *s: torch.randn(*s, generator=g).to(DEV).requires_grad_()
    x = dict(q=r(B, H, 20, D), sk=r(B, G, Hkv, M, D), sv=r(B, G, Hkv, M, Dv), wk=r(B, Hkv, 25, D),
             wv=r(B, Hkv, 25, Dv), st=(torch.rand(H, generator=g) + .5).to(DEV).requires_grad_(),
             bt=(torch.rand(H, generator=g) + .5).to(DEV).requires_grad_())
    rows = torch.tensor([0, 3, 5, 7, 7][:G], dtype=torch.int32, device=DEV)
    if not with_state:
        x["sk"] = x["sv"] = rows = None
    geo = dict(q_start=q_start, q_lo=q_lo, q_hi=q_hi, k_start=k_start)
    y, lse = chunk_attention(x["q"], x["sk"], x["sv"], rows, x["wk"], x["wv"], x["st"], x["bt"], chunk_len=C,
                             n_bswa_chunks=n, scale=0.3, return_lse=True, **geo)
    y_ref = attention_reference(x["q"], x["sk"], x["sv"], rows, x["wk"], x["wv"], x["st"], x["bt"], C=C, n=n,
                                scale=0.3, **geo)
    assert_close("y", y_ref, y, TOL)
    assert (y[:, :, :1] == 0).all() and (y[:, :, q_hi - q_start:] == 0).all()    # rows outside [q_lo, q_hi)
    assert torch.isfinite(lse[:, :, q_lo - q_start:q_hi - q_start]).all()
    dy = torch.randn(y.shape, generator=g).to(DEV)
    names = [k for k, v in x.items() if v is not None and (with_state or k != "st")]
    g1 = torch.autograd.grad((y * dy).sum(), [x[k] for k in names])
    g0 = torch.autograd.grad((y_ref * dy).sum(), [x[k] for k in names])
    for name, a, b in zip(names, g0, g1):
        assert_close("d" + name, a, b, TOL)


def test_decode_kernel_reads_lengths_from_device_tensors():
    """Spare buffer capacity is never read; lengths come from a tensor; t > 1 queries are causal."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, Dv, t = 2, 4, 2, 16, 12, 3
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    q, sk, sv = r(B, H, t, D), r(B, Hkv, 20, D), r(B, Hkv, 20, Dv)
    wk, wv = r(B, Hkv, 24, D), r(B, Hkv, 24, Dv)
    st, bt = torch.rand(H, generator=g).to(DEV) + .5, torch.rand(H, generator=g).to(DEV) + .5
    for rows, wlen in ((9, 11), (0, 5), (20, 24)):
        sk_nan, wk_nan = sk.clone(), wk.clone()
        sk_nan[:, :, rows:], wk_nan[:, :, wlen:] = float("nan"), float("nan")   # poison the spare capacity
        lengths = torch.tensor([rows, wlen], dtype=torch.int32, device=DEV)
        y = decode_attention(q, sk_nan, sv, wk_nan, wv, lengths, st, bt, 0.25)
        y_ref = attention_reference(q, sk[:, None], sv[:, None], torch.tensor([rows]), wk[:, :, :wlen], wv[:, :, :wlen],
                                    st, bt, q_start=wlen - t, q_lo=wlen - t, q_hi=wlen, k_start=0, C=64, n=1,
                                    scale=0.25)
        assert_close(f"decode rows={rows} wlen={wlen}", y_ref, y, TOL)


# ---- the op, backend="triton" against the spec -----------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_naive_with_grad(case):
    compare(outputs_and_grads("naive", case), outputs_and_grads("triton", case))


@pytest.mark.parametrize("case", CASES[2:], ids=case_id)
def test_triton_prefill_no_grad_matches_naive(case):
    compare(outputs_and_grads("naive", case, grad=False), outputs_and_grads("triton", case, grad=False))


@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
def test_many_groups_both_backwards(backward, monkeypatch):
    """One query chunk per group (window slices per group); the kernels' backward inside one autograd graph
    and inside the reverse state reconstruction (saved output / LSE reused, no forward re-run)."""
    case = CASES[2]
    ref = outputs_and_grads("naive", case)
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1)
    monkeypatch.setattr(chunk_mod, "default_group_bytes", lambda device: 1)     # a GPU's is sized by its memory
    launches, groups = [], []
    real_fwd, real_groups = tri_attn._fwd, plan_mod.groups
    monkeypatch.setattr(tri_attn, "_fwd", lambda *a: launches.append(1) or real_fwd(*a))
    monkeypatch.setattr(plan_mod, "groups", lambda *a: groups.append(len(real_groups(*a))) or real_groups(*a))
    compare(ref, outputs_and_grads("triton", case))
    assert len(launches) == groups[0] >= 3              # one forward launch per group; backward re-runs none
    compare((ref[0], ref[1], {}), outputs_and_grads("triton", case, grad=False))


@pytest.mark.parametrize("grad", [True, False])
def test_mixed_numerics_runs_half_precision_dots(grad, monkeypatch):
    """numerics="mixed", fp16 inputs: the kernels get fp16 q / snapshots / window (fp32 accumulation); outputs
    and gradients match the torch chunked path in the same mode, within fp16 tolerance. (fp16, because the
    Triton 3.9 CPU interpreter computes bf16 dots wrongly; bf16 is covered by the gpu tests.)"""
    case = CASES[2]
    T, H, Hkv = case[0], case[5], case[6]
    seen = []
    real_fwd = tri_attn._fwd
    monkeypatch.setattr(tri_attn, "_fwd", lambda q, sk, sv, *a: seen.append((q.dtype, getattr(sk, "dtype", q.dtype)))
                        or real_fwd(q, sk, sv, *a))
    res = []
    for backend in ("chunked", "triton"):
        x = inputs_for(T, H, Hkv, dtype=torch.float16, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            y, state = call(backend, x, 0, T, case, numerics="mixed")
        grads = {}
        if grad:
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
            g = torch.autograd.grad((y.float() * dy).sum() + 0.3 * state.rows()[0].sum(), [x[k] for k in NAMES],
                                    allow_unused=True, materialize_grads=True)
            grads = {k: v.float() for k, v in zip(NAMES, g)}
        res.append((y.float(), state, grads))
    assert seen and all(d == (torch.float16, torch.float16) for d in seen)
    compare(*res, tol=2 * TOLERANCES[torch.float16])


@pytest.mark.parametrize("value_radius,gate_appends", [(False, True)])
def test_ablations(value_radius, gate_appends):
    kw = dict(value_radius=value_radius, gate_appends=gate_appends)
    compare(outputs_and_grads("naive", CASES[2], **kw), outputs_and_grads("triton", CASES[2], **kw))


def test_continuation_and_decode_match_one_naive_call():
    """Prefill, then chunked continuations and token-by-token decode (Triton decode kernel), all with the
    triton backend; outputs and the final state equal one naive call."""
    case = (45, 8, 2, 1, StateBudget.fixed(8), 4, 2, 4)
    inputs = inputs_for(45, 4, 2)
    y_ref, s_ref = call("naive", inputs, 0, 45, case)
    bounds = [0, 11, 12, 13, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 43, 45]   # steps 11, 1, 1, 17, 1..., 3, 2
    ys, state = [], None
    with torch.no_grad():
        for lo, hi in zip(bounds, bounds[1:]):
            y, state = call("triton", inputs, lo, hi, case, state)
            ys.append(y)
    compare((y_ref, s_ref, {}), (torch.cat(ys, 2), state, {}))


def test_gradients_through_a_carried_state():
    case = CASES[2]
    ref = outputs_and_grads("naive", case)
    inputs = inputs_for(37, 4, 2, requires_grad=True)
    y0, s = call("triton", inputs, 0, 13, case)
    y1, s = call("triton", inputs, 13, 37, case, s)
    y = torch.cat([y0, y1], 2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    rows = s.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    grads = torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)
    compare(ref, (y, s, dict(zip(NAMES, grads))))


# ---- decode: Triton state update (route_overflow_triton + scatter_add_rows), persistent lengths -----------
# C=4 so that 30 tokens cross 5-6 chunk-boundary updates; fixed and growing budgets, sinks 0/1/2, GQA
DECODE_CASES = [
    (30, 4, 1, 0, StateBudget.fixed(8), 4, 2, 4),
    (30, 4, 1, 1, StateBudget.power_law(2, 0.5, min_len=4), 4, 1, 4),
    (30, 4, 2, 2, StateBudget.fixed(12), 4, 2, 0),
]


def decode_token_by_token(backend, inputs, case, after_step=None):
    ys, state = [], None
    with torch.no_grad():
        for p in range(case[0]):
            y, state = call(backend, inputs, p, p + 1, case, state)
            ys.append(y)
            if after_step is not None:
                after_step(p, state)
    return torch.cat(ys, 2), state


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_triton_decode_updates_route_and_sum_like_the_torch_path(case, monkeypatch):
    """Token-by-token decode with backend="triton": outputs equal naive (fp32 tolerance) and the final state
    rows equal the torch recurrent path's bit for bit (same routes, same fp32 sums; on CUDA, where atomic adds
    run in any order, within 1e-6); the torch routing is
    never called, the update kernels are (once per boundary)."""
    import kvmeans.ops.state as state_mod
    import kvmeans.ops.triton.update as upd_mod
    T, C = case[0], case[1]
    inputs = inputs_for(T, case[5], case[6])
    y_ref, s_ref = call("naive", inputs, 0, T, case)
    y_rec, s_rec = decode_token_by_token("recurrent", inputs, case)

    calls = {"route": 0, "scatter": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    def torch_routing(*a, **k):
        raise AssertionError("torch route_overflow called on the triton decode path")
    monkeypatch.setattr(upd_mod, "route_overflow_triton", counted("route", upd_mod.route_overflow_triton))
    monkeypatch.setattr(upd_mod, "scatter_add_rows", counted("scatter", upd_mod.scatter_add_rows))
    monkeypatch.setattr(state_mod, "route_overflow", torch_routing)
    y_tri, s_tri = decode_token_by_token("triton", inputs, case)

    updates = (s_ref.coverage - C) // C
    assert updates >= 4 and calls == {"route": updates, "scatter": 3 * updates}
    assert s_tri.num_rows < s_tri.coverage                   # merges happened (not only appends)
    compare((y_ref, s_ref, {}), (y_tri, s_tri, {}))
    assert (s_rec.num_rows, s_rec.coverage, s_rec.seen_tokens) == (s_tri.num_rows, s_tri.coverage, s_tri.seen_tokens)
    for name, a, b in zip(("keys", "values", "radii", "window keys", "window values", "window gates"),
                          (*s_rec.rows(), *s_rec.window()), (*s_tri.rows(), *s_tri.window())):
        if tri_attn.INTERPRETED:        # sums in order on both sides
            assert torch.equal(a, b), name
        else:                           # CUDA atomics (torch's scatter_add_ and the kernel's) add in any order
            assert_close(name, a, b, 1e-6)
    assert_close("y vs recurrent", y_rec, y_tri, TOL)
    with pytest.raises(AssertionError, match="torch route_overflow called"):   # the patch hits the torch path
        decode_token_by_token("recurrent", inputs, case)


@pytest.mark.parametrize("grad", [True, False])
def test_chunked_triton_routes_with_the_update_kernels(grad, monkeypatch):
    """Prefill / training with backend="triton": the routing pass (grad) and the in-place prefill (no grad)
    run the Triton routing / scatter kernels, never the torch routing; results equal naive."""
    import kvmeans.ops.state as state_mod
    import kvmeans.ops.triton.update as upd_mod
    case = DECODE_CASES[1]
    ref = outputs_and_grads("naive", case, grad=grad)
    calls = []
    real = upd_mod.route_overflow_triton
    monkeypatch.setattr(upd_mod, "route_overflow_triton", lambda *a, **k: calls.append(1) or real(*a, **k))

    def torch_routing(*a, **k):
        raise AssertionError("torch route_overflow called on the triton chunked path")
    monkeypatch.setattr(state_mod, "route_overflow", torch_routing)
    out = outputs_and_grads("triton", case, grad=grad)
    assert len(calls) == (ref[1].coverage - case[1]) // case[1] >= 4
    compare(ref, out)


def test_decode_lengths_are_a_persistent_device_buffer(monkeypatch):
    """Between chunk boundaries a triton decode step updates the same int32 lengths tensor in place (same
    object, same data_ptr) and builds no tensor on the host (no torch.tensor call)."""
    case = DECODE_CASES[0]
    C = case[1]
    inputs = inputs_for(case[0], case[5], case[6])
    made = []
    real_tensor = torch.tensor

    def counting_tensor(*a, **k):
        made.append(a)
        return real_tensor(*a, **k)
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    seen, steady = [], 0

    def after_step(p, state):
        nonlocal steady
        if p == 0:          # the first call (empty state) runs the chunked path, not the decode kernel
            made.clear()
            return
        buf = state._lengths[0]
        rows = state.num_rows if state.window_start > 0 else 0
        assert buf.dtype == torch.int32 and buf.device.type == DEV.type and buf.tolist() == [rows, state.window_len]
        if seen:            # one buffer for the whole decode (the row buffers grow, the lengths stay)
            assert buf is seen[-1][0] and buf.data_ptr() == seen[-1][1], p
        if p % C and p > 1:     # between boundaries: no tensor built on the host
            assert not made, (p, made)
            steady += 1
        seen.append((buf, buf.data_ptr()))
        made.clear()
    _, state = decode_token_by_token("triton", inputs, case, after_step)
    assert steady >= 20
    before = state._lengths[0].tolist()
    copy = state.clone()                                # a copy gets its own buffer when it continues
    with torch.no_grad():
        call("triton", inputs, case[0] - 1, case[0], case, copy)
    assert copy._lengths[0] is not state._lengths[0] and state._lengths[0].tolist() == before


# ---- dispatch --------------------------------------------------------------------------------
def test_auto_uses_the_torch_path_off_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("triton kernel called")
    monkeypatch.setattr(tri_attn, "chunk_attention", boom)
    x = make_inputs(T=20, dtype=torch.float32)
    y = kvm_attention(x["q"], x["k"], x["v"], x["gate"], chunk_len=4, budget=8)      # CPU tensors: torch
    if tri_attn.INTERPRETED:            # the interpreter runs the kernels on CPU tensors when forced
        with pytest.raises(AssertionError, match="triton kernel called"):
            kvm_attention(x["q"], x["k"], x["v"], x["gate"], chunk_len=4, budget=8, backend="triton")
    else:                               # compiled kernels refuse CPU tensors, naming the fix
        with pytest.raises(ValueError, match="backend='triton' cannot run here"):
            kvm_attention(x["q"], x["k"], x["v"], x["gate"], chunk_len=4, budget=8, backend="triton")
    assert y.shape == x["q"].shape


def test_forced_triton_refuses_what_it_cannot_run(monkeypatch):
    x = make_inputs(T=9, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='triton' cannot run here.*float64"):
        kvm_attention(x["q"], x["k"], x["v"], chunk_len=4, budget=8, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in unavailable_reason("cpu", torch.float32)
    assert unavailable_reason("cuda", torch.bfloat16) is None


def test_importing_kvmeans_does_not_import_triton():
    code = ("import sys, torch, kvmeans; from kvmeans import kvm_attention; q = torch.randn(1, 2, 9, 8); "
            "kvm_attention(q, q, q, chunk_len=4, budget=8); print('triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


# ---- broader sweep (slow) --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_sweep_with_grad(case):
    compare(outputs_and_grads("naive", case), outputs_and_grads("triton", case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_sweep_every_split_then_decode(case):
    T = case[0]
    inputs = inputs_for(T, case[5], case[6])
    y_ref, s_ref = call("naive", inputs, 0, T, case)
    with torch.no_grad():
        for t0 in (1, case[1], T // 2 + 1):
            ys, state = [], None
            for lo, hi in [(0, t0)] + [(p, p + 1) for p in range(t0, min(T, t0 + 9))] + [(min(T, t0 + 9), T)]:
                if hi > lo:
                    y, state = call("triton", inputs, lo, hi, case, state)
                    ys.append(y)
            compare((y_ref, s_ref, {}), (torch.cat(ys, 2), state, {}))


def test_fixed_tiles_are_autotune_candidates(monkeypatch):
    """KVMEANS_TRITON_AUTOTUNE=0 launches FIXED_META: it must be a tile the autotuner itself would try."""
    from kvmeans.ops.triton import decode, update
    monkeypatch.setenv("KVMEANS_TRITON_AUTOTUNE", "0")
    assert not tri_attn.autotuned()
    monkeypatch.setenv("KVMEANS_TRITON_AUTOTUNE", "1")
    assert tri_attn.autotuned()
    for fixed, configs in ((tri_attn.FIXED_META, tri_attn._FWD_CONFIGS), (tri_attn.FIXED_META, tri_attn._BWD_CONFIGS),
                           (decode.FIXED_META, decode._CONFIGS), (update.FIXED_META, update._CONFIGS)):
        tried = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]
        assert any(all(t.get(k) == v for k, v in fixed.items()) for t in tried), (fixed, tried)


def test_launch_picks_interpreter_fixed_or_tuned_tile(monkeypatch):
    """launch(): the interpreter's small tile, FIXED_META under KVMEANS_TRITON_AUTOTUNE=0, else the autotuner."""
    calls = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.name, grid, kw))

    plain, tuned = Kernel("plain"), Kernel("tuned")
    grid = lambda meta: (meta["BLOCK_M"],)
    args = (1, 2)
    monkeypatch.setattr(tri_attn, "INTERPRETED", True)
    tri_attn.launch(plain, tuned, grid, args, {"C": 3}, {"BLOCK_M": 16}, {"BLOCK_M": 64, "num_warps": 4})
    monkeypatch.setattr(tri_attn, "INTERPRETED", False)
    monkeypatch.setenv("KVMEANS_TRITON_AUTOTUNE", "0")
    tri_attn.launch(plain, tuned, grid, args, {"C": 3}, {"BLOCK_M": 16}, {"BLOCK_M": 64, "num_warps": 4})
    monkeypatch.setenv("KVMEANS_TRITON_AUTOTUNE", "1")
    tri_attn.launch(plain, tuned, grid, args, {"C": 3}, {"BLOCK_M": 16}, {"BLOCK_M": 64, "num_warps": 4})
    assert calls[0] == ("plain", (16,), {"C": 3, "BLOCK_M": 16})
    assert calls[1] == ("plain", (64,), {"C": 3, "BLOCK_M": 64, "num_warps": 4})
    assert calls[2][0] == "tuned" and calls[2][2] == {"C": 3} and callable(calls[2][1])


# ---- compiled kernels on a GPU ---------------------------------------------------------------
GPU_CASES = [
    (1000, 64, 2, 1, StateBudget.fixed(128), 8, 2, 32),
    (777, 64, 2, 0, StateBudget.power_law(16, 0.5, min_len=64), 8, 8, 0),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or tri_attn.INTERPRETED, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_triton_matches_torch_path(case, dtype):
    """Same rounded inputs through the torch chunked path and the compiled kernels (both compute in fp32);
    bf16 inputs: the routing is the same torch code on the same fp32 values, so routes agree exactly."""
    T, C, n, S, budget, H, Hkv, r = case
    res = []
    for backend in ("chunked", "triton"):
        x = {k: v.to(dtype).requires_grad_() for k, v in inputs_for(T, H, Hkv, D=64, Dv=64).items()}
        y, state = call(backend, x, 0, T, case)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        loss = (y.float() * dy.float()).sum() + 0.3 * state.rows()[0].sum()
        grads = torch.autograd.grad(loss, [x[k] for k in NAMES], allow_unused=True, materialize_grads=True)
        res.append((y, state, dict(zip(NAMES, grads))))
    compare(*res, tol=2e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or tri_attn.INTERPRETED, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_mixed_bf16_matches_exact(case):
    """numerics="mixed" (bf16 MMA in the kernels) against exact (fp32 dots) on the same bf16 inputs."""
    T, C, n, S, budget, H, Hkv, r = case
    res = []
    for numerics in ("exact", "mixed"):
        x = {k: v.to(torch.bfloat16).requires_grad_() for k, v in inputs_for(T, H, Hkv, D=64, Dv=64).items()}
        y, state = call("triton", x, 0, T, case, numerics=numerics)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        grads = torch.autograd.grad((y.float() * dy.float()).sum(), [x[k] for k in NAMES], allow_unused=True,
                                    materialize_grads=True)
        res.append((y.float(), state, {k: v.float() for k, v in zip(NAMES, grads)}))
    compare(*res, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or tri_attn.INTERPRETED, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_prefill_and_decode_match_torch_path(case):
    T, C, n, S, budget, H, Hkv, r = case
    x = inputs_for(T, H, Hkv, D=64, Dv=64)
    with torch.no_grad():
        outs = []
        for backend, step in (("chunked", "recurrent"), ("triton", "triton")):
            y, state = call(backend, x, 0, T - 80, case)
            ys = [y]
            for p in range(T - 80, T):
                y, state = call(step, x, p, p + 1, case, state)
                ys.append(y)
            outs.append((torch.cat(ys, 2), state, {}))
    compare(*outs, tol=2e-4)


NAIVE_GPU_CASES = [
    (300, 32, 2, 1, StateBudget.fixed(64), 8, 2, 16),
    (257, 32, 3, 0, StateBudget.power_law(8, 0.5, min_len=32), 4, 4, 0),
]


def triton_vs_naive(case, dtype, device):
    """The compiled kernels on ``dtype`` inputs against the spec (``ops/naive.py``) on the same values in fp32:
    outputs, carried state and gradients of a loss that reads both."""
    T, C, n, S, budget, H, Hkv, r = case
    res = []
    for backend in ("naive", "triton"):
        base = {k: v.to(device).to(dtype) for k, v in inputs_for(T, H, Hkv, D=64, Dv=64).items()}
        x = {k: (v.float() if backend == "naive" else v).requires_grad_() for k, v in base.items()}
        y, state = call(backend, x, 0, T, case)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
        rows = state.rows()
        loss = (y.float() * dy).sum() + 0.3 * rows[0].float().sum() + 0.2 * rows[2].float().sum()
        grads = torch.autograd.grad(loss, [x[k] for k in NAMES], allow_unused=True, materialize_grads=True)
        res.append((y.float(), state, {k: g.float() for k, g in zip(NAMES, grads)}))
    return res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or tri_attn.INTERPRETED, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", NAIVE_GPU_CASES, ids=case_id)
def test_gpu_triton_matches_naive_spec(case, dtype):
    """The spec in code, run on the GPU, against the compiled kernels: fp32 within TF32-free fp32 tolerance;
    bf16 inputs (outputs and gradients rounded to bf16) within bf16's."""
    ref, out = triton_vs_naive(case, dtype, torch.device("cuda"))
    compare(ref, out, tol=2e-4 if dtype == torch.float32 else 3e-2)


# ---- state-update kernels and the route-agreement measurement -----------------------------------
def test_route_scores_and_route_overflow_match_torch_routing():
    from kvmeans.ops.routing import route_overflow
    from kvmeans.ops.triton.update import route_overflow_triton, route_scores
    g = torch.Generator().manual_seed(5)
    B, Hkv, C, D, m = 2, 2, 8, 16, 21
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    rows_hat, sel, app = r(B, Hkv, m, D), r(B, Hkv, C, D), r(B, Hkv, C, D)
    rows_hat[:, :, 7] = rows_hat[:, :, 12]                  # exact duplicate rows: ties go to the lower index
    best, target, novel = route_scores(sel, rows_hat, 2)
    logits = sel @ rows_hat.transpose(-1, -2)
    assert torch.equal(target, logits[..., 2:].argmax(-1) + 2)
    assert_close("best", logits[..., 2:].amax(-1), best, 1e-6)
    assert_close("novelty", logits.amax(-1), novel, 1e-6)
    assert not (target == 12).any()
    for n_append, sink in ((0, 1), (3, 0), (3, 2), (8, 1)):
        d0, a0 = route_overflow(rows_hat, sel, app, n_append, sink)
        d1, a1 = route_overflow_triton(rows_hat, sel, app, n_append, sink)
        assert torch.equal(a0, a1) and torch.equal(d0, d1), (n_append, sink)


def test_scatter_add_rows_accumulates_in_float32():
    from kvmeans.ops.triton.update import scatter_add_rows
    g = torch.Generator().manual_seed(6)
    dst = torch.randn(2, 3, 10, 12, generator=g).to(DEV)
    dest = torch.randint(0, 10, (2, 3, 37), generator=g).to(DEV)
    src = torch.randn(2, 3, 37, 12, generator=g).to(DEV)
    ref = dst.scatter_add(2, dest.unsqueeze(-1).expand_as(src), src)
    assert_close("scatter", ref, scatter_add_rows(dst.clone(), dest, src), 1e-6)
    assert_close("scatter bf16 src", ref.double(), scatter_add_rows(dst.clone(), dest, src.bfloat16()).double(), 1e-2)


def test_route_agreement_measures_flips():
    from kvmeans.ops.chunk.route import route_agreement
    x = make_inputs(T=70, D=16, dtype=torch.float32)
    cfg = dict(chunk_len=8, n_bswa_chunks=2, sink_len=1, rope_dim=4, budget=StateBudget.fixed(12))
    same = route_agreement(x["k"], x["v"], x["gate"], x["k"], x["v"], x["gate"], **cfg)
    assert same["dest"] == 1.0 and same["created"] == 1.0 and same["first_flip"] is None and same["tokens"] == 56
    bf = lambda t: t.bfloat16().float()
    rounded = route_agreement(x["k"], x["v"], x["gate"], bf(x["k"]), bf(x["v"]), bf(x["gate"]), **cfg)
    assert 0.5 < rounded["dest"] <= 1.0
    shuffled = route_agreement(x["k"], x["v"], x["gate"], x["k"].flip(2), x["v"], x["gate"], **cfg)
    assert shuffled["dest"] < 0.9 and shuffled["first_flip"] is not None
