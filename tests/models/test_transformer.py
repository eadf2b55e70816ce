"""KVMLanguageModel: paper parameter counts, every mixer and hybrids (full forward == prefill +
decode == any split), flat cache memory, beams, value-residual streams, gradients, presets, MLP."""
import pytest
import torch

from kvmeans.models import MLP, KVMLanguageModel, KVMModelConfig, preset
from kvmeans.utils.testing import perturb_identity_init

TINY = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, chunk_len=8,
            n_bswa_chunks=2, budget={"kind": "fixed", "n": 16}, swa_window=8, bswa_chunks=2, bswa_sink_len=2,
            ovq_chunk_len=8, ovq_max_centroids=12)
ARCHS = {
    "kvm": dict(), "full": dict(mixer="full"), "swa": dict(mixer="swa"), "bswa": dict(mixer="bswa"),
    "ovq": dict(mixer="ovq"), "kvm+swa": dict(alt_mixer="swa", alt_every=2),
    "ovq+swa": dict(mixer="ovq", alt_mixer="swa", alt_every=2),
}
T = 70  # crosses 8 chunks of 8 tokens


def tiny_model(arch, seed=0, **overrides):
    torch.manual_seed(seed)
    model = KVMLanguageModel(KVMModelConfig(**{**TINY, **ARCHS[arch], **overrides}))
    perturb_identity_init(model)   # the paper init makes blocks the identity
    return model.eval()


def run_split(model, ids, cuts):
    logits, cache, begin = [], None, 0
    for end in (*cuts, ids.shape[1]):
        out, cache = model(ids[:, begin:end], cache)
        logits.append(out)
        begin = end
    return torch.cat(logits, dim=1), cache


# ---- parameter counts (reference 5.3) -------------------------------------------------------------
def count(name):
    with torch.device("meta"):
        return KVMLanguageModel(preset(name)).num_parameters()


def test_paper_parameter_counts():
    assert count("kvm-120m") == 162_942_096
    assert count("kvm-350m") == 407_026_048


@pytest.mark.parametrize("size, d, H, L", [("120m", 768, 6, 12), ("350m", 1024, 8, 24)])
def test_baseline_counts_follow_the_per_layer_differences(size, d, H, L):
    kvm, D = count(f"kvm-{size}"), d // H
    kvm_only = 2 * D + H * d + 2 * H                   # ln_s_k, key_weighting, two temperatures
    assert count(f"kvm-sqrt-{size}") == kvm
    assert count(f"gpta-{size}") == count(f"bswa-{size}") == kvm - L * kvm_only
    assert count(f"kvm-swa-{size}") == kvm - L // 2 * kvm_only
    assert count(f"ovq-swa-{size}") == kvm - L * kvm_only - L // 2 * (4 * D - H)  # no ln_q/ln_k, plus beta


