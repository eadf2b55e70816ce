"""numerics="reference": the rounding points of the authors' eager mixer (docs/reference-conventions.md
§1.7, §1.8, §1.11, §10), its plumbing through configs / loaders / Auto classes, and its invariants against
"exact"."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvmeans.models import KVMLanguageModel, KVMModelConfig
from kvmeans.ops import KVMState, StateBudget, kvm_attention
from kvmeans.utils.testing import perturb_identity_init

BF16 = torch.bfloat16


def inputs(B=1, H=2, Hkv=2, T=12, D=8, Dv=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, H, T, D), r(B, Hkv, T, D), r(B, Hkv, T, Dv)
    gate = 1 + F.elu(r(B, Hkv, T))
    params = dict(state_norm_weight=1 + 0.1 * r(D), state_norm_bias=0.1 * r(D), state_temp=1 + 0.1 * r(H),
                  bswa_temp=1 + 0.1 * r(H))
    return [t.to(dtype) for t in (q, k, v, gate)], {n: t.to(dtype) for n, t in params.items()}


# one update with 2 appends + 2 merges, then one readout: tokens [0,4) = initial rows, block [4,8) enters
# the state when the chunk [8,12) arrives (n_bswa_chunks=1), which attends to 6 rows + its own chunk
GEOM = dict(chunk_len=4, n_bswa_chunks=1, sink_len=1, rope_dim=2, budget=StateBudget.fixed(6))


# ---- (i) an independent emulation of one overflow update and one readout ---------------------------
def _emulate_bf16(q, k, v, gate, p):
    """Written from docs/reference-conventions.md §1.2, §1.3, §1.7, §1.8, §10 for bf16 tensors: every op is
    computed in fp32 (or fp64) and rounded once to bf16 where the authors' code produces a bf16 tensor."""
    rnd = lambda x: x.to(BF16)  # noqa: E731
    w, b = p["state_norm_weight"], p["state_norm_bias"]

    def ln(x):           # nn.LayerNorm on bf16: fp32 math, bf16 out
        return rnd(F.layer_norm(x.double(), x.shape[-1:], w.double(), b.double(), 1e-5))

    def mm(a, c):        # bf16 matmul: exact products, fp32 accumulation, one rounding
        return rnd(a.double() @ c.double().transpose(-1, -2))

    def prep(x):         # memory key: zero the rope channels, LN_s
        return ln(torch.cat([torch.zeros_like(x[..., :2]), x[..., 2:]], -1))

    K, V, R = prep(k[:, :, :4]), v[:, :, :4], v[:, :, :4].float().norm(dim=-1)
    sel, vb, g = prep(k[:, :, 4:8]), v[:, :, 4:8], gate[:, :, 4:8, None]
    mk, mv = rnd(sel.double() * g.double()), rnd(vb.double() * g.double())    # gated merge key / value
    novelty = mm(sel, ln(K)).float().amax(-1)                                  # all rows, sinks included
    order = novelty.sort(dim=-1, stable=True).indices                              # ties: lower token first
    margin = (novelty.sort(-1).values[..., 2] - novelty.sort(-1).values[..., 1]).min()
    # what fp32 scores with the ungated key would decide (kvmeans' exact numerics)
    app32 = (sel.float() @ ln(K).float().transpose(-1, -2)).amax(-1).sort(dim=-1, stable=True).indices[..., :2]
    app, mrg = order[..., :2].sort(-1).values, order[..., 2:].sort(-1).values
    take = lambda x, i: x.gather(2, i[..., None].expand(*i.shape, x.shape[-1]))  # noqa: E731
    K, V = torch.cat([K, take(sel, app)], 2), torch.cat([V, take(vb, app)], 2)
    R = torch.cat([R, take(vb, app).float().norm(dim=-1)], 2)
    logits = mm(take(mk, mrg), ln(K)).float()          # gated key against old + appended rows
    logits[..., 0] = -math.inf                         # the sink
    top2 = logits.topk(2, -1).values
    margin = min(margin, (top2[..., 0] - top2[..., 1]).min())
    logits32 = take(sel, mrg).float() @ ln(K).float().transpose(-1, -2)
    logits32[..., 0] = -math.inf
    flipped = not (torch.equal(app32.sort(-1).values, app) and torch.equal(logits32.argmax(-1), logits.argmax(-1)))
    onehot = F.one_hot(logits.argmax(-1), K.shape[2]).double()
    K = rnd(K.double() + rnd(onehot.transpose(-1, -2) @ take(mk, mrg).double()))
    V = rnd(V.double() + rnd(onehot.transpose(-1, -2) @ take(mv, mrg).double()))
    # readout of chunk [8, 12): LN_s(sums) * state temp; normalize(v_sum fp32) * radius -> bf16
    st, bt = p["state_temp"].view(1, -1, 1, 1), p["bswa_temp"].view(1, -1, 1, 1)
    k_hat = rnd(ln(K).double() * st.double())
    vf = V.float()
    v_hat = rnd(vf / vf.norm(dim=-1, keepdim=True).clamp_min(1e-12) * R[..., None])
    keys = torch.cat([k_hat, rnd(k[:, :, 8:12].double() * bt.double())], 2)
    vals = torch.cat([v_hat, v[:, :, 8:12]], 2)
    mask = torch.ones(4, 10, dtype=torch.bool).tril(6)                          # lower-right causal
    y = F.scaled_dot_product_attention(q[:, :, 8:12], keys, vals, attn_mask=mask)   # the reference's SDPA call
    return y, (K, V, R), margin, flipped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_update_and_readout_match_a_hand_emulation_bitwise(seed):
    (q, k, v, gate), p = inputs(seed=seed, dtype=BF16)
    y, state = kvm_attention(q, k, v, gate, **GEOM, **p, numerics="reference", return_state=True)
    y_ref, (K, V, R), margin, _ = _emulate_bf16(q, k, v, gate, p)
    assert margin > 0                                   # routing is well separated: no tie to break
    assert state.num_rows == 6 and state.keys.dtype == BF16 and state.radii.dtype == torch.float32
    assert torch.equal(state.keys, K) and torch.equal(state.values, V) and torch.equal(state.radii, R)
    assert torch.equal(y[:, :, 8:], y_ref)
    # and it is not what the exact numerics give (they compute in fp32 and do not round the readout)
    y_exact = kvm_attention(q, k, v, gate, **GEOM, **p)
    assert not torch.equal(y_exact, y)


