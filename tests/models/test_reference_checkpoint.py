"""Authors' checkpoint -> kvmeans: config mapping, refusals, layout checks, file round trip, unused fields."""
import json
import os

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

from kvmeans.models import reference_checkpoint as cv  # noqa: E402
from kvmeans.models.config import KVMModelConfig  # noqa: E402
from kvmeans.models.reference_layout import REFERENCE_DEFAULTS  # noqa: E402


def ref(**over):
    """A 120M paper-style KVM config.json (all their keys, their spellings)."""
    base = {**REFERENCE_DEFAULTS, "model_type": "rwkv7backbone", "architectures": ["RWKV7BackboneForCausalLM"],
            "tie_worhidden_sizedings": False, "token_mixer": "kvm", "use_tokenshift_att": 1,
            "use_tokenshift_ffn": 1, "residual_scale": 1.0, "kvm_apply_merge_gate_to_appends": 0,
            "state_min_len": 256, "n_max_d_chunks": 1}
    return {**base, **over}


# ---- config mapping: paper variants --------------------------------------------------------------
def test_fixed256_120m():
    c = cv.reference_config_to_ours(ref())
    assert (c.hidden_size, c.num_layers, c.num_heads, c.qk_head_dim, c.vocab_size) == (768, 12, 6, 128, 50304)
    assert c.mixer_per_layer() == ["kvm"] * 12 and c.rope_for_layer(0) == 64
    assert c.budget == {"kind": "fixed", "n": 256} and c.state_budget()(10 ** 6) == 256
    assert (c.chunk_len, c.n_bswa_chunks, c.sink_len) == (256, 2, 1)
    assert c.merge_gate and c.head_temps and c.value_radius and not c.gate_appends
    assert c.token_shift and c.mlp_token_shift and c.value_residual and c.qk_norm and not c.tie_embeddings
    assert c.rope_reference_bf16 and c.logit_softcap is None and c.residual_scale == 1.0 and c.ffn_dim == 3072
    assert c.kvm_numerics == "reference"          # the authors' eager rounding points (ops/reference_numerics.py)


def test_sqrt16_350m():
    c = cv.reference_config_to_ours(ref(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                                        residual_scale=0.5, state_budget_mode="power_law",
                                        state_growth_factor=16.0, state_min_len=256, n_max_d_chunks=10000))
    assert c.budget == {"kind": "power_law", "factor": 16.0, "exponent": 0.5, "min_len": 256, "round_down": 1,
                        "max_len": 2560000}
    b = c.state_budget()
    assert (b(100), b(1024), b(4096)) == (256, 512, 1024)
    assert c.residual_scale == 0.5 and c.qk_head_dim == 128 and c.ffn_dim == 4096


def test_kvm_swa_saturation_hybrid():
    c = cv.reference_config_to_ours(ref(alt_layer_every=2, alt_token_mixer="swa", alt_rope_partial_dim=128,
                                        state_budget_mode="kvm_saturation", state_saturation_n=1024,
                                        state_min_len=1, n_max_d_chunks=10000, swa_window_size=256))
    assert c.mixer_per_layer() == ["swa", "kvm"] * 6
    assert (c.rope_for_layer(0), c.rope_for_layer(1), c.swa_window) == (128, 64, 256)
    assert c.budget == {"kind": "saturating", "n": 1024, "min_len": 1, "round_down": 1, "max_len": 2560000}
    assert c.state_budget()(1024) == 512


