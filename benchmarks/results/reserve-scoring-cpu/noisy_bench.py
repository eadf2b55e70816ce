"""`kvmeans bench pretrained` with every attention layer's q/k/v multiplied by 1 + EPS noise (seeded): how much a
NIAH score moves under last-bit-sized changes. python noisy_bench.py EPS SEED [kvmeans bench pretrained args]"""
import sys

import torch
import transformers

from kvmeans.cli import main

eps, seed = float(sys.argv[1]), int(sys.argv[2])
gen = torch.Generator().manual_seed(seed)
load = transformers.AutoModelForCausalLM.from_pretrained.__func__


def noisy(cls, *args, **kwargs):
    model = load(cls, *args, **kwargs)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.register_forward_hook(lambda mod, a, out: out * (1 + eps * torch.randn(out.shape, generator=gen)))
    return model


transformers.AutoModelForCausalLM.from_pretrained = classmethod(noisy)
sys.exit(main(["bench", "pretrained", *sys.argv[3:]]))
