"""Which of a needle's tokens the reserve holds after a prefill with KVzip-style replay scoring (dev, with
tried/kvzip-replay.patch): python kvzip_slots.py MODEL SPEC S [SAMPLES] (first 2 samples; every third layer)."""
import json
import os
import sys

import torch

model, spec, seg = sys.argv[1:4]
samples = sys.argv[4] if len(sys.argv) > 4 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                             "reserve-scoring-cpu", "niah", "samples-qwen05.jsonl")
sys.argv = ["niah_kvzip.py", model, samples, spec, seg]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import niah_kvzip as nk  # noqa: E402

from kvmeans.models.hf_compat import cache_from  # noqa: E402
from kvmeans.pretrained.cache import ConvertedCacheLayer  # noqa: E402

for line in list(open(samples))[:2]:
    r = json.loads(line)
    ids = r["context_ids"]
    digs = nk.tok(r["answers"][0], add_special_tokens=False)["input_ids"]
    p = [i for i in range(len(ids)) if ids[i:i + len(digs)] == digs][0]
    with torch.no_grad():
        out = nk.prefill(ids)
    layers = [la for la in cache_from(out).layers if isinstance(la, ConvertedCacheLayer)]
    print(r["id"], "needle at", p, "of", len(ids), flush=True)
    for i, la in enumerate(layers):
        st = la.state.parts[0][1]
        pos = st.reserve_pos[0]                                   # [Hkv, R]
        held = [[int(x) for x in sorted(pos[h].tolist()) if p - 2 <= x < p + len(digs)] for h in range(pos.shape[0])]
        if i % 3 == 0:
            print(f" L{i} needle tokens held per kv head: {held}; head 0's first 12 slots: "
                  f"{sorted(int(x) for x in pos[0].tolist())[:12]}, slot scores "
                  f"{st.reserve_score[0, 0].min():.3f}..{st.reserve_score[0, 0].max():.3f}", flush=True)
