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
    return kvm_attention(q, k, v, chunk_len=C, n_bswa_chunks=N_BSWA, sink_len=1,
                         budget=StateBudget.novelty(threshold, cap), return_state=True, backend=backend, **kw)


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


def test_novelty_counts_the_sinks_merges_skip_them():
    q, k, v = hand_built(h(0), h("w"), h(2), h(3))      # token 4 copies the sink row: not novel, merges elsewhere
    _, st = grow(q, k, v, 0.5, 64)
    kbar = lambda x: torch.nn.functional.layer_norm(x, (D,), eps=1e-5)
    assert st.row_count.tolist() == [[5]]
    torch.testing.assert_close(st.rows()[0][0, 0, 0], kbar(h(0)))                 # the sink is untouched
    torch.testing.assert_close(st.rows()[0][0, 0, 1], kbar(h(1)) + kbar(h(0)))    # all scores tie: lowest non-sink


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
    with pytest.raises(ValueError, match="numerics='reference' does not support a novelty budget"):
        grow(q, k, v, 0.5, 8, numerics="reference")
    _, st = grow(q, k, v, 0.5, 8)
    with pytest.raises(ValueError, match="continue it with a StateBudget.novelty budget"):
        kvm_attention(q, k, v, chunk_len=C, n_bswa_chunks=N_BSWA, budget=8, initial_state=st)


def test_spec_and_config_forms():
    from kvmeans.models.config import KVMModelConfig, preset, with_budget
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


# ---- every path == naive on random inputs ------------------------------------------------------------------------
import kvmeans.ops.chunk as chunk_mod  # noqa: E402
from kvmeans.utils.testing import assert_close  # noqa: E402

NAMES = ["q", "k", "v", "gate", "state_norm_weight", "state_norm_bias", "state_temp", "bswa_temp"]
# (T, C, n, sink, threshold, cap, H, Hkv, rope_dim, extra): lengths not multiples of C, GQA, no sink, several sinks,
# thresholds where some (sequence, kv head)s grow and others do not, caps that bind and caps that do not
CASES = [
    (37, 4, 2, 1, 0.5, 64, 4, 2, 2, {}),
    (41, 4, 1, 0, 0.6, 9, 4, 4, 0, {}),
    (50, 5, 3, 2, 0.45, 11, 6, 3, 4, {}),
    (70, 8, 2, 3, 0.35, 20, 4, 1, 2, {}),
    (45, 4, 2, 1, 0.5, 64, 4, 2, 2, dict(value_radius=False, gate_appends=True)),
]


def case_id(c):
    return "T{}-C{}-n{}-S{}-th{}-cap{}-H{}-Hkv{}-r{}".format(*c[:9]) + ("-ablation" if c[9] else "")


def call(inputs, lo, hi, case, state=None, **kw):
    T, C, n, S, th, cap, H, Hkv, r, extra = case
    part = {k: (x[:, :, lo:hi] if k in ("q", "k", "v", "gate") else x) for k, x in inputs.items()}
    return kvm_attention(part.pop("q"), part.pop("k"), part.pop("v"), part.pop("gate"), chunk_len=C, n_bswa_chunks=n,
                         sink_len=S, rope_dim=r, budget=StateBudget.novelty(th, cap), initial_state=state,
                         return_state=True, **part, **extra, **kw)


def inputs_for(case, B=2, seed=0, requires_grad=False):
    T, C, n, S, th, cap, H, Hkv, r, extra = case
    return make_inputs(B=B, H=H, Hkv=Hkv, T=T, D=8, Dv=6, seed=seed, requires_grad=requires_grad)


def rows_in_use(st):
    """``[B, Hkv]`` (a state before its first update under novelty, row_count None, has num_rows everywhere)."""
    return torch.full(st.keys.shape[:2], st.num_rows, device=st.keys.device) if st.row_count is None else st.row_count


def assert_same_state(s0, s1, tol=1e-10):
    assert (s0.num_rows, s0.coverage, s0.seen_tokens, s0.window_len) == (s1.num_rows, s1.coverage, s1.seen_tokens,
                                                                        s1.window_len)
    assert torch.equal(rows_in_use(s0), rows_in_use(s1))
    for name, a, b in zip(("keys", "values", "radii", "wkeys", "wvalues", "wgates"), (*s0.rows(), *s0.window()),
                          (*s1.rows(), *s1.window())):
        assert_close(name, a, b, tol)


def outputs_and_grads(backend, case):
    inputs = inputs_for(case, requires_grad=True)
    y, state = call(inputs, 0, case[0], case, backend=backend)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    rows = state.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    return y, state, torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_naive_grows_per_sequence_and_head(case):
    _, st = call(inputs_for(case), 0, case[0], case, backend="naive")
    count = st.row_count
    assert count.dtype == torch.long and count.shape == st.keys.shape[:2] and st.num_rows == int(count.max())
    assert count.min() >= case[1] and count.max() <= case[5]
    if case[5] > case[1] + 2:
        assert count.unique().numel() > 1, "the case should grow (sequence, kv head)s differently"
    unused = torch.arange(st.num_rows) >= count.unsqueeze(-1)
    for t in st.rows():
        assert t[unused].eq(0).all()                 # rows beyond a (b, h)'s count hold zeros