@pytest.mark.parametrize("over, check", [
    (dict(token_mixer="gptalpha"), lambda c: c.mixer_per_layer() == ["full"] * 12),
    (dict(token_mixer="gptalpha_bswa", n_bswa_chunks=3, sink_len=0),
     lambda c: c.mixer == "bswa" and (c.bswa_chunks, c.bswa_sink_len) == (3, 0)),
    (dict(token_mixer="ovq", alt_layer_every=2, ovq_chunk_size=256, ovq_max_centroids=1024),
     lambda c: c.mixer_per_layer()[:2] == ["swa", "ovq"] and (c.ovq_chunk_len, c.ovq_max_centroids) == (256, 1024)),
    (dict(kvm_use_merge_gate_keys=0, kvm_use_merge_gate_values=0), lambda c: not c.merge_gate),
    (dict(kvm_use_head_temps=0), lambda c: not c.head_temps),
    (dict(kvm_use_vlens=0), lambda c: not c.value_radius),
    (dict(kvm_apply_merge_gate_to_appends=1), lambda c: c.gate_appends),
    (dict(sink_len=0), lambda c: c.sink_len == 0),
    (dict(swa_window_size=-1, chunk_len=128, alt_layer_every=2, alt_rope_partial_dim=128),
     lambda c: c.swa_window == 128),
    (dict(logit_softcap=30.0), lambda c: c.logit_softcap == 30.0),
    (dict(residual_scale=None), lambda c: c.residual_scale == 1.0),
    (dict(d_head=64), lambda c: c.qk_head_dim == 64),
    (dict(num_key_value_heads=2), lambda c: c.kv_heads == 2),
    (dict(state_min_len=-1), lambda c: c.budget == {"kind": "fixed", "n": 256}),   # the initial chunk
    (dict(state_min_len=4096, n_max_d_chunks=4), lambda c: c.budget == {"kind": "fixed", "n": 1024}),
    (dict(alt_layer_every=1, alt_token_mixer="nonsense"), lambda c: c.alt_every == 0),
    (dict(alt_share_v0=1), lambda c: c.value_residual),                       # no-op without a hybrid
    (dict(use_tokenshift_att=0, kvm_token_shift_mode="weird"), lambda c: not c.token_shift),
    (dict(use_value_residual=0, kvm_value_residual_mode="linear"), lambda c: not c.value_residual),
    (dict(token_mixer_class_path="model.kvm_triton_mixer.SequenceMixer"), lambda c: c.mixer == "kvm"),
    (dict(token_mixer="rwkv7", token_mixer_class_path="model.swa_mixer.SequenceMixer"), lambda c: c.mixer == "swa"),
    (dict(lact_chunk_size=64, some_future_key=[1, 2], tie_worhidden_sizedings=True),
     lambda c: not c.tie_embeddings),
])
def test_mapping_variants(over, check):
    assert check(cv.reference_config_to_ours(ref(**over)))


def test_optional_keys_take_reference_defaults():
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "token_mixer",
            "use_tokenshift_att", "use_tokenshift_ffn", "kvm_apply_merge_gate_to_appends", "state_budget_mode",
            "chunk_len")
    c = cv.reference_config_to_ours({k: ref()[k] for k in keep})
    assert c.budget == {"kind": "fixed", "n": 256} and c.rope_dim == 64 and c.swa_window == 256


