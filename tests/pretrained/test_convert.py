"""Training-free conversion of pretrained transformers LMs (kvmeans.convert_hf) on tiny random configs of
each family: exact while nothing is compressed, prefill + decode == one forward, generate, save/load,
bounded cache bytes, the RoPE read-out and the log-count read-out against independent references."""
import copy
import math

import pytest
import torch

tf = pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from kvmeans.ops.budget import StateBudget  # noqa: E402
from kvmeans.pretrained.cache import ConvertedCacheLayer, cache_nbytes  # noqa: E402
from kvmeans.pretrained.convert import KVMSpec, convert_hf, load_converted, parse_kvm_spec  # noqa: E402
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention, rotate, unrotate  # noqa: E402

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "llama": lambda: tf.LlamaConfig(num_key_value_heads=2, **COMMON),
    "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, **COMMON),
    "qwen3": lambda: tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON),
    "mistral": lambda: tf.MistralConfig(num_key_value_heads=2, **COMMON),
    "gemma2": lambda: tf.Gemma2Config(num_key_value_heads=2, head_dim=16, **COMMON),
    "gemma3": lambda: tf.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=16,
                                          layer_types=["sliding_attention", "full_attention"], **COMMON),
    "gemma": lambda: tf.GemmaConfig(num_key_value_heads=2, head_dim=16, **COMMON),
    "mixtral": lambda: tf.MixtralConfig(num_key_value_heads=2, num_local_experts=2, **COMMON),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(num_key_value_heads=2, shared_expert_intermediate_size=32, **MOE, **COMMON),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, **MOE, **COMMON),
    "phi": lambda: tf.PhiConfig(num_key_value_heads=2, **COMMON),                  # partial rotary, dense qkv
    "phi3": lambda: tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **COMMON),   # fused qkv
    "olmo": lambda: tf.OlmoConfig(num_key_value_heads=2, pad_token_id=0, **COMMON),
    "olmo2": lambda: tf.Olmo2Config(num_key_value_heads=2, pad_token_id=0, **COMMON),  # norms on q/k
    "granite": lambda: tf.GraniteConfig(num_key_value_heads=2, attention_multiplier=0.2, **COMMON),
    "stablelm": lambda: tf.StableLmConfig(num_key_value_heads=2, **COMMON),
    "starcoder2": lambda: tf.Starcoder2Config(num_key_value_heads=2, **COMMON),
    "smollm3": lambda: tf.SmolLM3Config(num_key_value_heads=2, pad_token_id=0, no_rope_layers=[1, 0], **COMMON),
    "gpt2": lambda: tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128),
}
SMALL = dict(budget=8, chunk_len=8, n_bswa_chunks=2, sink_len=2)     # state 8 rows, window 9..16 tokens


def tiny(family, seed=0):
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()


def ids(T=100, B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["fits_window", "nothing_merges"])
@torch.no_grad()
def test_exact_while_nothing_is_compressed(family, case):
    """The sequence fits the exact window (no state), or every token is its own row (count 1, bias
    log 1 = 0) with positions kept (post-RoPE keys): the original model's logits."""
    model = tiny(family)
    x = ids(16 if case == "fits_window" else 100)
    ref = model(x).logits
    settings = SMALL if case == "fits_window" else {**SMALL, "budget": 1000}
    if case == "nothing_merges" and family != "gpt2":
        settings = {**settings, "rope_mode": "post_rope"}
    torch.testing.assert_close(convert_hf(model, **settings)(x).logits, ref, rtol=0, atol=1e-5)


