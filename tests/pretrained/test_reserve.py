"""A reserve of exact rows for the most novel tokens (KVMSpec.exact_rows, kvmeans.pretrained.reserve): 0 is
KVM's routing bit for bit; which tokens keep a slot (one score per token shared by the kv heads); the pool keeps
the budget less the reserve with no empty row; any split, batch rows, padding, crop, generate and save/load."""
import pytest
import torch
import torch.nn.functional as F

from kvmeans.ops.budget import StateBudget, as_budget
from kvmeans.ops.routing import route_overflow
from kvmeans.ops.schedule import plan_updates
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention

tf = pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.pretrained.convert import KVMSpec, convert_hf, converted_cache, load_converted, parse_kvm_spec  # noqa: E402
from tests.pretrained.test_batch import left_pad, positions, rows  # noqa: E402
from tests.pretrained.test_convert import ids, tiny  # noqa: E402

RESERVE = dict(budget=16, chunk_len=8, n_bswa_chunks=2, sink_len=2, exact_rows=6, exact_lead=1)   # pool 10 + 6 slots


def _qkv(B=2, H=4, Hkv=2, T=121, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64))


def _state(st):
    return {n: getattr(st, n) for n in ConvertedKVMState.FIELDS} | {"seen": st.seen, "covered": st.covered}


def _assert_same_state(a, b, atol=0.0):
    sa, sb = _state(a), _state(b)
    for name, x in sa.items():
        y = sb[name]
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=name)
        else:
            assert x == y, name


def _kvm_routing(k, v, budget, C, n, sink):
    """KVM's routing as it was before the reserve (one call, ``rope_mode='none'``, no gate): the oracle."""
    ks, vs = k[..., :C, :], v[..., :C, :]
    cnt = torch.ones(ks.shape[:-1], dtype=k.dtype)
    for step in plan_updates(as_budget(budget), C, C, k.shape[2], C, n):
        bk, bv = k[..., step.start:step.start + C, :], v[..., step.start:step.start + C, :]
        sel = F.normalize(bk, dim=-1)
        dest, _ = route_overflow(F.normalize(ks, dim=-1), sel, sel, step.n_append, sink)
        pad = (0, 0, 0, step.n_append)
        ks = F.pad(ks, pad).scatter_add(-2, dest.unsqueeze(-1).expand_as(bk), bk)
        vs = F.pad(vs, pad).scatter_add(-2, dest.unsqueeze(-1).expand_as(bv), bv)
        cnt = F.pad(cnt, pad[2:]).scatter_add(-1, dest, torch.ones_like(dest, dtype=cnt.dtype))
    return ks, vs, cnt


@pytest.mark.parametrize("budget", [24, StateBudget.power_law(2.0, 0.5)])
def test_zero_exact_rows_is_kvm_routing_bit_for_bit(budget):
    q, k, v = _qkv()
    run = dict(scaling=8 ** -0.5, budget=budget, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="none")
    st = ConvertedKVMState()
    out = converted_kvm_attention(q, k, v, st, exact_rows=0, **run)
    for got, want in zip((st.key_sum, st.value_sum, st.count), _kvm_routing(k, v, budget, 8, 2, 2)):
        assert torch.equal(got, want)
    assert st.reserve_count is None
    assert torch.equal(out, converted_kvm_attention(q, k, v, ConvertedKVMState(), **run))


def _needles(T=120, D=8):
    """Two kv heads of one repeated key; in head 0 tokens 40 and 48 are orthogonal to it and token 60 is nearly
    it. Values carry each token's position in channel 0."""
    k = torch.zeros(1, 2, T, D, dtype=torch.float64)
    k[..., 0] = 1
    k[0, 0, 40], k[0, 0, 48] = F.one_hot(torch.tensor([1, 2]), D).double()
    k[0, 0, 60, 3] = 0.1
    v = torch.zeros(1, 2, T, D, dtype=torch.float64)
    v[..., 0] = torch.arange(T, dtype=torch.float64)
    return k, v


