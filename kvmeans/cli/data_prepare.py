"""``kvmeans data prepare``: tokenize files into a token file (see :mod:`kvmeans.train.prepare`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from kvmeans.train.prepare import prepare_tokens
from kvmeans.utils.args import UsageError, check_out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvmeans data prepare --input PATH... --out DIR [...]`` (``--help`` lists the options)."""
    p = argparse.ArgumentParser(prog="kvmeans data prepare", description="Tokenize text into train.bin / val.bin "
                                "token files (documents separated by EOS; document-level train/val split).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="'builtin[:play|act|scene]', files, folders (*.txt, *.md, *.jsonl), JSONL files, "
                        "or local `datasets` names")
    p.add_argument("--out", required=True, help="output folder for train.bin, val.bin, tokenizer.json")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 | builtin | PATH/tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of --tokenizer builtin")
    p.add_argument("--packing", choices=["concat", "cram"], default="concat",
                   help="concat: documents joined by EOS; cram: the authors' fixed windows (drops tokens)")
    p.add_argument("--seq-len", type=int, default=8192, help="cram window is seq-len + 1 tokens")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out")
    p.add_argument("--text-field", default="text", help="JSONL / dataset field holding the text")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val document split")
    a = p.parse_args(argv)
    check_out_dir("--out", a.out)
    if not 0 <= a.val_fraction < 1:
        raise UsageError(f"--val-fraction must be in [0, 1), got {a.val_fraction}")
    if a.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {a.seq_len}")
    try:
        prepare_tokens(a.input, a.out, a.tokenizer, packing=a.packing, seq_len=a.seq_len,
                       val_fraction=a.val_fraction, seed=a.seed, text_field=a.text_field, vocab_size=a.vocab_size)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"kvmeans data prepare: error: {e}", file=sys.stderr)
        return 2
    return 0
