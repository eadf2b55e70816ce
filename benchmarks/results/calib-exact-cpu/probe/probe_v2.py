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
        names = [NAMES[(2 * i + j) % len(NAMES)] for j in range(3)]
        codes = [str(rng.randint(10**6, 10**7 - 1)) for _ in names]
        depths = [d] + [x for x in DEPTHS if x != d][:2]
        needles = [enc(f"\n{n}'s safe opens with the code {c}.\n") for n, c in zip(names, codes)]
        q = enc(f"\nQuestion: which code opens {names[0]}'s safe?\nAnswer: the code is")
        a = enc(f" {codes[0]}")
        n_hay = length - sum(map(len, needles)) - len(q) - len(a)
        off = 3000 + i * 1500
        hay = plays[off:off + n_hay]
        cuts = sorted(zip([int(x * n_hay) for x in depths], needles), key=lambda t: t[0])
        ids, prev = [], 0
        for p, nd in cuts:
            ids += hay[prev:p] + nd
            prev = p
        ids += hay[prev:] + q + a
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
cands = [Split(32, 0.5, 0.25), Split(32, 0.5, 0.75), Split(16, 0.875, 0.45)]
cands += [Split(32, 0.5, e) for e in (0.0, 0.25, 0.5, 0.75)] + [Split(32, 0.75, e) for e in (0.0, 0.25, 0.5, 0.75)]
cands += [Split(16, 0.875, e) for e in (0.0, 0.45)] + [Split(32, 0.25, e) for e in (0.5, 0.75)]
for s in cands:
    if names and s.name not in names or s.name in res:
        continue
    st = split_settings(s, K)
    trial = kvmeans.convert_hf(copy_sharing_weights(model), **st)
    pr = probe_score(trial)
    res[s.name] = {"probe": pr[0], "per": pr[1], "tail": math.exp(_tail_nll(trial, W, K)), "exact": st["exact_rows"],
                   "budget": str(st["budget"]), "n": st["n_bswa_chunks"]}
    print(s.name, res[s.name], round(time.time() - t0), flush=True)
    json.dump(res, open(out, "w"), indent=1)
