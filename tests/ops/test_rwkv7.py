"""RWKV-7 baseline: the op's paths agree with the token loop (outputs, final state, gradients), the layer and the
model continue any split exactly, the presets, config errors, and generate / padding / save-load through HF."""
import pytest
import torch
import torch.nn.functional as F

from kvmeans.layers.rwkv7 import RWKV7Config, RWKV7State, RWKV7TimeMix
from kvmeans.models import KVMLanguageModel, KVMModelConfig, preset
from kvmeans.ops.rwkv7 import rwkv7_attention
from kvmeans.ops.rwkv7.naive import rwkv7_naive
from kvmeans.utils.testing import assert_close, perturb_identity_init


def op_inputs(B=2, T=37, H=3, K=8, V=6, dtype=torch.float64, seed=0, requires_grad=False):
    """RWKV-7-shaped inputs: log decay in [-e^-0.5, 0], ``a = -kk``, ``b = kk * iclr`` with unit ``kk``."""
    g = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    kk = F.normalize(n(B, T, H, K), dim=-1)
    x = dict(r=n(B, T, H, K), w=-0.6065 * torch.sigmoid(2 * n(B, T, H, K)), k=0.5 * n(B, T, H, K),
             v=n(B, T, H, V), a=-kk, b=kk * torch.sigmoid(n(B, T, H, K)), initial_state=n(B, H, K, V))
    return {k: t.to(dtype).requires_grad_(requires_grad) for k, t in x.items()}


# ---- the op's paths against the token loop ------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 7, 37, 64, 100])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("H", [1, 3])
def test_chunk_and_recurrent_equal_naive_float64(T, chunk_size, H):
    x = op_inputs(T=T, H=H, seed=T * 7 + chunk_size)
    o_ref, s_ref = rwkv7_naive(**x)
    for backend in ("chunk", "recurrent"):
        with torch.no_grad():
            o, s = rwkv7_attention(**x, chunk_size=chunk_size, backend=backend)
        assert_close(f"{backend} o", o_ref, o, 1e-12)
        assert_close(f"{backend} state", s_ref, s, 1e-12)


def test_zero_initial_state_is_none():
    x = op_inputs(T=20)
    x["initial_state"] = torch.zeros_like(x["initial_state"])
    o, s = rwkv7_attention(**x, backend="chunk", chunk_size=8)
    o0, s0 = rwkv7_attention(**{**x, "initial_state": None}, backend="chunk", chunk_size=8)
    assert torch.equal(o, o0) and torch.equal(s, s0)


@pytest.mark.parametrize("T,chunk_size", [(37, 16), (64, 64), (9, 4)])
def test_chunk_gradients_equal_naive(T, chunk_size):
    x = op_inputs(T=T, requires_grad=True, seed=T)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(2, T, 3, 6, generator=g, dtype=torch.float64)
    ds = torch.randn(2, 3, 8, 6, generator=g, dtype=torch.float64)
    grads = {}
    for name, fn in (("naive", lambda: rwkv7_naive(**x)),
                     ("chunk", lambda: rwkv7_attention(**x, chunk_size=chunk_size, backend="chunk"))):
        o, s = fn()
        grads[name] = torch.autograd.grad((o * do).sum() + (s * ds).sum(), list(x.values()))
    for key, gn, gc in zip(x, grads["naive"], grads["chunk"]):
        assert_close(f"d{key}", gn, gc, 1e-11)


def test_float32_chunk_and_half_inputs_against_float64():
    x = op_inputs(B=1, T=300, H=2, K=64, V=64)
    o_ref, s_ref = rwkv7_naive(**x)
    o, s = rwkv7_attention(**{k: t.float() for k, t in x.items()}, backend="chunk")
    assert_close("fp32 o", o_ref, o, 2e-5)
    assert_close("fp32 state", s_ref, s, 2e-5)
    o, s = rwkv7_attention(**{k: t.bfloat16() for k, t in x.items()}, backend="chunk")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close("bf16 o", o_ref, o, 3e-2)


