"""The compared attention arms of a pretrained transformers model and their perplexity, shared by ``kvmeans eval
ppl`` (:mod:`kvmeans.pretrained.ppl`) and ``kvmeans bench pretrained`` (:mod:`kvmeans.pretrained.bench`).

An :class:`Arm` is a model run as is (full attention, a converted KVM copy, a saved conversion) or under
StreamingLLM (``sinks`` + the last ``window`` tokens): :func:`streaming_mask` over the unchanged model, positions
the tokens' own, as in a cache that evicts post-RoPE keys (:func:`evict` drops what the next query cannot see).
The builders set each arm's kept keys; a KVM arm's at a length come from :func:`kvm_kept_keys` (its state budget
at that length plus its ``n_bswa_chunks * chunk_len`` window).

Perplexity: :func:`window_nll` is one forward over one window (the NLL of each next token; with ``cache`` also the
bytes its cache holds after the window); :func:`run_windows` runs arms over windows, window by window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from kvmeans.pretrained.calibrate import SPLIT_SIZES
from kvmeans.pretrained.nll import forward_nll, token_nll
from kvmeans.utils.args import UsageError
from kvmeans.utils.modules import copy_sharing_weights

__all__ = ["Arm", "streaming_mask", "evict", "token_nll", "perplexity", "window_nll", "run_windows",
           "kvm_kept_keys", "streaming_arm", "converted_arm", "kvm_spec_arm", "saved_arm", "kvm_spec_as_given",
           "kvm_settings", "kvm_arm", "SPLIT_SIZES",
           "distilled_arm"]



@dataclass
class Arm:
    """One compared method: ``model`` as is (``sinks=None``) or under StreamingLLM (``sinks`` + ``window``).

    ``kept_keys``: keys a token can attend to at most (None: all, or ``sinks + window`` under StreamingLLM)."""
    name: str
    model: Any
    kept_keys: Optional[int] = None
    sinks: Optional[int] = None
    window: Optional[int] = None

    def kept(self, length: int) -> int:
        """Keys a token attends to at most in ``length``-token windows."""
        if self.kept_keys is not None:
            return min(length, self.kept_keys)
        return length if self.sinks is None else min(length, self.sinks + self.window)


# ---- StreamingLLM -----------------------------------------------------------------------------------------------
def streaming_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, sinks: int, window: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, Q, K]`` additive mask: the query at position p sees keys at positions ``< sinks`` and
    ``(p - window, p]`` (``key_pos [K]``, ``query_pos [Q]``; a whole window: both ``arange(T)``)."""
    k, q = key_pos[None, :], query_pos[:, None]
    keep = (k <= q) & ((k < sinks) | (k > q - window))
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)[None, None]


