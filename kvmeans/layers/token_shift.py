"""RWKV-style token shift: ``shift(a)_t = a_t + alpha * (a_{t-1} - a_t)`` per channel.

Used on the projected q, k, v of the attention layer and on the MLP input
(docs/reference-conventions.md §4.2). The predecessor of the first token is either the token itself
(``"first"``: position 0 unchanged; attention) or zero (``"zero"``; MLP). A decode step passes
the last input of the previous call instead, which makes split calls equal one full call.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["token_shift", "TokenShift", "alpha_ramp", "attention_shift_alphas", "mlp_shift_alpha"]

PREDECESSORS = ("first", "zero")


def token_shift(x: Tensor, alpha: Tensor, prev: Optional[Tensor] = None, predecessor: str = "first") -> Tensor:
    """Shift ``x [B, T, C]`` towards its predecessor token; returns ``[B, T, C]``.

    Args:
        alpha: ``[C]`` (or broadcastable to ``x``) mixing weights; 0 keeps ``x``, 1 takes ``a_{t-1}``.
        prev: ``[B, C]`` last input of the previous call, or None at the start of a sequence.
        predecessor: what stands before the first token when ``prev`` is None: ``"first"``
            (the token itself) or ``"zero"``.
    """
    if predecessor not in PREDECESSORS:
        raise ValueError(f"predecessor must be one of {PREDECESSORS}, got {predecessor!r}")
    if prev is not None:
        if prev.shape != (x.shape[0], x.shape[2]):
            raise ValueError(f"prev must be [B, C] = {[x.shape[0], x.shape[2]]}, got {list(prev.shape)}")
        head = prev.to(x.dtype).unsqueeze(1)
    elif predecessor == "first":
        head = x[:, :1]
    else:
        head = torch.zeros_like(x[:, :1])
    before = torch.cat((head, x[:, :-1]), dim=1)  # a_{t-1}, [B, T, C]
    return x + alpha.to(x.dtype) * (before - x)


class TokenShift(nn.Module):
    """Token shift with a learned per-channel ``alpha`` (parameter ``[dim]``).

    Args:
        dim: channels C.
        alpha_init: initial ``alpha``, a float or a ``[dim]`` tensor (see the ramps below).
        predecessor: ``"first"`` or ``"zero"``, see :func:`token_shift`.
    """

    def __init__(self, dim: int, alpha_init: Union[float, Tensor] = 0.5, predecessor: str = "first"):
        super().__init__()
        if predecessor not in PREDECESSORS:
            raise ValueError(f"predecessor must be one of {PREDECESSORS}, got {predecessor!r}")
        init = torch.as_tensor(alpha_init, dtype=torch.get_default_dtype())
        self.alpha = nn.Parameter(init.expand(dim).clone())
        self.predecessor = predecessor

    def forward(self, x: Tensor, prev: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """``x [B, T, dim]``, ``prev [B, dim]`` or None -> ``(y [B, T, dim], last [B, dim])``.

        ``last`` is the unshifted last input: pass it as ``prev`` to the next call.
        """
        return token_shift(x, self.alpha, prev, self.predecessor), x[:, -1]


def alpha_ramp(dim: int, power: float) -> Tensor:
    """``[dim]`` ramp ``1 - (i/dim)**power`` in the default dtype: channel 0 fully shifted, later ones less.

    Computed in fp32 and then cast, so a model built under a bf16 default dtype (``from_pretrained(...,
    dtype=torch.bfloat16)``, the authors' training) holds bf16 alphas like every other parameter.
    """
    # i/dim in float64 then rounded once, as the reference fills it from Python floats.
    frac = (torch.arange(dim, dtype=torch.float64) / dim).float()
    return (1.0 - frac.pow(power)).to(torch.get_default_dtype())


def _depth_ratio(layer_idx: int, num_layers: int) -> float:
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, num_layers={num_layers}), got {layer_idx}")
    return 1.0 - layer_idx / num_layers


def attention_shift_alphas(d_q: int, d_k: int, d_v: int, layer_idx: int,
                           num_layers: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Initial alphas ``([d_q], [d_k], [d_v])`` for the projected q, k, v of one attention layer.

    ``alpha_q = 1-(i/d)^(0.2*rho)``, ``alpha_k = alpha_v = 1-(i/d)^(0.7*rho)``,
    ``rho = 1 - layer_idx/num_layers`` (deeper layers shift less).
    """
    rho = _depth_ratio(layer_idx, num_layers)
    return alpha_ramp(d_q, 0.2 * rho), alpha_ramp(d_k, 0.7 * rho), alpha_ramp(d_v, 0.7 * rho)


def mlp_shift_alpha(dim: int, layer_idx: int, num_layers: int) -> Tensor:
    """Initial MLP alpha ``[dim]``: ``1-(i/d)^(rho^4)``."""
    return alpha_ramp(dim, _depth_ratio(layer_idx, num_layers) ** 4)
