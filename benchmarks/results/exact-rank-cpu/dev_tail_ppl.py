"""Dev check on the calibration text only (built-in plays + package source): tail ppl per split x exact_rank."""
import sys, math, time, json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvmeans.pretrained.calibrate import Split, split_settings, calibration_windows, _tail_nll
from kvmeans.pretrained.convert import convert_hf
from kvmeans.utils.modules import copy_sharing_weights
torch.set_num_threads(1)
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
win = calibration_windows(tok, 1024, per_text=2)
K = 260
RANKS = sys.argv[2].split(",") if len(sys.argv) > 2 else ("novelty", "attention")
splits = [Split(32, 0.75, 0.5), Split(16, 0.875, 0.45)]
print("full", math.exp(_tail_nll(model, win, K)), flush=True)
for sp in splits:
    for rank in RANKS:
        t0 = time.time()
        try:
            s = split_settings(sp, K)
        except ValueError as e:
            print(sp.name, e); continue
        trial = convert_hf(copy_sharing_weights(model), **s, exact_rank=rank)
        ppl = math.exp(_tail_nll(trial, win, K))
        print(json.dumps({"split": sp.name, "rank": rank, "exact": s["exact_rows"], "tail_ppl": round(ppl, 4), "s": round(time.time()-t0)}), flush=True)
        del trial
