"""A converted layer's state through fixed-shape slots (kvmeans.serve.state_slots; plain torch, no vLLM): any split
of calls through load/op/store and the batched decode gives what one persistent ConvertedKVMState gives."""
import functools

import pytest
import torch

from kvmeans.ops.budget import StateBudget
from kvmeans.ops.schedule import rows_after
from kvmeans.pretrained.board import NoveltyBoard
from kvmeans.pretrained.convert import KVMSpec
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention, rotate, unrotate
from kvmeans.serve.state_slots import SlotLayout, decode_batch, load_state, needs_routing, pool_capacity, store_state

H, HKV, D = 4, 2, 8


def _rope(positions, R=D, theta=100.0):
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    ang = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def _kwargs(spec, mode, T0, T):
    """The op's RoPE arguments for tokens [T0, T0 + T) of one sequence."""
    if mode in ("none", "post_rope"):
        return {} if mode == "none" else dict(cos=None, sin=None)
    cos, sin = _rope(torch.arange(T0, T0 + T)[None])
    cd, sd = _rope(torch.tensor([spec.distance]))
    return dict(cos=cos, sin=sin, cos_d=cd[0], sin_d=sd[0], rope=_rope)


def _run(spec, mode, q, k, v, st, T0, gate=None, learned=None, layer_novelty=None):
    T = q.shape[2]
    return converted_kvm_attention(q, k, v, st, scaling=D ** -0.5, budget=spec.state_budget, chunk_len=spec.chunk_len,
                                   n_bswa_chunks=spec.n_bswa_chunks, sink_len=spec.sink_len,
                                   rope_mode="none" if mode == "none" else mode, exact_rows=spec.exact_rows,
                                   exact_lead=spec.exact_lead, exact_join=spec.exact_join, merge_gate=gate,
                                   layer_novelty=layer_novelty,
                                   log_count_bias=spec.log_count_bias, **(learned or {}),
                                   **{k_: v_ for k_, v_ in _kwargs(spec, mode, T0, T).items()
                                      if not (mode == "post_rope" and k_ in ("cos", "sin"))})


def _q_state(spec, mode, q, pos):
    """[N, H, D] the query that reads the rows (what the op computes inside)."""
    if mode not in ("pre_rope_fixed", "split"):
        return q
    c, s = _rope(pos)
    cd, sd = _rope(torch.tensor([spec.distance]))
    a = (cd[0] ** 2 + sd[0] ** 2).sqrt()
    return rotate(unrotate(q[:, :, None], c[:, None, None], s[:, None, None]), cd[0] * a, sd[0] * a)[:, :, 0]


def _inputs(T, n_seq, seed=0, mode="post_rope"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_seq):
        q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (H, HKV, HKV))
        if mode != "none":
            cos, sin = _rope(torch.arange(T)[None])
            q, k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
        gate = 1 + 0.5 * torch.rand(1, HKV, T, generator=g)
        out.append((q, k, v, gate))
    return out


LEARNED = dict(state_key_weight=1 + 0.1 * torch.randn(HKV, D, generator=torch.Generator().manual_seed(3)),
               state_key_bias=0.1 * torch.randn(HKV, D, generator=torch.Generator().manual_seed(4)),
               state_temp=torch.linspace(0.8, 1.2, H), window_temp=torch.linspace(1.1, 0.9, H))