# ---- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, key", [
    (dict(use_block_lambdas=1), "use_block_lambdas=1"),
    (dict(use_skip_connections=1), "use_skip_connections=1"),
    (dict(alt_layer_every=2, alt_share_v0=1), "alt_share_v0=1"),
    (dict(kvm_use_merge_gate_keys=1, kvm_use_merge_gate_values=0), "kvm_use_merge_gate_keys/kvm_use_merge_gate_values"),
    (dict(kvm_use_merge_gate_keys=0, kvm_use_merge_gate_values=1), "kvm_use_merge_gate_keys/kvm_use_merge_gate_values"),
    (dict(kvm_apply_merge_gate_to_initial_state=1), "kvm_apply_merge_gate_to_initial_state=1"),
    (dict(kvm_value_residual_mode="linear"), "kvm_value_residual_mode='linear'"),
    (dict(kvm_value_residual_mode="rwkv_post_tokenshift"), "kvm_value_residual_mode='rwkv_post_tokenshift'"),
    (dict(alt_layer_every=2, swa_value_residual_mode="linear"), "swa_value_residual_mode='linear'"),
    (dict(kvm_token_shift_mode="rwkv7"), "kvm_token_shift_mode='rwkv7'"),
    (dict(alt_layer_every=2, swa_token_shift_mode="none"), "kvm_token_shift_mode, swa_token_shift_mode"),
    (dict(token_mixer="rwkv7"), "token_mixer='rwkv7'"),
    (dict(token_mixer="mamba"), "token_mixer='mamba'"),
    (dict(alt_layer_every=2, alt_token_mixer="lact"), "alt_token_mixer='lact'"),
    (dict(token_mixer_class_path="my.module.Mixer"), "token_mixer_class_path='my.module.Mixer'"),
    (dict(token_mixer_class_path="model.kda_mixer.SequenceMixer"),
     "token_mixer_class_path='model.kda_mixer.SequenceMixer'"),
    (dict(d_v_head=64), "d_v_head=64"),
    (dict(state_budget_mode="exponential"), "state_budget_mode='exponential'"),
    (dict(state_budget_mode="kvm_saturation", state_saturation_n=None), "state_saturation_n=None"),
    (dict(rope_partial_dim=0), "rope_partial_dim=0"),
    (dict(token_mixer="swa", alt_layer_every=2, alt_token_mixer="kvm", alt_rope_partial_dim=128),
     "alt_rope_partial_dim=128"),
    (dict(n_max_d_chunks=0), "n_max_d_chunks=0"),
    (dict(token_mixer="ovq", ovq_use_delta_rule=1), "ovq_use_delta_rule=1"),
    (dict(token_mixer="ovq", ovq_normalize_centroids=1), "ovq_normalize_centroids=1"),
    (dict(model_type="llama"), "model_type='llama'"),
])
def test_refusals_name_key_and_value(over, key):
    with pytest.raises(ValueError, match="not supported") as err:
        cv.reference_config_to_ours(ref(**over))
    assert key in str(err.value)


@pytest.mark.parametrize("drop", ["hidden_size", "token_mixer", "use_tokenshift_att", "model_type",
                                  "kvm_apply_merge_gate_to_appends"])
def test_missing_required_key(drop):
    cfg = ref()
    del cfg[drop]
    with pytest.raises(ValueError, match=drop):
        cv.reference_config_to_ours(cfg)


def test_kvm_keys_not_required_without_kvm_layers():
    cfg = ref(token_mixer="gptalpha")
    del cfg["kvm_apply_merge_gate_to_appends"]
    assert cv.reference_config_to_ours(cfg).mixer == "full"


# ---- layouts of the ablation checkpoints ----------------------------------------------------------
def _names(tmp_path, **flags):
    cv.build_tiny_reference_checkpoint(tmp_path, **flags)
    return set(load_file(tmp_path / "model.safetensors"))


def test_tiny_checkpoint_is_authors_layout(tmp_path):
    cfg = cv.build_tiny_reference_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw == cfg and raw["model_type"] == "rwkv7backbone" and "tie_worhidden_sizedings" in raw
    assert raw["architectures"] == ["RWKV7BackboneForCausalLM"] and raw["dtype"] == "bfloat16"
    sd = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    a = "transformer.h.0.attn."
    assert sd[a + "c_q.weight"].shape == (64, 64) and sd[a + "key_weighting.weight"].shape == (2, 64)
    assert sd[a + "v_gate1.weight"].shape == (32, 64) and sd[a + "v_gate0"].shape == (1, 1, 64)
    assert sd[a + "ln_s_k.weight"].shape == (32,) and sd[a + "front_head_temp"].shape == (2,)
    assert (sd["transformer.h.1.mlp.x_k"].shape == (1, 1, 64)
            and sd["transformer.h.1.mlp.c_fc.weight"].shape == (256, 64))
    assert cv.is_reference_checkpoint(tmp_path)


