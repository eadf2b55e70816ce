"""How well the first converted layer's novelty ranks a block's tokens as the mean over all layers does, on the
calibration text: python agree.py MODEL SPEC -> per block, Spearman of layer 0's scores vs the all-layer mean, and
the overlap of their top quarters; printed as means."""
import sys

import torch
import transformers as tf

import kvmeans
from kvmeans.models.load import load_hf_tokenizer
from kvmeans.pretrained.calibrate import calibration_windows

torch.set_num_threads(1)
model_dir, spec = sys.argv[1], sys.argv[2]
tok = load_hf_tokenizer(model_dir)
m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec + ",exact_scope=model"))
board = next(mod.kvm_board for mod in m.modules() if getattr(mod, "kvm_board", None) is not None)
rec = {}
inner = board.combine


def combine(layer_pos, start, score, rows=None):
    rec.setdefault((rows, start), {})[layer_pos] = score[0, 0].clone()
    return inner(layer_pos, start, score, rows)


board.combine = combine


def ranks(x):
    return x.argsort().argsort().double()


with torch.no_grad():
    for w in calibration_windows(tok):
        m(input_ids=torch.as_tensor(w).view(1, -1)[:, :2048])
sp, top = [], []
for per in rec.values():
    L = len(per)
    first = per[0]
    mean = torch.stack([per[i] for i in range(L)]).mean(0)
    rf, rm = ranks(first), ranks(mean)
    sp.append(torch.corrcoef(torch.stack((rf, rm)))[0, 1].item())
    k = max(1, len(first) // 4)
    top.append(len(set(first.topk(k).indices.tolist()) & set(mean.topk(k).indices.tolist())) / k)
print(f"{model_dir.rstrip('/').split('/')[-1]}: blocks {len(sp)}, layers {L}, spearman(first, mean) "
      f"{sum(sp) / len(sp):.3f}, top-quarter overlap {sum(top) / len(top):.3f}")
