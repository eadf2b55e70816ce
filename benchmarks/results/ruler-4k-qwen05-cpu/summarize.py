"""RULER scores (kvpress / RULER's string_match_all: the share of a sample's answers found in its prediction, x100,
averaged over samples) per task, arm and ratio from a `kvmeans bench pretrained` bench.json: python summarize.py
bench.json [samples.jsonl]"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from kvmeans.eval import ruler

bench = json.loads(Path(sys.argv[1]).read_text())
samples_path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(sys.argv[1]).with_name("samples.jsonl")
samples = {s["id"]: s for s in map(json.loads, samples_path.read_text().splitlines())}
cells = defaultdict(list)
for a in bench["answers"]:
    s = samples[a["id"]]
    _, per = ruler.string_match_all([a["pred"]], [s["answers"]])
    cells[(s["bench"], a["arm"], a["ratio"])].append(per[0])
arms = sorted({(arm, r) for _, arm, r in cells}, key=lambda x: (x[0] != "full", x[1] or 0))
tasks = list(dict.fromkeys(t for t, _, _ in cells))
print("| task | n | " + " | ".join(a[0] if a[1] is None else f"{a[0]} {a[1]}" for a in arms) + " |")
print("|---" * (len(arms) + 2) + "|")
means = defaultdict(list)
for t in tasks:
    row = []
    for a in arms:
        v = cells.get((t, *a))
        if v:
            row.append(f"{100 * sum(v) / len(v):.1f}")
            means[a].append(100 * sum(v) / len(v))
        else:
            row.append("-")
    n = len(cells.get((t, "full", None), []))
    print(f"| {t} | {n} | " + " | ".join(row) + " |")
mean = [f"**{sum(means[a]) / len(means[a]):.1f}** ({len(means[a])} tasks)" for a in arms]
print("| **mean** | | " + " | ".join(mean) + " |")
