"""Assisted and prompt-lookup decoding: KVMCache.crop rolls every mixer back, so both modes return the
greedy tokens; crop then continue equals never having gone past."""
import pytest
import torch

pytest.importorskip("transformers")
from kvmeans.models.hf_cache import KVMCache  # noqa: E402
from kvmeans.models.hf_compat import CACHE_KWARG, cache_from, cache_kwargs  # noqa: E402
from tests.models.test_hf import ARCHS, GREEDY, prompts, tiny  # noqa: E402

C = 4                                   # chunk_len: every verification of >= 4 tokens crosses a boundary
SMALL = dict(chunk_len=C, ovq_chunk_len=C, swa_window=6)


def model(arch="kvm", seed=0, **kw):
    return tiny(arch, seed=seed, **SMALL, **kw)


def greedy(m, ids, n):
    return m.generate(ids, max_new_tokens=n, **GREEDY)


def count_rollbacks(monkeypatch, cache_cls=KVMCache):
    """Spy on ``cache_cls.crop``: a list of (columns before, columns after) of crops that removed tokens."""
    seen, crop = [], cache_cls.crop

    def spy(self, amount):
        before = self.get_seq_length()
        crop(self, amount)
        if self.get_seq_length() < before:
            seen.append((before, self.get_seq_length()))
    monkeypatch.setattr(cache_cls, "crop", spy)
    return seen


def draft_tokens(m, n):
    m.generation_config.num_assistant_tokens = n
    m.generation_config.num_assistant_tokens_schedule = "constant"
    return m


@pytest.mark.parametrize("arch", list(ARCHS))
def test_assisted_with_same_weights_draft_equals_greedy(arch, monkeypatch):
    m, ids = model(arch), prompts([7])[0][None]
    want = greedy(m, ids, 18)
    draft = draft_tokens(model(arch), 5)             # same weights, a separate cache
    assert torch.equal(m.generate(ids, max_new_tokens=18, assistant_model=draft, **GREEDY), want)


