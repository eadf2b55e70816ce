"""Data-dependent growth (StateBudget.novelty) on backend="triton" == naive: the chunked path's attention kernel and
the decode kernel read each (sequence, kv head)'s own row count. float32 (the kernels' dtypes), tolerance
``TOLERANCES[float32]``; without CUDA the kernels run in Triton's CPU interpreter (conftest.py)."""
import pytest
import torch

pytest.importorskip("triton")

import kvmeans.ops.chunk as chunk_mod  # noqa: E402
from kvmeans.ops.triton import attention as tri_attn  # noqa: E402
from kvmeans.ops.triton import available, unavailable_reason  # noqa: E402
from kvmeans.ops.triton import decode as tri_decode  # noqa: E402
from kvmeans.utils.testing import TOLERANCES, assert_close, make_inputs  # noqa: E402
from tests.ops.test_growth import CASES, NAMES, assert_same_state, call, case_id, rows_in_use  # noqa: E402

DEV = torch.device("cpu" if tri_attn.INTERPRETED else "cuda")
if not available(DEV):
    pytest.skip(f"Triton kernels cannot run: {unavailable_reason(DEV)}", allow_module_level=True)

TOL = TOLERANCES[torch.float32]


def inputs_for(case, B=2, requires_grad=False):
    T, C, n, S, th, cap, H, Hkv, r, extra = case
    x = make_inputs(B=B, H=H, Hkv=Hkv, T=T, D=8, Dv=6, dtype=torch.float32)
    return {k: v.to(DEV).requires_grad_(requires_grad) for k, v in x.items()}


def outputs_and_grads(backend, case, grad=True):
    inputs = inputs_for(case, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y, state = call(inputs, 0, case[0], case, backend=backend)
    if not grad:
        return y, state, ()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    rows = state.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    return y, state, torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)


def compare(ref, out):
    (y0, s0, g0), (y1, s1, g1) = ref, out
    assert_close("y", y0, y1, TOL)
    assert_same_state(s0, s1, TOL)
    for name, a, b in zip(NAMES, g0, g1):
        assert_close("d" + name, a, b, TOL)


@pytest.fixture
def kernel_rows(monkeypatch):
    """The row counts the attention kernels were launched with: ``[(kernel, rows)]``."""
    seen = []
    real_fwd, real_decode = tri_attn._fwd, tri_decode._length_strides
    monkeypatch.setattr(tri_attn, "_fwd", lambda *a: seen.append(("chunk", a[3])) or real_fwd(*a))
    monkeypatch.setattr(tri_decode, "_length_strides",
                        lambda lengths, *a: seen.append(("decode", lengths.clone())) or real_decode(lengths, *a))
    return seen


def per_head(seen, kernel):
    """Launches of ``kernel`` whose row counts differ between (b, kv head)s."""
    pick = (lambda r: r) if kernel == "chunk" else (lambda r: r[..., 0])
    return [r for k, r in seen if k == kernel and r is not None and r.dim() == 3 and
            pick(r).flatten(0, 1).unique(dim=0).shape[0] > 1]


# GQA 2:1 in one group, 6:3 with 2 sinks in a group per chunk, the ablations
@pytest.mark.parametrize("case,groups", [(CASES[0], "one"), (CASES[2], "per-chunk"), (CASES[4], "one")],
                         ids=lambda x: x if isinstance(x, str) else case_id(x))
def test_triton_matches_naive_with_grad(case, groups, kernel_rows, monkeypatch):
    """Outputs, state (rows, row_count, window) and every gradient; one group or a group per chunk (the
    reconstruction backward restores the counts of each group)."""
    if groups == "per-chunk":
        monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1)
    compare(outputs_and_grads("naive", case), outputs_and_grads("triton", case))
    assert per_head(kernel_rows, "chunk"), "the kernel should see counts that differ per (b, kv head)"


@pytest.mark.parametrize("case", CASES[:3:2], ids=case_id)
def test_triton_no_grad_prefill_matches_naive(case):
    compare(outputs_and_grads("naive", case, grad=False), outputs_and_grads("triton", case, grad=False))


@pytest.mark.parametrize("case,steps", [(CASES[0], (1,)), (CASES[2], (3, 1, 6))],
                         ids=lambda x: case_id(x) if len(x) > 3 else "steps" + "-".join(map(str, x)))
