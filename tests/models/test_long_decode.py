"""Bounded memory: decoding 100k tokens with a fixed-256 model keeps the cache flat (slow: ~1-2 min)."""
import pytest
import torch

from kvmeans.models import KVMLanguageModel, KVMModelConfig


@pytest.mark.slow
def test_fixed_budget_cache_is_flat_over_100k_decoded_tokens():
    torch.manual_seed(0)
    cfg = KVMModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, chunk_len=256,
                         budget={"kind": "fixed", "n": 256})
    model = KVMLanguageModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 100_000))
    sizes = []
    with torch.no_grad():
        _, cache = model(ids[:, :256])
        for t in range(256, ids.shape[1]):
            _, cache = model(ids[:, t:t + 1], cache)
            if t % 256 == 0:
                sizes.append(cache.nbytes)
    state = cache.layers[0]
    assert state.seen_tokens == 100_000 and state.num_rows == 256
    assert len(set(sizes[1:])) == 1, f"cache bytes changed while decoding: {sorted(set(sizes))}"