def _first_layer_keys(model, x, start):
    """Layer 0's post-RoPE keys ``[B, Hkv, T, D]`` at positions ``start..`` and the RoPE ``(cos, sin) [B, T, R]``
    the model passed it (the layer's input does not depend on positions, so its pre-RoPE keys do not)."""
    got = {}

    def capture(module, query, key, value, attention_mask, **kw):      # only the keys matter: any [B, T, H, D]
        got.setdefault("k", key)
        return query.transpose(1, 2).contiguous(), None

    tf.AttentionInterface.register("kvmeans_test_capture", capture)
    model.set_attn_implementation("kvmeans_test_capture")
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention") and m.layer_idx == 0)

    def rope(module, args, kwargs):
        got.setdefault("rope", kwargs["position_embeddings"])

    hook = layer.register_forward_pre_hook(rope, with_kwargs=True)
    try:
        model(x, position_ids=torch.arange(start, start + x.shape[1]).expand_as(x))
    finally:
        hook.remove()
    return got["k"], got["rope"]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt2"])
@torch.no_grad()
def test_unrotate_inverts_the_family_rope(family):
    """The op reads keys before RoPE (``pre_rope_fixed``) by our ``unrotate`` (rotate-half layout): the same
    tokens at positions 0.. and 37.. unrotate to the same keys. An interleaved-RoPE family would fail here."""
    model, x = tiny(family), ids(12, B=1)
    (k0, (c0, s0)), (k1, (c1, s1)) = _first_layer_keys(model, x, 0), _first_layer_keys(model, x, 37)
    assert (k0 - k1).abs().max() > 1e-3                                  # the keys are rotated
    torch.testing.assert_close(unrotate(k0, c0[:, None], s0[:, None]), unrotate(k1, c1[:, None], s1[:, None]))


@pytest.mark.parametrize("family", ["cohere", "gptj"])
def test_families_whose_rope_the_op_would_misread_are_refused(family):
    cfg = {"cohere": lambda: tf.CohereConfig(num_key_value_heads=2, **COMMON),
           "gptj": lambda: tf.GPTJConfig(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)}[family]()
    with pytest.raises(ValueError, match=f"got '{family}' \\(interleaved RoPE"):
        convert_hf(tf.AutoModelForCausalLM.from_config(cfg), **SMALL)


@torch.no_grad()
def test_layers_without_rope_read_their_keys_as_they_are():
    """SmolLM3's NoPE layers under the default pre-RoPE read: nothing merges (budget >= T), so a layer that does
    not un-rotate keys it never rotated gives the original logits; the RoPE layer keeps the pre-RoPE read."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(
        tf.SmolLM3Config(num_key_value_heads=2, pad_token_id=0, no_rope_layers=[0, 0], **COMMON)).eval()
    x = ids(100)
    ref = model(x).logits
    torch.testing.assert_close(convert_hf(model, **{**SMALL, "budget": 1000})(x).logits, ref, rtol=0, atol=1e-5)
    mixed = convert_hf(tiny("smollm3"), **SMALL)
    assert [m.self_attn.kvm_spec.rope_mode for m in mixed.model.layers] == ["pre_rope_fixed", "none"]
    assert mixed.config.kvm_conversion["rope_mode"] == "pre_rope_fixed"


def _prefill_then_decode(model, x, prefill=37):
    """``(logits [B, T, V], cache)`` of ``x`` read as a prefill of ``prefill`` tokens, then one token per call."""
    out = model(x[:, :prefill], use_cache=True)
    cache, parts = cache_from(out), [out.logits]
    for t in range(prefill, x.shape[1]):
        out = model(x[:, t:t + 1], **cache_kwargs(cache), use_cache=True)
        parts.append(out.logits)
    return torch.cat(parts, 1), cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_half_precision_model_runs_in_its_dtype_close_to_fp32(family, dtype):
    """A model loaded in bf16 / fp16 (how GPUs run them) converts and decodes in its dtype: its logits near the
    fp32 conversion's, and prefill + decode near its own single forward (exact rows in use)."""
    settings = {**SMALL, "budget": 16, "exact_rows": 4}
    x = ids(100)
    ref = convert_hf(tiny(family), **settings)(x).logits
    model = convert_hf(tiny(family).to(dtype), **settings)
    one = model(x).logits
    assert one.dtype == dtype
    torch.testing.assert_close(one.float(), ref, rtol=0, atol=0.05)
    torch.testing.assert_close(_prefill_then_decode(model, x)[0].float(), one.float(), rtol=0, atol=0.02)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_prefill_then_token_by_token_decode_equals_one_forward(family):
    model = convert_hf(tiny(family), **SMALL)
    x = ids(100)
    full = model(x).logits
    assert (full - tiny(family)(x).logits).abs().max() > 1e-4          # the state is in use
    logits, cache = _prefill_then_decode(model, x)
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)
    layer = cache.layers[model.config.kvm_conversion["layers"][0]]
    assert isinstance(layer, ConvertedCacheLayer) and layer.state.seen == 100 and layer.state.num_rows == 8


