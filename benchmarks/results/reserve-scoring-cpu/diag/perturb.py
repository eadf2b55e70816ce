"""The near-tie measurement of docs/serving.md#tests: SmolLM2 converted with SPEC, q/k/v times 1 + EPS noise
(seeded), the first greedy token's top-2 gap on the vLLM suite's 260-token prompt: python perturb.py EPS SEED SPEC"""
import sys

import torch
import transformers as tf

import kvmeans

torch.set_num_threads(2)
TEXT = open("/work/main/tests/serve/test_vllm.py").read().split('TEXT = (')[1].split(')\nLENGTHS')[0]
TEXT = eval("(" + TEXT + ")")
SMOL = "/root/.cache/kvmeans/models/smollm2-135m"
tok = tf.AutoTokenizer.from_pretrained(SMOL)
ids = tok(TEXT, add_special_tokens=False)["input_ids"][:260]
m = tf.AutoModelForCausalLM.from_pretrained(SMOL, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(sys.argv[3]))
eps = float(sys.argv[1])
g = torch.Generator().manual_seed(int(sys.argv[2]))
if eps:
    for layer in m.model.layers:
        for p in (layer.self_attn.k_proj, layer.self_attn.q_proj, layer.self_attn.v_proj):
            p.register_forward_hook(lambda mod, a, out: out * (1 + eps * torch.randn(out.shape, generator=g)))
with torch.no_grad():
    out = m(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    top = out.logits[0, -1].topk(2)
    print("eps", eps, "first-token margin", round(float(top.values[0] - top.values[1]), 5))
