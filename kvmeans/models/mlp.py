"""GPTAlpha-2 channel mixer (reference 4.6): token shift, ``c_fc``, ReLU squared, ``c_proj``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvmeans.layers.token_shift import mlp_shift_alpha, token_shift

__all__ = ["MLP"]


class MLP(nn.Module):
    """``y = c_proj(relu(c_fc(shift(x)))**2)``, no biases.

    The shift mixes each token with its predecessor, ``shift(x)_t = x_t + x_k * (x_{t-1} - x_t)``;
    the first token of a sequence has a zero predecessor. Parameters: ``x_k [1, 1, d]`` (ramp
    ``1 - (i/d)^(rho^4)``, rho = 1 - layer/num_layers; only with ``token_shift``),
    ``c_fc [ffn_dim, d]`` (orthogonal), ``c_proj [d, ffn_dim]`` (zeros: the block starts as identity).
    """

    def __init__(self, hidden_size: int, ffn_dim: int, layer_idx: int = 0, num_layers: int = 1,
                 token_shift: bool = True):
        super().__init__()
        self.x_k = nn.Parameter(mlp_shift_alpha(hidden_size, layer_idx, num_layers).view(1, 1, hidden_size)) \
            if token_shift else None
        self.c_fc = nn.Linear(hidden_size, ffn_dim, bias=False)
        self.c_proj = nn.Linear(ffn_dim, hidden_size, bias=False)
        with torch.no_grad():
            nn.init.orthogonal_(self.c_fc.weight, gain=1.0)
            nn.init.zeros_(self.c_proj.weight)

    def forward(self, x: Tensor, prev: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """``x [B, T, d]``, ``prev [B, d]`` (last input of the previous call, None at position 0) ->
        ``(y [B, T, d], last [B, d])``; ``last`` is None without token shift."""
        last = None
        if self.x_k is not None:
            last = x[:, -1].clone()  # clone: a view would keep the whole call's activations alive
            x = token_shift(x, self.x_k, prev, "zero")
        return self.c_proj(F.relu(self.c_fc(x)).square()), last
