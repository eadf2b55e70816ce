"""transformers 5.24 renamed ``past_key_values`` to ``cache``: kvmeans.models.hf_compat picks the installed
version's name, KVMForCausalLM.forward takes either name (not both) and returns the cache where the installed
version's generate reads it; converted layers find their cache under either name. Runs under 5.18-5.24."""
import pytest
import torch

tf = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from kvmeans.models.hf_cache import KVMCache  # noqa: E402
from kvmeans.models.hf_compat import CACHE_KWARG, cache_from, cache_kwargs, either_cache  # noqa: E402
from kvmeans.pretrained.convert import convert_hf  # noqa: E402
from tests.models.test_hf import prompts, tiny  # noqa: E402

RENAMED = Version(Version(tf.__version__).base_version) >= Version("5.24")
# the model-forward names the installed transformers accepts (5.24 keeps past_key_values as a deprecated alias)
HF_NAMES = ["cache", "past_key_values"] if RENAMED else ["past_key_values"]


def test_the_cache_keyword_is_the_installed_versions():
    assert CACHE_KWARG == ("cache" if RENAMED else "past_key_values")
    assert cache_kwargs("c") == {CACHE_KWARG: "c"}


def test_cache_from_reads_either_name_the_installed_one_first():
    other = "past_key_values" if CACHE_KWARG == "cache" else "cache"
    assert cache_from({other: "old"}) == "old"
    assert cache_from({other: "old", CACHE_KWARG: "new"}) == "new"
    assert cache_from({CACHE_KWARG: None, "layer_past": "neox"}, "layer_past") == "neox"
    assert cache_from({"layer_past": "neox"}) is None
    assert either_cache(None, None) is None and either_cache("a", None) == "a" and either_cache(None, "b") == "b"


def test_cache_from_reads_an_output_by_its_own_field_only(monkeypatch):
    """5.24's outputs map ``get("past_key_values")`` to ``cache`` with a deprecation warning: an output without a
    cache (labels, use_cache=False) must not be asked for the other name."""
    asked, get = [], CausalLMOutputWithPast.get
    monkeypatch.setattr(CausalLMOutputWithPast, "get", lambda self, key, default=None:
                        asked.append(key) or get(self, key, default))
    assert cache_from(CausalLMOutputWithPast(logits=torch.zeros(1))) is None and asked == [CACHE_KWARG]


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@torch.no_grad()
def test_forward_continues_a_cache_given_under_either_name(name):
    model, seq = tiny(), prompts([20])[0][None]
    first = model(seq[:, :13], use_cache=True)
    cache = cache_from(first)
    assert isinstance(cache, KVMCache) and getattr(first, CACHE_KWARG) is cache   # where generate reads it
    rest = model(seq[:, 13:], use_cache=True, **{name: cache})
    assert cache_from(rest) is cache and cache.get_seq_length() == 20
    torch.testing.assert_close(rest.logits, model(seq, use_cache=False).logits[:, 13:], rtol=0, atol=1e-5)


def test_forward_refuses_both_names_in_one_line():
    model, seq = tiny(), prompts([6])[0][None]
    with pytest.raises(ValueError, match=r"^got both cache= and past_key_values= .*pass the cache once$"):
        model(seq, cache=KVMCache(), past_key_values=KVMCache())


def test_trainer_drops_the_cache_field_of_the_output():
    model, seq = tiny(), prompts([6])[0][None]
    with torch.no_grad():
        out = model(seq, use_cache=True)
    assert set(out.keys()) - set(model.config.keys_to_ignore_at_inference) == {"logits"}


@pytest.mark.parametrize("name", HF_NAMES)
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")   # 5.24's alias, on purpose
@torch.no_grad()
def test_a_converted_model_continues_its_cache_under_each_accepted_name(name):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    model = convert_hf(tf.AutoModelForCausalLM.from_config(cfg).eval(), budget=8, chunk_len=8, n_bswa_chunks=2,
                       sink_len=2)
    x = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(1))
    first = model(x[:, :41], use_cache=True)
    rest = model(x[:, 41:], use_cache=True, **{name: cache_from(first)})
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), model(x).logits, rtol=0, atol=1e-5)
