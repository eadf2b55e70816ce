"""The needle's surprisal (-log p of each token under full attention) against the context's: python
needle_surprisal.py MODEL [SAMPLES] (first 3 samples)."""
import json
import os
import sys

import torch
import transformers as tf

torch.set_num_threads(1)
model = sys.argv[1]
samples = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                             "reserve-scoring-cpu", "niah", "samples-qwen05.jsonl")
tok = tf.AutoTokenizer.from_pretrained(model)
m = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
for line in list(open(samples))[:3]:
    r = json.loads(line)
    ids = torch.tensor([r["context_ids"]])
    with torch.no_grad():
        lp = m(input_ids=ids).logits.log_softmax(-1)
    s = -lp[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)          # s[i]: surprisal of token i + 1
    digs = tok(r["answers"][0], add_special_tokens=False)["input_ids"]
    flat = ids[0].tolist()
    p = [i for i in range(len(flat)) if flat[i:i + len(digs)] == digs][0]
    ns = s[p - 1:p - 1 + len(digs)]
    print(r["id"], "needle surprisal", [round(float(x), 2) for x in ns], "percentile",
          [round(float((s < x).float().mean()), 2) for x in ns], "median", round(float(s.median()), 2))
