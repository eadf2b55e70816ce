"""lm-evaluation-harness support: the ``kvm`` model type (a subclass of lm-eval's ``HFLM``).

Importing this module registers ``kvm`` with ``lm_eval.api.registry``. Three ways to run it::

    kvmeans eval lm-eval --model DIR --tasks lambada_openai piqa --batch_size 8
    python -m kvmeans.eval.harness --model kvm --model_args pretrained=DIR,dtype=float32 --tasks piqa
    lm_eval.simple_evaluate(model=KVMLM(pretrained=DIR), tasks=[...])        # from Python

``kvmeans eval lm-eval`` and ``python -m kvmeans.eval.harness`` take lm-eval's own command line
(``lm-eval run`` options: ``--tasks``, ``--include_path``, ``--limit``, ``--output_path``, ...) and
call lm-eval's CLI after the registration; ``--model DIR`` (a directory) is shorthand for
``--model kvm --model_args pretrained=DIR``, and ``--model`` defaults to ``kvm``.

The plain ``lm_eval --model kvm`` command does **not** work: lm-eval 0.4.x (checked: 0.4.13) only
knows the models listed in its own ``lm_eval/models/__init__.py`` and imports no installed plug-ins
(no entry-point discovery, no ``--include_package``), so nothing imports this module first.

Model arguments (``--model_args`` / ``KVMLM(...)``): ``pretrained`` (a directory in our layout or
the authors' ``rwkv7backbone`` layout, or a ``KVMForCausalLM`` instance), ``tokenizer`` (a
directory / ``tokenizer.json`` / hub-free name; default: the one saved with the model, else GPT-2's
built offline for the authors' GPT-2 stand-in config), ``dtype`` (default ``auto`` = as stored;
``float32`` on CPU for bf16 checkpoints), ``device`` (default cuda if available, else cpu; on the
command line use lm-eval's ``--device``, not a ``device=`` model argument),
``batch_size`` and ``max_length`` (no limit by default: ``max_position_embeddings`` is 2**30;
``batch_size=auto`` needs an explicit ``max_length``), and HFLM's other options.

Padding and batch size. Log-likelihood batches are right-padded by HFLM and the model is called
without a mask: the model is causal (every mixer, token shift and the MLP shift read only earlier
positions), so pads after a request's last token cannot change the logits of its real tokens; the
pad positions' logits are discarded by HFLM. ``generate_until`` batches are left-padded and passed
with their ``attention_mask``: :class:`~kvmeans.models.hf.KVMForCausalLM` strips each row's pads
(every sequence starts at position 0, as alone). Results therefore do not depend on the batch size
up to float rounding of differently shaped batched matmuls (tests: batch 1 vs 3, identical
metrics and generations, log-likelihoods equal to 1e-5).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import get_dtype
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kvmeans.eval.harness needs lm-eval with its Hugging Face backend ({_err}): "
                      "pip install 'kvmeans[eval]' (lm-eval, accelerate, transformers)") from _err

from ..models.convert import is_reference_checkpoint, reference_config_to_ours
from ..models.hf import KVMConfig, KVMForCausalLM
from ..utils.cli import UsageError, run_main

__all__ = ["KVMLM", "main", "translate_args", "MODEL_NAME"]

MODEL_NAME = "kvm"
log = logging.getLogger(__name__)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer_for(model_dir: str):
    """The tokenizer for a model directory (:func:`kvmeans.train.tokenizers.model_tokenizer`: the one saved
    there, or GPT-2's built offline for an authors'-layout directory), with a hint for ``--model_args``."""
    from ..train.tokenizers import model_tokenizer
    try:
        return model_tokenizer(model_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}; pass tokenizer=PATH in --model_args (a folder with tokenizer.json "
                                "or a tokenizer.json file)") from None


class KVMLM(HFLM):
    """lm-eval model ``kvm``: :class:`KVMForCausalLM` (our or the authors' layout) under ``HFLM``.

    Args:
        pretrained: model directory or a ``KVMForCausalLM`` instance.
        tokenizer: None (the model's), a path, or a ``PreTrainedTokenizerFast``.
        dtype: ``"auto"`` (as stored), ``"float32"``, ``"bfloat16"``, ... (directories only).
        device: None = cuda if available, else cpu.
        **kwargs: the rest of ``HFLM``'s arguments (``batch_size``, ``max_length``, ...).
    """

    def __init__(self, pretrained: Any, tokenizer: Any = None, dtype: Any = "auto", device: Optional[str] = None,
                 batch_size: Any = 1, max_length: Optional[int] = None, **kwargs):
        if isinstance(pretrained, (str, os.PathLike)):
            pretrained = str(pretrained)
            if not os.path.isdir(pretrained):
                raise FileNotFoundError(f"kvm: pretrained={pretrained!r} is not a directory; pass the folder of a "
                                        "saved KVM model (ours or the authors' layout); hub ids are not downloaded")
        elif not isinstance(pretrained, KVMForCausalLM):
            raise TypeError(f"kvm: pretrained must be a model directory or a KVMForCausalLM, "
                            f"got {type(pretrained).__name__}")
        if str(batch_size).startswith("auto") and not max_length:
            raise ValueError("kvm: batch_size=auto probes with a max_length-token batch and KVM models have no "
                             "length limit (2**30); also pass max_length=N in --model_args, or use an integer "
                             "batch_size")
        kwargs.pop("backend", None)
        kwargs.pop("trust_remote_code", None)      # our code is local: nothing remote to trust
        super().__init__(pretrained=pretrained, backend="causal", tokenizer=tokenizer, dtype=dtype,
                         device=device or _default_device(), batch_size=batch_size, max_length=max_length,
                         **kwargs)

    # ---- loading ------------------------------------------------------------------------------
    def _get_config(self, pretrained: str, **kwargs) -> None:
        if is_reference_checkpoint(pretrained):
            raw = json.loads((Path(pretrained) / "config.json").read_text())
            self._config = KVMConfig.from_model_config(reference_config_to_ours(raw))
        else:
            self._config = KVMConfig.from_pretrained(pretrained)

    def _create_model(self, pretrained: str, dtype: Any = "auto", parallelize: bool = False, peft=None,
                      delta=None, autogptq=False, gptqmodel=False, gguf_file=None, tp_plan=None, **kwargs) -> None:
        unsupported = {k: v for k, v in dict(parallelize=parallelize, peft=peft, delta=delta, autogptq=autogptq,
                                               gptqmodel=gptqmodel, gguf_file=gguf_file, tp_plan=tp_plan).items() if v}
        if unsupported:
            raise ValueError(f"kvm: model_args {sorted(unsupported)} are not supported for KVM models; drop them")
        dt = "auto" if dtype in (None, "auto") else get_dtype(dtype)
        self._model = KVMForCausalLM.from_pretrained(pretrained, dtype=dt).to(self._device).eval()

    def _create_tokenizer(self, pretrained: Any, tokenizer: Any, **kwargs) -> None:
        from transformers import PreTrainedTokenizerBase
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            self.tokenizer = tokenizer
        elif tokenizer:
            path = str(tokenizer)
            if os.path.isfile(path):
                from transformers import PreTrainedTokenizerFast
                self.tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
            elif os.path.isdir(path):
                self.tokenizer = load_tokenizer_for(path)
            else:
                raise FileNotFoundError(f"kvm: tokenizer={path!r} is neither a folder nor a tokenizer.json file")
        else:
            src = pretrained if isinstance(pretrained, str) else getattr(pretrained, "name_or_path", "") or \
                getattr(pretrained.config, "name_or_path", "")
            if not src or not os.path.isdir(src):
                raise ValueError("kvm: the model instance has no directory to load a tokenizer from; "
                                 "pass tokenizer=<PreTrainedTokenizerFast or path>")
            self.tokenizer = load_tokenizer_for(src)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # ---- model calls --------------------------------------------------------------------------
    def _model_call(self, inps: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                    labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of a right-padded batch (no mask needed: the model is causal, so the
        pads after a row's tokens cannot reach them; no cache is kept)."""
        if attn_mask is not None or labels is not None:
            raise ValueError("kvm is a decoder-only model: _model_call takes input ids only")
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return self.model(inps, use_cache=False).logits

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: List[str], **generation_kwargs):
        """``generate`` over a left-padded batch; ``attention_mask`` (passed by ``generate_until``)
        makes each row start at position 0 exactly as it would alone."""
        if generation_kwargs.get("attention_mask") is None:
            pad = self.tokenizer.pad_token_id
            # only leading pads are padding (a prompt may legitimately contain the pad/eos id later)
            is_tok = (context != pad).long().cummax(dim=1).values if pad is not None else torch.ones_like(context)
            generation_kwargs["attention_mask"] = is_tok
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def _register() -> None:
    """Register :class:`KVMLM` as ``kvm`` (once; a second import of this module is a no-op)."""
    try:
        register_model(MODEL_NAME)(KVMLM)
    except (ValueError, AssertionError):       # already registered: fine if it is this class
        from lm_eval.api.registry import get_model
        cur = get_model(MODEL_NAME)
        if getattr(cur, "__qualname__", None) != KVMLM.__qualname__ or \
                getattr(cur, "__module__", None) != KVMLM.__module__:
            raise


if __name__ != "__main__":       # under `python -m`, the package module (imported below) registers
    _register()


# ------------------------------------------------------------------------------------------- CLI
_SUBCOMMANDS = ("run", "ls", "validate")


def translate_args(argv: Sequence[str]) -> List[str]:
    """lm-eval arguments with kvmeans' conveniences: ``--model DIR`` -> ``--model kvm --model_args
    pretrained=DIR``; no ``--model`` -> ``--model kvm``; ``ls`` / ``validate`` pass through."""
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
        else:
            out.append(a)
        i += 1
    if not model_seen and not any(a in ("-h", "--help") for a in rest):
        out = ["--model", MODEL_NAME] + out
    return ["run"] + out if (head or out) else out


def _check_pretrained(args: Sequence[str]) -> None:
    """A :class:`UsageError` when the ``kvm`` model's ``pretrained=`` is not a folder (before lm-eval starts)."""
    opts = {}
    for i, a in enumerate(args):          # the last value of each --name value / --name=value
        name, eq, val = a.partition("=")
        if name.startswith("--"):
            opts[name] = val if eq else (args[i + 1] if i + 1 < len(args) else "")
    if opts.get("--model") != MODEL_NAME or opts.get("--model_args", "").lstrip().startswith("{"):
        return
    for item in opts.get("--model_args", "").split(","):
        key, _, val = item.partition("=")
        if key.strip() == "pretrained" and not os.path.isdir(val.strip()):
            raise UsageError(f"--model_args pretrained={val.strip()}: not a directory; give the folder of a saved "
                             "KVM model")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run lm-eval's command line with the ``kvm`` model registered (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans eval lm-eval [--model DIR | --model kvm --model_args pretrained=DIR,...] "
              "--tasks T [T ...] [lm-eval run options]\n\n"
              "Runs lm-evaluation-harness (`lm-eval run`) with the `kvm` model type registered.\n"
              "  --model DIR        shorthand for --model kvm --model_args pretrained=DIR\n"
              "  --model_args ...   pretrained=DIR, dtype=float32, tokenizer=PATH, max_length=N, device=cpu\n"
              "  --include_path P   extra task YAMLs (e.g. local tasks, no download)\n"
              "All other options are lm-eval's: see `kvmeans eval lm-eval run --help`.\n"
              "Note: plain `lm_eval --model kvm` does not work (lm-eval 0.4.x loads no plug-ins).")
        return 0
    args = translate_args(argv)
    _check_pretrained(args)
    from lm_eval.__main__ import cli_evaluate
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:     # argparse errors / --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    # run through the package module so the registered class is kvmeans.eval.harness.KVMLM (not a
    # second copy defined in __main__)
    from kvmeans.eval.harness import main as _main
    sys.exit(run_main("python -m kvmeans.eval.harness", _main, None))
