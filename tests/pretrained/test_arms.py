"""The arms shared by eval ppl and bench pretrained (kvmeans.pretrained.arms) on a tiny random-weight Llama."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvmeans.ops.budget import StateBudget  # noqa: E402
from kvmeans.pretrained import arms  # noqa: E402

PER_KEY = 2 * 2 * 2 * 8 * 4      # K and V x layers x kv heads x head_dim x fp32 bytes


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_every_kvm_arm_counts_its_kept_keys_the_same_way(model, tmp_path):
    """A converted copy (eval ppl --kvm), its saved folder (kvm:saved) and the loaded folder (bench's distilled
    arm) keep the state budget at the length plus the window; a power-law budget grows with the length."""
    kvm = {"budget": StateBudget.power_law(2, 0.5), "chunk_len": 4, "n_bswa_chunks": 2, "sink_len": 1}
    conv = arms.kvm_spec_arm(model, kvm, 100)
    assert conv.name == "kvm" and conv.kept_keys == 2 * 10 + 8 and conv.model is not model
    conv.model.save_pretrained(tmp_path)
    saved = arms.saved_arm(str(tmp_path), 400)
    assert (saved.name, saved.kept_keys) == ("kvm:saved", 2 * 20 + 8)
    assert arms.distilled_arm(saved.model, 100).kept_keys == conv.kept_keys
    assert arms.kvm_kept_keys(conv.model.config.kvm_conversion, 400) == saved.kept_keys
    with pytest.raises(arms.UsageError, match="^--kvm: sink_len"):
        arms.kvm_spec_arm(model, {"chunk_len": 4, "sink_len": 4}, 100)


def test_kept_keys_of_an_arm_at_a_length():
    assert arms.Arm("full", None).kept(64) == 64
    assert arms.Arm("s", None, sinks=2, window=6).kept(64) == 8
    assert arms.streaming_arm(None, 80, 4).kept(64) == 64 and arms.streaming_arm(None, 20, 4).kept(64) == 20
    assert arms.Arm("kvm", None, 12).kept(8) == 8


def test_window_nll_with_and_without_a_cache(model):
    w = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    full = arms.Arm("full", model)
    nll, nbytes, secs = arms.window_nll(full, w)
    assert nll.shape == (39,) and nbytes is None and secs > 0
    assert torch.equal(nll, arms.token_nll(model, w[None])[0])
    cached, nbytes, _ = arms.window_nll(full, w, cache=True)
    torch.testing.assert_close(cached, nll)
    assert nbytes == 40 * PER_KEY
    st = arms.streaming_arm(model, 12, 2)
    nll_st, nbytes, _ = arms.window_nll(st, w, cache=True)
    pos = torch.arange(40)
    torch.testing.assert_close(nll_st, arms.token_nll(model, w[None], arms.streaming_mask(pos, pos, 2, 10))[0])
    assert nbytes == 11 * PER_KEY           # what the next token can still see: 2 sinks + the last 9


def test_run_windows_goes_window_by_window(model):
    windows = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    two = [arms.Arm("full", model), arms.streaming_arm(model, 8, 1)]
    seen = []
    out = arms.run_windows(two, windows, each=lambda i, arm, nll: seen.append((i, arm.name, nll.shape[0])))
    assert seen == [(i, name, 23) for i in range(3) for name in ("full", "streaming")]
    assert [o[0].shape for o in out] == [(3, 23)] * 2 and out[0][0].dtype == torch.float64
    assert out[0][1] is None and out[0][2] > 0
    assert torch.exp(out[0][0].mean()).item() == pytest.approx(arms.perplexity(model, windows), rel=1e-12)
