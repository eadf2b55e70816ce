import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.calibrate import calibrate

torch.set_num_threads(1)
path, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
chosen = calibrate(model, convert=kvmeans.convert_hf, tokenizer=tok, progress=False)
json.dump(chosen["calibration"], open(out, "w"), indent=1)
print(json.dumps(chosen["calibration"], indent=1))