def test_novel_tokens_keep_their_slots_in_every_kv_head():
    """Head 0 sees tokens 40 and 48 as novel, head 1 sees nothing novel: the scores are averaged over the heads,
    so both heads keep 40 and 48 exactly (per-head scores would keep head 1's first tokens), and the near
    duplicate at 60 goes to the pool."""
    k, v = _needles()
    st = ConvertedKVMState()
    converted_kvm_attention(k.repeat_interleave(2, 1), k, v, st, scaling=1.0, budget=12, chunk_len=8,
                            n_bswa_chunks=2, sink_len=1, rope_mode="none", exact_rows=2)
    assert st.covered == 104 and st.count.shape[-1] == 10 and st.num_rows == 12
    assert sorted(st.reserve_value[0, 0, :, 0].tolist()) == [40, 48] == sorted(st.reserve_value[0, 1, :, 0].tolist())
    assert st.reserve_count.tolist() == [[[1, 1], [1, 1]]]
    torch.testing.assert_close(st.reserve_key[0, 0].sort(0).values, k[0, 0, [40, 48]].sort(0).values, rtol=0, atol=0)
    assert float(st.count.sum()) == 2 * (104 - 2)                         # every other token is in the pool


def test_a_lead_keeps_the_token_before_a_novel_one_across_a_block_boundary():
    """With exact_lead=1 a token scores the most of its own novelty and the next token's: 39 (before 40) and 47,
    the last of its block, whose next token 48 lies in the next block (still in the window), keep slots beside
    40 and 48; without it the two slots the novel tokens do not take keep the first token that filled them and the
    slightly novel 60."""
    k, v = _needles()
    held = {}
    for lead in (0, 1):
        st = ConvertedKVMState()
        converted_kvm_attention(k.repeat_interleave(2, 1), k, v, st, scaling=1.0, budget=14, chunk_len=8,
                                n_bswa_chunks=2, sink_len=1, rope_mode="none", exact_rows=4, exact_lead=lead)
        held[lead] = [sorted(st.reserve_value[0, h, :, 0].tolist()) for h in range(2)]
    assert held[1] == [[39, 40, 47, 48]] * 2
    assert held[0] == [[8, 40, 48, 60]] * 2


def _run_of_novel_tokens(*runs, T=120, D=8):
    """Two kv heads of one repeated key, the tokens of each ``(first, last)`` of ``runs`` one other key (novel);
    values carry each token's position in channel 0."""
    k = torch.zeros(1, 2, T, D, dtype=torch.float64)
    k[..., 0] = 1
    for first, last in runs:
        k[:, :, first:last + 1] = F.one_hot(torch.tensor(1), D).double()
    v = torch.zeros(1, 2, T, D, dtype=torch.float64)
    v[..., 0] = torch.arange(T, dtype=torch.float64)
    return k, v


def _held(k, v, exact_rows=6, **kw):
    st = ConvertedKVMState()
    out = converted_kvm_attention(k.repeat_interleave(2, 1), k, v, st, scaling=1.0, budget=20, chunk_len=8,
                                  n_bswa_chunks=2, sink_len=1, rope_mode="none", exact_rows=exact_rows, **kw)
    held = [sorted(st.reserve_value[0, h, :, 0].tolist()) for h in range(2)]
    assert sorted(st.reserve_pos[0, 0].tolist()) == held[0]           # each slot knows its token's index
    return held, out


def test_join_keeps_a_novel_run_cut_by_a_block_boundary():
    """Tokens 45-50 are one novel run and a block boundary falls at 48. The block [40, 48) gives 45-47 slots;
    without exact_join 48-50 then meet them in the slots (cosine 1), look known, and the slots keep the first
    tokens that filled them; with it, 48-50 (each higher without the slots the block before filled, after its
    held last token 47) score as inside that block and the whole run is kept. Token 51, as known either way,
    ends the run."""
    k, v = _run_of_novel_tokens((45, 50))
    assert _held(k, v, exact_lead=0)[0] == [[8, 9, 10, 45, 46, 47]] * 2
    assert _held(k, v, exact_lead=0, exact_join=True)[0] == [[45, 46, 47, 48, 49, 50]] * 2
    assert _held(k, v, exact_lead=1, exact_join=True)[0] == [[44, 45, 46, 47, 48, 49]] * 2   # 44 leads; 6 slots


