"""``kvmeans data corpora [--verify]``: the offline evaluation corpora (:mod:`kvmeans.eval.corpora`): their
table, and with ``--verify`` each installed one loaded and hash-checked."""
from __future__ import annotations

import argparse
import json
from typing import List, Optional

from kvmeans.eval.corpora import CORPORA, CorpusMismatch, CorpusUnavailable, corpus_info, load_corpus


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans data corpora",
                                description="The offline evaluation corpora: source, size, hash.")
    p.add_argument("--verify", action="store_true", help="load every installed corpus and check its hash")
    p.add_argument("--json", action="store_true", help="print corpus_info of each corpus as JSON")
    args = p.parse_args(argv)
    infos = [corpus_info(n) for n in CORPORA]
    if args.json:
        print(json.dumps(infos, indent=1))
        return 0
    bad = 0
    print(f"{'name':12s} {'kind':13s} {'role':9s} {'requirement':32s} {'docs':>5s} {'words':>9s}  status")
    for info in infos:
        status = "installed" if info["installed"] else "missing"
        if args.verify and info["installed"]:
            try:
                load_corpus(info["name"])
                status = "ok"
            except (CorpusMismatch, CorpusUnavailable) as e:
                status, bad = f"FAILED: {e}", bad + 1
        print(f"{info['name']:12s} {info['kind']:13s} {info['role']:9s} {info['requirement']:32s} "
              f"{info['documents']:5d} {info['words']:9d}  {status}")
    return 1 if bad else 0
