"""lm-evaluation-harness support: the ``kvm`` model type (a subclass of lm-eval's ``HFLM``).

Importing this module registers ``kvm`` with ``lm_eval.api.registry``. Two ways to run it::

    kvmeans eval lm-eval --model DIR --tasks lambada_openai piqa --batch_size 8
    lm_eval.simple_evaluate(model=KVMLM(pretrained=DIR), tasks=[...])        # from Python

``kvmeans eval lm-eval`` takes lm-eval's own command line
(``lm-eval run`` options: ``--tasks``, ``--include_path``, ``--limit``, ``--output_path``, ...) and
call lm-eval's CLI after the registration; ``--model DIR`` (a directory) is shorthand for
``--model kvm --model_args pretrained=DIR``, and ``--model`` defaults to ``kvm``
(:mod:`kvmeans.cli.eval_lm_eval`, which checks the arguments before importing lm-eval).

The plain ``lm_eval --model kvm`` command does **not** work: lm-eval 0.4.x (checked: 0.4.13) only
knows the models listed in its own ``lm_eval/models/__init__.py`` and imports no installed plug-ins
(no entry-point discovery, no ``--include_package``), so nothing imports this module first.

Model arguments (``--model_args`` / ``KVMLM(...)``): ``pretrained`` (a directory in our layout or
the authors' ``rwkv7backbone`` layout, a saved converted transformers model, a plain transformers
causal LM folder, or a ``KVMForCausalLM`` instance), ``kvm`` (a :func:`kvmeans.parse_kvm_spec` spec:
convert a plain transformers folder after loading; on the command line ``--kvm SPEC``, or quoted in
``--model_args kvm="budget=fixed:128,chunk_len=32"``), ``tokenizer`` (a
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
metrics and generations, log-likelihoods equal to 1e-5). A converted transformers model strips them
the same way (``kvmeans.pretrained.batch``).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, List, Optional

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import get_dtype
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"kvmeans.eval.harness needs lm-eval with its Hugging Face backend ({_err}): "
                      "pip install 'kvmeans[eval]' (lm-eval, accelerate, transformers)") from _err

from kvmeans.models.hf import KVMConfig, KVMForCausalLM
from kvmeans.models.load import load_model
from kvmeans.models.reference_checkpoint import is_reference_checkpoint, reference_config_to_ours
from kvmeans.utils.args import parse_budget_arg, parse_kvm_arg

__all__ = ["KVMLM", "MODEL_NAME"]
MODEL_NAME = "kvm"            # the lm-eval model type (kvmeans.cli.eval_lm_eval says it too, without importing lm-eval)
log = logging.getLogger(__name__)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer_for(model_dir: str):
    """The tokenizer for a model directory (:func:`kvmeans.train.tokenizers.model_tokenizer`: the one saved
    there, or GPT-2's built offline for an authors'-layout directory), with a hint for ``--model_args``."""
    from kvmeans.train.tokenizers import model_tokenizer
    try:
        return model_tokenizer(model_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}; pass tokenizer=PATH in --model_args (a folder with tokenizer.json "
                                "or a tokenizer.json file)") from None


class KVMLM(HFLM):
    """lm-eval model ``kvm``: :class:`KVMForCausalLM` (our or the authors' layout) or a transformers causal
    LM (converted, or converted here with ``kvm``) under ``HFLM``.

    Args:
        pretrained: model directory or a ``KVMForCausalLM`` instance.
        kvm: a ``--kvm`` spec applied to a plain transformers folder (:func:`kvmeans.cli.load_model`).
        budget: a ``--budget`` spec replacing a KVM model's state schedule on load (:func:`kvmeans.cli.load_model`).
        tokenizer: None (the model's), a path, or a ``PreTrainedTokenizerFast``.
        dtype: ``"auto"`` (as stored), ``"float32"``, ``"bfloat16"``, ... (directories only).
        device: None = cuda if available, else cpu.
        **kwargs: the rest of ``HFLM``'s arguments (``batch_size``, ``max_length``, ...).
    """

    def __init__(self, pretrained: Any, tokenizer: Any = None, dtype: Any = "auto", device: Optional[str] = None,
                 batch_size: Any = 1, max_length: Optional[int] = None, kvm: Optional[str] = None,
                 budget: Any = None, **kwargs):
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
        self._kvm = parse_kvm_arg(kvm)
        self._budget = parse_budget_arg(budget)
        if self._budget is not None and isinstance(pretrained, KVMForCausalLM):
            raise ValueError("kvm: budget= applies when loading a model directory; load the instance with "
                             "KVMForCausalLM.from_pretrained(dir, budget=...) instead")
        kwargs.pop("backend", None)
        kwargs.pop("trust_remote_code", None)      # our code is local: nothing remote to trust
        super().__init__(pretrained=pretrained, backend="causal", tokenizer=tokenizer, dtype=dtype,
                         device=device or _default_device(), batch_size=batch_size, max_length=max_length,
                         **kwargs)

    # ---- loading ------------------------------------------------------------------------------
    def _get_config(self, pretrained: str, **kwargs) -> None:
        raw = json.loads((Path(pretrained) / "config.json").read_text())
        if is_reference_checkpoint(pretrained):
            self._config = KVMConfig.from_model_config(reference_config_to_ours(raw))
        elif raw.get("model_type") == KVMConfig.model_type:
            self._config = KVMConfig.from_pretrained(pretrained)
        else:
            from transformers import AutoConfig
            self._config = AutoConfig.from_pretrained(pretrained)

    def _create_model(self, pretrained: str, dtype: Any = "auto", parallelize: bool = False, peft=None,
                      delta=None, autogptq=False, gptqmodel=False, gguf_file=None, tp_plan=None, **kwargs) -> None:
        unsupported = {k: v for k, v in dict(parallelize=parallelize, peft=peft, delta=delta, autogptq=autogptq,
                                               gptqmodel=gptqmodel, gguf_file=gguf_file, tp_plan=tp_plan).items() if v}
        if unsupported:
            raise ValueError(f"kvm: model_args {sorted(unsupported)} are not supported for KVM models; drop them")
        dt = "auto" if dtype in (None, "auto") else get_dtype(dtype)
        self._model = load_model(pretrained, dt, self._device, self._kvm, self._budget)

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
        pad = self.tokenizer.pad_token_id
        if generation_kwargs.get("attention_mask") is None:
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


_register()
