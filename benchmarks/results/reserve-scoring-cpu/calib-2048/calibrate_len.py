"""Calibration record at another window length: python calibrate_len.py MODEL_DIR OUT.json LENGTH"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.calibrate import calibrate

torch.set_num_threads(1)
path, out, length = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
chosen = calibrate(model, convert=kvmeans.convert_hf, tokenizer=tok, length=length, progress=False)
json.dump(chosen["calibration"], open(out, "w"), indent=1)
print(json.dumps(chosen["calibration"], indent=1))
