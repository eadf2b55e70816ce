"""Dev script (not in the package): tail perplexity on the calibration windows and the retrieval probe v3 (one line
'NAME's safe opens with the code NNNNNNN.' in the built-in plays, a paraphrased question) per split, K = 260.
Usage: python probe_v3.py MODEL_DIR OUT.json SPLIT[,SPLIT...] [THREADS]"""
import json
import math
import random
import sys
import time
from typing import Sequence, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.calibrate import Split, _plays, _tail_nll, calibration_windows, split_settings
from kvmeans.pretrained.nll import token_nll
from kvmeans.utils.modules import copy_sharing_weights

PROBE_NAMES = ("Orsino", "Beatrice", "Malvolio", "Perdita", "Leontes", "Imogen", "Camillo", "Rosalind")
PROBE_DEPTHS = (0.1, 0.3, 0.5, 0.7)


def probe_windows(tokenizer, length: int = 1024, depths: Sequence[float] = PROBE_DEPTHS, seed: int = 0
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Retrieval probes: ``(ids [N, length], answer [N, length] bool)``, one per depth. Each is a window of the
    built-in plays with the line "NAME's safe opens with the code NNNNNNN." at ``depth``, then "Question: which
    code opens NAME's safe? Answer: the code is" and the code, whose tokens ``answer`` marks. Seeded, so the same
    tokenizer gives the same probes."""
    rng = random.Random(seed)
    def enc(text):
        return tokenizer(text, add_special_tokens=False).input_ids
    plays = enc(_plays()[:200_000])
    rows, marks = [], []
    for i, depth in enumerate(depths):
        name, code = PROBE_NAMES[i % len(PROBE_NAMES)], str(rng.randint(10 ** 6, 10 ** 7 - 1))
        needle = enc(f"\n{name}'s safe opens with the code {code}.\n")
        question = enc(f"\nQuestion: which code opens {name}'s safe?\nAnswer: the code is")
        answer = enc(f" {code}")
        n_hay = length - len(needle) - len(question) - len(answer)
        start = 3000 + i * 1500
        hay = plays[start:start + n_hay]
        if n_hay < length // 2 or len(hay) < n_hay:
            raise ValueError(f"length={length} is too short for the retrieval probes; give length >= 512")
        cut = int(depth * n_hay)
        ids = hay[:cut] + needle + hay[cut:] + question + answer
        rows.append(ids)
        marks.append([False] * (len(ids) - len(answer)) + [True] * len(answer))
    return torch.tensor(rows), torch.tensor(marks)


def _probe_nll(model, probes: Tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean over the probes of the mean NLL of their answer tokens (teacher-forced)."""
    ids, answer = probes
    nll, mark = token_nll(model, ids), answer[:, 1:].to(ids.device)
    return sum(nll[i][mark[i]].double().mean().item() for i in range(len(ids))) / len(ids)




torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
path, out, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
K = 260
P = probe_windows(tok, 1024)
W = calibration_windows(tok, 1024)
try:
    res = json.load(open(out))
except Exception:
    res = {}
t0 = time.time()
if "full" not in res:
    res["full"] = {"probe": _probe_nll(model, P), "tail": math.exp(_tail_nll(model, W, K))}
    print("full", res["full"], flush=True)
for n in names:
    c, w, e = n.split("-")
    s = Split(int(c[1:]), float(w[1:]), float(e[1:]))
    if s.name in res:
        continue
    st = split_settings(s, K)
    trial = kvmeans.convert_hf(copy_sharing_weights(model), **st)
    res[s.name] = {"probe": _probe_nll(trial, P), "tail": math.exp(_tail_nll(trial, W, K)), "exact": st["exact_rows"]}
    print(s.name, res[s.name], round(time.time() - t0), flush=True)
    json.dump(res, open(out, "w"), indent=1)
