"""Where a needle's tokens rank under the reserve's scores, per layer (dev, with tried/replay-surprisal.patch):
python replay_ranks.py MODEL SAMPLES SPEC N (N samples, every fourth layer, ranks of the token before the needle
and its digits among every token scored)."""
import json
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.pretrained import op

torch.set_num_threads(1)
model_dir, samples, spec, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = tf.AutoTokenizer.from_pretrained(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
rec = {}
orig_adv = op._advance
def adv(st, total, *a, **kw):
    if st.buf_att is not None and st.buf_v is not None:
        base = st.seen - st.buf_v.shape[-2]
        d = rec.setdefault(id(st), {})
        for i in range(st.buf_att.shape[-1]):
            d[base + i] = st.buf_att[0, :, i].clone()
    return orig_adv(st, total, *a, **kw)
op._advance = adv
rows = [json.loads(line) for line in open(samples)][:n]
for r in rows:
    rec.clear()
    ids = r["context_ids"] + r["question_ids"]
    ans = tok(" " + r["answers"][0], add_special_tokens=False)["input_ids"]
    # find needle positions: the answer digits in the context
    digs = tok(r["answers"][0], add_special_tokens=False)["input_ids"]
    pos = [i for i in range(len(ids) - len(digs)) if ids[i:i + len(digs)] == digs]
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    print(r["id"], "needle at", pos, [tok.decode([t]) for t in digs])
    for li, (sid, d) in enumerate(rec.items()):
        if not pos:
            break
        P = sorted(d)
        sc = torch.stack([d[p] for p in P]).amax(-1)  # max over kv heads
        order = sc.argsort(descending=True)
        rank = {P[int(o)]: k for k, o in enumerate(order)}
        p0 = pos[0]
        rk = [rank.get(p, -1) for p in range(p0 - 1, p0 + len(digs))]
        if li % 4 == 0:
            top = [(P[int(o)], tok.decode([ids[P[int(o)]]])) for o in order[:8]]
            print(f" L{li} ranks(prev,digits)={rk} of {len(P)}; top={top}")
