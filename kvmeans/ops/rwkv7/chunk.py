"""RWKV-7 in chunk-parallel form (training and prefill): exact, pure PyTorch, differentiable by autograd.

Within a chunk of L tokens entering with state ``S0``, let ``G_t`` be the inclusive cumulative log decay since
the chunk start and ``u_s = S_{s-1}^T a_s`` the removed values. Unrolling the recurrence of :mod:`.naive`:

    u_s = S0^T (a_s e^{G_{s-1}}) + sum_{j<s} A_ab[s,j] u_j + sum_{j<s} A_ak[s,j] v_j
    o_t = S0^T (r_t e^{G_t})     + sum_{j<=t} A_rb[t,j] u_j + sum_{j<=t} A_rk[t,j] v_j
    S_L = e^{G_L} S0 + sum_j (b_j e^{G_L - G_j}) u_j^T + (k_j e^{G_L - G_j}) v_j^T

with ``A_xy[s,j] = sum_i x_{s,i} y_{j,i} e^{G_{s(-1),i} - G_{j,i}}``. The first line is a unit lower-triangular
system (the UT transform of fla's ``chunk_dplr``): ``U = W S0 + U_v`` with ``W = (I - A_ab)^{-1} (a e^{G_{-1}})``
and ``U_v = (I - A_ab)^{-1} A_ak V``. So every chunk reduces, in parallel, to an affine map of its entering
state: ``O = Q S0 + O_v`` and ``S_L = M S0 + E``; only the ``[K, K] @ [K, V]`` products ``S <- M S + E`` run
in sequence. The pairwise decays are factored around the chunk's middle token, so no factor exceeds
``exp(half the chunk's total log decay)`` (the entry check keeps that finite).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["rwkv7_chunk"]

_MAX_HALF_SPAN = {torch.float32: 60.0, torch.float64: 600.0}    # |log| of the largest factor, below overflow


def rwkv7_chunk(r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                initial_state: Optional[Tensor] = None, chunk_size: int = 64) -> Tuple[Tensor, Tensor]:
    """Same contract as :func:`rwkv7_naive`; ``chunk_size`` L tokens per chunk (any T: the tail is padded
    with tokens that leave the state unchanged)."""
    dtype = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    B, T, H, K = r.shape
    V = v.shape[-1]
    L = chunk_size
    n = math.ceil(T / L)

    def chunks(x: Tensor) -> Tensor:             # [B, T, H, X] -> [B, H, n, L, X], zero tail
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, n * L - T))
        return x.view(B, n, L, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    r, w, k, v, a, b = (chunks(t) for t in (r, w, k, v, a, b))
    G = w.cumsum(3)                                                   # inclusive, [B, H, n, L, K]
    G_prev = G - w
    G_end = G[:, :, :, -1:]                                           # [B, H, n, 1, K]
    mid = G[:, :, :, L // 2:L // 2 + 1]
    half_span = float(torch.maximum(mid - G_end, -mid).detach().max())
    if half_span > _MAX_HALF_SPAN.get(dtype, 60.0):
        raise ValueError(f"rwkv7 chunk: a chunk's log decay reaches {-2 * half_span:.3g}, too steep for "
                         f"chunk_size={L} in {dtype}; lower chunk_size or use backend='recurrent'")

    q_a, q_r = a * (G_prev - mid).exp(), r * (G - mid).exp()          # query side, decayed to the middle
    k_b, k_k = b * (mid - G).exp(), k * (mid - G).exp()               # key side, from the middle
    strict = torch.ones(L, L, dtype=torch.bool, device=r.device).tril(-1)
    causal = torch.ones(L, L, dtype=torch.bool, device=r.device).tril()
    zero = r.new_zeros(())
    A_ab = torch.where(strict, q_a @ k_b.transpose(-1, -2), zero)
    A_ak = torch.where(strict, q_a @ k_k.transpose(-1, -2), zero)
    A_rb = torch.where(causal, q_r @ k_b.transpose(-1, -2), zero)
    A_rk = torch.where(causal, q_r @ k_k.transpose(-1, -2), zero)

    eye = torch.eye(L, dtype=dtype, device=r.device)
    solve = lambda rhs: torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True)
    Wm = solve(a * G_prev.exp())                                      # [B, H, n, L, K]
    U_v = solve(A_ak @ v)                                             # [B, H, n, L, V]
    Q = r * G.exp() + A_rb @ Wm                                       # O = Q S0 + O_v
    O_v = A_rb @ U_v + A_rk @ v
    tail_b, tail_k = b * (G_end - G).exp(), k * (G_end - G).exp()
    M = torch.diag_embed(G_end[:, :, :, 0].exp()) + tail_b.transpose(-1, -2) @ Wm     # S_L = M S0 + E
    E = tail_b.transpose(-1, -2) @ U_v + tail_k.transpose(-1, -2) @ v                 # [B, H, n, K, V]

    S = r.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    entering = []
    for c in range(n):
        entering.append(S)
        S = torch.baddbmm(E[:, :, c].reshape(B * H, K, V), M[:, :, c].reshape(B * H, K, K),
                          S.reshape(B * H, K, V)).view(B, H, K, V)
    o = Q @ torch.stack(entering, dim=2) + O_v                        # [B, H, n, L, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * L, H, V)[:, :T]
    return o, S
