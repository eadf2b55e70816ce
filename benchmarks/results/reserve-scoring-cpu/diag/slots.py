"""Which tokens hold the reserve's slots after a NIAH context: python slots.py MODEL SPEC N [I,J,...] (the first N
samples, or those indices)"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.bench import niah_samples

torch.set_num_threads(1)
path, spec = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 5
tok = AutoTokenizer.from_pretrained(path)
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
cfg = m.config
Hkv, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
caps = {}
for i, layer in enumerate(m.model.layers):
    layer.self_attn.k_proj.register_forward_hook(lambda mod, a, out, i=i: caps.setdefault(i, []).append(out.detach()))
samples = niah_samples(tok, 20, 1024)
for s in [samples[int(x)] for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else samples[:n]:
    caps.clear()
    ids = torch.tensor([s["context_ids"]])
    enc = tok(s["context"], return_offsets_mapping=True, add_special_tokens=False)
    val = s["answers"][0]
    c = s["context"].find(val)
    needle = [j for j, (a, b) in enumerate(enc["offset_mapping"]) if a < c + len(val) and b > c]
    assert enc["input_ids"] == s["context_ids"], "offsets do not match the ids"
    with torch.no_grad():
        out = m(ids, use_cache=True, logits_to_keep=1)
    T = ids.shape[1]
    hits, pos_all = [], []
    for i, layer in enumerate(out.past_key_values.layers):
        st = layer.state.parts[0][1]
        if st.reserve_key is None:
            continue
        k = torch.cat(caps[i], 1)[0].view(T, Hkv, D).transpose(0, 1)        # [Hkv, T, D] pre-RoPE keys
        r = st.reserve_key[0]                                                  # [Hkv, R, D]
        cos = torch.nn.functional.normalize(r, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-1, -2)
        pos = cos.argmax(-1)                                                   # [Hkv, R]
        filled = st.reserve_count[0] > 0
        held = set(pos[filled].tolist())
        pos_all += pos[0][filled[0]].tolist()
        hits.append(sum(p in held for p in needle))
    quart = torch.tensor(pos_all).float().quantile(torch.tensor([.1, .25, .5, .75, .9])).int().tolist()
    print(f"depth {s['depth']:.0f} T={T} needle tokens {needle[0]}..{needle[-1]} ({len(needle)}); slots holding "
          f"needle tokens per layer: {hits}; slot positions quartiles {quart}", flush=True)