def test_ablation_layouts(tmp_path):
    a0, a1 = "transformer.h.0.attn.", "transformer.h.1.attn."
    n = _names(tmp_path / "g", kvm_use_merge_gate_keys=0, kvm_use_merge_gate_values=0)
    assert a0 + "key_weighting.weight" not in n and a0 + "state_head_temp" in n
    n = _names(tmp_path / "t", kvm_use_head_temps=0)
    assert a0 + "front_head_temp" not in n and a0 + "key_weighting.weight" in n
    n = _names(tmp_path / "h", alt_layer_every=2)
    assert {a0 + s for s in ("ln_s_k.weight", "key_weighting.weight", "front_head_temp")}.isdisjoint(n)
    assert {a1 + s for s in ("ln_s_k.weight", "key_weighting.weight", "front_head_temp")} <= n
    n = _names(tmp_path / "o", token_mixer="ovq", alt_layer_every=2)
    assert a1 + "beta" in n and a1 + "ln_q.weight" not in n and a0 + "ln_q.weight" in n and a0 + "beta" not in n
    n = _names(tmp_path / "v", use_tokenshift_att=0)      # the reference's unused zero x_v stays
    assert a0 + "x_v" in n and a0 + "x_q" not in n


# ---- state-dict validation ------------------------------------------------------------------------
@pytest.fixture
def tiny(tmp_path):
    cfg = cv.build_tiny_reference_checkpoint(tmp_path / "ref")
    return cv.reference_config_to_ours(cfg), cv.load_reference_state_dict(tmp_path / "ref"), tmp_path


def test_map_keeps_tensors_and_dtype(tiny):
    config, sd, _ = tiny
    out = cv.map_reference_state_dict(sd, config)
    assert out.keys() == sd.keys() and all(out[k] is sd[k] for k in sd)
    assert set(out) == set(cv.kvmeans_parameter_shapes(config))


@pytest.mark.parametrize("edit, words", [
    (lambda sd: sd.pop("transformer.h.1.attn.key_weighting.weight"),
     "missing transformer.h.1.attn.key_weighting.weight"),
    (lambda sd: sd.update({"transformer.h.0.attn.c_k.weight": torch.zeros(32, 64)}),
     "shape of transformer.h.0.attn.c_k.weight: expected [64, 64], got [32, 64]"),
    (lambda sd: sd.update({"transformer.h.0.lambdas": torch.zeros(2)}), "unexpected transformer.h.0.lambdas"),
])
def test_layout_errors(tiny, edit, words):
    config, sd, _ = tiny
    edit(sd)
    with pytest.raises(ValueError, match="layout is not supported") as err:
        cv.map_reference_state_dict(sd, config)
    assert words in str(err.value)


def test_flags_disagreeing_with_tensors_are_caught(tmp_path):
    cfg = cv.build_tiny_reference_checkpoint(tmp_path, kvm_use_head_temps=0)
    sd = cv.load_reference_state_dict(tmp_path)
    with pytest.raises(ValueError, match="missing transformer.h.0.attn.front_head_temp"):
        cv.map_reference_state_dict(sd, cv.reference_config_to_ours({**cfg, "kvm_use_head_temps": 1}))


def test_value_residual_without_token_shift_drops_unused_x_v(tmp_path):
    cfg = cv.build_tiny_reference_checkpoint(tmp_path, use_tokenshift_att=0)
    config = cv.reference_config_to_ours(cfg)
    out = cv.map_reference_state_dict(cv.load_reference_state_dict(tmp_path), config)
    assert not any(k.endswith("attn.x_v") for k in out) and "transformer.h.0.attn.v_gate0" in out


# ---- file formats ---------------------------------------------------------------------------------
def test_sharded_and_bin_loading(tiny):
    _, sd, tmp = tiny
    names = sorted(sd)
    shard = tmp / "sharded"
    shard.mkdir()
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(shard / fname))
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    got = cv.load_reference_state_dict(shard)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    binary = tmp / "bin"
    binary.mkdir()
    torch.save(sd, binary / "pytorch_model.bin")
    got = cv.load_reference_state_dict(binary)
    assert all(torch.equal(got[k], sd[k]) and got[k].dtype == torch.bfloat16 for k in sd)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        cv.load_reference_state_dict(tmp)


def test_is_reference_checkpoint(tmp_path):
    assert not cv.is_reference_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not cv.is_reference_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert not cv.is_reference_checkpoint(tmp_path)


