"""Prose NIAH with the reserve ranked by an oracle surprisal (full attention's -log p of each token, computed
first; dev, with tried/replay-surprisal.patch): python niah_surprisal.py MODEL SAMPLES SPEC."""
import json
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.hf_compat import cache_from, cache_kwargs
from kvmeans.pretrained import op

torch.set_num_threads(1)
model_dir, samples, spec = sys.argv[1:4]
tok = tf.AutoTokenizer.from_pretrained(model_dir)
full = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
score = 0
with torch.no_grad():
    for line in open(samples):
        r = json.loads(line)
        ids = torch.tensor([r["context_ids"] + r["question_ids"]])
        lp = full(input_ids=ids).logits.log_softmax(-1)
        s = torch.zeros(ids.shape, dtype=torch.float32)
        s[:, 1:] = -lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        s = torch.cat((s, torch.zeros(1, 64)), 1)
        op._SURPRISAL["s"] = s
        out = m(input_ids=ids, use_cache=True, logits_to_keep=1)
        toks = [int(out.logits[0, -1].argmax())]
        while len(toks) < 24 and toks[-1] != tok.eos_token_id:
            out = m(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, **cache_kwargs(cache_from(out)))
            toks.append(int(out.logits[0, -1].argmax()))
        text = tok.decode(toks)
        ok = all(a in text for a in r["answers"])
        score += ok
        print(r["id"], int(ok), repr(text[:30]), flush=True)
print("score", score)
