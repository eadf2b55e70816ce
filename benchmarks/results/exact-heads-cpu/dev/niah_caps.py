"""Prose NIAH with per-kv-head reserve caps from a retrieval-head calibration (dev): python niah_caps.py MODEL
SAMPLES SPEC SCORES.pt FLOOR RMAX [uniform]. SPEC's exact_rows is the mean slots per kv head R; the total R x heads
is shared: each head gets FLOOR, the rest in proportion to its copy score, at most RMAX (water-filled); the op runs
with exact_rows=RMAX (dead slots beyond a head's cap) and the pool budget of SPEC."""
import json
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.hf_compat import cache_from, cache_kwargs
from kvmeans.ops.budget import StateBudget
from kvmeans.pretrained import op

torch.set_num_threads(1)
model_dir, samples, spec, scores_pt, floor, rmax = sys.argv[1:7]
floor, rmax = int(floor), int(rmax)
uniform = len(sys.argv) > 7
kw = kvmeans.parse_kvm_spec(spec)
R = kw["exact_rows"]
budget = int(str(kw["budget"]).split(":")[-1]) if not hasattr(kw["budget"], "n") else kw["budget"].n
s = torch.load(scores_pt)                               # [layers, Hkv]
total = R * s.numel()


def allocate(s, total, floor, rmax):
    w = s.flatten().double()
    caps = torch.full_like(w, float(floor))
    free = torch.ones_like(w, dtype=torch.bool)
    left = total - caps.sum()
    for _ in range(50):                                 # water-filling: proportional, clipped at rmax
        if left <= 0 or not free.any():
            break
        add = left * w * free / (w * free).sum()
        caps = torch.minimum(caps + add, torch.full_like(caps, float(rmax)))
        free = caps < rmax - 1e-9
        left = total - caps.sum()
    caps = caps.floor().long()
    return caps.view_as(s)


caps = torch.full_like(s, R, dtype=torch.long) if uniform else allocate(s, total, floor, rmax)
print("caps per layer:", caps.tolist(), "total", int(caps.sum()), "of", total, flush=True)
pool = budget - R
kw["exact_rows"], kw["budget"] = rmax, StateBudget.fixed(pool + rmax)
tok = tf.AutoTokenizer.from_pretrained(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kw)
op._CAPS.update({i: caps[i] for i in range(caps.shape[0])})
score = 0
with torch.no_grad():
    for line in open(samples):
        r = json.loads(line)
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