def test_convert_round_trip(tiny):
    config, sd, tmp = tiny
    dst = tmp / "ours"
    for _ in range(2):                                      # converting over an existing output works
        assert cv.convert_reference_checkpoint(tmp / "ref", dst) == config
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer_config.json"]            # no temp files left
    raw = json.loads((dst / "config.json").read_text())
    assert raw["model_type"] == "kvmeans" and raw["format_version"] == 1
    got_config, got = cv.read_converted_checkpoint(dst)
    assert got_config == config and KVMModelConfig.from_dict(got_config.to_dict()) == config
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype for k in sd)
    assert (dst / "tokenizer_config.json").read_bytes() == (tmp / "ref" / "tokenizer_config.json").read_bytes()
    with pytest.raises(ValueError, match="not a kvmeans checkpoint"):
        cv.read_converted_checkpoint(tmp / "ref")
    with pytest.raises(ValueError, match="must differ"):
        cv.convert_reference_checkpoint(tmp / "ref", tmp / "ref")


def test_failed_write_leaves_no_partial_files(tiny, monkeypatch):
    _, _, tmp = tiny
    import safetensors.torch

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        cv.convert_reference_checkpoint(tmp / "ref", tmp / "ours")
    assert os.listdir(tmp / "ours") == []


# ---- into the model -------------------------------------------------------------------------------
def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits


@pytest.mark.parametrize("flags", [
    {}, dict(alt_layer_every=2), dict(kvm_use_merge_gate_keys=0, kvm_use_merge_gate_values=0, kvm_use_head_temps=0),
    dict(token_mixer="ovq", alt_layer_every=2), dict(token_mixer="gptalpha_bswa", sink_len=0),
    dict(use_tokenshift_att=0)], ids=["kvm", "kvm-swa", "no-gate-no-temps", "ovq-swa", "bswa", "no-shift"])
def test_converted_weights_load_into_model(tmp_path, flags):
    models = pytest.importorskip("kvmeans.models")
    if not hasattr(models, "KVMLanguageModel"):
        pytest.skip("kvmeans.models.KVMLanguageModel not written yet")
    cfg = cv.build_tiny_reference_checkpoint(tmp_path / "ref", **flags)
    config = cv.reference_config_to_ours(cfg)
    sd = cv.map_reference_state_dict(cv.load_reference_state_dict(tmp_path / "ref"), config)
    ids = torch.randint(0, config.vocab_size, (2, 45))           # > n*C = 16 tokens: the state is used

    def run(state_dict, cfg_):
        model = models.KVMLanguageModel(cfg_).eval()
        model.load_state_dict(state_dict, strict=True)
        with torch.no_grad():
            return model, _logits(model(ids))

    model, ref_logits = run(sd, config)
    assert ref_logits.shape == (2, 45, config.vocab_size) and torch.isfinite(ref_logits).all()
    cv.convert_reference_checkpoint(tmp_path / "ref", tmp_path / "ours")
    _, conv_logits = run(*reversed(cv.read_converted_checkpoint(tmp_path / "ours")))
    assert torch.equal(conv_logits, ref_logits)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "resaved.safetensors"))
    _, re_logits = run(load_file(tmp_path / "resaved.safetensors"), config)
    assert torch.equal(re_logits, ref_logits)


