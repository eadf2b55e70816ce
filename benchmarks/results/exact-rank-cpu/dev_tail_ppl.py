"""Tail perplexity on the calibration text (built-in plays + kvmeans' Python source) per split and reserve ranking.

    python dev_tail_ppl.py MODEL_DIR [RANK[,RANK]]      (default ranks: novelty,attention)

Prints the full model's tail perplexity, then one JSON line per (split, ranking): the kept keys are 260, the
splits those of the calibration pass (``kvmeans/pretrained/calibrate.py``), the text 2 windows of 1,024 tokens of
each of its two texts. The logs in this folder ran it with the split list below at the time of each log (the
first logs with six splits, the later ones with the last two).
"""
import json
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmeans.pretrained.calibrate import Split, _tail_nll, calibration_windows, split_settings
from kvmeans.pretrained.convert import convert_hf
from kvmeans.utils.modules import copy_sharing_weights

KEYS = 260
SPLITS = [Split(32, 0.75, 0.5), Split(16, 0.875, 0.45)]


def main(path: str, ranks) -> None:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = calibration_windows(AutoTokenizer.from_pretrained(path), 1024, per_text=2)
    print("full", math.exp(_tail_nll(model, windows, KEYS)), flush=True)
    for split in SPLITS:
        for rank in ranks:
            t0 = time.time()
            settings = split_settings(split, KEYS)
            trial = convert_hf(copy_sharing_weights(model), **settings, exact_rank=rank)
            ppl = math.exp(_tail_nll(trial, windows, KEYS))
            print(json.dumps({"split": split.name, "rank": rank, "exact": settings["exact_rows"],
                              "tail_ppl": round(ppl, 4), "s": round(time.time() - t0)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ("novelty", "attention"))
