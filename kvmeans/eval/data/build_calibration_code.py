"""Build ``calibration_code.json.gz``: the frozen Python-source text of the automatic conversion's calibration pass.

    python kvmeans/eval/data/build_calibration_code.py [GIT_REF]      (default df7be91)

The text is kvmeans' own ``kvmeans/**/*.py`` at ``GIT_REF``, files in path order (by path components, as
``sorted(Path.rglob)`` orders them), joined by blank lines and cut to ``CHARS`` characters. Frozen so that the
settings ``convert_hf(model)`` picks do not move when the package's code is edited (they did: the calibration read
the installed source). A rebuild at the same ref is byte-identical (gzip without a timestamp).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path, PurePosixPath

CHARS = 400_000
OUT = Path(__file__).with_name("calibration_code.json.gz")


def build(ref: str = "df7be91") -> dict:
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parent).stdout.strip()
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref, "kvmeans"], capture_output=True, text=True,
                           check=True, cwd=root).stdout.split()
    files = sorted((n for n in names if n.endswith(".py")), key=lambda n: PurePosixPath(n).parts)
    text = "\n\n".join(subprocess.run(["git", "show", f"{ref}:{n}"], capture_output=True, text=True, check=True,
                                      cwd=root).stdout for n in files)[:CHARS]
    commit = subprocess.run(["git", "rev-parse", ref], capture_output=True, text=True, check=True,
                            cwd=root).stdout.strip()
    return {"name": "kvmeans Python source, frozen for calibration", "commit": commit,
            "source": f"kvmeans git {commit}, kvmeans/**/*.py",
            "license": "this repository's", "chars": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "text": text}


def write(doc: dict, path: Path = OUT) -> None:
    raw = json.dumps(doc, ensure_ascii=False, sort_keys=True).encode("utf-8")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw)
    tmp.replace(path)


if __name__ == "__main__":
    write(build(*sys.argv[1:2]))
    print(f"wrote {OUT}")
