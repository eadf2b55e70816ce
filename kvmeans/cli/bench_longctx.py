"""``kvmeans bench longctx``: peak memory, time to first token, prefill and decode speed and cache bytes of a
transformers model at long context, full attention vs StreamingLLM vs KVM, each run in its own process (see
:mod:`kvmeans.bench.longctx`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from kvmeans.bench.longctx import DEFAULT_ARMS, DEFAULT_LENGTHS, DTYPES, LongctxConfig, parse_arms, rows_table, run

EPILOG = f"""\
arms (one argument each: a kvm spec has commas of its own, so the arms are not one comma list):
  full             the model as is: one forward over the prompt, its own KV cache
  streaming:S+W    StreamingLLM: S sink tokens + the last W tokens; prefilled in --segment segments, the cache
                   evicted after every forward
  kvm:SPEC         kvmeans.convert_hf with SPEC (the grammar of --kvm; prefill_segment defaults to --segment)
default: --arms {' '.join(DEFAULT_ARMS)}

--model config:NAME builds random weights from a config.json (memory and speed do not depend on the weights):
NAME is a folder holding a config.json, or a model fetched with `kvmeans models fetch NAME`.

Each (arm, length) runs in a fresh Python process; a run killed by the OOM killer, raising MemoryError or giving
no result within --timeout is reported (oom / timeout) and the longer lengths of that arm are skipped."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmeans bench longctx", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Long context in bounded memory: peak RSS, time to first token, prefill "
                                            "tok/s, decode ms/token and tok/s, cache bytes per arm and length; "
                                            "writes longctx.csv, longctx.json, longctx.png")
    p.add_argument("--model", required=True, metavar="DIR|config:NAME",
                   help="a transformers model folder, or config:DIR_OR_NAME for random weights from its config.json")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), metavar="N",
                   help=f"prompt lengths in tokens (default {' '.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="ARM",
                   help="full, streaming:S+W, kvm:SPEC, one per argument (see below)")
    p.add_argument("--decode-tokens", type=int, default=16,
                   help="greedy tokens decoded after the prompt (default 16; ms/token: median after the first)")
    p.add_argument("--batch", type=int, default=1, help="prompts run at once (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default float32; auto: as saved)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each run (default: torch's)")
    p.add_argument("--segment", type=int, default=256,
                   help="prefill segment of the streaming arms and of kvm arms whose spec sets no prefill_segment "
                        "(default 256)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed (default 1800)")
    p.add_argument("--generate", action="store_true", help="run model.generate on the prompt instead of a forward "
                   "and a decode loop (batch 1; full and kvm arms): what a user gets with no setting")
    p.add_argument("--interleave", action="store_true", help="decode time only, every arm in one process with their "
                   "steps interleaved (ratios that hold on a shared, noisy machine); writes decode.csv / decode.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of random weights (default 0)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    config = LongctxConfig(model=a.model, out=a.out, arms=parse_arms(a.arms), lengths=a.lengths,
                           decode_tokens=a.decode_tokens, batch=a.batch, dtype=a.dtype, device=a.device,
                           threads=a.threads, segment=a.segment, seed=a.seed, timeout=a.timeout,
                           generate=a.generate)
    if a.interleave:
        from kvmeans.bench.longctx_decode import run_interleaved
        run_interleaved(config, log=lambda msg: print(msg, flush=True))
        print(f"wrote {Path(a.out) / 'decode.csv'}, decode.json")
        return 0
    rows: List[dict] = run(config, log=lambda msg: print(msg, flush=True))
    print(rows_table(rows, config.arms))
    out = Path(a.out)
    png = " and longctx.png" if (out / "longctx.png").exists() else ""
    print(f"wrote {out / 'longctx.csv'}, longctx.json{png}")
    return 0
