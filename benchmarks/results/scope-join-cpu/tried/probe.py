"""The scope probe alone on a model at its automatic split, with scope-probe.patch applied to kvmeans: python probe.py
MODEL SPLIT"""
import sys
import time

import torch
import transformers as tf

import kvmeans
from kvmeans.models.load import load_hf_tokenizer
from kvmeans.pretrained.calibrate import calibration_windows, probe_scope, split_named, split_settings

torch.set_num_threads(1)
tok = load_hf_tokenizer(sys.argv[1])
m = tf.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
t0 = time.time()
got = probe_scope(m, split_settings(split_named(sys.argv[2]), 260), convert=kvmeans.convert_hf,
                  windows=calibration_windows(tok), tokenizer=tok)
print(sys.argv[1].rstrip("/").split("/")[-1], got, f"{time.time() - t0:.0f} s", flush=True)