def evict(cache, key_pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Keep only the cached keys/values where ``keep [K]`` is true (every layer); returns their positions."""
    idx = keep.nonzero().squeeze(1)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, idx.to(layer.keys.device))
        layer.values = layer.values.index_select(-2, idx.to(layer.values.device))
    return key_pos[idx]


# ---- perplexity -------------------------------------------------------------------------------------------------
def perplexity(model, windows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> float:
    """``exp`` of the mean next-token NLL over all windows ``[N, T]`` (one window per forward)."""
    nll = torch.cat([token_nll(model, w[None], attention_mask) for w in windows])
    return math.exp(nll.double().mean().item())


def window_nll(arm: Arm, window: torch.Tensor, cache: bool = False) -> Tuple[torch.Tensor, Optional[int], float]:
    """``(nll [T - 1] float32 on the CPU, cache bytes, seconds of the forward)`` of ``arm`` on ``window [T]``: one
    forward, under :func:`streaming_mask` for a StreamingLLM arm. ``cache``: the forward fills a ``DynamicCache``
    and the bytes are what it holds after the window (a StreamingLLM arm's evicted to the keys the next token
    could see); else no cache and the bytes are None."""
    model = arm.model
    pos = torch.arange(window.shape[0])
    mask = None if arm.sinks is None else streaming_mask(pos, pos, arm.sinks, arm.window,
                                                         next(model.parameters()).dtype)
    kv, nbytes = None, None
    if cache:
        from transformers import DynamicCache
        kv = DynamicCache()
    nll, secs = forward_nll(model, window[None], mask, kv)
    if kv is not None:
        from kvmeans.pretrained.cache import cache_nbytes
        if arm.sinks is not None:
            evict(kv, pos, (pos < arm.sinks) | (pos > window.shape[0] - arm.window))
        nbytes = cache_nbytes(kv)
    return nll[0].cpu(), nbytes, secs


def run_windows(arms: Sequence[Arm], windows: torch.Tensor, cache: bool = False,
                each: Optional[Callable[[int, Arm, torch.Tensor], None]] = None
                ) -> List[Tuple[torch.Tensor, Optional[int], float]]:
    """Every arm on every window ``[N, T]`` (window by window, the arms in turn; :func:`window_nll`). Per arm
    ``(nll [N, T - 1] float64, cache bytes after the last window, seconds)``; ``each(i, arm, nll)`` after every
    forward."""
    nll: List[List[torch.Tensor]] = [[] for _ in arms]
    nbytes: List[Optional[int]] = [None] * len(arms)
    secs = [0.0] * len(arms)
    for i, w in enumerate(windows):
        for j, arm in enumerate(arms):
            x, nbytes[j], s = window_nll(arm, w, cache)
            nll[j].append(x)
            secs[j] += s
            if each is not None:
                each(i, arm, x)
    return [(torch.stack(x).double(), b, s) for x, b, s in zip(nll, nbytes, secs)]


# ---- arms -------------------------------------------------------------------------------------------------------
def kvm_kept_keys(settings: dict, length: int) -> int:
    """Keys a model converted with ``settings`` (its ``kvm_conversion``) keeps at ``length`` tokens: its state
    budget at ``length`` plus its ``n_bswa_chunks * chunk_len`` window."""
    from kvmeans.pretrained.convert import KVMSpec
    spec = KVMSpec.from_dict({k: v for k, v in settings.items() if k != "layers"})
    return spec.state_budget(length) + spec.n_bswa_chunks * spec.chunk_len


def streaming_arm(model, keys: int, sinks: int, name: str = "streaming") -> Arm:
    """StreamingLLM at ``keys`` kept keys: ``sinks`` + the last ``keys - sinks`` tokens."""
    return Arm(name, model, keys, sinks, keys - sinks)


def converted_arm(name: str, model, length: int) -> Arm:
    """A converted model (its ``config.kvm_conversion``) as it is; kept keys at ``length`` (:func:`kvm_kept_keys`)."""
    return Arm(name, model, kvm_kept_keys(model.config.kvm_conversion, length))


def kvm_spec_arm(model, kvm: dict, length: int) -> Arm:
    """The arm ``kvm``: a copy of ``model`` converted with the ``--kvm`` settings ``kvm``; a one-line ``--kvm``
    :class:`UsageError` when they cannot apply."""
    from kvmeans.pretrained.convert import convert_hf
    try:
        conv = convert_hf(copy_sharing_weights(model), **kvm)
    except ValueError as err:
        raise UsageError(f"--kvm: {err}") from None
    return converted_arm("kvm", conv, length)


def saved_arm(model_dir: str, length: int) -> Arm:
    """The arm ``kvm:saved``: a folder saved from a converted (or distilled) model, run with its own conversion
    (learned parameters included) via ``load_converted``."""
    from kvmeans.pretrained.convert import load_converted
    return converted_arm("kvm:saved", load_converted(model_dir, dtype=torch.float32).eval(), length)


def distilled_arm(model, length: int) -> Arm:
    """A saved converted (distilled) model at its own settings; kept keys at ``length``."""
    return converted_arm("kvm distilled", model, length)


def kvm_spec_as_given(kvm: dict):
    """The ``KVMSpec`` of ``--kvm`` settings as written (its defaults where not given), without ``layers``,
    ``budget`` and ``exact_rows``, which :func:`kvm_settings` sets and checks per kept keys."""
    from kvmeans.pretrained.convert import KVMSpec
    return KVMSpec(**{k: v for k, v in kvm.items() if k not in ("layers", "budget", "exact_rows")})


def kvm_settings(keys: int, kvm) -> dict:
    """The ``convert_hf`` settings of the KVM arm at ``keys`` kept keys. ``kvm`` a dict of settings: those with the
    window shrunk to at most ``keys // 2`` (fewer chunks, then halved chunks) and the rest of ``keys`` as a fixed
    state budget; a :class:`UsageError` naming ``--kvm`` when they leave no state rows or cannot hold
    ``exact_rows``. ``kvm`` ``{"split": a calibration Split, **other settings}`` (``--kvm auto[:NAME],...``): the
    split's shares of ``keys`` as ``convert_hf(model)`` spends them (``calibrate.split_settings``), with the other
    settings (none of :data:`SPLIT_SIZES`)."""
    from kvmeans.ops.budget import StateBudget
    from kvmeans.pretrained.calibrate import split_settings
    from kvmeans.pretrained.convert import KVMSpec
    if "split" in kvm:
        split = kvm["split"]
        try:
            sizes = split_settings(split, keys)
        except ValueError as err:
            raise UsageError(f"--kvm auto ({split.name}): {err}; drop the shorter lengths / higher ratios") from None
        return {**{k: v for k, v in kvm.items() if k != "split"}, **sizes}
    spec = kvm_spec_as_given(kvm)           # checked against the budget set below, not KVMSpec's default one
    chunk, n = spec.chunk_len, spec.n_bswa_chunks
    while n > 1 and n * chunk > keys // 2:
        n -= 1
    while n * chunk > keys // 2 and chunk // 2 > spec.sink_len:
        chunk //= 2
    if keys - n * chunk <= spec.sink_len:
        raise UsageError(f"--kvm: {keys} kept keys leave no state rows beside a {n * chunk}-token window and "
                         f"{spec.sink_len} sinks; use a smaller sink_len or a lower compression ratio")
    settings = {**kvm, "chunk_len": chunk, "n_bswa_chunks": n, "budget": StateBudget.fixed(keys - n * chunk)}
    most = KVMSpec(**{k: v for k, v in settings.items() if k not in ("layers", "exact_rows")}).max_exact_rows
    if kvm.get("exact_rows", 0) > most:
        raise UsageError(f"--kvm: exact_rows={kvm['exact_rows']} does not fit {keys} kept keys (window {n * chunk}, "
                         f"state budget {keys - n * chunk}: at most budget - chunk_len = {most}); lower "
                         "exact_rows, or drop the shorter lengths / higher ratios")
    return settings


def effective_record(got: dict) -> dict:
    """What a KVM arm ran, from its :func:`kvm_settings` (``got``), as benches record it per kept keys
    (``kvm_effective``): chunk length, chunks of window, state budget, exact rows."""
    return {"chunk_len": got["chunk_len"], "n_bswa_chunks": got["n_bswa_chunks"], "budget": got["budget"].n,
            "exact_rows": got.get("exact_rows", 0)}


def shrink_note(keys: int, kvm, got: dict) -> Optional[str]:
    """A one-line note when :func:`kvm_settings` ran a hand-written ``--kvm`` (``kvm``) at ``keys`` kept keys with
    another window than the spec's (``got``: what it returned); ``None`` when the spec ran as written."""
    if "split" in kvm:
        return None
    given = kvm_spec_as_given(kvm)
    if (got["chunk_len"], got["n_bswa_chunks"]) == (given.chunk_len, given.n_bswa_chunks):
        return None
    return (f"--kvm: at {keys} kept keys the window is {got['n_bswa_chunks']} chunks of {got['chunk_len']} tokens "
            f"({got['n_bswa_chunks'] * got['chunk_len']}: at most keys // 2) and the state {got['budget'].n} rows, "
            "not the spec's window; give n_bswa_chunks * chunk_len <= keys // 2 to run the spec as written")


def kvm_arm(model, keys: int, kvm) -> Arm:
    """Training-free KVM at ``keys`` kept keys on a converted copy of ``model`` (:func:`kvm_settings`)."""
    from kvmeans.pretrained.convert import convert_hf
    return Arm("kvm", convert_hf(copy_sharing_weights(model), **kvm_settings(keys, kvm)), keys)