@torch.no_grad()
def test_deepcopy_of_a_converted_model_uses_its_own_rotary():
    model = convert_hf(tiny("llama"), **SMALL)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert attn.kvm_rope_at.rotary is twin.model.rotary_emb
    x = ids(60)
    torch.testing.assert_close(twin(x).logits, model(x).logits, rtol=0, atol=0)


@torch.no_grad()
def test_generate_greedy_equals_argmax_of_full_forwards():
    model = convert_hf(tiny("llama"), **SMALL)
    x = ids(30, B=1)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=25, do_sample=False, pad_token_id=0)
    seq = x
    for _ in range(25):
        seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_beam_search_with_the_kvm_cache_equals_beam_search_without_cache():
    # prompts without repeated tokens: a token repeated in the first chunk gives layer 0 two state rows equal up to
    # rounding (their pre-RoPE keys are unrotated from different positions), and the argmax routing between such a
    # tie follows rounding, which differs between a 1-token decode step and a whole-sequence forward
    model = convert_hf(tiny("llama"), **SMALL)
    g = torch.Generator().manual_seed(1)
    x = torch.stack([torch.randperm(V, generator=g)[:30] for _ in range(2)])
    run = dict(max_new_tokens=20, num_beams=3, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **run), model.generate(x, use_cache=False, **run))


@torch.no_grad()
def test_cache_bytes_fixed_budget_flat_and_below_the_kv_cache():
    model = convert_hf(tiny("llama"), **SMALL)
    plain = tiny("llama")
    sizes = [cache_nbytes(cache_from(model(ids(T), use_cache=True))) for T in (200, 400)]
    kv = cache_nbytes(cache_from(plain(ids(400), use_cache=True)))
    assert sizes[0] == sizes[1] < kv / 5


@torch.no_grad()
def test_custom_4d_mask_refused():
    """Padding masks work (tests/test_convert_hf_padding.py); a custom 4D mask is refused, in one line."""
    model = convert_hf(tiny("llama"), **SMALL)
    x = ids(20)
    with pytest.raises(ValueError, match="2D attention_mask"):
        model(x, attention_mask=torch.ones(2, 1, 20, 20))


@torch.no_grad()
def test_save_and_load_converted_round_trip(tmp_path):
    model = convert_hf(tiny("qwen3"), budget=StateBudget.power_law(2, 0.5, min_len=8), chunk_len=8, sink_len=1,
                       rope_mode="split")
    model.save_pretrained(tmp_path)
    loaded = load_converted(tmp_path)
    assert type(loaded) is type(model)
    assert loaded.config.kvm_conversion == model.config.kvm_conversion
    assert loaded.config.kvm_conversion["budget"]["kind"] == "power_law"
    x = ids(90)
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="convert_hf"):
        plain.save_pretrained(tmp_path / "plain")
        plain.config.kvm_conversion = None
        plain.config.save_pretrained(tmp_path / "plain")
        load_converted(tmp_path / "plain")



