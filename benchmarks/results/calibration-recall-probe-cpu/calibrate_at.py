"""The present calibration pass (no probe) at each kept-keys setting on the built-in 1,024-token windows:
``python calibrate_at.py MODEL_DIR KEYS...``; one JSON line (the calibration record) per KEYS."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmeans import convert_hf
from kvmeans.pretrained.calibrate import calibrate, calibration_windows

torch.set_num_threads(1)
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
win = calibration_windows(tok, 1024)
for keys in [int(k) for k in sys.argv[2:]]:
    with torch.no_grad():
        r = calibrate(model, keys, convert=convert_hf, windows=win, progress=False)
    print(json.dumps({"keys": keys, **r["calibration"]}), flush=True)
