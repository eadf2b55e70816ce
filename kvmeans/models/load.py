"""Loading a saved model folder (ours, the authors', converted, or any transformers causal LM) and its
tokenizer; mistakes raise :class:`~kvmeans.utils.args.UsageError` naming the command-line flag."""
from __future__ import annotations

import os
from typing import Optional

from kvmeans.utils.args import UsageError


def load_model_tokenizer(model_dir: str):
    """The tokenizer saved next to the model (see :func:`kvmeans.train.tokenizers.model_tokenizer`);
    a :class:`UsageError` naming ``--model`` when there is none."""
    from kvmeans.train.tokenizers import model_tokenizer
    try:
        return model_tokenizer(model_dir)
    except FileNotFoundError:
        raise UsageError(f"--model {model_dir}: no tokenizer in the folder (tokenizer.json or tokenizer_config.json); "
                         "save the tokenizer with the model (kvmeans train writes it into OUT/final)") from None


def load_hf_tokenizer(model_dir: str, flag: str = "--model"):
    """``AutoTokenizer.from_pretrained(model_dir)``; a :class:`UsageError` naming ``flag`` when it cannot load."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        why = (str(err).strip().splitlines() or ["no tokenizer"])[0].rstrip(": ")
        raise UsageError(f"{flag} {model_dir}: cannot load its tokenizer ({why}); save the tokenizer with the "
                         "model") from None


def load_model(model_dir: str, dtype, device, kvm: Optional[dict] = None, budget=None):
    """The model in ``model_dir`` on ``device`` in eval mode: ``KVMForCausalLM`` for our (or the authors')
    layout, with every KVM layer's schedule replaced by ``budget`` (:func:`parse_budget_arg`) when given; a saved
    converted model through :func:`kvmeans.load_converted`; any other transformers causal LM through
    ``AutoModelForCausalLM``, converted with ``kvm`` (:func:`parse_kvm_arg`) when given.
    A :class:`UsageError` naming ``--model`` / ``--kvm`` / ``--budget`` for missing files or a spec that cannot
    apply."""
    import json

    from kvmeans.models.config import with_budget
    from kvmeans.models.hf import KVMForCausalLM
    from kvmeans.models.reference_checkpoint import NATIVE_MODEL_TYPES
    from kvmeans.pretrained.convert import CONFIG_KEY, convert_hf, load_converted
    from kvmeans.utils.weights import named_weight_errors
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {model_dir}: cannot read config.json ({err})") from None
    if "model_type" not in raw:
        final = os.path.join(model_dir, "final")
        hint = (f"a training run's folder: its model is {final}" if os.path.isfile(os.path.join(final, "config.json"))
                else "give the folder of a saved model (e.g. OUT/final of kvmeans train)")
        raise UsageError(f"--model {model_dir}: config.json has no model_type, so it is no saved model; {hint}")
    native = raw.get("model_type") in NATIVE_MODEL_TYPES
    if kvm is not None and (native or raw.get(CONFIG_KEY)):
        why = "is a KVM model already" if native else f"is converted already (config.json {CONFIG_KEY})"
        raise UsageError(f"--kvm: {model_dir} {why}; drop --kvm")
    if budget is not None and not native:
        raise UsageError(f"--budget: {model_dir} is not a KVM-native model (model_type {raw.get('model_type')!r}); "
                         "a plain transformers model takes its schedule from --kvm budget=SPEC")
    if budget is not None:              # checked against the saved model's settings before it loads
        from transformers import AutoConfig
        try:
            with_budget(AutoConfig.from_pretrained(model_dir).to_model_config(), budget)
        except ValueError as err:
            raise UsageError(f"--budget: {err}") from None
    try:
        if native:
            model = KVMForCausalLM.from_pretrained(model_dir, dtype=dtype, **({} if budget is None else
                                                                             {"budget": budget}))
        elif raw.get(CONFIG_KEY):
            model = load_converted(model_dir, dtype=dtype)
        else:
            from transformers import AutoModelForCausalLM
            with named_weight_errors(model_dir):
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {model_dir}: {(str(err).strip().splitlines() or ['cannot load it'])[0]}") from None
    if kvm is not None:
        try:
            convert_hf(model, **kvm)
        except ValueError as err:
            raise UsageError(f"--kvm: {err}") from None
    return model.to(device).eval()


def conversion_settings(model) -> Optional[dict]:
    """The conversion settings of a converted transformers model (config.json ``kvm_conversion``), else None."""
    from kvmeans.pretrained.convert import CONFIG_KEY
    return getattr(model.config, CONFIG_KEY, None) or None
