"""Ragged batches: rows at different positions advance in one call per step, each row equal to its solo run
(the op on a stacked KVMState, and KVMForCausalLM.generate on left-padded prompts of distinct lengths)."""
import pytest
import torch

from kvmeans import StateBudget, kvm_attention
from kvmeans.ops.state import KVMState
from kvmeans.utils.args import UsageError
from kvmeans.utils.testing import make_inputs

pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from tests.models.test_hf import GREEDY, left_pad, prompts, tiny  # noqa: E402

BUDGETS = {"fixed": StateBudget.fixed(8), "sqrt": StateBudget.power_law(2.0, 0.5, min_len=4),
           "saturating": StateBudget.saturating(14, min_len=4)}
LENGTHS = [1, 3, 4, 6, 9, 12, 17, 22]      # first chunk, boundaries, inactive and active states (C=4, L=8)
STEPS = 11


def op_kwargs(budget, sink_len=1, **extra):
    return dict(chunk_len=4, n_bswa_chunks=2, sink_len=sink_len, rope_dim=2, budget=BUDGETS[budget], **extra)


def per_row(x, lengths, t):
    """``x[b, :, lengths[b] + t]`` of every row, as ``[B, heads, 1, ...]`` (each row's next token)."""
    return torch.stack([x[b, :, n + t] for b, n in enumerate(lengths)]).unsqueeze(2)


def prefill(inp, lengths, kw):
    """Each row's prompt alone: ``[(solo state)]``."""
    keys = ("q", "k", "v", "gate")
    return [kvm_attention(*(inp[n][b:b + 1, :, :L] for n in keys), **kw, return_state=True)[1]
            for b, L in enumerate(lengths)]


def state_params(inp):
    return {n: inp[n] for n in ("state_norm_weight", "state_norm_bias", "state_temp", "bswa_temp")}


def assert_rows_equal(ragged: KVMState, solos, atol):
    for rows, part in ragged.split():
        for j, b in enumerate(rows.tolist()):
            solo = solos[b]
            assert (part.seen_tokens, part.num_rows, part.coverage) == (solo.seen_tokens, solo.num_rows, solo.coverage)
            for mine, want in zip((*part.rows(), *part.window()), (*solo.rows(), *solo.window())):
                torch.testing.assert_close(mine[j], want[0], rtol=0, atol=atol)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("sink_len", [0, 1])
def test_ragged_decode_equals_each_row_alone(budget, sink_len):
    inp = make_inputs(B=len(LENGTHS), H=4, Hkv=2, T=max(LENGTHS) + STEPS, D=8)        # GQA, float64
    kw = op_kwargs(budget, sink_len, **state_params(inp))
    solos = prefill(inp, LENGTHS, kw)
    ragged = KVMState.stack([s.clone() for s in solos])
    assert ragged.schedule is not None and ragged.schedule.seen == tuple(LENGTHS)
    for t in range(STEPS):
        step = [per_row(inp[n], LENGTHS, t) for n in ("q", "k", "v", "gate")]
        with torch.no_grad():
            y = kvm_attention(*step, **kw, initial_state=ragged)                        # one call, every row
            for b, solo in enumerate(solos):
                want = kvm_attention(*(x[b:b + 1] for x in step), **kw, initial_state=solo)
                torch.testing.assert_close(y[b:b + 1], want, rtol=0, atol=1e-10)
    assert ragged.schedule.seen == tuple(n + STEPS for n in LENGTHS)
    assert_rows_equal(ragged, solos, 1e-10)


def test_a_non_finite_token_reaches_only_its_own_row():
    inp = make_inputs(B=3, H=4, Hkv=2, T=30, D=8)
    kw = op_kwargs("sqrt", **state_params(inp))
    lengths = [6, 13, 20]
    solos = prefill(inp, lengths, kw)
    ragged = KVMState.stack([s.clone() for s in solos])
    inp["v"][1, :, 13] = float("nan")                            # row 1's first new token
    for t in range(8):
        step = [per_row(inp[n], lengths, t) for n in ("q", "k", "v", "gate")]
        with torch.no_grad():
            y = kvm_attention(*step, **kw, initial_state=ragged)
            want = torch.cat([kvm_attention(*(x[b:b + 1] for x in step), **kw, initial_state=solo)
                              for b, solo in enumerate(solos)])
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
        torch.testing.assert_close(y[[0, 2]], want[[0, 2]], rtol=0, atol=1e-10)