def test_join_needs_the_block_before_to_end_held():
    """A novel run 41-46 inside one block, a known token 47, then 48-49 like the run: the block before does not end
    held, so 48-49 keep their scores (they look known) and two slots keep their first tokens, with or without
    exact_join, outputs bit for bit (scored without the slots of 41-46 they would take those two slots)."""
    k, v = _run_of_novel_tokens((41, 46), (48, 49))
    (held, out), (held_j, out_j) = _held(k, v, exact_rows=8), _held(k, v, exact_rows=8, exact_join=True)
    assert held == held_j == [[8, 9, 41, 42, 43, 44, 45, 46]] * 2 and torch.equal(out, out_j)


@pytest.mark.parametrize("exact_rows", [0, 2])
def test_a_query_for_the_needle_reads_it_exactly_only_from_the_reserve(exact_rows):
    k, v = _needles()
    q = k.repeat_interleave(2, 1).clone()
    q[:, :2, -1] = 30 * F.one_hot(torch.tensor(1), 8).double()           # the last query asks for token 40's key
    out = converted_kvm_attention(q, k, v, ConvertedKVMState(), scaling=1.0, budget=12, chunk_len=8,
                                  n_bswa_chunks=2, sink_len=1, rope_mode="none", exact_rows=exact_rows)
    got = float(out[0, 0, -1, 0])
    assert (abs(got - 40) < 1e-6) == bool(exact_rows), got               # KVM's routing merges it with others


def test_the_pool_keeps_the_budget_less_the_reserve_and_no_empty_row():
    """While the slots fill, the pool takes only the tokens the reserve lets go (no empty row is appended); it
    then grows to budget - exact_rows, and every token is counted once."""
    q, k, v = _qkv(T=150)
    st = ConvertedKVMState()
    converted_kvm_attention(q, k, v, st, scaling=8 ** -0.5, budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2,
                            rope_mode="none", exact_rows=12)
    assert st.count.shape[-1] == 12 and st.num_rows == 24
    assert bool((st.count > 0).all()) and bool((st.reserve_count == 1).all())
    assert torch.isfinite(st.reserve_score).all()
    torch.testing.assert_close(st.count.sum(-1) + st.reserve_count.sum(-1),
                               torch.full((2, 2), float(st.covered), dtype=torch.float64))


