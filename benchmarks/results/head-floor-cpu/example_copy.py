"""Where a RULER common-words (cwe) answer comes from: for every cwe answer in the bench.json files given, how many
of its words are the real answers, the in-context example's answer (the few-shot list and its answer that RULER puts
before the real list), or neither. python example_copy.py [LABEL=]bench.json ... (the samples.jsonl beside each file,
or else those beside the files before it; sha256-checked)."""
import json
import re
import sys
from pathlib import Path

seen = {}
print("| run | sample | real answers | the example's answer | other words |")
print("|---|---|---|---|---|")
for arg in sys.argv[1:]:
    label, _, path = arg.rpartition("=")
    beside = Path(path).with_name("samples.jsonl")
    if beside.exists():
        seen.update({s["id"]: s for s in map(json.loads, beside.read_text().splitlines())})
    for a in json.loads(Path(path).read_text())["answers"]:
        if not a["id"].startswith("cwe"):
            continue
        s = seen[a["id"]]
        assert s["sha256"] == a["sha256"], f"{path}: {a['id']} ran other token ids"
        example = re.search(r"are: (.*?)\n", s["context"][s["context"].find("Question"):]).group(1)
        example = set(re.findall(r"\d+\. ([\w-]+)", example))
        said = list(dict.fromkeys(re.findall(r"[A-Za-z][\w-]*", a["pred"])))
        real = sum(w in s["answers"] for w in said)
        copied = sum(w in example for w in said)
        other = len(said) - real - copied
        print(f"| {label or path} {a['arm']} {a['ratio']} | {a['id']} | {real} | {copied} | {other} |")
