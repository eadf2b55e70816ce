"""Public entry point ``rwkv7_attention``: validates inputs and dispatches to a path."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from kvmeans.ops.rwkv7.chunk import rwkv7_chunk
from kvmeans.ops.rwkv7.fla_backend import fla_available, fla_usable, rwkv7_fla
from kvmeans.ops.rwkv7.naive import rwkv7_naive
from kvmeans.ops.rwkv7.recurrent import rwkv7_recurrent

__all__ = ["rwkv7_attention", "BACKENDS"]

BACKENDS = ("auto", "naive", "chunk", "recurrent", "fla")
FLA_CHUNK_MIN = 64           # fla's layer: its chunk kernel from 64 tokens (and in training), fused recurrent below


def rwkv7_attention(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, *,
                    initial_state: Optional[Tensor] = None, chunk_size: int = 64,
                    backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The RWKV-7 state update (a generalised delta rule, see :mod:`kvmeans.ops.rwkv7.naive`) and its read-out.

    Args:
        r: ``[B, T, H, K]`` receptance (the query).  k: ``[B, T, H, K]`` keys.  v: ``[B, T, H, V]`` values.
        w: ``[B, T, H, K]`` log decay (``<= 0``; the decay is ``exp(w)``).
        a, b: ``[B, T, H, K]`` the rank-one transition term ``b a^T`` (RWKV-7: ``a = -kk``, ``b = kk * iclr``).
        initial_state: ``[B, H, K, V]`` state to continue (not modified), None for zeros.
        chunk_size: tokens per chunk of the chunked path (16-64 are fast on CPU).
        backend: ``"auto"`` | ``"naive"`` (token loop, the spec) | ``"chunk"`` (training / prefill) |
            ``"recurrent"`` (no-grad decode) | ``"fla"`` (flash-linear-attention's kernels, CUDA). ``"auto"``
            takes fla on CUDA when it is installed and passed a one-time check against ``chunk`` on that device
            (:func:`~kvmeans.ops.rwkv7.fla_backend.fla_usable`), else ``recurrent`` for a no-grad call on CPU
            (measured faster there at any length) or shorter than a chunk, and ``chunk`` otherwise. All agree
            within rounding.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final state [B, H, K, V])``; half inputs are computed in float32 and
        the state is float32.
    """
    if backend not in BACKENDS:
        raise ValueError(f"rwkv7_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"rwkv7_attention: chunk_size must be an int >= 1, got {chunk_size!r}")
    if r.dim() != 4 or r.shape[1] == 0:
        raise ValueError(f"rwkv7_attention: r must be [B, T>=1, H, K], got {list(r.shape)}")
    for name, t in (("w", w), ("k", k), ("a", a), ("b", b)):
        if t.shape != r.shape:
            raise ValueError(f"rwkv7_attention: {name} must have r's shape {list(r.shape)}, got {list(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != r.shape[:3]:
        raise ValueError(f"rwkv7_attention: v must be [B, T, H, V] = {list(r.shape[:3])} + [V], got {list(v.shape)}")
    B, T, H, K = r.shape
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"rwkv7_attention: initial_state must be [B, H, K, V] = {[B, H, K, v.shape[-1]]}, "
                         f"got {list(initial_state.shape)}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (r, w, k, v, a, b, initial_state))
    if backend == "auto":
        if r.is_cuda and fla_usable(r.device):
            backend = "fla"
        else:
            backend = "recurrent" if not needs_grad and (r.device.type == "cpu" or T < chunk_size) else "chunk"
    if backend == "recurrent" and needs_grad:
        raise ValueError("rwkv7_attention: backend='recurrent' has no gradients; use 'chunk' (or 'auto') under "
                         "autograd, or call it under torch.no_grad()")
    if backend == "fla":
        if not fla_available():
            raise ValueError("rwkv7_attention: backend='fla' needs flash-linear-attention "
                             "(pip install 'kvmeans[fla]'); use 'auto' to fall back to the torch paths")
        o, state = rwkv7_fla(r, w, k, v, a, b, initial_state, chunk=needs_grad or T >= FLA_CHUNK_MIN)
    elif backend == "naive":
        o, state = rwkv7_naive(r, w, k, v, a, b, initial_state)
    elif backend == "recurrent":
        o, state = rwkv7_recurrent(r, w, k, v, a, b, initial_state)
    else:
        o, state = rwkv7_chunk(r, w, k, v, a, b, initial_state, chunk_size)
    return o.to(v.dtype), state.float() if state.dtype in (torch.float16, torch.bfloat16) else state