@pytest.mark.parametrize("gated", [False, True])
def test_a_block_that_outscores_no_slot_skips_the_sort_bit_for_bit(monkeypatch, gated):
    """The shortcut (no token of a block scores above a filled slot: the reserve stays as it is) gives what the
    full sort gives, outputs and state bit for bit, and it is taken for most blocks once the slots hold the most
    novel tokens seen."""
    import kvmeans.pretrained.op as op
    T = 400
    q, k, v = _qkv(T=T)
    gate = torch.rand(2, 2, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    run = dict(scaling=8 ** -0.5, budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="none",
               exact_rows=6, merge_gate=gate if gated else None)
    taken = []
    holds = op._reserve_holds
    monkeypatch.setattr(op, "_reserve_holds", lambda *a: taken.append(holds(*a)) or taken[-1])
    fast_st = ConvertedKVMState()
    fast = converted_kvm_attention(q, k, v, fast_st, **run)
    monkeypatch.setattr(op, "_reserve_holds", lambda *a: False)
    sort_st = ConvertedKVMState()
    slow = converted_kvm_attention(q, k, v, sort_st, **run)
    assert sum(taken) > len(taken) // 2 and not all(taken)
    assert torch.equal(fast, slow)
    _assert_same_state(fast_st, sort_st)


@pytest.mark.parametrize("exact_rows,chunk_len,n_bswa_chunks,sink_len,budget,T,gated,lead,join", [
    (3, 8, 2, 2, 24, 121, False, 0, False),
    (3, 8, 2, 2, 24, 121, False, 1, False),
    (12, 8, 2, 0, 24, 121, True, 1, False),         # more slots than a chunk: the reserve fills over two blocks
    (5, 4, 3, 1, StateBudget.power_law(2.0, 0.5), 95, False, 9, False),    # the most lead: every window token after it
    (4, 8, 1, 2, 24, 121, False, 1, False),         # a one-chunk window: the lead token is the partial chunk's first
    (6, 4, 2, 1, 24, 121, False, 1, True),          # joined runs
    (12, 8, 2, 0, 24, 121, True, 0, True),
])
def test_any_split_equals_one_call(exact_rows, chunk_len, n_bswa_chunks, sink_len, budget, T, gated, lead, join):
    q, k, v = _qkv(T=T)
    gate = torch.rand(2, 2, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    run = dict(scaling=8 ** -0.5, budget=budget, chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks,
               sink_len=sink_len, rope_mode="none", exact_rows=exact_rows, exact_lead=lead, exact_join=join)
    one = ConvertedKVMState()
    full = converted_kvm_attention(q, k, v, one, merge_gate=gate if gated else None, **run)
    base = converted_kvm_attention(q, k, v, ConvertedKVMState(), merge_gate=gate if gated else None,
                                   **{**run, "exact_rows": 0})
    assert (full - base).abs().max() > 1e-3                                  # the reserve changes the read
    for cuts in ([37], [5, 6, 7, 40, 41, 90], list(range(1, T))):
        st, parts, prev = ConvertedKVMState(), [], 0
        for cut in cuts + [T]:
            g = gate[..., prev:cut] if gated else None
            parts.append(converted_kvm_attention(q[:, :, prev:cut], k[:, :, prev:cut], v[:, :, prev:cut], st,
                                                 merge_gate=g, **run))
            prev = cut
        torch.testing.assert_close(torch.cat(parts, 2), full, rtol=0, atol=1e-12)
        _assert_same_state(st, one, atol=1e-12)


def test_batch_rows_are_independent_and_the_state_methods_carry_the_reserve():
    q, k, v = _qkv(B=3)
    run = dict(scaling=8 ** -0.5, budget=24, chunk_len=8, n_bswa_chunks=2, sink_len=2, rope_mode="none",
               exact_rows=10)
    st = ConvertedKVMState()
    out = converted_kvm_attention(q, k, v, st, **run)
    for b in range(3):
        alone = ConvertedKVMState()
        torch.testing.assert_close(converted_kvm_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], alone, **run),
                                   out[b:b + 1], rtol=0, atol=1e-12)
        _assert_same_state(alone, st.copy().index_select(torch.tensor([b])), atol=1e-12)
    slots = sum(t.numel() * t.element_size() for t in st.reserve)
    assert slots > 0 and st.nbytes == slots + sum(t.numel() * t.element_size() for t in
                                                  (st.buf_k, st.buf_v, st.key_sum, st.value_sum, st.count))
    assert "exact_rows=10" in repr(st)


# ---- a converted model --------------------------------------------------------------------------------------

@torch.no_grad()
def test_converted_llama_decodes_and_generates_like_full_forwards():
    model = convert_hf(tiny("llama"), **RESERVE)
    x = ids(100)
    full = model(x).logits
    assert (full - convert_hf(tiny("llama"), **{**RESERVE, "exact_rows": 0})(x).logits).abs().max() > 1e-4
    cache = assert_decode_matches(model, x, full)
    assert cache.layers[0].state.num_rows == 16
    x = ids(30)
    run = dict(max_new_tokens=25, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **run), model.generate(x, use_cache=False, **run))   # a forward per token


@torch.no_grad()
def test_save_load_left_padding_and_crop_keep_the_reserve(tmp_path):
    model = convert_hf(tiny("llama"), **RESERVE)
    model.save_pretrained(tmp_path)
    loaded = load_converted(tmp_path)
    assert loaded.config.kvm_conversion["exact_rows"] == 6
    x = ids(90)
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    assert_left_padding_matches(model)
    assert_crop_replays(model)


def assert_decode_matches(model, x, full):
    """A prefill of 37 tokens, then one token per call through the cache: the logits of one forward (``full``);
    returns the cache."""
    cache = tf.DynamicCache(config=model.config)
    steps = [x[:, :37], *x[:, 37:].split(1, 1)]
    decoded = torch.cat([model(s, **cache_kwargs(cache), use_cache=True).logits for s in steps], 1)
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)
    return cache


def assert_left_padding_matches(model):
    """Rows of distinct lengths left-padded into one batch: each row's logits as when it runs alone."""
    seqs = rows()
    xp, mask = left_pad(seqs, pad=7)
    padded = model(xp, attention_mask=mask, position_ids=positions(mask)).logits
    for i, s in enumerate(seqs):
        torch.testing.assert_close(padded[i, xp.shape[1] - len(s):], model(s[None]).logits[0], rtol=0, atol=1e-5)


