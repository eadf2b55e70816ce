"""Native KVM models in bounded memory: an eval-mode forward over a long input runs in segments of
``config.prefill_segment`` tokens (== one call: logits, the cache it leaves, padded batches, every mixer), and
no activation grows with the prompt."""
import pytest
import torch

pytest.importorskip("transformers")
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
from tests.models.test_hf import ARCHS, left_pad, prompts, tiny  # noqa: E402
from tests.pretrained.test_long_context import _Largest  # noqa: E402


def run(model, ids, segment, **kw):
    model.config.prefill_segment = segment
    with torch.no_grad():
        return model(ids, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_segmented_prefill_equals_one_call(arch):
    model = tiny(arch)
    ids = torch.stack(prompts([70, 70]))
    one = run(model, ids, 0, use_cache=True)
    seg = run(model, ids, 16, use_cache=True)
    torch.testing.assert_close(seg.logits, one.logits, rtol=0, atol=1e-5)
    last = run(model, ids, 16, use_cache=True, logits_to_keep=3)
    torch.testing.assert_close(last.logits, one.logits[:, -3:], rtol=0, atol=1e-5)
    nxt = torch.stack(prompts([2, 2], seed=5))
    want = run(model, nxt, 0, **cache_kwargs(cache_from(one)), use_cache=True).logits
    got = run(model, nxt, 0, **cache_kwargs(cache_from(last)), use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_segmented_prefill_of_a_left_padded_batch_equals_one_call():
    model = tiny("kvm")
    ids, mask = left_pad(prompts([75, 30, 52]))           # the second row is pads only in the first segments
    one = run(model, ids, 0, attention_mask=mask).logits
    seg = run(model, ids, 16, attention_mask=mask).logits
    torch.testing.assert_close(seg, one, rtol=0, atol=1e-5)


def test_no_float_tensor_grows_with_the_prompt():
    model = tiny("kvm")
    model.config.prefill_segment = 16
    most = {}
    for T in (64, 256):
        with _Largest() as probe, torch.no_grad():
            model(torch.stack(prompts([T])), use_cache=True, logits_to_keep=1)
        most[T] = probe.most
    assert most[64] == most[256], most
