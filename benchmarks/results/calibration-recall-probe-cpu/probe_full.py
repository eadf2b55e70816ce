"""Full attention's tail and recall-probe perplexity on the probed calibration windows: ``python probe_full.py
MODEL_DIR`` (commit 0003f24 with calibrate-recall-probe.diff applied)."""
import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmeans.pretrained.calibrate import _scores, calibration_windows

torch.set_num_threads(1)
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
win = calibration_windows(tok, 1024)
with torch.no_grad():
    s = _scores(model, win, 260, 4, 8, 24)
print({k: math.exp(v) for k, v in s.items()})
