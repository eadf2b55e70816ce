"""Per sample: where the needle's value tokens lie against 16-token blocks and the window at the end (``W``
tokens, default 192): whole in one block, cut by a block boundary, or still in the window.
python cut.py MODEL SAMPLES.jsonl"""
import json
import os
import sys

from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
C, W = 16, int(os.environ.get("W", 192))
for line in open(sys.argv[2]):
    r = json.loads(line)
    ids = r["context_ids"] + r["question_ids"]
    T = len(ids)
    ans = r["answers"][0]
    for i in range(len(r["context_ids"])):      # the first token holding the answer's first digit that starts it
        if ans[0] in tok.decode(ids[i:i + 1]):
            j = i
            while j < len(ids) and ans not in tok.decode(ids[i:j + 1]):
                j += 1
            if j < len(ids) and ans in tok.decode(ids[i:j + 1]):
                break
    end = (T // C) * C - (W - C)      # roughly: tokens before this are out of the window at the end
    kind = "window" if i >= end else ("cut" if i // C != j // C else "whole")
    print(r["id"], (i, j), kind, f"cut at {(j // C) * C}" if kind == "cut" else "")
