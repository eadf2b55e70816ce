"""RULER scores (kvpress / RULER's string_match_all: the share of a sample's answers found in its prediction, x100,
averaged over samples) per task, arm and ratio from `kvmeans bench pretrained` bench.json files (or kvpress.json
files of benchmarks/kvpress/run_kvpress.py on the same samples.jsonl), side by side:
python summarize.py [LABEL=]bench.json ... (the samples.jsonl beside each file, or else those beside the files
before it; every answer's sample sha256 is checked; a LABEL prefixes that file's arms, e.g.
first-join=q05-4k-first-join/bench.json)"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from kvmeans.eval import ruler

cells = defaultdict(list)
seen = {}                                                   # the samples beside the files so far, by id
for arg in sys.argv[1:]:
    label, _, path = arg.rpartition("=")
    bench = json.loads(Path(path).read_text())
    beside = Path(path).with_name("samples.jsonl")
    if beside.exists():
        seen.update({s["id"]: s for s in map(json.loads, beside.read_text().splitlines())})
    samples = seen
    for a in bench["answers"] if "answers" in bench else bench["samples"]:     # bench.json / kvpress.json
        s = samples[a["id"]]
        assert s["sha256"] == a["sha256"], f"{path}: {a['id']} ran other token ids than {beside}"
        _, per = ruler.string_match_all([a["pred"]], [s["answers"]])
        arm = f"{label} {a['arm']}" if label and a["arm"] != "full" else a["arm"]
        cells[(s["bench"], arm, a["ratio"])].append(per[0])
arms = sorted({(arm, r) for _, arm, r in cells}, key=lambda x: (x[0] != "full", x[1] or 0, x[0]))
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
    n = max(len(cells.get((t, *a), [])) for a in arms)
    print(f"| {t} | {n} | " + " | ".join(row) + " |")
mean = [f"**{sum(means[a]) / len(means[a]):.1f}** ({len(means[a])} tasks)" for a in arms]
print("| **mean** | | " + " | ".join(mean) + " |")