def test_auto_on_cpu_uses_the_recurrent_step_without_grad_and_chunks_under_autograd(monkeypatch):
    import kvmeans.ops.rwkv7.op as op
    used = []
    for name in ("rwkv7_chunk", "rwkv7_recurrent"):
        orig = getattr(op, name)
        monkeypatch.setattr(op, name, lambda *a, _n=name, _f=orig, **k: (used.append(_n), _f(*a, **k))[1])
    with torch.no_grad():
        rwkv7_attention(**op_inputs(T=3), chunk_size=4)
        rwkv7_attention(**op_inputs(T=9), chunk_size=4)
    rwkv7_attention(**op_inputs(T=3, requires_grad=True), chunk_size=4)
    assert used == ["rwkv7_recurrent", "rwkv7_recurrent", "rwkv7_chunk"]


@pytest.mark.parametrize("change,match", [
    (dict(backend="nope"), "backend must be one of"),
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(chunk_size=True), "chunk_size must be an int >= 1"),
    (dict(w=torch.zeros(2, 37, 3, 7)), "w must have r's shape"),
    (dict(v=torch.zeros(2, 36, 3, 6)), r"v must be \[B, T, H, V\]"),
    (dict(initial_state=torch.zeros(2, 3, 6, 8)), r"initial_state must be \[B, H, K, V\]"),
    (dict(backend="fla"), "needs flash-linear-attention"),
])
def test_op_errors_name_the_argument(change, match):
    x = {**op_inputs(dtype=torch.float32), **change}
    if change.get("backend") == "fla":
        from kvmeans.ops.rwkv7.fla_backend import fla_available
        if fla_available():
            pytest.skip("fla is installed")
    with pytest.raises(ValueError, match=match):
        rwkv7_attention(**x)


def test_recurrent_refuses_autograd_and_chunk_refuses_overflowing_decay():
    with pytest.raises(ValueError, match="backend='recurrent' has no gradients"):
        rwkv7_attention(**op_inputs(T=4, requires_grad=True), backend="recurrent")
    x = op_inputs(T=64, dtype=torch.float32)
    x["w"] = torch.full_like(x["w"], -5.0)
    with pytest.raises(ValueError, match="lower chunk_size or use backend='recurrent'"):
        rwkv7_attention(**x, backend="chunk", chunk_size=64)
    o, _ = rwkv7_attention(**x, backend="chunk", chunk_size=16)        # factors up to e^45: fine in float32
    assert_close("steep decay", rwkv7_naive(**{k: t.double() for k, t in x.items()})[0], o, 2e-5)


@pytest.mark.parametrize("agree", [True, False])
def test_fla_is_used_only_after_agreeing_with_the_chunked_path(monkeypatch, agree):
    import kvmeans.ops.rwkv7.fla_backend as fb
    from kvmeans.ops.rwkv7.chunk import rwkv7_chunk

    def fake_fla(r, w, k, v, a, b, initial_state=None, chunk=True):   # stands in for the kernels (no CUDA here)
        o, s = rwkv7_chunk(r, w if agree else -w.exp(), k, v, a, b, initial_state)    # as a raw-decay fla reads w
        return o, s
    monkeypatch.setattr(fb, "fla_available", lambda: True)
    monkeypatch.setattr(fb, "rwkv7_fla", fake_fla)
    monkeypatch.setattr(fb, "_CHECKED", {})
    if agree:
        assert fb.fla_usable(torch.device("cpu")) is True
    else:
        with pytest.warns(RuntimeWarning, match="kernels do not match the torch path on cpu"):
            assert fb.fla_usable(torch.device("cpu")) is False
    assert fb.fla_usable(torch.device("cpu")) is agree                 # checked once per device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_kernels_equal_the_chunked_path_on_cuda():
    pytest.importorskip("fla")
    x = {k: t.float().cuda() for k, t in op_inputs(B=2, T=200, H=4, K=64, V=64).items()}
    for T in (200, 5):
        y = {k: (t[:, :T] if t.dim() == 4 else t) for k, t in x.items()}
        o_ref, s_ref = rwkv7_attention(**y, backend="chunk")
        o, s = rwkv7_attention(**y, backend="fla")
        assert_close("fla o", o_ref, o, 2e-3)
        assert_close("fla state", s_ref, s, 2e-3)