@torch.no_grad()
def test_saved_read_distance_survives_a_new_default(tmp_path, monkeypatch):
    """The default read distance is stored resolved: a model saved at today's default reloads at it even when the
    default changes (a distilled model's learned read-out was fit at that distance)."""
    model = convert_hf(tiny("llama"), **SMALL)
    assert model.config.kvm_conversion["rope_distance"] == KVMSpec(**SMALL).distance
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(KVMSpec, "distance",
                        property(lambda self: 5 if self.rope_distance is None else self.rope_distance))
    loaded = load_converted(tmp_path)
    x = ids(90)
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)

def test_gemma_sliding_layers_keep_their_window():
    model = convert_hf(tiny("gemma3"), **SMALL)
    assert model.config.kvm_conversion["layers"] == [1]
    with pytest.raises(ValueError, match="sliding-window layer"):
        convert_hf(tiny("gemma3"), layers=[0], **SMALL)


def test_convert_errors_name_the_argument():
    with pytest.raises(ValueError, match="rope_mode='none'"):
        convert_hf(tiny("gpt2"), rope_mode="post_rope")
    with pytest.raises(ValueError, match="rope_mode"):
        convert_hf(tiny("llama"), rope_mode="none")
    with pytest.raises(ValueError, match="sink_len"):
        convert_hf(tiny("llama"), chunk_len=4, sink_len=4)
    with pytest.raises(ValueError, match="layers: 5"):
        convert_hf(tiny("llama"), layers=[5])
    dynamic = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, **COMMON))
    with pytest.raises(ValueError, match="dynamic"):
        convert_hf(dynamic)
    convert_hf(dynamic, rope_mode="post_rope")
    model = convert_hf(tiny("llama"), **SMALL)
    with pytest.raises(ValueError, match="already converted"):
        convert_hf(model, **SMALL)


def test_parse_kvm_spec():
    spec = parse_kvm_spec("budget=fixed:128,chunk_len=64,n_bswa_chunks=2,sink_len=4")
    assert spec == dict(budget=StateBudget.fixed(128), chunk_len=64, n_bswa_chunks=2, sink_len=4)
    assert parse_kvm_spec("budget=power_law:16:0.5:256,layers=0-2+5,rope_mode=split,log_count_bias=false") == dict(
        budget=StateBudget.power_law(16, 0.5, min_len=256), layers=[0, 1, 2, 5], rope_mode="split",
        log_count_bias=False)
    assert parse_kvm_spec("budget=96")["budget"] == 96
    assert KVMSpec().distance == 384 and KVMSpec(rope_distance=7).distance == 7
    assert KVMSpec(rope_mode="split").distance == 0
    assert KVMSpec(**{k: v for k, v in parse_kvm_spec("budget=saturating:64:8").items()}).budget == \
        StateBudget.saturating(64, 8)
    for bad, msg in [("budget=huge", "budget 'huge'"), ("chunk=4", "chunk=4"), ("sink_len=x", "sink_len"),
                     ("rope_mode=nope", "rope_mode"), ("layers=a", "layers 'a'"),
                     ("chunk_len=8,sink_len=8", "sink_len")]:
        with pytest.raises(ValueError, match=msg):
            parse_kvm_spec(bad)


# ---- the read-out maths against independent references ------------------------------------------

def _rope(T, R, theta=100.0, scale=1.0):
    inv = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos() * scale, emb.sin() * scale