def assert_crop_replays(model):
    """A rejected draft that crossed a chunk boundary (48), cropped: the next tokens as if never drafted."""
    x, draft = ids(80, B=1, seed=4), ids(7, B=1, seed=5)
    want_cache, cache = tf.DynamicCache(config=model.config), converted_cache(model)
    cache.activate_past_recording()
    model(x[:, :45], **cache_kwargs(want_cache), use_cache=True)
    want = model(x[:, 45:], **cache_kwargs(want_cache), use_cache=True).logits
    model(x[:, :44], **cache_kwargs(cache), use_cache=True)
    model(torch.cat((x[:, 44:45], draft[:, 1:]), 1), **cache_kwargs(cache), use_cache=True)
    cache.crop(-6)
    torch.testing.assert_close(model(x[:, 45:], **cache_kwargs(cache), use_cache=True).logits, want, rtol=0, atol=1e-5)


def test_learned_read_out_gates_the_reserved_tokens():
    """With learned=True a slot holds g*k, g*v and count g: perturbed read-out parameters still decode like one
    forward, and gradients reach the merge gate."""
    from tests.pretrained.test_distill import perturb
    model = convert_hf(tiny("llama"), learned=True, **RESERVE)
    perturb(model)
    x = ids(100)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :53], use_cache=True)
        rest = model(x[:, 53:], **cache_kwargs(cache_from(out)), use_cache=True).logits
        torch.testing.assert_close(torch.cat((out.logits, rest), 1), full, rtol=0, atol=1e-5)
        state = cache_from(out).layers[0].state.parts[0][1]
        assert not torch.equal(state.reserve_count, (state.reserve_count > 0).to(state.reserve_count.dtype))
    model(x).logits.square().mean().backward()
    grad = model.model.layers[0].self_attn.kvm_gate_weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0


def test_spec_parses_and_refuses_in_one_line():
    assert parse_kvm_spec("exact_rows=64") == {"exact_rows": 64}
    assert KVMSpec(budget=StateBudget.power_law(2.0), exact_rows=500).exact_rows == 500     # no cap to check
    with pytest.raises(ValueError, match=r"exact_rows must be in \[0, budget - chunk_len = 8\].*raise budget"):
        KVMSpec(budget=16, chunk_len=8, exact_rows=9)
    with pytest.raises(ValueError, match=r"exact_rows must be in \[0, budget - chunk_len = 96\]"):
        parse_kvm_spec("budget=fixed:128,exact_rows=97")
    with pytest.raises(ValueError, match="exact_rows must be >= 0"):
        KVMSpec(budget=StateBudget.power_law(2.0), exact_rows=-1)
    with pytest.raises(ValueError, match="set one of them to 0"):
        KVMSpec(exact_rows=4, novel_rows=2)
    assert KVMSpec().exact_lead == 1 and parse_kvm_spec("exact_lead=0") == {"exact_lead": 0}
    assert KVMSpec.from_dict({"budget": 128, "exact_rows": 32}).exact_lead == 0     # saved before it existed
    with pytest.raises(ValueError, match=r"exact_lead must be in \[0, \(n_bswa_chunks - 1\) \* chunk_len \+ 1 = 9\]"):
        parse_kvm_spec("chunk_len=8,n_bswa_chunks=2,exact_lead=10")
    with pytest.raises(ValueError, match="exact_lead must be in"):
        converted_kvm_attention(*_qkv(T=20), ConvertedKVMState(), scaling=1.0, budget=8, chunk_len=4,
                                n_bswa_chunks=1, sink_len=0, rope_mode="none", exact_rows=2, exact_lead=2)
    assert KVMSpec.from_dict({"budget": 128, "exact_rows": 32}).exact_join is False     # saved before it existed
    assert parse_kvm_spec("exact_join=true") == {"exact_join": True}
    assert KVMSpec(exact_join=True).op_kwargs()["exact_join"] is True
    with pytest.raises(ValueError, match="exact_join must be true or false"):
        parse_kvm_spec("exact_join=2")