def test_bf16_rounded_scores_and_gated_key_decide_near_ties():
    """Where bf16 rounding of the scores (or gating the merge key) changes an append or merge decision
    against fp32 ungated scores, the mode follows the rounded, gated scores of the reference."""
    found = 0
    for seed in range(100, 120):
        (q, k, v, gate), p = inputs(B=4, H=4, Hkv=4, D=4, seed=seed, dtype=BF16)
        y_ref, (K, V, R), _, flipped = _emulate_bf16(q, k, v, gate, p)
        if not flipped:
            continue
        found += 1
        y, state = kvm_attention(q, k, v, gate, **GEOM, **p, numerics="reference", return_state=True)
        assert torch.equal(state.keys, K) and torch.equal(state.values, V) and torch.equal(state.radii, R)
        assert torch.equal(y[:, :, 8:], y_ref)
    assert found >= 3


# ---- (ii) reference vs exact in fp32 ---------------------------------------------------------------
LONG = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2,
            budget=StateBudget.power_law(2.0, 0.5, min_len=4))


def test_fp32_without_state_reads_equals_exact():
    (q, k, v, gate), p = inputs(T=8, seed=3)            # T <= L: plain causal attention over the window
    ref = kvm_attention(q, k, v, gate, **LONG, **p, numerics="reference")
    torch.testing.assert_close(ref, kvm_attention(q, k, v, gate, **LONG, **p), rtol=0, atol=1e-6)


def test_fp32_difference_is_the_bf16_readout_cast():
    """In fp32 the state arithmetic agrees with exact numerics; the one rounding point left is the
    bf16 cast of the readout values: at most 2^-9 relative per value, so the attention output (a convex
    combination) moves by at most 2^-9 * max radius. With 1-D values whose radii are bf16 numbers the
    readout ``sign(v_sum) * radius`` is exactly representable and the two numerics agree to fp32 rounding."""
    (q, k, v, gate), p = inputs(B=2, H=4, Hkv=2, T=40, seed=4)
    ref, s_ref = kvm_attention(q, k, v, gate, **LONG, **p, numerics="reference", return_state=True)
    ex, s_ex = kvm_attention(q, k, v, gate, **LONG, **p, return_state=True)
    assert s_ref.num_rows == s_ex.num_rows > 4
    for a, b in zip(s_ref.rows(), s_ex.rows()):          # same routing, same sums up to fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    bound = 2.0 ** -9 * s_ex.radii.max().item()
    diff = (ref - ex).abs().max().item()
    assert 1e-5 < diff <= bound

    v1 = v[..., :1].to(BF16).float()                     # Dv = 1, values on the bf16 grid
    ref1 = kvm_attention(q, k, v1, gate, **LONG, **p, numerics="reference")
    torch.testing.assert_close(ref1, kvm_attention(q, k, v1, gate, **LONG, **p), rtol=0, atol=1e-6)


