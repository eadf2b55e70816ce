"""flash-linear-attention's RWKV-7 kernels (CUDA, optional extra ``fla``), called with our argument layout.

fla's ``chunk_rwkv7`` has changed its signature between releases (``w`` was once the raw decay, not its log),
so ``auto`` uses the kernels on a device only after a one-time check against the chunked path there.
"""
from __future__ import annotations

import importlib.util
import warnings
from functools import lru_cache
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fla_available", "fla_usable", "rwkv7_fla"]

_CHECKED: Dict[str, bool] = {}


@lru_cache(maxsize=None)
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def rwkv7_fla(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
              initial_state: Optional[Tensor] = None, chunk: bool = True) -> Tuple[Tensor, Tensor]:
    """Same contract as :func:`rwkv7_naive`: fla's ``chunk_rwkv7`` (training, long prefill) or
    ``fused_recurrent_rwkv7`` (short continuations); ``w`` is the log decay in both, the state fp32."""
    from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
    fn = chunk_rwkv7 if chunk else fused_recurrent_rwkv7
    state = None if initial_state is None else initial_state.float().contiguous()
    o, final = fn(r=r, w=w, k=k, v=v, a=a, b=b, scale=1.0, initial_state=state, output_final_state=True)
    return o, final


def fla_usable(device: torch.device) -> bool:
    """fla is installed and, checked once per device, its chunk and recurrent kernels give the chunked path's
    outputs and state on a small input; otherwise (or if they raise) warn once and return False."""
    if not fla_available():
        return False
    key = str(device)
    if key not in _CHECKED:
        _CHECKED[key] = _agrees(device)
    return _CHECKED[key]


def _agrees(device: torch.device) -> bool:
    from kvmeans.ops.rwkv7.chunk import rwkv7_chunk
    g = torch.Generator().manual_seed(0)
    n = lambda *s: torch.randn(*s, generator=g)
    B, T, H, K = 1, 70, 2, 64
    kk = F.normalize(n(B, T, H, K), dim=-1)
    x = [n(B, T, H, K), -0.6 * torch.sigmoid(n(B, T, H, K)), 0.5 * n(B, T, H, K), n(B, T, H, K), -kk,
         kk * torch.sigmoid(n(B, T, H, K))]
    s0 = n(B, H, K, K)
    try:
        for length, chunk in ((T, True), (5, False)):
            args = [t[:, :length].to(device) for t in x]
            o, s = rwkv7_fla(*args, s0.to(device), chunk=chunk)
            o_ref, s_ref = rwkv7_chunk(*args, s0.to(device))
            for name, got, want in (("output", o, o_ref), ("state", s, s_ref)):
                err = float((got.float() - want).norm() / want.norm())
                if not err < 1e-2:
                    raise ValueError(f"{'chunk' if chunk else 'recurrent'} kernel {name}: relative error {err:.2g}")
    except Exception as err:            # an fla of another signature, or one that fails here
        warnings.warn(f"rwkv7: flash-linear-attention's kernels do not match the torch path on {device} ({err}); "
                      "using the torch paths (backend='fla' forces them)", RuntimeWarning, stacklevel=3)
        return False
    return True
