"""Next-token loss of a causal LM over token ids: one forward, the NLL of each next token. A leaf module (torch
and the cache-name shim only), so that :mod:`kvmeans.pretrained.arms` and :mod:`kvmeans.pretrained.calibrate`,
which :func:`kvmeans.convert_hf` calls, share it without an import circle."""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["forward_nll", "token_nll"]

NLL_SLICE = 256            # tokens per cross-entropy call


def forward_nll(model, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 cache=None) -> Tuple[torch.Tensor, float]:
    """``(nll [B, T - 1] float32, seconds of the forward)`` of each next token of ``ids [B, T]``: one forward,
    with ``cache`` (a transformers ``Cache``) or none."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    kw = {} if attention_mask is None else {"attention_mask": attention_mask.to(device)}
    if cache is not None:
        from kvmeans.models.hf_compat import cache_kwargs
        kw.update(cache_kwargs(cache))
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=cache is not None, **kw).logits
    secs = time.perf_counter() - t0
    # in slices of the sequence: one log-softmax copy of [B, T, vocab] costs 1.2 GB at 2K tokens of a 152K vocabulary
    T = ids.shape[1] - 1
    return torch.cat([F.cross_entropy(logits[:, i:min(T, i + NLL_SLICE)].float().transpose(1, 2),
                                      ids[:, i + 1:min(T, i + NLL_SLICE) + 1], reduction="none")
                      for i in range(0, T, NLL_SLICE)], 1), secs


def token_nll(model, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T - 1]`` float32 NLL of each next token of ``ids [B, T]`` under ``model`` (one forward, no cache)."""
    return forward_nll(model, ids, attention_mask)[0]