# ---- (iii) any split of a sequence gives the state and outputs of one call ------------------------
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_op_prefill_then_decode_equals_one_call(dtype):
    (q, k, v, gate), p = inputs(B=2, H=4, Hkv=2, T=37, seed=5, dtype=dtype)
    y, s = kvm_attention(q, k, v, gate, **LONG, **p, numerics="reference", return_state=True)
    for splits in ([11] + [1] * 26, [16, 5, 16]):
        state, outs, pos = None, [], 0
        for n in splits:
            sl = slice(pos, pos + n)
            out, state = kvm_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], gate[:, :, sl], **LONG, **p,
                                       numerics="reference", initial_state=state, return_state=True)
            outs.append(out)
            pos += n
        for a, b in zip((*state.rows(), *state.window()), (*s.rows(), *s.window())):
            assert torch.equal(a, b)                     # routing and sums do not depend on the split
        # attention is one SDPA per call shape (as in the reference): rounding of the kernel only
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(torch.cat(outs, 2).float(), y.float(), rtol=tol, atol=tol)


def test_backend_is_ignored_and_autograd_flows():
    (q, k, v, gate), p = inputs(B=1, H=2, Hkv=1, T=30, seed=6)
    with torch.no_grad():
        ys = [kvm_attention(q, k, v, gate, **LONG, **p, numerics="reference", backend=b)
              for b in ("auto", "naive", "chunked", "recurrent")]
    assert all(torch.equal(y, ys[0]) for y in ys)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, gate)]
    kvm_attention(*leaves, **LONG, **p, numerics="reference").square().sum().backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def _tiny_lm(dtype, numerics="reference"):
    torch.manual_seed(0)
    lm = KVMLanguageModel(KVMModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                         chunk_len=4, n_bswa_chunks=2, rope_reference_bf16=True,
                                         budget={"kind": "power_law", "factor": 2.0, "exponent": 0.5, "min_len": 4},
                                         kvm_numerics=numerics))
    perturb_identity_init(lm)   # the paper init makes blocks the identity
    return lm.to(dtype).eval()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (BF16, 0.1)])
def test_model_prefill_then_decode_equals_one_forward(dtype, tol):
    lm = _tiny_lm(dtype)
    assert all(b.attn.config.numerics == "reference" for b in lm.transformer.h)
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full, full_cache = lm(ids)
        logits, cache = lm(ids[:, :13])
        steps = [logits]
        for i in range(13, 30):
            logits, cache = lm(ids[:, i:i + 1], cache)
            steps.append(logits)
    step = torch.cat(steps, 1)
    torch.testing.assert_close(step, full, rtol=0, atol=tol)
    assert torch.equal(step.argmax(-1), full.argmax(-1))
    for a, b in zip(cache.layers, full_cache.layers):
        assert a.num_rows == b.num_rows and a.keys.dtype == dtype
        torch.testing.assert_close(a.rows()[0].float(), b.rows()[0].float(), rtol=0, atol=tol)


# ---- (iv) loaders: authors' layout -> reference by default, overrides, round trips -------------------
@pytest.fixture(scope="module")
def authors_dir(tmp_path_factory):
    pytest.importorskip("safetensors")
    from kvmeans.models.reference_checkpoint import build_tiny_reference_checkpoint
    path = tmp_path_factory.mktemp("authors") / "ref"
    build_tiny_reference_checkpoint(path, seed=3)
    return path


IDS = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(8))   # > n*C = 16: state read


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_authors_layout_loads_reference_numerics_and_override(authors_dir, tmp_path):
    hf = pytest.importorskip("kvmeans.models.hf")
    ref = hf.KVMForCausalLM.from_pretrained(authors_dir, dtype=torch.float32)
    kvm = [b.attn for b in ref.transformer.h if b.mixer == "kvm"]
    assert ref.config.kvm_numerics == "reference" and kvm and all(a.config.numerics == "reference" for a in kvm)
    exact = hf.KVMForCausalLM.from_pretrained(authors_dir, dtype=torch.float32, kvm_numerics="exact")
    assert exact.config.kvm_numerics == "exact" and all(b.attn.config.numerics == "exact"
                                                       for b in exact.transformer.h if b.mixer == "kvm")
    l_ref, l_exact = _logits(ref), _logits(exact)
    assert 0 < (l_ref - l_exact).abs().max() < 0.05      # only rounding differs
    # authors -> ours -> save -> load keeps the flag and the logits, both ways round
    for model, logits in ((ref, l_ref), (exact, l_exact)):
        out = tmp_path / model.config.kvm_numerics
        model.save_pretrained(out)
        assert json.loads((out / "config.json").read_text())["kvm_numerics"] == model.config.kvm_numerics
        back = hf.KVMForCausalLM.from_pretrained(out)
        assert back.config.kvm_numerics == model.config.kvm_numerics and torch.equal(_logits(back), logits)
    # our layout can be switched at load time as well
    switched = hf.KVMForCausalLM.from_pretrained(tmp_path / "reference", kvm_numerics="exact")
    assert switched.config.kvm_numerics == "exact" and torch.equal(_logits(switched), l_exact)
    # a config.json written before the flag existed loads as "exact"
    cfg = json.loads((tmp_path / "reference" / "config.json").read_text())
    del cfg["kvm_numerics"]
    (tmp_path / "reference" / "config.json").write_text(json.dumps(cfg))
    assert hf.KVMForCausalLM.from_pretrained(tmp_path / "reference").config.kvm_numerics == "exact"


