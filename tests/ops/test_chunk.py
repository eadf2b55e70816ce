"""chunked (graph and reverse-reconstruction backwards, many groups) == naive: outputs, final state, every gradient."""
import pytest
import torch

import kvmeans.ops.chunk as chunk_mod
from kvmeans import StateBudget, kvm_attention
from kvmeans.bench.arms import saved_bytes
from kvmeans.ops.chunk import flash as flash_mod
from kvmeans.ops.chunk import plan as plan_mod
from kvmeans.utils.testing import TOLERANCES, assert_close, make_inputs

NAMES = ["q", "k", "v", "gate", "state_norm_weight", "state_norm_bias", "state_temp", "bswa_temp"]
SQRT = StateBudget.power_law(2, 0.5, min_len=4)
SAT = StateBudget.saturating(10)
CALLABLE = lambda t: 4 + t // 5

# (T, C, n, sink, budget, H, Hkv, rope_dim): T < C, T == L, T == L + 1, T not a multiple of C,
# long enough for a fixed budget to fill and the growing ones to grow
CASES = [
    (3, 4, 2, 1, StateBudget.fixed(4), 4, 2, 2),
    (8, 4, 2, 1, StateBudget.fixed(4), 4, 2, 2),
    (9, 4, 2, 1, SQRT, 4, 2, 2),
    (37, 4, 2, 1, StateBudget.fixed(4), 4, 2, 2),
    (37, 4, 2, 0, SQRT, 4, 4, 0),
    (37, 4, 2, 2, SAT, 4, 1, 4),
    (41, 4, 1, 1, CALLABLE, 2, 2, 2),
    (50, 5, 3, 1, StateBudget.fixed(12), 4, 2, 2),
    (64, 4, 2, 1, StateBudget.fixed(8), 6, 3, 8),
    (70, 8, 2, 3, StateBudget.power_law(3, 0.5, min_len=8), 4, 2, 2),
]


def case_id(c):
    T, C, n, S, b, H, Hkv, r = c
    return f"T{T}-C{C}-n{n}-S{S}-{b!r}-H{H}-Hkv{Hkv}-r{r}"[:60]


def run(backend, inputs, T, C, n, S, budget, r, **extra):
    y, state = kvm_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["gate"], chunk_len=C, n_bswa_chunks=n, sink_len=S,
        rope_dim=r, budget=budget, state_norm_weight=inputs["state_norm_weight"],
        state_norm_bias=inputs["state_norm_bias"], state_temp=inputs["state_temp"],
        bswa_temp=inputs["bswa_temp"], return_state=True, backend=backend, **extra)
    return y, state


def outputs_and_grads(backend, case, dtype=torch.float64, seed=0, **extra):
    T, C, n, S, budget, H, Hkv, r = case
    inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=8, Dv=6, dtype=dtype, seed=seed, requires_grad=True)
    y, state = run(backend, inputs, T, C, n, S, budget, r, **extra)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.dtype)
    rows = state.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    grads = torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)
    return y, state, dict(zip(NAMES, grads))


def compare(ref, out, tol):
    (y0, s0, g0), (y1, s1, g1) = ref, out
    assert (s0.num_rows, s0.coverage, s0.seen_tokens) == (s1.num_rows, s1.coverage, s1.seen_tokens)
    assert_close("y", y0, y1, tol)
    for name, a, b in zip(("state keys", "state values", "radii"), s0.rows(), s1.rows()):
        assert_close(name, a, b, tol)
    for name, a, b in zip(("window keys", "window values", "window gates"), s0.window(), s1.window()):
        assert_close(name, a, b, tol)
    for name in NAMES:
        assert_close("d" + name, g0[name], g1[name], tol)


@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_chunked_matches_naive_float64(case, backward, monkeypatch):
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    compare(outputs_and_grads("naive", case), outputs_and_grads("chunked", case), TOLERANCES[torch.float64])


@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
@pytest.mark.parametrize("case", CASES[3:7], ids=case_id)
@pytest.mark.parametrize("value_radius,gate_appends", [(False, False), (True, True)])
def test_ablations_match_naive(case, value_radius, gate_appends, backward, monkeypatch):
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    kw = dict(value_radius=value_radius, gate_appends=gate_appends)
    compare(outputs_and_grads("naive", case, **kw), outputs_and_grads("chunked", case, **kw), 1e-10)