# ---- authors' checkpoints: fields of layer kinds the model does not build -----------------------------
# (base flags, unused values): the checkpoint with the unused values loads as the same model as without them
UNUSED = {
    "alt rope wider than the head, no alternate layers": ({}, dict(alt_rope_partial_dim=64)),
    "alt_layer_every 1 is no hybrid": ({}, dict(alt_layer_every=1, alt_rope_partial_dim=64, alt_rope_theta=0.0)),
    "alt rope theta 0": ({}, dict(alt_rope_theta=0.0)),
    "alternate mixer settings": ({}, dict(alt_token_mixer="rwkv7", alt_token_mixer_class_path="my.module.Mixer",
                                          alt_share_v0=1)),
    "swa keys without SWA layers": ({}, dict(swa_window_size=0, swa_token_shift_mode="weird",
                                             swa_value_residual_mode="linear")),
    "ovq keys without OVQ layers": ({}, dict(ovq_chunk_size=0, ovq_max_centroids=-1, ovq_use_delta_rule=1,
                                             ovq_normalize_centroids=1, ovq_token_shift_mode="weird")),
    "gptalpha modes without full attention": ({}, dict(gptalpha_token_shift_mode="weird",
                                                       gptalpha_value_residual_mode="linear")),
    "budget keys fixed mode does not read": ({}, dict(state_growth_factor=-1.0, state_growth_exponent=-2.0,
                                                      state_round_down=0, state_saturation_n=0)),
    "saturation n in power-law mode": (dict(state_budget_mode="power_law", state_growth_factor=4.0,
                                            n_max_d_chunks=4), dict(state_saturation_n=-3)),
    "growth keys in saturation mode": (dict(state_budget_mode="kvm_saturation", state_saturation_n=32,
                                            n_max_d_chunks=4),
                                       dict(state_growth_factor=0.0, state_growth_exponent=-1.0)),
    "gate placement without a merge gate": (dict(kvm_use_merge_gate_keys=0, kvm_use_merge_gate_values=0),
                                            dict(kvm_apply_merge_gate_to_initial_state=1,
                                                 kvm_apply_merge_gate_to_appends=1)),
    "token-shift mode with token shift off": (dict(use_tokenshift_att=0), dict(kvm_token_shift_mode="weird")),
    "value-residual mode with it off": (dict(use_value_residual=0), dict(kvm_value_residual_mode="linear")),
    "KVM keys in a full-attention model": (dict(token_mixer="gptalpha"), dict(
        chunk_len=0, n_bswa_chunks=0, sink_len=-1, n_max_d_chunks=0, state_budget_mode="nonsense",
        kvm_use_merge_gate_keys=1, kvm_use_merge_gate_values=0, kvm_apply_merge_gate_to_initial_state=1,
        kvm_value_residual_mode="linear", kvm_token_shift_mode="weird")),
    "main rope of an OVQ stream": (dict(token_mixer="ovq", alt_layer_every=2), dict(rope_partial_dim=64,
                                                                                     rope_theta=0.0)),
    "KVM and OVQ keys in a BSWA model": (dict(token_mixer="gptalpha_bswa"), dict(
        n_max_d_chunks=0, state_min_len=10 ** 9, kvm_use_head_temps=7, ovq_chunk_size=-1, swa_window_size=-7,
        alt_rope_partial_dim=1000)),
    "OVQ keys in a KVM/SWA hybrid": (dict(alt_layer_every=2), dict(ovq_chunk_size=0, ovq_max_centroids=0)),
}


@pytest.mark.parametrize("base, unused", list(UNUSED.values()), ids=list(UNUSED))
def test_authors_unused_fields_may_hold_anything_their_code_accepts(tmp_path, base, unused):
    KVMForCausalLM = pytest.importorskip("kvmeans.models.hf").KVMForCausalLM
    cv.build_tiny_reference_checkpoint(tmp_path / "plain", seed=5, **base)
    raw = cv.build_tiny_reference_checkpoint(tmp_path / "unused", seed=5, **base, **unused)
    assert cv.reference_config_to_ours(raw) == cv.reference_config_to_ours(
        json.loads((tmp_path / "plain" / "config.json").read_text()))
    plain = KVMForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32)
    model = KVMForCausalLM.from_pretrained(tmp_path / "unused", dtype=torch.float32)
    assert model.config.to_model_config() == plain.config.to_model_config()
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, plain(ids).logits) and logits.isfinite().all()


def test_used_fields_are_still_checked(tmp_path):
    raw = cv.build_tiny_reference_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"alt_rope_dim: 64 must be even and in \[0, head_dim=32\]"):
        cv.reference_config_to_ours({**raw, "alt_layer_every": 2, "alt_rope_partial_dim": 64})
    with pytest.raises(ValueError, match="ovq_chunk_len: must be >= 1"):
        cv.reference_config_to_ours({**raw, "token_mixer": "ovq", "ovq_chunk_size": 0})
    with pytest.raises(ValueError, match="kvm_apply_merge_gate_to_initial_state=1 is not supported"):
        cv.reference_config_to_ours({**raw, "kvm_apply_merge_gate_to_initial_state": 1})