# ---- the layer ----------------------------------------------------------------------------------------------
def random_layer(layer_idx=1, num_layers=3, C=32, H=4, seed=0, **kw):
    torch.manual_seed(seed)
    layer = RWKV7TimeMix(RWKV7Config(hidden_size=C, num_heads=H, layer_idx=layer_idx, num_layers=num_layers,
                                     init_output_zero=False, **kw)).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "lora.0" in name:                   # zero at init: the LoRAs would not depend on x
                p.normal_(std=0.3)
    return layer


def test_layer_continues_any_split_exactly():
    layer = random_layer(chunk_size=8)
    x, v_first = torch.randn(2, 29, 32, dtype=torch.float64), torch.randn(2, 29, 32, dtype=torch.float64)
    y, state = layer(x, v_first=v_first)                               # under autograd: the chunked path
    with torch.no_grad():                                              # the recurrent step on CPU
        for split in (1, 8, 13, 28):
            y1, s1 = layer(x[:, :split], v_first=v_first[:, :split])
            y2, s2 = layer(x[:, split:], s1, v_first=v_first[:, split:])
            assert_close(f"split {split}", y, torch.cat((y1, y2), 1), 1e-12)
            assert_close(f"state at split {split}", state.state, s2.state, 1e-12)
            assert s2.seen_tokens == 29 and torch.equal(s2.x_prev, x[:, -1])
    assert isinstance(state, RWKV7State) and state.nbytes == (2 * 4 * 8 * 8 + 2 * 32) * 8


def test_layer_zero_has_no_value_mix_and_its_anchor_is_its_value():
    layer = random_layer(layer_idx=0)
    assert layer.v_lora is None
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        y, state = layer(x[:, :6])
        anchor = layer.value_anchor(x[:, 6:], state)
        want = layer.v_proj(x[:, 6:] + (torch.cat((x[:, 5:6], x[:, 6:-1]), 1) - x[:, 6:]) * layer.x_v)
        ignored = layer(x[:, :6], v_first=torch.randn(2, 6, 32, dtype=torch.float64))[0]
    assert torch.equal(anchor, want) and torch.equal(ignored, y)


def test_layer_gradients_equal_the_naive_path():
    ref, fast = random_layer(backend="naive"), random_layer(backend="chunk", chunk_size=4)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    for layer in (ref, fast):
        layer(x, v_first=x.flip(1))[0].square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert_close(f"d{name}", p.grad, q.grad, 1e-10)


@pytest.mark.parametrize("field,value,match", [
    ("num_heads", 5, "RWKV7Config.num_heads: 5 does not divide hidden_size=32"),
    ("chunk_size", 0, "RWKV7Config.chunk_size: must be >= 1"),
    ("backend", "cuda", "RWKV7Config.backend: must be one of"),
    ("decay_lora", 0, "RWKV7Config.decay_lora: must be >= 1"),
    ("layer_idx", 3, r"RWKV7Config.layer_idx: must be in \[0, num_layers=3\)"),
])
def test_layer_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        RWKV7Config(**{"hidden_size": 32, "num_heads": 4, "num_layers": 3, field: value})


# ---- the model ----------------------------------------------------------------------------------------------
TINY = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, mixer="rwkv7", rwkv7_chunk_size=8)


def tiny_lm(seed=0, **overrides) -> KVMLanguageModel:
    torch.manual_seed(seed)
    lm = KVMLanguageModel(KVMModelConfig(**{**TINY, **overrides}))
    perturb_identity_init(lm)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("o_proj.weight") or "lora.0" in name:
                p.normal_(std=0.2)
    return lm.eval()


