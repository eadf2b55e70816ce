"""Which tokens around a NIAH needle hold a reserve slot, in how many converted layers (a slot matched to a token by the
highest cosine of its key to the layer's pre-RoPE keys): python first_digit.py MODEL SPEC I,J,... (a full spec, budget
included; the bench's 20 prose NIAH samples at 1024 tokens, seed 0)."""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmeans
from kvmeans.pretrained.bench import niah_samples

torch.set_num_threads(1)
path, spec = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
kvmeans.convert_hf(m, **kvmeans.parse_kvm_spec(spec))
cfg = m.config
Hkv, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
caps = {}
for i, layer in enumerate(m.model.layers):
    layer.self_attn.k_proj.register_forward_hook(lambda mod, a, out, i=i: caps.setdefault(i, []).append(out.detach()))
samples = niah_samples(tok, 20, 1024)
for idx in [int(x) for x in sys.argv[3].split(",")]:
    s = samples[idx]
    caps.clear()
    ids = torch.tensor([s["context_ids"]])
    enc = tok(s["context"], return_offsets_mapping=True, add_special_tokens=False)
    val = s["answers"][0]
    c = s["context"].find(val)
    needle = [j for j, (a, b) in enumerate(enc["offset_mapping"]) if a < c + len(val) and b > c]
    span = list(range(needle[0] - 3, needle[-1] + 2))
    with torch.no_grad():
        out = m(ids, use_cache=True, logits_to_keep=1)
    T = ids.shape[1]
    count = {p: 0 for p in span}
    nl = 0
    for i, layer in enumerate(out.past_key_values.layers):
        st = layer.state.parts[0][1]
        if st.reserve_key is None:
            continue
        nl += 1
        k = torch.cat(caps[i], 1)[0].view(T, Hkv, D).transpose(0, 1)
        r = st.reserve_key[0]
        cos = torch.nn.functional.normalize(r, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-1, -2)
        pos = cos.argmax(-1)
        filled = st.reserve_count[0] > 0
        held = set(pos[filled].tolist())
        for p in span:
            count[p] += p in held
    held = " ".join(f"{tok.decode([s['context_ids'][p]])!r}:{count[p]}/{nl}" for p in span)
    print(idx, val, "block", [p // 16 for p in (needle[0], needle[-1])], held, flush=True)