def test_checkpoint_names_and_shapes():
    with torch.device("meta"):
        model = KVMLanguageModel(preset("kvm-120m"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    expect = {"transformer.wte.weight": (50304, 768), "transformer.ln_emb.weight": (768,),
              "transformer.ln_head.bias": (768,), "lm_head.weight": (50304, 768),
              "transformer.h.3.ln_attn.weight": (768,), "transformer.h.3.attn.x_q": (768,),
              "transformer.h.3.attn.v_gate0": (1, 1, 768), "transformer.h.3.attn.v_gate1.weight": (32, 768),
              "transformer.h.3.attn.v_gate2.weight": (768, 32), "transformer.h.3.attn.front_head_temp": (6,),
              "transformer.h.3.attn.ln_q.weight": (128,), "transformer.h.3.attn.ln_s_k.bias": (128,),
              "transformer.h.3.attn.key_weighting.weight": (6, 768), "transformer.h.3.mlp.x_k": (1, 1, 768),
              "transformer.h.3.mlp.c_fc.weight": (3072, 768), "transformer.h.3.mlp.c_proj.weight": (768, 3072)}
    assert {n: shapes[n] for n in expect} == expect
    assert len([n for n in shapes if n.startswith("transformer.h.0.attn.")]) == 19
    assert not list(model.buffers())
    assert [model.transformer.h[i].attn.config.rope_dim for i in (0, 1)] == [64, 64]
    with torch.device("meta"):
        hybrid = KVMLanguageModel(preset("ovq-swa-120m"))
    assert [b.attn.config.rope_dim for b in hybrid.transformer.h[:2]] == [128, 0]
    assert "transformer.h.1.attn.beta" in dict(hybrid.named_parameters())


def test_reference_init():
    model = KVMLanguageModel(KVMModelConfig(**TINY))
    t = model.transformer
    assert t.wte.weight.abs().max() <= 1e-4
    for block in t.h:
        assert torch.count_nonzero(block.attn.c_proj.weight) == 0 and torch.count_nonzero(block.mlp.c_proj.weight) == 0
        torch.testing.assert_close(block.mlp.c_fc.weight.T @ block.mlp.c_fc.weight, torch.eye(32), atol=1e-5, rtol=0)
    gain2 = 0.25 * 64 / 32
    torch.testing.assert_close(model.lm_head.weight.T @ model.lm_head.weight, gain2 * torch.eye(32), atol=1e-5, rtol=0)
    ids = torch.randint(0, 64, (2, 9))
    logits, _ = model(ids)                   # identity blocks: logits depend on the token only
    assert logits.dtype == torch.float32 and logits.shape == (2, 9, 64)


# ---- prefix consistency ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_decode_and_splits_equal_full_forward(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        full, _ = model(ids)
        decoded, cache = run_split(model, ids, tuple(range(5, T)))         # prefill 5, then token by token
        torch.testing.assert_close(decoded, full, rtol=1e-4, atol=1e-4)
        assert cache.seen_tokens == T and all(st.seen_tokens == T for st in cache.layers)
        for cuts in [(1, 8, 9, 30), (3, 17, 18, 40, 63), (16, 24, 69)]:
            split, _ = run_split(model, ids, cuts)
            torch.testing.assert_close(split, full, rtol=1e-4, atol=1e-4, msg=f"cuts={cuts}")


@pytest.mark.parametrize("arch", ["kvm", "swa", "bswa"])
def test_decode_cache_memory_is_flat(arch):
    model = tiny_model(arch)
    sizes = []
    with torch.no_grad():
        _, cache = model(torch.randint(0, 64, (1, 20)))
        for _ in range(60):                                       # 7+ more chunks
            _, cache = model(torch.randint(0, 64, (1, 1)), cache)
            sizes.append(cache.nbytes)
    assert len(set(sizes[20:])) == 1, sizes
    if arch != "kvm":
        assert len(set(sizes)) == 1
    report = cache.report()
    assert [r["layer"] for r in report] == [0, 1, 2, 3] and {r["mixer"] for r in report} == {arch}
    assert sum(r["nbytes"] for r in report) == cache.nbytes and "total" in cache.summary()


def test_full_attention_cache_grows():
    model = tiny_model("full")
    with torch.no_grad():
        _, cache = model(torch.randint(0, 64, (1, 8)))
        before = cache.nbytes
        _, cache = model(torch.randint(0, 64, (1, 40)), cache)
    assert cache.nbytes > before


def test_beam_reorder_and_snapshot():
    model = tiny_model("kvm+swa")
    ids = torch.randint(0, 64, (3, 30))
    with torch.no_grad():
        full, _ = model(ids)
        _, cache = model(ids[:, :20])
        snapshot = cache.clone()
        beams, _ = model(ids[[2, 2, 0], 20:], cache.index_select(torch.tensor([2, 2, 0])))
        reordered, _ = model(ids[[1, 0, 2], 20:], cache.reorder_(torch.tensor([1, 0, 2])))
        resumed, _ = model(ids[:, 20:], snapshot)
    torch.testing.assert_close(beams, full[[2, 2, 0], 20:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reordered, full[[1, 0, 2], 20:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(resumed, full[:, 20:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="batch"):
        model(ids[:2, :1], snapshot)


def test_value_residual_streams():
    model = tiny_model("ovq+swa")
    seen = {}
    for i, block in enumerate(model.transformer.h):
        block.attn.register_forward_pre_hook(lambda m, a, kw, i=i: seen.__setitem__(i, kw["v_first"]), with_kwargs=True)
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        model(ids)
        t = model.transformer
        x0 = t.ln_emb(t.wte(ids))
        alt, main = t.h[0].attn.c_v(t.h[0].ln_attn(x0)), t.h[1].attn.c_v(t.h[1].ln_attn(x0))
    for i, want in [(0, alt), (2, alt), (1, main), (3, main)]:
        torch.testing.assert_close(seen[i], want)


# ---- training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["kvm+swa", "ovq+swa", "full", "bswa"])
def test_gradients_reach_every_parameter(arch):
    model = tiny_model(arch).train()
    ids = torch.randint(0, 64, (2, 40))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    model.loss(ids, targets).backward()
    # a stream's first layer anchors on its own input when that input is x0 (layer 0): the mix is an exact no-op
    inert = {"transformer.h.0.attn.v_gate0", "transformer.h.0.attn.v_gate1.weight",
             "transformer.h.0.attn.v_gate2.weight"}
    for name, p in model.named_parameters():
        nonzero = p.grad is not None and p.grad.abs().sum() > 0
        assert nonzero != (name in inert), name


def test_loss_matches_cross_entropy_and_ignores():
    model = tiny_model("kvm")
    ids = torch.randint(0, 64, (2, 12))
    targets = torch.randint(0, 64, (2, 12))
    targets[0, :5] = -100
    with torch.no_grad():
        logits, _ = model(ids)
        keep = targets != -100
        want = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
        torch.testing.assert_close(model.loss(ids, targets), want)


# ---- config and presets ---------------------------------------------------------------------------------
def test_presets_and_errors():
    cfg = preset("kvm-swa-350m")
    assert (cfg.hidden_size, cfg.num_layers, cfg.residual_scale) == (1024, 24, 0.5)
    assert cfg.mixer_per_layer()[:3] == ["swa", "kvm", "swa"] and cfg.value_residual and cfg.token_shift
    assert preset("tiny-cpu", num_layers=2).num_layers == 2
    assert KVMLanguageModel.from_preset("tiny-cpu", num_layers=1).config.num_layers == 1
    with pytest.raises(ValueError, match=r"unknown preset 'kvm-7b'.*available: .*kvm-120m"):
        preset("kvm-7b")
    with pytest.raises(ValueError, match=r"KVMModelConfig\.mixer"):
        KVMModelConfig(mixer="mamba")
    with pytest.raises(ValueError, match=r"KVMModelConfig\.swa_window"):
        KVMModelConfig(swa_window=0)
    assert KVMModelConfig(hidden_size=48, num_heads=8).rope_for_layer(0) == 2   # head 6 -> 2 rotated channels
    with pytest.raises(ValueError, match="input_ids"):
        KVMLanguageModel(KVMModelConfig(**TINY))(torch.zeros(2, 0, dtype=torch.long))


def test_mlp_token_shift_zero_predecessor_and_carry():
    torch.manual_seed(0)
    mlp = MLP(8, 32, layer_idx=1, num_layers=4)
    with torch.no_grad():
        mlp.c_proj.weight.normal_()
    x = torch.randn(2, 9, 8)
    y, last = mlp(x)
    torch.testing.assert_close(last, x[:, -1])
    alpha = mlp.x_k[0, 0]
    torch.testing.assert_close(alpha, torch.tensor([1 - (i / 8) ** (0.75 ** 4) for i in range(8)]))
    first = mlp.c_proj(torch.relu(mlp.c_fc(x[:, :1] * (1 - alpha))).square())
    torch.testing.assert_close(y[:, :1], first)
    y1, prev = mlp(x[:, :4])
    y2, _ = mlp(x[:, 4:], prev)
    torch.testing.assert_close(torch.cat((y1, y2), 1), y)
    assert MLP(8, 32, token_shift=False).x_k is None
