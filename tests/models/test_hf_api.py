"""transformers habits of KVMForCausalLM: from_pretrained(dtype=...), output_hidden_states /
output_attentions, gradient checkpointing, foreign configs, beam-search caches."""
import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.hf import KVMForCausalLM  # noqa: E402
from kvmeans.models.hf_compat import cache_from, cache_kwargs  # noqa: E402
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


# ---- output_hidden_states / output_attentions ---------------------------------------------------------
def test_output_hidden_states_follow_llama_convention():
    model, x = tiny(), ids()
    blocks = []
    hooks = [b.register_forward_hook(lambda m, args, out: blocks.append(out[0])) for b in model.transformer.h]
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    for h in hooks:
        h.remove()
    hs, tr = out.hidden_states, model.transformer
    assert isinstance(hs, tuple) and len(hs) == model.config.num_layers + 1
    assert all(h.shape == (2, 21, 32) for h in hs)
    torch.testing.assert_close(hs[0], tr.ln_emb(tr.wte(x)), rtol=0, atol=0)       # the embedding output
    for i in range(len(blocks) - 1):
        torch.testing.assert_close(hs[i + 1], blocks[i], rtol=0, atol=0)          # each block's output
    torch.testing.assert_close(hs[-1], tr.ln_head(blocks[-1]), rtol=0, atol=0)    # the last after the final norm
    torch.testing.assert_close(out.logits, model.lm_head(hs[-1]).float(), rtol=0, atol=0)
    with torch.no_grad():
        assert model(x).hidden_states is None
        model.config.output_hidden_states = True                                  # the config default applies
        assert len(model(x).hidden_states) == 4


def test_hidden_states_of_a_left_padded_batch_equal_per_sequence():
    model = tiny()
    a, b = ids(1, 13, seed=2)[0], ids(1, 7, seed=3)[0]
    x = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    x[0], mask[0] = a, 1
    x[1, 6:], mask[1, 6:] = b, 1
    with torch.no_grad():
        hs = model(x, attention_mask=mask, output_hidden_states=True).hidden_states
        alone = model(b[None], output_hidden_states=True).hidden_states
    for got, ref in zip(hs, alone):
        torch.testing.assert_close(got[1, 6:], ref[0])
        assert not got[1, :6].any()                                                # zeros at pads


def test_generate_returns_hidden_states_per_step():
    model = tiny()
    out = model.generate(ids(2, 9), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_hidden_states=True)
    assert len(out.hidden_states) == 3                                             # prefill + 2 decode steps
    assert [h.shape[1] for h in (step[0] for step in out.hidden_states)] == [9, 1, 1]
    assert all(len(step) == model.config.num_layers + 1 for step in out.hidden_states)


def test_output_attentions_is_refused_with_the_reason():
    model = tiny()
    with pytest.raises(ValueError, match="output_attentions=True: KVM layers .* no dense attention matrix"):
        model(ids(), output_attentions=True)


# ---- gradient checkpointing -----------------------------------------------------------------------------
def _grads(model, x, split=None):
    """Parameter gradients of the LM loss over ``x``, in one call or two (the second continuing the cache)."""
    model.zero_grad(set_to_none=True)
    if split is None:
        loss = model(x, labels=x).loss
    else:
        first = model(x[:, :split], use_cache=True)
        second = model(x[:, split:], **cache_kwargs(cache_from(first)))
        loss = first.logits.logsumexp(-1).mean() + second.logits.logsumexp(-1).mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")
@pytest.mark.parametrize("split", [None, 13], ids=["one-call", "continued-cache"])
def test_gradient_checkpointing_gives_the_same_gradients(split):
    model, x = tiny().train(), ids(2, 29)
    ref = _grads(model, x, split)
    runs = []
    for block in model.transformer.h:
        block.attn.register_forward_hook(lambda *a: runs.append(1))
    model.gradient_checkpointing_enable()
    assert all(b.gradient_checkpointing for b in model.transformer.h)
    runs.clear()
    got = _grads(model, x, split)
    calls = 1 if split is None else 2
    assert len(runs) == 2 * calls * model.config.num_layers        # each block re-ran in backward
    assert got.keys() == ref.keys() and len(got) > 20
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)
    model.gradient_checkpointing_disable()
    runs.clear()
    _grads(model, x, split)
    assert len(runs) == calls * model.config.num_layers


# ---- foreign configs -----------------------------------------------------------------------------------
def test_from_pretrained_refuses_another_architecture_up_front(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    monkeypatch.setattr(KVMForCausalLM, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ValueError, match=r"config.json has model_type 'gpt2'; KVMForCausalLM loads model_type "
                                         r"'kvmeans' .* AutoModelForCausalLM"):
        KVMForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)


# ---- caches returned by beam search --------------------------------------------------------------------
def _step(model, cache, tokens):
    with torch.no_grad():
        return model(tokens, **cache_kwargs(cache)).logits[:, -1]


@pytest.mark.parametrize("padded", [False, True], ids=["one-group", "padded-groups"])
def test_a_beam_search_cache_continues_through_select(padded):
    model = tiny()
    x, mask = ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    if padded:
        x[1, :3], mask[1, :3] = 0, 0
    out = model.generate(x, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    cache, nxt = cache_from(out), out.sequences[:1, -1:]
    assert cache.batch_size == 6 and cache.columns == out.sequences.shape[1] - 1
    with pytest.raises(ValueError, match=r"holds 6 sequences but input_ids has batch 1; .*beam search holds "
                                         r"every beam: continue some of them with cache.select\(rows\)"):
        _step(model, cache, nxt)
    before = cache.nbytes, cache.lengths.clone(), repr(cache)
    assert len(cache.groups) == 1                       # padded rows were merged: one ragged state per layer
    assert (cache.to_model_cache().layers[0].schedule is not None) == padded
    every = _step(model, copy.deepcopy(cache), nxt.expand(6, 1))    # all beams, the same next token
    for rows in ([4], [5, 0]):
        torch.testing.assert_close(_step(model, cache.select(rows), nxt.expand(len(rows), 1)), every[rows],
                                   rtol=0, atol=1e-5)
    assert (cache.nbytes, repr(cache)) == (before[0], before[2]) and torch.equal(cache.lengths, before[1])
    with pytest.raises(ValueError, match=r"select: rows must be .* batch rows in \[0, 6\), got \[6\]"):
        cache.select([6])


# ---- torch.compile --------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_model_compiles_prefill_and_decode_once(fresh_dynamo):
    """10 layers (more than dynamo's recompile limit of 8 per function), 8-token chunks: decode steps
    cross chunk boundaries and grow the state without new compiles; outputs equal eager."""
    from torch._dynamo.testing import CompileCounter
    model, counter = tiny(num_layers=10), CompileCounter()
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        out, ref = compiled(ids(1, 20)), model(ids(1, 20))
        prefill_frames = counter.frame_count
        assert prefill_frames <= 10
        compiled(ids(1, 20, seed=5))                                  # a new sequence of the same length
        assert counter.frame_count == prefill_frames
        cache, ref_cache, tok = cache_from(out), cache_from(ref), ref.logits[:, -1:].argmax(-1)
        for step in range(12):                                        # 20 -> 32 tokens: 2 chunk boundaries
            if step == 2:
                warm = counter.frame_count                            # T=1 shapes and a moving position seen
            out, ref = compiled(tok, **cache_kwargs(cache)), model(tok, **cache_kwargs(ref_cache))
            torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
            tok = ref.logits[:, -1:].argmax(-1)
    assert counter.frame_count == warm <= 20
