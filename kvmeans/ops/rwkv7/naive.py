"""The RWKV-7 recurrence as a token loop: the spec the chunked and recurrent paths are tested against.

Per head, with the state ``S [K, V]`` (fla's layout; RWKV-7's ``[V, K]`` transposed) and log decay ``w <= 0``:

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T        o_t = S_t^T r_t

The RWKV-7 time mixer calls it with ``a = -kk`` and ``b = kk * iclr`` (kk the normalised removal key, iclr the
in-context learning rate): a generalised delta rule whose transition ``diag(exp(w)) + b a^T`` is diagonal plus
rank one. The decay and the rank-one term both act on ``S_{t-1}``; the output reads the state after token t.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["rwkv7_naive"]


def rwkv7_naive(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``r, w, k, a, b [B, T, H, K]``, ``v [B, T, H, V]``, ``initial_state [B, H, K, V]`` or None (zeros) ->
    ``(o [B, T, H, V] in v's dtype, final state [B, H, K, V])``; computed in float32 for half inputs."""
    dtype = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    r, w, k, v, a, b = (t.to(dtype) for t in (r, w, k, v, a, b))
    B, T, H, K = r.shape
    S = r.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(T):
        removed = (a[:, t, :, :, None] * S).sum(2, keepdim=True)                    # a_t^T S  [B, H, 1, V]
        S = (w[:, t].exp()[..., None] * S + b[:, t, :, :, None] * removed
             + k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append((r[:, t, :, :, None] * S).sum(2))                              # S^T r_t  [B, H, V]
    return torch.stack(outs, dim=1), S
