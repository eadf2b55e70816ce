"""kvmeans.serve.native_slots: a native model's cache packed into a fixed byte slot between calls continues exactly
as the cache kept in memory, for every mixer, and never outgrows the slot sized for max_len (no vLLM needed)."""
import pytest
import torch

from kvmeans.models.config import KVMModelConfig
from kvmeans.models.transformer import KVMLanguageModel
from kvmeans.serve.native_slots import pack_cache, slot_bytes, unpack_cache

BASE = dict(vocab_size=97, hidden_size=32, num_heads=4, num_kv_heads=2, chunk_len=8, n_bswa_chunks=2, sink_len=2,
            swa_window=12, bswa_chunks=2, ovq_chunk_len=8, ovq_max_centroids=16, rwkv7_chunk_size=8)
CASES = {
    "kvm-fixed": dict(num_layers=2, budget={"kind": "fixed", "n": 12}),
    "kvm-sqrt": dict(num_layers=2, budget={"kind": "power_law", "factor": 2.0}),
    "kvm-novelty": dict(num_layers=2, budget={"kind": "novelty", "threshold": 0.3, "n": 10}),
    "hybrid": dict(num_layers=4, mixer_types=["kvm", "full", "swa", "bswa"], budget={"kind": "fixed", "n": 12}),
    "ovq": dict(num_layers=2, mixer_types=["ovq", "kvm"]),
    "rwkv7": dict(num_layers=2, mixer="rwkv7", num_kv_heads=None, value_residual=True),
    "no-shift": dict(num_layers=2, token_shift=False, mlp_token_shift=False, value_residual=False),
}
SPLITS = (5, 1, 1, 17, 3, 1, 8, 1, 30, 1, 1, 9)     # ragged calls: prefill pieces and decode steps


def _model(case):
    torch.manual_seed(0)
    cfg = KVMModelConfig(**{**BASE, **CASES[case]})
    model = KVMLanguageModel(cfg).eval()
    with torch.no_grad():                    # a sharper model than the near-zero init, so outputs differ
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return cfg, model


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_packed_cache_continues_exactly_and_fits(case):
    cfg, model = _model(case)
    T = sum(SPLITS)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    size = slot_bytes(cfg, max_len=T)
    slot = torch.full((size,), 255, dtype=torch.uint8)          # garbage where nothing is written
    ref_cache, skeleton, pos = None, None, 0
    for n in SPLITS:
        piece = ids[:, pos:pos + n]
        ref, ref_cache = model(piece, ref_cache)
        cache = None if skeleton is None else unpack_cache(skeleton, slot)
        out, cache = model(piece, cache)
        skeleton = pack_cache(cache, slot)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"{case}: call at {pos}")
        pos += n
    assert skeleton.seen_tokens == T


@pytest.mark.parametrize("case", ["kvm-fixed", "kvm-sqrt", "hybrid"])
@torch.no_grad()
def test_slot_bytes_bounds_the_cache_at_every_length(case):
    """The slot for max_len holds the packed cache after every length up to max_len, and the bound is not
    loose by more than the token-shift rows and alignment for a fixed budget."""
    cfg, model = _model(case)
    T = 120
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    size = slot_bytes(cfg, max_len=T)
    slot = torch.empty(size, dtype=torch.uint8)
    cache, most = None, 0
    for t in range(T):
        _, cache = model(ids[:, t:t + 1], cache)
        pack_cache(cache, slot)
        most = max(most, sum(s.nbytes_used if hasattr(s, "nbytes_used") else 0 for s in cache.layers))
    assert most <= size
    if case == "kvm-fixed":
        assert slot_bytes(cfg, max_len=10 * T) == size          # a fixed budget: the same slot at any length
    else:
        assert slot_bytes(cfg, max_len=10 * T) > size


def test_a_cache_that_outgrows_its_slot_is_refused():
    cfg, model = _model("hybrid")                                 # a full-attention layer grows with the tokens
    slot = torch.empty(slot_bytes(cfg, max_len=16), dtype=torch.uint8)
    with torch.no_grad():
        _, cache = model(torch.randint(0, cfg.vocab_size, (1, 64)))
    with pytest.raises(RuntimeError, match="does not fit its slot .*max_model_len"):
        pack_cache(cache, slot)


def test_one_sequence_per_slot():
    cfg, model = _model("kvm-fixed")
    with torch.no_grad():
        _, cache = model(torch.randint(0, cfg.vocab_size, (2, 9)))
    with pytest.raises(ValueError, match="one sequence per slot"):
        pack_cache(cache, torch.empty(slot_bytes(cfg, 16), dtype=torch.uint8))
