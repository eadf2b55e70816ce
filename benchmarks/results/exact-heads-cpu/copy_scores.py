"""Each kv head's copy score and its slots at a mean of R exact rows, as convert_hf(exact_heads="copy") measures and
shares them: python copy_scores.py MODEL OUT.json [R ...] (default R: 48)."""
import json
import sys

import torch
import transformers as tf

from kvmeans.pretrained.heads import copy_scores, head_caps

torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
rows = [int(r) for r in sys.argv[3:]] or [48]
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
scores = copy_scores(m)
w = torch.tensor(scores, dtype=torch.float64)
record = {"model": model_dir, "copy_scores": [[round(x, 4) for x in r] for r in scores],
          "caps": {str(r): head_caps(w, r).tolist() for r in rows}}
with open(out, "w") as f:
    json.dump(record, f, indent=1)
for i, r in enumerate(scores):
    print(i, [round(x, 3) for x in r], [record["caps"][str(rr)][i] for rr in rows])
