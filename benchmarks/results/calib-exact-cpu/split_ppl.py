"""Dev script: window / continuation perplexity of one calibration split on the windows of a `bench quality` run
(its windows.jsonl), against that run's full-attention rows (quality.json). Usage:
python split_ppl.py MODEL_DIR RUN_DIR SPLIT OUT.json [THREADS]"""
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import kvmeans
from kvmeans.pretrained.calibrate import split_named, split_settings
from kvmeans.pretrained.nll import token_nll
from kvmeans.pretrained.quality import continuation_len
from kvmeans.utils.modules import copy_sharing_weights

model_dir, run, split, out = sys.argv[1:5]
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
recs = [json.loads(line) for line in open(Path(run) / "windows.jsonl")]
rows = json.load(open(Path(run) / "quality.json"))["rows"]
cells = {}
for r in recs:
    cells.setdefault(r["cell"], []).append(r)
res = {}
for cell, ws in cells.items():
    keys = ws[0]["keys"]
    conv = kvmeans.convert_hf(copy_sharing_weights(plain), **split_settings(split_named(split), keys))
    ids = torch.tensor([w["ids"] for w in ws])
    t0 = time.time()
    nll = torch.cat([token_nll(conv, x[None]) for x in ids])
    tail = continuation_len(ids.shape[1])
    ppl, cont = math.exp(nll.double().mean()), math.exp(nll[:, -tail:].double().mean())
    ref = {r["arm"]: r for r in rows if r["cell"] == cell}
    f, s = ref["full"], ref["streaming"]
    res[cell] = {"split": split, "keys": keys, "ppl": ppl, "ppl_continuation": cont,
                 "x_full": [ppl / f["ppl"], cont / f["ppl_continuation"]],
                 "streaming_x_full": [s["ppl"] / f["ppl"], s["ppl_continuation"] / f["ppl_continuation"]],
                 **{f"{a}_x_full": [ref[a]["ppl"] / f["ppl"], ref[a]["ppl_continuation"] / f["ppl_continuation"]]
                    for a in ref if a.startswith("kvm")}, "seconds": round(time.time() - t0, 1)}
    print(cell, json.dumps(res[cell]), flush=True)
    json.dump(res, open(out, "w"), indent=1)
