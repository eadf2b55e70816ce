"""transformers habits of KVMForCausalLM: from_pretrained(dtype=...), output_hidden_states /
output_attentions, gradient checkpointing, foreign configs, beam-search caches."""
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.hf import KVMForCausalLM  # noqa: E402
from kvmeans.utils.testing import TOLERANCES, assert_close, perturb_identity_init  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, chunk_len=8,
            n_bswa_chunks=2, budget={"kind": "fixed", "n": 16}, swa_window=8, value_residual=True)


def tiny(seed=0, **overrides) -> KVMForCausalLM:
    torch.manual_seed(seed)
    lm = KVMLanguageModel(KVMModelConfig(**{**TINY, **overrides}))
    perturb_identity_init(lm)
    return KVMForCausalLM.from_language_model(lm).eval()


def ids(B=2, T=21, seed=1):
    return torch.randint(1, 64, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- dtype ------------------------------------------------------------------------------------------
def test_from_pretrained_bf16_gives_a_bf16_model_close_to_fp32(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    half = KVMForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    kept = [n for n, p in half.named_parameters() if p.dtype != torch.bfloat16]
    assert kept == [], f"parameters not in bf16: {kept}"     # token-shift alphas and v_gate0 included
    x = ids()
    with torch.no_grad():
        ref, out = model(x).logits, half(x).logits
    assert out.dtype == torch.float32                        # logits are returned in fp32 whatever the model
    assert_close("bf16 logits", ref, out, 2 * TOLERANCES[torch.bfloat16])
