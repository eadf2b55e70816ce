"""``kvmeans eval lm-eval``: lm-eval's command line with the ``kvm`` model registered
(:mod:`kvmeans.eval.harness`).

Arguments are checked here, before lm-eval, transformers and the model are imported (seconds):
``--model DIR`` is shorthand for ``--model kvm --model_args pretrained=DIR``, ``--kvm SPEC`` for
``--model_args kvm="SPEC"`` (convert a plain transformers folder after loading), and a ``--model`` or
``pretrained=`` that names no folder, or a bad spec, is a one-line error.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

from kvmeans.utils.args import UsageError, parse_budget_arg, parse_kvm_arg

__all__ = ["MODEL_NAME", "main", "translate_args"]

MODEL_NAME = "kvm"              # = kvmeans.eval.harness.MODEL_NAME (importing it would import lm-eval)


def translate_args(argv: Sequence[str]) -> List[str]:
    """lm-eval arguments with kvmeans' conveniences: ``--model DIR`` -> ``--model kvm --model_args
    pretrained=DIR``; ``--kvm SPEC`` -> ``--model_args kvm="SPEC"`` and ``--budget SPEC`` -> ``--model_args
    budget=SPEC`` (checked here); no ``--model`` ->
    ``--model kvm``; ``ls`` / ``validate`` pass through."""
    argv = list(argv)
    if argv and argv[0] in ("ls", "validate"):
        return argv
    head = ["run"] if argv and argv[0] == "run" else []
    rest = argv[len(head):]
    out: List[str] = []
    model_seen = False
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, val = a.partition("=")
        if name in ("--model", "-M"):
            model_seen = True
            if not eq:
                if i + 1 >= len(rest):
                    raise UsageError("--model needs a value (kvm, or a model directory)")
                val = rest[i + 1]
                i += 1
            if os.path.isdir(val):
                out += ["--model", MODEL_NAME, "--model_args", f"pretrained={val}"]
            elif "/" in val or os.sep in val or val.startswith((".", "~")) or os.path.exists(val):
                raise UsageError(f"--model {val}: not a directory; give the folder of a saved KVM model "
                                 "(or an lm-eval model name such as kvm)")
            else:
                out += ["--model", val]
        elif name in ("--kvm", "--budget"):
            if not eq:
                if i + 1 >= len(rest):
                    raise UsageError(f"{name} needs a value, e.g. {name} " +
                                     ("budget=fixed:128,chunk_len=32" if name == "--kvm" else "power_law:16:0.5:256"))
                val = rest[i + 1]
                i += 1
            if name == "--kvm":
                parse_kvm_arg(val)
                out += ["--model_args", f'kvm="{val}"']
            else:
                parse_budget_arg(val)
                out += ["--model_args", f"budget={val}"]
        else:
            out.append(a)
        i += 1
    if not model_seen and not any(a in ("-h", "--help") for a in rest):
        out = ["--model", MODEL_NAME] + out
    return ["run"] + out if (head or out) else out


def _check_pretrained(args: Sequence[str]) -> None:
    """A :class:`UsageError` when the ``kvm`` model's ``pretrained=`` is not a folder, or has no tokenizer and no
    ``tokenizer=`` is given (before lm-eval starts)."""
    opts = {}
    for i, a in enumerate(args):          # the last value of each --name value / --name=value
        name, eq, val = a.partition("=")
        if name.startswith("--"):
            opts[name] = val if eq else (args[i + 1] if i + 1 < len(args) else "")
    if opts.get("--model") != MODEL_NAME or opts.get("--model_args", "").lstrip().startswith("{"):
        return
    items = (item.partition("=") for item in opts.get("--model_args", "").split(","))
    model_args = {k.strip(): v.strip() for k, _, v in items}
    path = model_args.get("pretrained")
    if path is not None and not os.path.isdir(path):
        raise UsageError(f"--model_args pretrained={path}: not a directory; give the folder of a saved KVM model")
    if path is not None and "tokenizer" not in model_args:
        from kvmeans.train.tokenizers import model_tokenizer
        try:
            model_tokenizer(path)
        except FileNotFoundError as err:
            why = " ".join(str(err).split())      # transformers' reason spans lines
            raise UsageError(f"--model_args pretrained={path}: {why}; pass tokenizer=PATH in --model_args") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run lm-eval's command line with the ``kvm`` model registered (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans eval lm-eval [--model DIR | --model kvm --model_args pretrained=DIR,...] "
              "--tasks T [T ...] [lm-eval run options]\n\n"
              "Runs lm-evaluation-harness (`lm-eval run`) with the `kvm` model type registered.\n"
              "  --model DIR        shorthand for --model kvm --model_args pretrained=DIR\n"
              "  --kvm SPEC         convert a plain transformers model folder after loading (kvmeans.parse_kvm_spec)\n"
              "  --budget SPEC      KVM models: another state schedule than the saved one, e.g. power_law:16:0.5:256\n"
              "  --model_args ...   pretrained=DIR, dtype=float32, tokenizer=PATH, max_length=N, device=cpu\n"
              "  --include_path P   extra task YAMLs (e.g. local tasks, no download)\n"
              "All other options are lm-eval's: see `kvmeans eval lm-eval run --help`.\n"
              "Note: plain `lm_eval --model kvm` does not work (lm-eval 0.4.x loads no plug-ins).")
        return 0
    args = translate_args(argv)
    _check_pretrained(args)
    from lm_eval.__main__ import cli_evaluate

    from kvmeans.eval import harness  # noqa: F401  (registers the kvm model)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:     # argparse errors / --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except ValueError as err:   # lm-eval (0.4.x) raises its unknown-task error as a plain ValueError
        if not str(err).startswith("Tasks not found"):
            raise
        raise UsageError(f"--tasks: {str(err).splitlines()[0]} (lm-eval's task names; local YAMLs need "
                         "--include_path)") from None
    finally:
        sys.argv = saved
    return 0