CASES = {
    "post_rope": (dict(budget=12, chunk_len=4, n_bswa_chunks=2, sink_len=1), "post_rope", False),
    "pre_rope_fixed": (dict(budget=12, chunk_len=4, n_bswa_chunks=3, sink_len=2, rope_distance=20),
                       "pre_rope_fixed", False),
    "exact_rows": (dict(budget=16, chunk_len=4, n_bswa_chunks=2, sink_len=1, exact_rows=6, rope_distance=12,
                        exact_lead=1), "pre_rope_fixed", False),
    "exact_lead": (dict(budget=16, chunk_len=4, n_bswa_chunks=3, sink_len=1, exact_rows=6, exact_lead=9),
                   "post_rope", False),                     # the most lead: every window token after the block
    "exact_join": (dict(budget=16, chunk_len=4, n_bswa_chunks=3, sink_len=1, exact_rows=6, exact_lead=1,
                        exact_join=True, rope_distance=14), "pre_rope_fixed", False),
    "power_law": (dict(budget=StateBudget.power_law(2.0), chunk_len=4, n_bswa_chunks=2, sink_len=1), "none", False),
    "no_count_bias": (dict(budget=StateBudget.power_law(2.0), chunk_len=4, n_bswa_chunks=2, sink_len=1, exact_rows=3,
                           log_count_bias=False), "post_rope", False),
    "learned": (dict(budget=12, chunk_len=4, n_bswa_chunks=2, sink_len=1, exact_rows=4, learned=True,
                     rope_distance=10), "pre_rope_fixed", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slots_continue_the_op_exactly(case):
    """Three sequences of different lengths: prompts in uneven pieces (through load/op/store), then decode steps
    batched over the sequences (decode_batch, or the op for a step that routes); every output and the final
    states equal one persistent ConvertedKVMState per sequence."""
    settings, mode, learned = CASES[case]
    spec = KVMSpec(**settings, rope_mode=mode)
    T = 70
    seqs = _inputs(T, 3, mode=mode)
    prompts = [23, 9, 41]
    layout = SlotLayout.for_spec(spec, num_kv_heads=HKV, head_dim=D, max_len=T, dtype=torch.float32)
    slots = layout.allocate(5)
    for name in ("key_sum", "buf_k", "buf_v", "read_key", "read_value", "read_bias"):
        slots[name].fill_(float("nan"))          # a reused slot's leftovers must never be read
    slot_of = [3, 0, 4]
    extra = (lambda s, a, b: dict(gate=s[3][:, :, a:b], learned=LEARNED)) if learned else (lambda s, a, b: {})
    store = dict(log_count_bias=spec.log_count_bias,
                 **({k_: LEARNED[k_] for k_ in ("state_key_weight", "state_key_bias")} if learned else {}))
    ref_states = [ConvertedKVMState() for _ in seqs]
    ref = [_run(spec, mode, s[0], s[1], s[2], st, 0, **extra(s, 0, T)) for s, st in zip(seqs, ref_states)]
    got = [[] for _ in seqs]
    pieces = [7, 1, 13]
    for j, (s, P) in enumerate(zip(seqs, prompts)):      # prompts: uneven pieces through the op
        a = 0
        while a < P:
            b = min(P, a + pieces[a % 3])
            st = load_state(slots, slot_of[j], layout, spec.sink_len, mode in ("pre_rope_fixed", "split"))
            got[j].append(_run(spec, mode, s[0][:, :, a:b], s[1][:, :, a:b], s[2][:, :, a:b], st, a, **extra(s, a, b)))
            store_state(slots, slot_of[j], st, layout, **store)
            a = b
    n_fast = 0
    for step in range(T - min(prompts)):                  # decode: all sequences still running, batched
        live = [j for j in range(3) if prompts[j] + step < T]
        fast = []
        for j in live:
            p = prompts[j] + step
            seen, covered, _, _ = slots["meta"][slot_of[j]].tolist()
            assert seen == p
            if needs_routing(seen, covered, spec.chunk_len, spec.n_bswa_chunks):
                s = seqs[j]
                st = load_state(slots, slot_of[j], layout, spec.sink_len, mode in ("pre_rope_fixed", "split"))
                got[j].append(_run(spec, mode, s[0][:, :, p:p + 1], s[1][:, :, p:p + 1], s[2][:, :, p:p + 1], st, p,
                                   **extra(s, p, p + 1)))
                store_state(slots, slot_of[j], st, layout, **store)
            else:
                fast.append(j)
        if fast:
            n_fast += len(fast)
            idx = torch.tensor([slot_of[j] for j in fast])
            pos = torch.tensor([prompts[j] + step for j in fast])
            q = torch.cat([seqs[j][0][:, :, prompts[j] + step] for j in fast])
            k = torch.cat([seqs[j][1][:, :, prompts[j] + step] for j in fast])
            v = torch.cat([seqs[j][2][:, :, prompts[j] + step] for j in fast])
            kw = {}
            if learned:
                kw = dict(gate=torch.cat([seqs[j][3][:, :, prompts[j] + step] for j in fast]),
                          state_temp=LEARNED["state_temp"], window_temp=LEARNED["window_temp"])
            out = decode_batch(slots, layout, idx, slots["meta"][idx].clone(), q, k, v, _q_state(spec, mode, q, pos),
                               scaling=D ** -0.5, **kw)
            for r, j in enumerate(fast):
                got[j].append(out[r:r + 1, :, None])
    assert n_fast > 50
    for j in range(3):
        torch.testing.assert_close(torch.cat(got[j], 2), ref[j], atol=1e-5, rtol=1e-5)
        st = load_state(slots, slot_of[j], layout, spec.sink_len, mode in ("pre_rope_fixed", "split"))
        assert (st.seen, st.covered, st.num_rows) == (ref_states[j].seen, ref_states[j].covered,
                                                      ref_states[j].num_rows)
        for name in ("key_sum", "value_sum", "count", "buf_k", "buf_v", "reserve_key", "reserve_count", "reserve_pos"):
            if getattr(ref_states[j], name) is not None:
                torch.testing.assert_close(getattr(st, name), getattr(ref_states[j], name), atol=1e-5, rtol=1e-5)


def test_a_reused_slot_starts_fresh():
    spec = KVMSpec(budget=12, chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_mode="post_rope")
    layout = SlotLayout.for_spec(spec, num_kv_heads=HKV, head_dim=D, max_len=64, dtype=torch.float32)
    slots = layout.allocate(1)
    (q, k, v, _), (q2, k2, v2, _) = _inputs(40, 2, seed=5)
    st = load_state(slots, 0, layout, 1, False)
    _run(spec, "post_rope", q, k, v, st, 0)
    store_state(slots, 0, st, layout)
    slots["meta"][0].zero_()                     # what the plugin does for a request's first call
    st = load_state(slots, 0, layout, 1, False)
    assert st.seen == 0 and st.count is None
    out = _run(spec, "post_rope", q2, k2, v2, st, 0)
    torch.testing.assert_close(out, _run(spec, "post_rope", q2, k2, v2, ConvertedKVMState(), 0))


def test_board_ranking_across_layers_through_slots():
    """exact_scope="model": two layers rank a block by their mean novelty; per-request board keys through the
    slots give what the one-state path gives."""
    spec = KVMSpec(budget=16, chunk_len=4, n_bswa_chunks=2, sink_len=1, exact_rows=6, rope_mode="post_rope")
    layout = SlotLayout.for_spec(spec, num_kv_heads=HKV, head_dim=D, max_len=64, dtype=torch.float32)
    layers = [_inputs(48, 1, seed=s)[0] for s in (7, 8)]
    ref_board, board = NoveltyBoard(2), NoveltyBoard(2)
    ref_st = [ConvertedKVMState(), ConvertedKVMState()]
    slots = [layout.allocate(2), layout.allocate(2)]
    outs, refs = [], []
    for a, b in ((0, 13), (13, 14), (14, 48)):
        for li, (q, k, v, _) in enumerate(layers):
            refs.append(_run(spec, "post_rope", q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], ref_st[li], a,
                             layer_novelty=functools.partial(ref_board.combine, li)))
            st = load_state(slots[li], 1, layout, 1, False)
            outs.append(_run(spec, "post_rope", q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], st, a,
                             layer_novelty=functools.partial(board.combine, li, rows=("slot", 1))))
            store_state(slots[li], 1, st, layout)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r)
    assert len(board) == 0


