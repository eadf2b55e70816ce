"""copy_sharing_weights: eval arms convert their own copy of a model without a second copy of its weights."""
import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvmeans.pretrained.convert import convert_hf  # noqa: E402
from kvmeans.utils.modules import copy_sharing_weights  # noqa: E402


def test_a_converted_copy_shares_the_weights_and_leaves_the_original_unchanged():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    settings = dict(budget=6, chunk_len=4, n_bswa_chunks=2, sink_len=1)
    shared = convert_hf(copy_sharing_weights(model), **settings)
    owned = convert_hf(copy.deepcopy(model), **settings)
    for (name, p), q in zip(model.named_parameters(), shared.parameters()):
        assert p is q, name
    assert shared.lm_head.weight is shared.model.embed_tokens.weight          # ties kept
    assert model.model.layers[0].self_attn.config._attn_implementation != "kvmeans_converted"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
        compressed = shared(ids).logits
        torch.testing.assert_close(compressed, owned(ids).logits, rtol=0, atol=0)
    assert not torch.allclose(compressed, before, atol=1e-4)        # 40 tokens > window + budget: compressed