def test_model_prefill_plus_decode_equals_one_forward():
    lm, ids = tiny_lm(), torch.randint(0, 64, (2, 30))
    want, cache = lm(ids)                                              # under autograd: the chunked path
    with torch.no_grad():                                              # the recurrent step on CPU
        for split in (1, 8, 17):
            first, c = lm(ids[:, :split])
            parts = [first]
            for t in range(split, 30):                                 # token-by-token decode
                parts.append(lm(ids[:, t:t + 1], c)[0])
            assert_close(f"split {split}", want, torch.cat(parts, 1), 2e-5)
    assert cache.mixers == ["rwkv7"] * 3 and cache.seen_tokens == 30


def test_model_gradients_reach_every_parameter_and_the_state_is_flat():
    lm = tiny_lm()
    lm.train()
    lm.loss(torch.randint(0, 64, (2, 20)), torch.randint(0, 64, (2, 20))).backward()
    missing = [n for n, p in lm.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing, missing
    with torch.no_grad():
        sizes = [lm(torch.randint(0, 64, (1, n)))[1].nbytes for n in (1, 50, 300)]
    assert sizes[0] == sizes[1] == sizes[2] == 3 * ((4 * 8 * 8) * 4 + 32 * 4 + 32 * 4)


def test_value_residual_switch():
    on, off = tiny_lm(), tiny_lm(value_residual=False)
    has_v_lora = lambda lm: [b.attn.v_lora is not None for b in lm.transformer.h]
    assert has_v_lora(on) == [False, True, True] and has_v_lora(off) == [False, False, False]
    missing, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert not missing and all(".v_lora." in k for k in unexpected)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(on(ids)[0], off(ids)[0])           # the same weights but the value mix


def test_presets_have_the_paper_sizes():
    sizes = {"rwkv7-120m": (768, 12, 12, 1.0), "rwkv7-350m": (1024, 24, 16, 0.5)}
    for name, (d, layers, heads, scale) in sizes.items():
        cfg = preset(name)
        assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.residual_scale) == (d, layers, heads, scale)
        assert cfg.mixer_per_layer() == ["rwkv7"] * layers and cfg.qk_head_dim == 64
    with torch.device("meta"):
        assert KVMLanguageModel(preset("rwkv7-120m")).num_parameters() == 167_638_272


@pytest.mark.parametrize("overrides,match", [
    (dict(mixer_types=["rwkv7", "kvm", "rwkv7"]),
     r"KVMModelConfig.mixer_types: rwkv7 layers cannot be mixed with \['kvm'\]"),
    (dict(alt_mixer="swa", alt_every=2), r"KVMModelConfig.alt_mixer: rwkv7 layers cannot be mixed with \['swa'\]"),
    (dict(head_dim=16), "KVMModelConfig.head_dim: RWKV-7 heads split hidden_size=32"),
    (dict(num_kv_heads=2), "KVMModelConfig.num_kv_heads: RWKV-7 has no grouped heads"),
    (dict(rwkv7_chunk_size=0), "KVMModelConfig.rwkv7_chunk_size: must be >= 1"),
    (dict(token_shift=False), "KVMModelConfig.token_shift: RWKV-7's time mixer always shifts"),
    (dict(mixer="rwkv8"), "KVMModelConfig.mixer: unknown mixer 'rwkv8'"),
])
def test_model_config_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        KVMModelConfig(**{**TINY, **overrides})


# ---- transformers: generate, padding, save/load --------------------------------------------------------------
def tiny_hf(seed=0):
    pytest.importorskip("transformers")
    from kvmeans.models.hf import KVMForCausalLM
    return KVMForCausalLM.from_language_model(tiny_lm(seed)).eval()


GREEDY = dict(do_sample=False, pad_token_id=0)