def test_unrotate_inverts_scaled_partial_rope():
    x = torch.randn(2, 3, 10, 16, dtype=torch.float64)
    cos, sin = _rope(10, 8, scale=1.3)
    torch.testing.assert_close(unrotate(rotate(x, cos, sin), cos, sin), x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_state_query_is_the_query_unrotated_then_rotated_by_the_distance(dtype):
    """One rotation by d - p from composed tables equals the two steps it replaces (scaled, partial rotary)."""
    from kvmeans.pretrained.op import state_query
    q = torch.randn(2, 3, 10, 16, dtype=torch.float64)
    cos_all, sin_all = _rope(20, 8, scale=1.3)
    cos, sin, d = cos_all[5:15][None, None], sin_all[5:15][None, None], 9
    a = (cos_all[d] ** 2 + sin_all[d] ** 2).sqrt()
    want = rotate(unrotate(q, cos, sin), cos_all[d] * a, sin_all[d] * a)
    got = state_query(q.to(dtype), cos.to(dtype), sin.to(dtype), cos_all[d].to(dtype), sin_all[d].to(dtype))
    assert got.dtype == torch.promote_types(dtype, torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert not torch.allclose(got.double(), q, atol=0.1)        # a rotation happened


@pytest.mark.parametrize("mode", ["pre_rope_fixed", "split"])
def test_state_rows_are_read_at_a_fixed_relative_position(mode):
    """No merges (budget >= T): a state key j is scored as the model would score it at position p - d
    (d = distance; split: d = 0), window keys at their own positions; reference built per query."""
    torch.manual_seed(0)
    B, H, Hkv, T, D, C, n, d, a = 1, 4, 2, 40, 8, 4, 2, 9, 1.2
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64) for h in (H, Hkv, Hkv))
    cos_all, sin_all = _rope(T + d, 6, scale=a)                          # partial rotary: 6 of 8 channels
    cos, sin = cos_all[:T][None], sin_all[:T][None]
    rq, rk = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    dist = d if mode == "pre_rope_fixed" else 0
    out = converted_kvm_attention(rq, rk, v, ConvertedKVMState(), scaling=D ** -0.5, budget=1000, chunk_len=C,
                                  n_bswa_chunks=n, sink_len=1, rope_mode=mode, cos=cos, sin=sin,
                                  rope=lambda pos: (cos_all[pos], sin_all[pos]),
                                  cos_d=cos_all[dist], sin_d=sin_all[dist])
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    ref = torch.empty_like(out)
    for p in range(T):
        wb = max(0, -(-(p + 1) // C) * C - n * C)                       # first window token of query p
        ang = torch.tensor([p - dist], dtype=torch.float64)
        inv = 1.0 / 100.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6)
        e = torch.cat([ang[:, None] * inv] * 2, -1)
        st_k = rotate(kk[:, :, :wb], e.cos() * a, e.sin() * a)         # state keys placed at position p - d
        keys = torch.cat([st_k, rotate(kk, cos[:, None], sin[:, None])[:, :, wb:p + 1]], 2)
        w = torch.softmax(rq[:, :, p:p + 1] @ keys.transpose(-1, -2) * D ** -0.5, -1)
        ref[:, :, p:p + 1] = w @ vv[:, :, :p + 1]
    torch.testing.assert_close(out, ref)


def test_a_row_of_m_identical_tokens_gets_their_total_weight():
    """Merged rows read as mean key/value with +log(m): identical tokens merge without changing the output."""
    torch.manual_seed(0)
    B, H, T, D, C = 1, 2, 64, 8, 4
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, H, T, D, dtype=torch.float64)
    k[:, :, C:], v[:, :, C:] = k[:, :, C:C + 1], v[:, :, C:C + 1]       # after the first chunk: one token repeated
    run = dict(scaling=D ** -0.5, chunk_len=C, n_bswa_chunks=2, sink_len=1, rope_mode="none")
    full = converted_kvm_attention(q, k, v, ConvertedKVMState(), budget=1000, **run)
    small = ConvertedKVMState()
    merged = converted_kvm_attention(q, k, v, small, budget=6, **run)
    assert small.num_rows == 6 and small.count.max() > 20 and bool((small.count.sum(-1) == 56).all())
    torch.testing.assert_close(merged, full)
    no_bias = converted_kvm_attention(q, k, v, ConvertedKVMState(), budget=6, log_count_bias=False, **run)
    assert (no_bias - full).abs().max() > 1e-2
    assert math.isfinite(float(merged.sum()))
