"""Window perplexity of the automatic split with and without per-head budgets (exact_heads=copy) on the quality
protocol's cells (the windows `kvmeans bench quality` reads, seed 0): python ppl_heads.py MODEL SPLIT LENGTH N
CORPUS..."""
import json
import math
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.load import load_hf_tokenizer
from kvmeans.pretrained.arms import Arm, run_windows
from kvmeans.pretrained.calibrate import split_named, split_settings
from kvmeans.pretrained.quality import cell_windows, kept_keys
from kvmeans.utils.modules import copy_sharing_weights

torch.set_num_threads(1)
model_dir, split, length, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = load_hf_tokenizer(model_dir)
plain = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
keys = kept_keys(length, 0.125)
settings = split_settings(split_named(split), keys)
arms = [Arm("uniform", kvmeans.convert_hf(copy_sharing_weights(plain), **settings)),
        Arm("heads", kvmeans.convert_hf(copy_sharing_weights(plain), **settings, exact_heads="copy"))]
cache = {}
for corpus in sys.argv[5:]:
    ids = cell_windows(tok, corpus, length, n, 0, cache)
    res = run_windows(arms, ids)
    print(json.dumps({"model": model_dir.rstrip("/").split("/")[-1], "corpus": corpus, "length": length, "keys": keys,
                      "split": split, **{a.name: round(math.exp(r[0].mean().item()), 4) for a, r in zip(arms, res)}}),
          flush=True)