def test_generate_with_the_cache_equals_argmax_over_full_forwards():
    model = tiny_hf()
    ids = torch.randint(1, 64, (2, 11))
    out = model.generate(ids, max_new_tokens=12, **GREEDY)
    cur = ids
    with torch.no_grad():
        for _ in range(12):
            cur = torch.cat([cur, model(cur, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, cur)
    assert torch.equal(model.generate(ids, max_new_tokens=12, use_cache=False, **GREEDY), out)


def test_beam_search_with_the_cache_equals_uncached_beam_search():
    model = tiny_hf()
    ids = torch.randint(1, 64, (2, 7))
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, **GREEDY)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_prompt_lookup_decoding_rolls_back_and_equals_greedy(monkeypatch):
    from kvmeans.models.hf_cache import KVMCache
    model = tiny_hf()
    ids = torch.randint(1, 64, (1, 6)).repeat(1, 3)                   # text that repeats: drafts to verify
    greedy = model.generate(ids, max_new_tokens=12, **GREEDY)
    removed, crop = [], KVMCache.crop

    def counting_crop(self, n):
        before = self.get_seq_length()
        crop(self, n)
        removed.append(before - self.get_seq_length())
    monkeypatch.setattr(KVMCache, "crop", counting_crop)
    assert torch.equal(model.generate(ids, max_new_tokens=12, prompt_lookup_num_tokens=4, **GREEDY), greedy)
    assert any(r > 0 for r in removed)                                 # some drafts were rejected and undone


def left_padded(lengths):
    """``(sequences, ids [B, L], mask [B, L])`` of random sequences right-aligned with pads in front."""
    seqs = [torch.randint(1, 64, (n,)) for n in lengths]
    L = max(lengths)
    ids, mask = torch.zeros(len(seqs), L, dtype=torch.long), torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = s, 1
    return seqs, ids, mask


def test_left_padded_batch_equals_solo_rows():
    model = tiny_hf()
    seqs, ids, mask = left_padded((4, 13, 9))
    L = ids.shape[1]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=8, **GREEDY)
        assert torch.equal(out[i, L:], alone[0, len(s):]), f"row {i}"


def test_left_padded_rows_decode_in_one_call_per_step():
    model = tiny_hf()
    from kvmeans.models.hf_compat import cache_from, cache_kwargs
    seqs, ids, mask = left_padded((4, 13, 9))
    with torch.no_grad():
        cache = cache_from(model(ids, attention_mask=mask))
        assert len(cache.groups) == 3                                  # prefilled by length
        nxt = torch.randint(1, 64, (3, 1))
        got = model(nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                    **cache_kwargs(cache)).logits[:, -1]
        assert len(cache.groups) == 1                                  # merged: one batched state per layer
        for i, s in enumerate(seqs):
            want = model(torch.cat([s, nxt[i]])[None], use_cache=False).logits[0, -1]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_save_load_round_trip(tmp_path):
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.models.hf_compat import cache_from
    model, ids = tiny_hf(), torch.randint(0, 64, (2, 20))
    model.save_pretrained(tmp_path)
    loaded = KVMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.to_model_config() == model.config.to_model_config()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with torch.no_grad():
        cache = cache_from(model(ids)).to_model_cache()
    torch.save(cache.layers[0], tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(state.state, cache.layers[0].state) and state.seen_tokens == 20


def test_eval_memory_reports_flat_cache_bytes():
    from kvmeans.eval.memory import measure_model
    res = measure_model(tiny_lm(), [8, 100, 300], decode_tokens=2, warmup=False, log=lambda *_: None)
    sizes = [r["cache_bytes"] for r in res]
    assert sizes[0] == sizes[1] == sizes[2] == 3 * ((4 * 8 * 8) * 4 + 32 * 4 + 32 * 4)
    assert res[-1]["full_attn_kv_bytes"] > 10 * sizes[-1] and all(r["decode_tok_s"] > 0 for r in res)
    assert all(layer["mixer"] == "rwkv7" and layer["state_rows"] is None for layer in res[0]["layers"])


def test_demo_has_an_rwkv7_row():
    from kvmeans import demo
    assert demo.MODELS[0] == "rwkv7" and demo.LABELS["rwkv7"] == "RWKV-7"
    cfg = demo.model_config("rwkv7", demo.demo_settings(quick=True))
    assert cfg.mixer_per_layer() == ["rwkv7"] * cfg.num_layers