def test_triton_decode_matches_naive(case, steps, kernel_rows):
    """A Triton prefill of 11 tokens, then token-by-token (or a few at a time) Triton decode: the decode kernel
    reads ``lengths [B, Hkv, 2]`` once the counts differ per head."""
    inputs, T = inputs_for(case), case[0]
    y_ref, s_ref = call(inputs, 0, T, case, backend="naive")
    with torch.no_grad():
        y, state = call(inputs, 0, 11, case, backend="triton")
        ys, pos, i = [y], 11, 0
        while pos < T:
            end = min(T, pos + steps[i % len(steps)])
            y, state = call(inputs, pos, end, case, state, backend="triton")
            ys.append(y)
            pos, i = end, i + 1
    assert_close("y", y_ref, torch.cat(ys, 2), TOL)
    assert_same_state(s_ref, state, TOL)
    assert per_head(kernel_rows, "decode"), "the decode kernel should see counts that differ per (b, kv head)"


def test_triton_split_points_match_naive():
    """A chunked Triton call up to a position (inside the first chunk, mid-chunk, on a boundary), the rest in
    one more Triton call."""
    case = CASES[0]
    inputs, T = inputs_for(case), case[0]
    y_ref, s_ref = call(inputs, 0, T, case, backend="naive")
    with torch.no_grad():
        for t0 in (3, 14, 24, 33):
            y0, s = call(inputs, 0, t0, case, backend="triton")
            y1, s = call(inputs, t0, T, case, s, backend="triton")
            assert_close(f"y split at {t0}", y_ref, torch.cat([y0, y1], 2), TOL)
            assert_same_state(s_ref, s, TOL)


# ---- ragged decode: rows at different positions advance in one call per step -------------------------------------
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_ragged_decode_matches_naive_per_row(backend, monkeypatch):
    """Rows prefilled alone to distinct lengths (first chunk, inactive and active states, grown apart per kv head),
    stacked into one ragged state (row_count kept), then one token per row per call: every row's outputs, rows,
    row counts and window equal its own naive run. ``auto`` reads with the torch masks, ``triton`` with the decode
    kernel and ``lengths [B, Hkv, 2]``."""
    import kvmeans.ops.ragged as ragged_mod
    from kvmeans.ops.state import KVMState
    case, lengths, steps = CASES[2], [3, 8, 16, 23], 12
    inputs = inputs_for(case, B=len(lengths))
    row = lambda b, lo, hi: {k: (x[b:b + 1, :, lo:hi] if k in ("q", "k", "v", "gate") else x)
                             for k, x in inputs.items()}
    with torch.no_grad():
        solos = [call(row(b, 0, L), 0, L, case, backend="chunked")[1] for b, L in enumerate(lengths)]
        ragged = KVMState.stack(solos)
        assert ragged.schedule is not None and ragged.row_count.shape == (len(lengths), case[7])
        if backend == "auto" and not tri_attn.INTERPRETED:     # auto's one-time self-check first, unpatched
            from kvmeans import kvm_attention
            from kvmeans.ops.triton.selfcheck import triton_verified
            triton_verified(DEV, torch.float32, "exact", kvm_attention)
        reads = []
        real_attend, real_decode = ragged_mod._attend, tri_decode.decode_attention
        monkeypatch.setattr(ragged_mod, "_attend", lambda *a: reads.append(a[-1]) or real_attend(*a))
        monkeypatch.setattr(tri_decode, "decode_attention", lambda *a: reads.append(a[5]) or real_decode(*a))
        ys = []
        for t in range(steps):
            step = {k: (torch.stack([x[b, :, L + t] for b, L in enumerate(lengths)]).unsqueeze(2)
                        if k in ("q", "k", "v", "gate") else x) for k, x in inputs.items()}
            ys.append(call(step, 0, 1, case, ragged, backend=backend)[0])
    y = torch.cat(ys, 2)
    parts = {b: (part, j) for rows, part in ragged.split() for j, b in enumerate(rows.tolist())}
    for b, L in enumerate(lengths):
        y_ref, s_ref = call(row(b, 0, L + steps), 0, L + steps, case, backend="naive")
        assert_close(f"y[{b}]", y_ref[:, :, L:], y[b:b + 1], TOL)
        part, j = parts[b]
        assert torch.equal(part.row_count[j:j + 1], rows_in_use(s_ref))
        m, w = s_ref.num_rows, s_ref.window_len
        assert (part.seen_tokens, part.num_rows, part.coverage) == (s_ref.seen_tokens, m, s_ref.coverage)
        for name, a, c in zip(("keys", "values", "radii"), s_ref.rows(), part.rows()):
            assert_close(f"{name}[{b}]", a, c[j:j + 1, :, :m], TOL)
        for name, a, c in zip(("wkeys", "wvalues", "wgates"), s_ref.window(), part.window()):
            assert_close(f"{name}[{b}]", a, c[j:j + 1, :, :w], TOL)
    assert len(reads) == steps and all(r is not None and r.shape[:2] == ragged.row_count.shape for r in reads)
    assert (ragged.row_count.amax(1) > ragged.row_count.amin(1)).any(), "kv heads should grow apart"