def test_decode_batch_refuses_a_fresh_slot():
    spec = KVMSpec(budget=12, chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_mode="post_rope")
    layout = SlotLayout.for_spec(spec, num_kv_heads=HKV, head_dim=D, max_len=64, dtype=torch.float32)
    slots = layout.allocate(2)
    q, k, v = torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    with pytest.raises(ValueError, match="first call goes through the op"):
        decode_batch(slots, layout, torch.tensor([1]), slots["meta"][[1]], q, k, v, q, scaling=1.0)


def test_layout_sizes_and_capacity():
    spec = KVMSpec(budget=128, chunk_len=32, n_bswa_chunks=4, sink_len=4)
    lay = SlotLayout.for_spec(spec, num_kv_heads=3, head_dim=64, max_len=32768, dtype=torch.float32)
    assert (lay.rows, lay.window) == (128, 128)
    # meta; the rows' sums and counts; their read-out (mean keys, values, bias); the window's keys and values
    assert lay.nbytes == 16 + 4 * (2 * 3 * 128 * 64 + 3 * 128) * 2 + 4 * 2 * 3 * 128 * 64
    for T in (9, 100, 400, 401):                  # a growing budget: the rows a sequence of max_len tokens reaches
        assert pool_capacity(StateBudget.power_law(2.0), 4, 2, 0, T) == rows_after(StateBudget.power_law(2.0), T, 4, 2)
    assert pool_capacity(100, 32, 4, 0, 64) == 32                            # nothing leaves the window: chunk 1
    assert SlotLayout.for_spec(KVMSpec(budget=64, exact_rows=16), num_kv_heads=1, head_dim=8, max_len=4096,
                               dtype=torch.bfloat16).dtypes[0] == torch.int32
