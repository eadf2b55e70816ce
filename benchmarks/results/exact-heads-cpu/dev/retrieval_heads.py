"""Per kv head copy score on built-in text (dev): a passage of the built-in plays and the passage again; for each
layer and kv head, the mean over the second copy's queries of the attention (most over the kv group's heads) on the
first copy's token that comes next (what a retrieval / induction head reads). python retrieval_heads.py MODEL OUT.pt
[PASSAGE]"""
import sys

import torch
import transformers as tf

from kvmeans.pretrained.calibrate import _plays

torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 384
tok = tf.AutoTokenizer.from_pretrained(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
text = _plays()
ids = tok(text[len(text) // 3:len(text) // 3 + 8 * n], add_special_tokens=False)["input_ids"][:n]
x = torch.tensor([ids + ids])
with torch.no_grad():
    att = m(input_ids=x, output_attentions=True).attentions          # per layer [1, H, 2n, 2n]
Hkv = m.config.num_key_value_heads
scores = []
for a in att:
    H = a.shape[1]
    q = torch.arange(n, 2 * n - 1)                                     # second copy's queries
    w = a[0, :, q, q - n + 1]                                           # [H, n-1]: on the next token of the first copy
    scores.append(w.reshape(Hkv, H // Hkv, -1).amax(1).mean(-1))       # [Hkv]
s = torch.stack(scores)                                                 # [layers, Hkv]
torch.save(s, out)
for i, r in enumerate(s):
    print(i, [round(float(v), 3) for v in r])
