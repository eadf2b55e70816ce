"""Per NIAH sample: the needle's token span, whether a block boundary cuts it, whether it is still in the window,
and the runs' verdicts: python straddle.py MODEL CHUNK WINDOW RUN.json [RUN.json ...]"""
import json
import sys

from transformers import AutoTokenizer

from kvmeans.pretrained.bench import niah_samples

path, C, W = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
runs = [{a["id"]: a["correct"] for a in json.load(open(f))["answers"] if a["arm"].startswith("kvm")}
        for f in sys.argv[4:]]
tally = {}
for s in niah_samples(tok, 20, 1024):
    enc = tok(s["context"], return_offsets_mapping=True, add_special_tokens=False)
    val = s["answers"][0]
    c = s["context"].find(val)
    nd = [j for j, (a, b) in enumerate(enc["offset_mapping"]) if a < c + len(val) and b > c]
    T = len(s["context_ids"])
    first_window = -(-T // C) * C - W          # first token still exact in the window after the context
    cut = nd[0] // C != nd[-1] // C
    where = "window" if nd[0] >= first_window else ("cut" if cut else "whole")
    marks = " ".join("Y" if r[s["id"]] else "." for r in runs)
    tally.setdefault(where, []).append([r[s["id"]] for r in runs])
    print(f"{s['id']:14s} depth {s['depth']:>4} needle {nd[0]}..{nd[-1]} T={T} {where:6s} {marks}")
for where, v in tally.items():
    print(where, len(v), "correct per run:", [sum(x[i] for x in v) for i in range(len(runs))])
