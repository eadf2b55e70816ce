"""``kvmeans bench ragged``: generate on prompts of distinct lengths vs equal lengths (see
:mod:`kvmeans.bench.ragged`)."""
from __future__ import annotations

import argparse
from typing import List, Optional

from kvmeans.bench.ragged import DEFAULT_LENGTHS, run


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvmeans bench ragged", description="Greedy generate on prompts of distinct "
                                "lengths vs equal lengths: time ratio and model calls per token")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS, help="prompt lengths of the ragged batch")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median), after one warm-up")
    p.add_argument("--preset", default="tiny-cpu", help="model preset (kvmeans.models.preset)")
    a = p.parse_args(argv)
    run(a.lengths, a.new_tokens, a.repeats, a.preset)
    return 0
