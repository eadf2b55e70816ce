"""Scratch: tail ppl (calibration windows) and a retrieval probe (needle in the built-in plays) per split."""
import json
import math
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.calibrate import Split, _plays, _tail_nll, calibration_windows, split_settings
from kvmeans.pretrained.nll import token_nll
from kvmeans.utils.modules import copy_sharing_weights

torch.set_num_threads(1)
path, out = sys.argv[1], sys.argv[2]
names = sys.argv[3].split(",") if len(sys.argv) > 3 else None
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
K = 260
NAMES = ["Orsino", "Beatrice", "Malvolio", "Perdita", "Leontes", "Imogen", "Camillo", "Rosalind"]
DEPTHS = [0.1, 0.3, 0.5, 0.7]

def probes(length=1024, seed=0):
    rng = random.Random(seed)
    enc = lambda s: tok(s, add_special_tokens=False).input_ids
    plays = enc(_plays()[:200_000])
    rows, masks = [], []
    for i, d in enumerate(DEPTHS):
        name, code = NAMES[i], str(rng.randint(10**6, 10**7 - 1))
        needle = enc(f"\nThe combination of {name}'s safe is {code}.\n")
        q = enc(f"\nWhat is the combination of {name}'s safe? The combination of {name}'s safe is")
        a = enc(f" {code}")
        n_hay = length - len(needle) - len(q) - len(a)
        off = 3000 + i * 1500
        hay = plays[off:off + n_hay]
        p = int(d * n_hay)
        ids = hay[:p] + needle + hay[p:] + q + a
        m = [0] * (len(ids) - len(a)) + [1] * len(a)
        rows.append(ids)
        masks.append(m)
    return torch.tensor(rows), torch.tensor(masks, dtype=torch.bool)

P, M = probes()
def probe_score(m):
    nll = token_nll(m, P)                  # [N, T-1]: nll[:, t] predicts token t+1
    mask = M[:, 1:]
    per = [(nll[i][mask[i]]).mean().item() for i in range(len(P))]
    return sum(per) / len(per), per

W = calibration_windows(tok, 1024)
res = {}
t0 = time.time()
full_probe = probe_score(model)
res["full"] = {"probe": full_probe[0], "per": full_probe[1], "tail": math.exp(_tail_nll(model, W, K))}
print("full", res["full"], flush=True)
cands = [Split(32, 0.5, e) for e in (0.0, 0.25, 0.5, 0.75)] + [Split(32, 0.75, e) for e in (0.0, 0.25, 0.5, 0.75)] + \
        [Split(16, 0.875, e) for e in (0.0, 0.45)] + [Split(32, 0.25, e) for e in (0.5, 0.75)]
for s in cands:
    if names and s.name not in names:
        continue
    st = split_settings(s, K)
    trial = kvmeans.convert_hf(copy_sharing_weights(model), **st)
    pr = probe_score(trial)
    res[s.name] = {"probe": pr[0], "per": pr[1], "tail": math.exp(_tail_nll(trial, W, K)), "exact": st["exact_rows"],
                   "budget": str(st["budget"]), "n": st["n_bswa_chunks"]}
    print(s.name, res[s.name], round(time.time() - t0), flush=True)
    json.dump(res, open(out, "w"), indent=1)