@pytest.mark.parametrize("budget", ["fixed", "sqrt"])
def test_ragged_multi_token_call_runs_each_position_group_alone(budget):
    lengths, T = [3, 9, 9, 14], 6
    inp = make_inputs(B=4, H=4, Hkv=2, T=max(lengths) + T, D=8)
    kw = op_kwargs(budget, **state_params(inp))
    solos = prefill(inp, lengths, kw)
    ragged = KVMState.stack([s.clone() for s in solos])
    chunk = lambda x, b, n: x[b:b + 1, :, n:n + T]
    y = kvm_attention(*(torch.cat([chunk(inp[n], b, L) for b, L in enumerate(lengths)])
                        for n in ("q", "k", "v", "gate")), **kw, initial_state=ragged)
    for b, L in enumerate(lengths):
        want = kvm_attention(*(chunk(inp[n], b, L) for n in ("q", "k", "v", "gate")), **kw, initial_state=solos[b])
        torch.testing.assert_close(y[b:b + 1], want, rtol=0, atol=1e-10)
    assert ragged.schedule.seen == tuple(n + T for n in lengths)
    assert_rows_equal(ragged, solos, 1e-10)


def test_ragged_triton_decode_kernel_reads_per_row_lengths():
    pytest.importorskip("triton")
    from kvmeans.ops.triton import available
    if not available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [2, 5, 10, 13]
    inp = {k: v.to(dev) for k, v in make_inputs(B=4, H=4, Hkv=2, T=max(lengths) + 6, D=8,
                                                  dtype=torch.float32).items()}
    kw = op_kwargs("sqrt", **state_params(inp))
    solos = prefill(inp, lengths, kw)
    ragged = KVMState.stack([s.clone() for s in solos])
    for t in range(6):
        step = [per_row(inp[n], lengths, t) for n in ("q", "k", "v", "gate")]
        with torch.no_grad():
            y = kvm_attention(*step, **kw, initial_state=ragged, backend="triton")
            want = torch.cat([kvm_attention(*(x[b:b + 1] for x in step), **kw, initial_state=solo, backend="recurrent")
                              for b, solo in enumerate(solos)])
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_stack_split_and_select_keep_each_row():
    inp = make_inputs(B=3, H=2, Hkv=2, T=20, D=8)
    kw = op_kwargs("fixed", **state_params(inp))
    solos = prefill(inp, [5, 17, 5], kw)
    ragged = KVMState.stack(solos)
    assert [r.tolist() for r, _ in ragged.split()] == [[0, 2], [1]]
    assert "ragged seen=[5, 17, 5]" in repr(ragged)
    assert ragged.nbytes_used == sum(st.nbytes_used for st in solos)
    picked = ragged.index_select(torch.tensor([1, 1]))           # rows at one position: a plain state
    assert picked.schedule is None and picked.seen_tokens == 17 and picked.num_rows == solos[1].num_rows
    torch.testing.assert_close(picked.window()[0][1], solos[1].window()[0][0])
    again = ragged.index_select(torch.tensor([2, 1]))
    assert again.schedule.seen == (5, 17) and ragged.clone().schedule == ragged.schedule
    other = kvm_attention(*(inp[n][:1, :, :5] for n in ("q", "k", "v", "gate")), **{**kw, "chunk_len": 5},
                          return_state=True)[1]
    with pytest.raises(ValueError, match="chunk_len"):
        KVMState.stack([solos[0], other])
    with pytest.raises(ValueError, match="dtype"):
        KVMState.stack([solos[0], solos[1].to(torch.float32)])
    half = make_inputs(B=2, H=2, Hkv=2, T=12, D=8, dtype=torch.bfloat16)        # reference numerics: fp32 radii
    ref = [kvm_attention(*(half[n][b:b + 1, :, :L] for n in ("q", "k", "v", "gate")), **kw | state_params(half),
                         numerics="reference", return_state=True)[1] for b, L in enumerate([5, 12])]
    both = KVMState.stack(ref)
    assert both.radii.dtype == torch.float32 and both.keys.dtype == torch.bfloat16
    torch.testing.assert_close(both.radii[1, :, :ref[1].num_rows], ref[1].radii[0, :, :ref[1].num_rows], rtol=0,
                               atol=0)


