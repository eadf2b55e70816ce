"""Prose NIAH with KVzip's scoring in bounded memory (dev): the context prefilled in segments of S tokens; after
each, the segment is replayed after a "repeat" prompt on a snapshot of the cache, each converted layer records the
most attention any replay query gave each buffered token, and the snapshot is restored with those scores
(``exact_rank=kvzip``: the reserve keeps the tokens with the highest). python niah_kvzip.py MODEL SAMPLES SPEC S"""
import json
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.hf_compat import cache_from, cache_kwargs
from kvmeans.pretrained import op
from kvmeans.pretrained.cache import ConvertedCacheLayer

torch.set_num_threads(1)
model_dir, samples, spec, S = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = tf.AutoTokenizer.from_pretrained(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
prompt = tok("\n\nRepeat the previous context exactly.\n", add_special_tokens=False)["input_ids"]


def prefill(ids):
    out = None
    for a in range(0, len(ids), S):
        seg = ids[a:a + S]
        kw = {} if out is None else cache_kwargs(cache_from(out))
        out = m(input_ids=torch.tensor([seg]), use_cache=True, logits_to_keep=1, **kw)
        cache = cache_from(out)
        layers = [la for la in cache.layers if isinstance(la, ConvertedCacheLayer)]
        saved = [(la.state.columns, [(r, st.copy()) for r, st in la.state.parts]) for la in layers]
        op._REPLAY.update(on=True, scores=[])
        m(input_ids=torch.tensor([prompt + seg]), use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        op._REPLAY["on"] = False
        assert len(op._REPLAY["scores"]) == len(layers), (len(op._REPLAY["scores"]), len(layers))
        for la, (cols, parts), sc in zip(layers, saved, op._REPLAY["scores"]):
            la.state.columns, la.state.parts = cols, parts
            st = parts[0][1]
            assert st.buf_att.shape == sc.shape, (st.buf_att.shape, sc.shape)
            st.buf_att = torch.maximum(st.buf_att, sc.to(st.buf_att.dtype))
    return out


if __name__ == "__main__":
    score = 0
    with torch.no_grad():
        for line in open(samples):
            r = json.loads(line)
            out = prefill(r["context_ids"])
            out = m(input_ids=torch.tensor([r["question_ids"]]), use_cache=True, logits_to_keep=1,
                    **cache_kwargs(cache_from(out)))
            toks = [int(out.logits[0, -1].argmax())]
            while len(toks) < 24 and toks[-1] != tok.eos_token_id:
                out = m(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, **cache_kwargs(cache_from(out)))
                toks.append(int(out.logits[0, -1].argmax()))
            text = tok.decode(toks)
            ok = all(a in text for a in r["answers"])
            score += ok
            print(r["id"], int(ok), repr(text[:30]), flush=True)
    print("score", score)
