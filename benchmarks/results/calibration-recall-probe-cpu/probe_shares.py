"""Tail and recall-probe perplexity of every calibration candidate (and two window-heavier ones) at each kept-keys
setting: ``python probe_shares.py MODEL_DIR LENGTH KEYS...``. Needs commit 0003f24 with calibrate-recall-probe.diff
applied (``with_probes`` and the recall score in ``kvmeans.pretrained.calibrate``); one JSON line per KEYS."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmeans import convert_hf
from kvmeans.pretrained.calibrate import (
    CANDIDATES,
    PROBE_PREFIX,
    PROBE_SPAN,
    PROBES,
    Split,
    calibrate,
    calibration_windows,
)

torch.set_num_threads(1)
path, length, keys_list = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
win = calibration_windows(tok, length)
extra = (Split(16, 0.9375, 0.0), Split(16, 0.9375, 0.5))
for keys in keys_list:
    t = time.time()
    with torch.no_grad():
        r = calibrate(model, keys, convert=convert_hf, windows=win, candidates=CANDIDATES + extra, progress=False)
    total = length + PROBES * (PROBE_PREFIX + PROBE_SPAN)
    print(json.dumps({"keys": keys, "share": round(keys / total, 3), "chosen": r["calibration"]["chosen"],
                      "cands": r["calibration"]["candidates"], "s": round(time.time() - t)}), flush=True)