@pytest.mark.parametrize("groups", ["one", "per-chunk"])
@pytest.mark.parametrize("backward", ["graph", "reconstruct"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_chunked_matches_naive(case, backward, groups, monkeypatch):
    monkeypatch.setattr(chunk_mod, "BACKWARD", backward)
    if groups == "per-chunk":
        monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1)
    (y0, s0, g0), (y1, s1, g1) = outputs_and_grads("naive", case), outputs_and_grads("chunked", case)
    assert_close("y", y0, y1, 1e-10)
    assert_same_state(s0, s1)
    for name, a, b in zip(NAMES, g0, g1):
        assert_close("d" + name, a, b, 1e-10)


@pytest.mark.parametrize("backend", ["chunked", "recurrent", "naive"])
@pytest.mark.parametrize("case", CASES[:4], ids=case_id)
def test_every_split_point(case, backend):
    inputs, T = inputs_for(case), case[0]
    y_ref, s_ref = call(inputs, 0, T, case, backend="naive")
    with torch.no_grad():
        for t0 in range(1, T, 3):
            y0, s = call(inputs, 0, t0, case, backend="chunked")
            y1, s = call(inputs, t0, T, case, s, backend=backend)
            assert_close(f"y split at {t0}", y_ref, torch.cat([y0, y1], 2), 1e-10)
            assert_same_state(s_ref, s)


@pytest.mark.parametrize("steps", [(1,), (2, 5, 1, 7)])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_matches_naive(case, steps):
    inputs, T, C = inputs_for(case), case[0], case[1]
    y_ref, s_ref = call(inputs, 0, T, case, backend="naive")
    ys, state, pos, i = [], None, 0, 0
    with torch.no_grad():
        while pos < T:
            end = min(T, pos + steps[i % len(steps)])
            y, state = call(inputs, pos, end, case, state)          # auto: recurrent once a state exists
            ys.append(y)
            pos, i = end, i + 1
            if pos % C == 0 and pos > 2 * C:                         # states agree at every chunk boundary
                assert_same_state(call(inputs, 0, pos, case, backend="naive")[1], state)
    assert_close("y", y_ref, torch.cat(ys, 2), 1e-10)
    assert_same_state(s_ref, state)


@pytest.mark.parametrize("backend", ["naive", "chunked", "recurrent"])
def test_batch_rows_independent(backend):
    case = CASES[2]
    inputs, T = inputs_for(case, B=3), case[0]
    with torch.no_grad():
        y, st = call(inputs, 0, 20, case, backend="chunked")
        y2, st = call(inputs, 20, T, case, st, backend=backend)
        y = torch.cat([y, y2], 2)
        for b in range(3):
            one = {k: (x[b:b + 1] if k in ("q", "k", "v", "gate") else x) for k, x in inputs.items()}
            yb, sb = call(one, 0, T, case, backend="naive")
            assert_close(f"y[{b}]", yb, y[b:b + 1], 1e-10)
            assert torch.equal(sb.row_count, st.row_count[b:b + 1])
            m = sb.num_rows
            for name, a, c in zip(("keys", "values", "radii"), sb.rows(), st.rows()):
                assert_close(f"{name}[{b}]", a, c[b:b + 1, :, :m], 1e-10)
                assert c[b:b + 1, :, m:].eq(0).all()


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_carried_state_under_autograd(case):
    """Two chunked calls under autograd (the second differentiates through the carried rows) == one naive call."""
    T = case[0]
    ref = outputs_and_grads("naive", case)
    inputs = inputs_for(case, requires_grad=True)
    y0, st = call(inputs, 0, 19, case, backend="chunked")
    y1, st = call(inputs, 19, T, case, st, backend="chunked")
    y = torch.cat([y0, y1], 2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    rows = st.rows()
    loss = (y * dy).sum() + 0.3 * rows[0].sum() + 0.1 * rows[1].pow(2).sum() + 0.2 * rows[2].sum()
    grads = torch.autograd.grad(loss, [inputs[k] for k in NAMES], allow_unused=True, materialize_grads=True)
    assert_close("y", ref[0], y, 1e-10)
    assert_same_state(ref[1], st)
    for name, a, b in zip(NAMES, ref[2], grads):
        assert_close("d" + name, a, b, 1e-10)


def test_from_pretrained_with_a_novelty_budget(tmp_path):
    """The schedule override selects growth on a saved model: cached decode == one forward, rows per kv head."""
    pytest.importorskip("transformers")
    from kvmeans.models import KVMLanguageModel, KVMModelConfig
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.models.hf_compat import cache_from, cache_kwargs
    from kvmeans.utils.testing import perturb_identity_init
    torch.manual_seed(0)
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, chunk_len=8,
                                         n_bswa_chunks=2, budget={"kind": "fixed", "n": 16}))
    perturb_identity_init(lm)
    KVMForCausalLM.from_language_model(lm).save_pretrained(tmp_path / "m")
    model = KVMForCausalLM.from_pretrained(tmp_path / "m", budget="novelty:0.5:24").eval()
    ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :70], use_cache=True)
        steps = [out.logits]
        for t in range(70, 90):
            out = model(ids[:, t:t + 1], **cache_kwargs(cache_from(out)), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    cache = cache_from(out).groups[0].cache
    counts = torch.stack([st.row_count for st, m in zip(cache.layers, cache.mixers) if m == "kvm"])
    assert counts.min() >= 8 and counts.max() <= 24 and counts.unique().numel() > 1