# ---- KVMForCausalLM.generate -------------------------------------------------------------------------
MODEL_BUDGETS = {"fixed": {"kind": "fixed", "n": 16},
                 "sqrt": {"kind": "power_law", "factor": 4.0, "exponent": 0.5, "min_len": 8},
                 "saturating": {"kind": "saturating", "n": 24, "min_len": 8},
                 "novelty": {"kind": "novelty", "threshold": 0.4, "n": 20}}     # row counts per kv head


@pytest.mark.parametrize("budget", list(MODEL_BUDGETS))
def test_left_padded_distinct_lengths_decode_in_one_call_per_step(budget):
    model = tiny("kvm", budget=MODEL_BUDGETS[budget])                      # 4 heads, 2 kv heads, sink 1
    seqs = prompts([3, 7, 12, 16, 21, 26, 30, 37])
    ids, mask = left_pad(seqs)
    calls, inner = [], model.transformer.forward
    model.transformer.forward = lambda x, *a, **k: (calls.append(x.shape[0]), inner(x, *a, **k))[1]
    kw = dict(max_new_tokens=20, output_logits=True, return_dict_in_generate=True, **GREEDY)
    out = model.generate(ids, attention_mask=mask, **kw)
    del model.transformer.forward
    assert calls[len(seqs):] == [len(seqs)] * 19                  # prefill by length, then one call per step
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], **kw)
        assert torch.equal(out.sequences[i, ids.shape[1]:], alone.sequences[0, len(s):]), f"row {i}"
        torch.testing.assert_close(torch.stack([x[i] for x in out.logits]), torch.cat(alone.logits),
                                   rtol=1e-4, atol=1e-5)


def test_ragged_cache_continues_with_padded_and_multi_token_calls():
    model, seqs = tiny("kvm"), prompts([9, 16, 23])
    full = lambda i, n: model(seqs[i][None, :n], use_cache=False).logits[0, -1]
    ids, mask = left_pad([s[:n] for s, n in zip(seqs, (5, 11, 14))])
    with torch.no_grad():
        cache = cache_from(model(ids, attention_mask=mask))
        more = torch.stack([s[n:n + 2] for s, n in zip(seqs, (5, 11, 14))])    # unpadded: merged, ragged
        cache = cache_from(model(more, **cache_kwargs(cache)))
        assert len(cache.groups) == 1 and cache.to_model_cache().layers[0].schedule.seen == (7, 13, 16)
        pad = torch.zeros(3, 2, dtype=torch.long)                               # rows take 0, 1, 2 tokens
        last = torch.stack([pad[0], torch.tensor([0, seqs[1][13]]), seqs[2][16:18]])
        m = torch.tensor([[0, 0], [0, 1], [1, 1]])
        got = model(last, attention_mask=m, **cache_kwargs(cache)).logits[:, -1]
        for i, n in ((1, 14), (2, 18)):
            torch.testing.assert_close(got[i], full(i, n), rtol=1e-4, atol=1e-5)
        assert cache.lengths.tolist() == [7, 14, 18]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=4, **GREEDY)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY))


def test_beam_search_on_a_ragged_batch_equals_uncached():
    model = tiny("kvm")
    ids, mask = left_pad(prompts([5, 9, 14]))
    kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=10, **GREEDY)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_bench_ragged_prints_the_ratio(capsys):
    from kvmeans.bench.ragged import run
    from kvmeans.cli.bench_ragged import main
    out = run([5, 9], new_tokens=3, repeats=1)
    assert out["calls_per_token"] == {"ragged": 4 / 3, "equal": 1.0}      # 2 prefill calls, then one per step
    text = capsys.readouterr().out
    assert "ragged / equal =" in text and "calls/token" in text
    with pytest.raises(UsageError, match="--new-tokens"):
        main(["--new-tokens", "0"])
    from kvmeans.cli import main as cli
    assert cli(["bench", "ragged", "--new-tokens", "0"]) == 2                  # routed, one-line error
    assert "ragged" in capsys.readouterr().err