@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[9]], ids=case_id)
def test_many_groups_match_naive(case, backward, monkeypatch):
    ref = outputs_and_grads("naive", case)
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1)                # one chunk per group
    sizes = []
    real = plan_mod.groups
    monkeypatch.setattr(plan_mod, "groups", lambda *a: sizes.append(len(real(*a))) or real(*a))
    compare(ref, outputs_and_grads("chunked", case), 1e-10)
    with torch.no_grad():                                            # the in-place prefill, same groups
        inputs = make_inputs(H=case[5], Hkv=case[6], T=case[0], D=8, Dv=6, dtype=torch.float64, seed=0)
        y, state = run("chunked", inputs, *case[:5], case[7])
    compare(ref, (y, state, ref[2]), 1e-10)
    assert sizes[0] == sizes[1] == -(-case[0] // case[1])            # one group per query chunk, both paths


def test_auto_backward_switches_to_reconstruction_for_large_graphs(monkeypatch):
    """"auto" keeps a graph for small calls and reconstructs past RECONSTRUCT_BYTES (same results)."""
    import kvmeans.ops.chunk.reconstruct as rec
    calls = []
    real = rec._Reconstruct.apply
    monkeypatch.setattr(rec._Reconstruct, "apply", lambda *a: calls.append(1) or real(*a))
    ref = outputs_and_grads("naive", CASES[5])
    compare(ref, outputs_and_grads("chunked", CASES[5]), 1e-10)
    assert not calls
    monkeypatch.setattr(chunk_mod, "RECONSTRUCT_BYTES", 0)
    compare(ref, outputs_and_grads("chunked", CASES[5]), 1e-10)
    assert calls


@pytest.mark.parametrize("budget", [StateBudget.fixed(128), StateBudget.power_law(8, 0.5, min_len=8)])
def test_reconstruction_keeps_no_state_copy_per_chunk(budget, monkeypatch):
    """Saved for backward: O(T + state), not O(chunks * state). 128 chunks, one per group, a state of up
    to 128 rows: the graph keeps a snapshot per chunk; reconstruction a few tensors of token or state size."""
    T, C, H, Hkv, D = 512, 4, 2, 2, 8
    monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1)
    inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=D, Dv=D, dtype=torch.float32, seed=0, requires_grad=True)
    call = lambda: kvm_attention(inputs["q"], inputs["k"], inputs["v"], inputs["gate"], chunk_len=C, n_bswa_chunks=2,
                                 budget=budget, return_state=True, backend="chunked")
    monkeypatch.setattr(chunk_mod, "BACKWARD", "graph")
    graph, _ = saved_bytes(call)
    monkeypatch.setattr(chunk_mod, "BACKWARD", "reconstruct")
    rec, (y, state) = saved_bytes(call)
    token_bytes = sum(t.numel() * 4 for t in (inputs["q"], inputs["k"], inputs["v"]))
    rows = [state.num_rows] if budget.kind == "fixed" else [budget(c * C) for c in range(T // C)]
    snapshots = sum(min(r, state.num_rows) for r in rows) * 2 * Hkv * (2 * D + 1) * 4 * (T // C - 2) // len(rows)
    assert graph > snapshots                      # what reconstruction avoids
    assert rec < 5 * token_bytes + 4 * state.nbytes, (rec, token_bytes, state.nbytes)
    assert rec < snapshots / 3, (rec, snapshots)
    y.sum().backward()                             # and it still differentiates
    assert inputs["k"].grad is not None and torch.isfinite(inputs["k"].grad).all()


def test_reconstruction_leaves_the_returned_state_free_to_advance(monkeypatch):
    """The returned state is a cache: decoding from it in place must not break the pending backward."""
    monkeypatch.setattr(chunk_mod, "BACKWARD", "reconstruct")
    inputs = make_inputs(H=2, Hkv=2, T=40, D=8, Dv=8, dtype=torch.float64, seed=0, requires_grad=True)
    kw = dict(chunk_len=4, n_bswa_chunks=2, budget=StateBudget.fixed(8), return_state=True)
    y, state = kvm_attention(inputs["q"], inputs["k"], inputs["v"], inputs["gate"], backend="chunked", **kw)
    ref = torch.autograd.grad(y.sum(), inputs["k"], retain_graph=True)[0]
    with torch.no_grad():
        more = make_inputs(H=2, Hkv=2, T=9, D=8, Dv=8, dtype=torch.float64, seed=1)
        kvm_attention(more["q"], more["k"], more["v"], more["gate"], initial_state=state, backend="recurrent",
                      **kw)
    assert torch.equal(torch.autograd.grad(y.sum(), inputs["k"])[0], ref)


@pytest.mark.parametrize("case", [CASES[3], CASES[9]], ids=case_id)
def test_float32_is_tight(case):
    compare(outputs_and_grads("naive", case, torch.float32), outputs_and_grads("chunked", case, torch.float32),
            TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float32_spec(dtype):
    """Half inputs are accumulated in float32: compare with the float32 spec on the same rounded inputs."""
    case = CASES[3]
    y, state, grads = outputs_and_grads("chunked", case, dtype)
    assert y.dtype == dtype and state.dtype == torch.float32
    T, C, n, S, budget, H, Hkv, r = case
    inputs = {k: v.to(torch.float32) for k, v in make_inputs(H=H, Hkv=Hkv, T=T, D=8, Dv=6, dtype=dtype).items()}
    y_ref, _ = run("naive", inputs, T, C, n, S, budget, r)
    assert_close("y", y_ref, y.float(), TOLERANCES[dtype])


def test_final_state_counts_follow_the_schedule():
    from kvmeans.ops.schedule import coverage_after, rows_after
    for T in (3, 8, 9, 30, 64, 65):
        _, state, _ = outputs_and_grads("chunked", (T, 4, 2, 1, SQRT, 4, 2, 2))
        assert state.num_rows == rows_after(SQRT, T, 4, 2)
        assert state.coverage == coverage_after(T, 4, 2)
        assert state.window_len == T - max(0, -(-T // 4) * 4 - 8)


def test_no_uninitialised_memory_is_read(monkeypatch):
    """Buffers from new_empty are poisoned with NaN: every element the op reads must have been written."""
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(float("nan")))
    case = CASES[9]
    ref = outputs_and_grads("naive", case)
    compare(ref, outputs_and_grads("chunked", case), 1e-10)
    with torch.no_grad():
        y, _ = run("chunked", make_inputs(H=4, Hkv=2, T=70, D=8, Dv=6), 70, 8, 2, 3, case[4], 2)
    assert_close("no-grad y", ref[0], y, 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_numerics_rounds_only_the_attention_operands(dtype):
    """numerics="mixed": half-precision attention dots; the state (routes, fp32 sums) is exact's, bit for bit,
    outputs and gradients agree with exact within the input dtype's tolerance, and they do differ."""
    case = CASES[5]
    y0, s0, g0 = outputs_and_grads("chunked", case, dtype)
    y1, s1, g1 = outputs_and_grads("chunked", case, dtype, numerics="mixed")
    for a, b in zip((*s0.rows(), *s0.window()), (*s1.rows(), *s1.window())):
        assert torch.equal(a, b)
    assert y1.dtype == dtype and not torch.equal(y0, y1)
    assert_close("y", y0.float(), y1.float(), TOLERANCES[dtype])
    for name in NAMES:
        assert_close("d" + name, g0[name].float(), g1[name].float(), 2 * TOLERANCES[dtype])
    T, C, n, S, budget, H, Hkv, r = case
    with torch.no_grad():               # the in-place prefill
        inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=8, Dv=6, dtype=dtype, seed=0)
        y2, s2 = run("chunked", inputs, T, C, n, S, budget, r, numerics="mixed")
    assert_close("y no-grad", y1.float(), y2.float(), TOLERANCES[dtype])
    assert s2.num_rows == s1.num_rows
    for name, a, b in zip(("keys", "values", "radii"), s1.rows(), s2.rows()):
        assert_close(name, a, b, TOLERANCES[torch.float32])


def test_mixed_numerics_is_exact_for_float32():
    y0, s0, g0 = outputs_and_grads("chunked", CASES[5], torch.float32)
    y1, s1, g1 = outputs_and_grads("chunked", CASES[5], torch.float32, numerics="mixed")
    assert torch.equal(y0, y1) and all(torch.equal(g0[k], g1[k]) for k in NAMES)


# ---- no-grad prefill: whole chunks attend in three dense calls joined by their log-sum-exp ----------------------
# (T, C, n, sink, budget, H, Hkv, rope_dim) with D == Dv (the CPU flash kernel's condition)
JOINED = [
    (64, 4, 2, 1, StateBudget.fixed(8), 4, 2, 2),
    (70, 8, 3, 3, StateBudget.power_law(3, 0.5, min_len=8), 4, 2, 2),    # rows grow inside a group: state mask
    (41, 4, 1, 1, CALLABLE, 2, 2, 2),                                      # n = 1: no previous chunks
    (50, 5, 2, 1, StateBudget.fixed(12), 2, 1, 4),
]
NO_GRADS = {name: torch.zeros(1) for name in NAMES}     # compare() without gradients


@pytest.mark.parametrize("split", [None, 13], ids=["fresh", "continued-mid-chunk"])
@pytest.mark.parametrize("case", JOINED, ids=case_id)
def test_no_grad_prefill_joins_dense_calls(case, split, monkeypatch):
    """Whole chunks with whole windows take the joined attention (state, previous chunks, causal own chunk); its
    outputs and final state equal naive's, fresh or continuing a state that ends mid-chunk."""
    T, C, n, S, budget, H, Hkv, r = case
    joined = []
    real = flash_mod.joined_attention
    monkeypatch.setattr(flash_mod, "joined_attention", lambda y, q, *a, **k: joined.append(q.shape[2]) or
                        real(y, q, *a, **k))
    inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=8, dtype=torch.float64, seed=3)
    ref, ref_state = run("naive", inputs, T, C, n, S, budget, r)
    with torch.no_grad():
        if split is None:
            y, state = run("chunked", inputs, T, C, n, S, budget, r)
        else:
            head, tail = ({k: v[:, :, a:b] if v.dim() > 1 else v for k, v in inputs.items()} for a, b in
                          ((0, split), (split, T)))
            y0, state = run("chunked", head, split, C, n, S, budget, r)
            y1, state = run("chunked", tail, T - split, C, n, S, budget, r, initial_state=state)
            y = torch.cat([y0, y1], 2)
    compare((ref, ref_state, NO_GRADS), (y, state, NO_GRADS), 1e-10)
    whole = (T // C - (n - 1)) * C if split is None else \
        max(0, split // C - (n - 1)) * C + (T // C - -(-split // C)) * C   # the partial chunk at 13 attends masked
    assert sum(joined) == whole                                 # queries of whole chunks with whole windows


def test_no_grad_prefill_without_the_flash_kernel_masks_one_call(monkeypatch):
    """Where the CPU flash kernel is missing (older torch, other devices) every group takes the masked call."""
    monkeypatch.setattr(flash_mod, "_FLASH_CPU", None)
    monkeypatch.setattr(flash_mod, "joined_attention", None)
    T, C, n, S, budget, H, Hkv, r = JOINED[0]
    inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=8, dtype=torch.float64, seed=3)
    with torch.no_grad():
        y, state = run("chunked", inputs, T, C, n, S, budget, r)
    compare((*run("naive", inputs, T, C, n, S, budget, r), NO_GRADS), (y, state, NO_GRADS), 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numerics", ["exact", "mixed"])
def test_joined_no_grad_prefill_in_half_precision(dtype, numerics, monkeypatch):
    """Half inputs through the joined attention (mixed: its flash calls in the input dtype, joined in fp32) agree
    with the masked call of the grad path within the dtype's tolerance."""
    T, C, n, S, budget, H, Hkv, r = JOINED[0]
    joined = []
    real = flash_mod.joined_attention
    monkeypatch.setattr(flash_mod, "joined_attention", lambda *a, **k: joined.append(1) or real(*a, **k))
    inputs = make_inputs(H=H, Hkv=Hkv, T=T, D=8, dtype=dtype, seed=3, requires_grad=True)
    ref, _ = run("chunked", inputs, T, C, n, S, budget, r, numerics=numerics)      # grad path: one masked call
    assert not joined
    with torch.no_grad():
        y, _ = run("chunked", inputs, T, C, n, S, budget, r, numerics=numerics)
    assert joined and y.dtype == dtype
    assert_close("y", ref.float(), y.float(), TOLERANCES[dtype])