def test_convert_records_numerics(authors_dir, tmp_path):
    from kvmeans.cli import main as cli
    from kvmeans.models.reference_checkpoint import convert_reference_checkpoint, read_converted_checkpoint
    assert convert_reference_checkpoint(authors_dir, tmp_path / "a").kvm_numerics == "reference"
    assert read_converted_checkpoint(tmp_path / "a")[0].kvm_numerics == "reference"
    assert cli(["convert", str(authors_dir), str(tmp_path / "b"), "--numerics", "exact", "--no-check"]) == 0
    assert read_converted_checkpoint(tmp_path / "b")[0].kvm_numerics == "exact"
    with pytest.raises(ValueError, match="numerics must be 'exact'.*'reference'.*got 'bf16'"):
        convert_reference_checkpoint(authors_dir, tmp_path / "c", numerics="bf16")


# ---- (v) Auto classes open an authors' directory ------------------------------------------------------
def test_auto_classes_open_authors_dir(authors_dir):
    hf = pytest.importorskip("kvmeans.models.hf")
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvmeans.models.reference_checkpoint import reference_config_to_ours
    raw = json.loads((authors_dir / "config.json").read_text())
    assert raw["model_type"] == "rwkv7backbone" and "auto_map" in raw
    for trust in (None, True):                        # our registration wins over their remote code
        config = AutoConfig.from_pretrained(authors_dir, trust_remote_code=trust)
        assert isinstance(config, hf.KVMReferenceConfig) and config.kvm_numerics == "reference"
        assert config.to_model_config() == reference_config_to_ours(raw)
    assert config.to_dict()["model_type"] == "kvmeans"   # saved as our layout
    model = AutoModelForCausalLM.from_pretrained(authors_dir, dtype=torch.float32)
    assert type(model) is hf.KVMForCausalLM and model.config.kvm_numerics == "reference" and not model.training
    direct = hf.KVMForCausalLM.from_pretrained(authors_dir, dtype=torch.float32)
    assert torch.equal(_logits(model), _logits(direct))
    exact = AutoModelForCausalLM.from_pretrained(authors_dir, dtype=torch.float32, kvm_numerics="exact")
    assert exact.config.kvm_numerics == "exact"
    assert torch.equal(_logits(exact), _logits(hf.KVMForCausalLM.from_pretrained(
        authors_dir, dtype=torch.float32, kvm_numerics="exact")))
    assert AutoModelForCausalLM.from_pretrained(authors_dir).dtype == torch.bfloat16   # "auto": as stored


# ---- (vi) bad values name the argument and the choices ------------------------------------------------
def test_bad_numerics_values_raise():
    (q, k, v, gate), p = inputs()
    with pytest.raises(ValueError, match=r"numerics must be one of \('exact', 'mixed', 'reference'\).*got 'fast'"):
        kvm_attention(q, k, v, gate, **GEOM, numerics="fast")
    from kvmeans.layers import KVMAttentionConfig
    with pytest.raises(ValueError, match=r"KVMAttentionConfig.numerics: must be one of "
                                         r"\('exact', 'mixed', 'reference'\), got 'bf16'"):
        KVMAttentionConfig(hidden_size=16, num_heads=2, numerics="bf16")
    with pytest.raises(ValueError,
                       match=r"KVMModelConfig.kvm_numerics: must be one of \('exact', 'mixed', 'reference'\)"):
        KVMModelConfig(kvm_numerics="Reference")


def test_state_of_other_numerics_is_refused():
    (q, k, v, gate), p = inputs(T=12, dtype=BF16)
    _, state = kvm_attention(q, k, v, gate, **GEOM, **p, numerics="reference", return_state=True)
    assert isinstance(state, KVMState) and state.dtype == BF16
    with pytest.raises(ValueError, match="numerics='exact'.*continue a sequence with the numerics that started it"):
        kvm_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], gate[:, :, :1], **GEOM, **p, initial_state=state)
