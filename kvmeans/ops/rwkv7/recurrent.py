"""RWKV-7 decode: the recurrence of :mod:`.naive` token by token, without autograd, on flattened heads.

For a continuation by a few tokens (one, in decode): each step is a decay, two batched rank-one updates
(``baddbmm``) and one batched read, with no ``[L, L]`` chunk matrices to build.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["rwkv7_recurrent"]


@torch.no_grad()
def rwkv7_recurrent(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                    initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Same contract as :func:`rwkv7_naive` (``initial_state`` is not modified); no gradients."""
    dtype = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    B, T, H, K = r.shape
    V = v.shape[-1]
    flat = lambda x: x.to(dtype).transpose(1, 2).reshape(B * H, T, x.shape[-1])   # [B*H, T, X]
    r, k, v, a, b = (flat(t) for t in (r, k, v, a, b))
    decay = flat(w).exp()
    S = (r.new_zeros(B * H, K, V) if initial_state is None
         else initial_state.to(dtype).reshape(B * H, K, V).clone())
    out = r.new_empty(B * H, T, V)
    for t in range(T):
        removed = torch.bmm(a[:, t, None, :], S)                                    # [B*H, 1, V]
        S.mul_(decay[:, t, :, None])
        S.baddbmm_(b[:, t, :, None], removed).baddbmm_(k[:, t, :, None], v[:, t, None, :])
        out[:, t] = torch.bmm(r[:, t, None, :], S)[:, 0]
    return out.view(B, H, T, V).transpose(1, 2), S.view(B, H, K, V)