@pytest.mark.parametrize("arch", ["kvm", "kvm+swa", "ovq+swa"])
def test_assisted_with_different_draft_rolls_back_across_boundaries_and_equals_greedy(arch, monkeypatch):
    m, ids = model(arch), prompts([9], seed=3)[0][None]
    want = greedy(m, ids, 24)
    draft = draft_tokens(model(arch, seed=7, num_layers=2), 5)
    rollbacks = count_rollbacks(monkeypatch)
    out = m.generate(ids, max_new_tokens=24, assistant_model=draft, **GREEDY)
    assert torch.equal(out, want)
    # rejected drafts were undone in both caches, some across a chunk boundary (columns // C differ)
    assert any(a // C != b // C for a, b in rollbacks), rollbacks


@pytest.mark.parametrize("arch", ["kvm", "bswa", "ovq+swa"])
def test_prompt_lookup_on_repetitive_text_equals_greedy(arch, monkeypatch):
    m = model(arch)
    ids = torch.arange(1, 8).repeat(3)[None]                   # 21 tokens: a phrase three times
    want = greedy(m, ids, 20)
    rollbacks = count_rollbacks(monkeypatch)
    out = m.generate(ids, max_new_tokens=20, prompt_lookup_num_tokens=5, **GREEDY)
    assert torch.equal(out, want)
    assert rollbacks                                           # some lookups were wrong and undone


def logits(m, ids, cache, keep=0):
    """``keep``: logits of the last ``keep`` positions only (as a call with ids fed in front returns them)."""
    with torch.no_grad():
        return m(ids, **cache_kwargs(cache), logits_to_keep=keep).logits


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("how", ["remove", "max_length"])
def test_crop_then_continue_equals_never_having_gone_past(arch, how):
    m = model(arch)
    prompt, x, y = prompts([6, 7, 5], seed=4)
    ref = KVMCache()
    logits(m, prompt[None], ref)
    want = logits(m, torch.cat((x[:2], y))[None], ref, keep=5)  # the kept ids are fed with the next call
    cache = KVMCache()
    logits(m, prompt[None], cache)
    cache.activate_past_recording()                            # the snapshot is taken at 6 columns
    logits(m, x[None], cache)                                  # columns 6..13: crosses 8 and 12
    cache.crop(-5 if how == "remove" else 8)
    assert cache.get_seq_length() == 8 and cache.snapshot_nbytes > 0   # kept for the next crop
    assert torch.equal(logits(m, y[None], cache), want)
    assert cache.get_seq_length() == ref.get_seq_length() == 13


def fed(m, ids):
    cache = KVMCache()
    logits(m, ids[None], cache)
    return cache


def test_crop_over_several_calls_and_twice_before_continuing():
    m = model("kvm+swa")
    seq = prompts([20], seed=5)[0]
    cache = fed(m, seq[:5])
    cache.activate_past_recording()
    for t in range(5, 11):                                     # six one-token calls (the draft's pattern)
        logits(m, seq[None, t:t + 1], cache)
    cache.crop(9)
    cache.crop(-2)                                             # cuts ids not fed yet
    assert cache.get_seq_length() == 7
    assert torch.equal(logits(m, seq[None, 7:14], cache), logits(m, seq[None, 5:14], fed(m, seq[:5]), keep=7))
    cache.crop(-3)                                             # the snapshot (5 columns) still serves
    assert torch.equal(logits(m, seq[None, 11:14], cache), logits(m, seq[None, 5:14], fed(m, seq[:5]), keep=3))


def test_long_replays_run_alone_and_move_the_snapshot_up():
    m = model("kvm")
    prompt, x, y = prompts([6, 7, 5], seed=4)
    ref = KVMCache()
    for part in (prompt, x[:4], y):                            # 4 kept ids > replay_limit: fed alone
        want = logits(m, part[None], ref)
    cache = KVMCache()
    cache.replay_limit = 3
    logits(m, prompt[None], cache)
    cache.activate_past_recording()
    logits(m, x[None], cache)
    cache.crop(10)
    assert cache.snapshot_nbytes == 0
    assert torch.equal(logits(m, y[None], cache), want)
    assert cache.snapshot_nbytes > 0
    with pytest.raises(ValueError, match="restore 10 columns at the least"):
        cache.crop(9)


def test_crop_refuses_what_it_cannot_restore():
    m = model("kvm")
    ids = prompts([10])[0][None]
    plain = cache_from(m(ids))
    plain.crop(0)
    with pytest.raises(ValueError, match="activate_past_recording"):
        plain.crop(-1)
    cache = fed(m, ids[0, :6])
    cache.activate_past_recording()
    logits(m, ids[:, 6:], cache)
    with pytest.raises(ValueError, match="restore 6 columns at the least"):
        cache.crop(5)
    cache.crop(6)
    assert cache.get_seq_length() == 6


def test_long_first_call_snapshots_before_its_tail_so_a_rejection_does_not_feed_the_prompt_again(monkeypatch):
    m = model("kvm+swa")
    ids = torch.arange(1, 11).repeat(5)[None]                  # 50 tokens > replay_limit (32)
    want = greedy(m, ids, 24)
    fed_tokens, run = [], KVMCache._run

    def counting_run(self, backbone, x, mask):
        fed_tokens.append(x.shape[1])
        return run(self, backbone, x, mask)
    monkeypatch.setattr(KVMCache, "_run", counting_run)
    rollbacks = count_rollbacks(monkeypatch)
    out = m.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=5, **GREEDY)
    assert torch.equal(out, want) and rollbacks
    assert fed_tokens[:2] == [50 + 5 - 32, 32]                 # the prompt and the first draft, split
    assert max(fed_tokens[2:]) <= 32 + 6                       # no later run feeds the prompt again


def test_crop_before_the_first_snapshot_feeds_again_from_the_start():
    m = model("kvm")
    seq = prompts([16], seed=6)[0]
    cache = KVMCache()
    cache.replay_limit = 3
    cache.activate_past_recording()
    logits(m, seq[None, :10], cache)                           # runs [0, 7) and [7, 10): snapshot at 7
    with pytest.raises(ValueError, match="holds 10 columns"):
        cache.crop(-11)
    cache.crop(4)
    assert cache.get_seq_length() == 4 and cache.snapshot_nbytes == 0
    assert torch.equal(logits(m, seq[None, 4:9], cache), logits(m, seq[None, 4:9], fed(m, seq[:4])))


@pytest.mark.parametrize("mode, records", [("ASSISTED_GENERATION", True), ("GREEDY_SEARCH", False)])
def test_generate_records_the_cache_of_assisted_decoding_itself(mode, records):
    """transformers 5.0 does not call activate_past_recording; the model does when it builds the cache."""
    from transformers import GenerationConfig
    from transformers.generation import GenerationMode
    m, kwargs = model("kvm"), {}
    m._prepare_cache_for_generation(GenerationConfig(use_cache=True), kwargs, getattr(GenerationMode, mode), 1, 64)
    cache = kwargs[CACHE_KWARG]               # past_key_values before transformers 5.24, cache from 5.24
    assert isinstance(cache, KVMCache) and cache.record_past is records
