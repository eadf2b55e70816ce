"""The bench's prose NIAH samples answered by a converted transformers model at a full spec (budget included, run as
written): python hf_niah.py MODEL SAMPLES.jsonl SPEC [split] (context and question in one call, or two with
`split`; greedy, 24 tokens or EOS)."""
import json
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.hf_compat import cache_from, cache_kwargs

torch.set_num_threads(1)
model_dir, samples, spec = sys.argv[1:4]
split = len(sys.argv) > 4
tok = tf.AutoTokenizer.from_pretrained(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
rows = [json.loads(line) for line in open(samples)]
score = 0
with torch.no_grad():
    for r in rows:
        if split:
            out = m(input_ids=torch.tensor([r["context_ids"]]), use_cache=True, logits_to_keep=1)
            out = m(input_ids=torch.tensor([r["question_ids"]]), use_cache=True, logits_to_keep=1,
                    **cache_kwargs(cache_from(out)))
        else:
            out = m(input_ids=torch.tensor([r["context_ids"] + r["question_ids"]]), use_cache=True, logits_to_keep=1)
        toks = [int(out.logits[0, -1].argmax())]
        while len(toks) < 24 and toks[-1] != tok.eos_token_id:
            out = m(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, **cache_kwargs(cache_from(out)))
            toks.append(int(out.logits[0, -1].argmax()))
        text = tok.decode(toks)
        ok = all(a in text for a in r["answers"])
        score += ok
        print(r["id"], int(ok), repr(text[:30]), flush=True)
print("score", score)
