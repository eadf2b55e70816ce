"""Partial rotary position embedding in the authors' convention (docs/reference-conventions.md §4.5).

Differences from the common ``theta**(-2j/r)`` RoPE, all deliberate for checkpoint parity:
the rotated channels are the first ``rope_dim`` ones in adjacent pairs (0,1), (2,3), ...;
the frequencies are ``f_j = theta**(-j/(r/2 - 1))`` (the exponent is an inclusive linspace, so
the slowest frequency is exactly 1/theta); the pair is rotated by ``-p*f``.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "rope_frequencies"]

Positions = Union[int, Tensor]


def rope_frequencies(rope_dim: int, theta: float, device=None) -> Tensor:
    """``[rope_dim // 2]`` fp32 angular frequencies ``theta**(-j/(rope_dim/2 - 1))``.

    With ``rope_dim == 2`` the single pair gets frequency 1.0 (the linspace has one point, 0).
    """
    # Same expression as the reference so fp32 frequencies agree bit for bit.
    exponent = torch.linspace(0.0, 1.0, steps=rope_dim // 2, dtype=torch.float32, device=device)
    return (1.0 / theta) ** exponent


class RotaryEmbedding(nn.Module):
    """Rotate the first ``rope_dim`` channels of ``[B, H, T, D]`` tensors by their positions.

    Args:
        rope_dim: number of leading channels rotated (even; 0 = NoPE, identity).
        theta: base of the frequencies (10000 in every paper config).
        reference_bf16: round cos/sin to bf16 before use, as the authors' code does even for fp32
            models; needed to reproduce their checkpoints' outputs bit-closely.
    """

    def __init__(self, rope_dim: int, theta: float = 10000.0, reference_bf16: bool = False):
        super().__init__()
        if rope_dim < 0 or rope_dim % 2:
            raise ValueError(f"rope_dim must be a non-negative even number, got {rope_dim}")
        if not theta > 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.rope_dim = int(rope_dim)
        self.theta = float(theta)
        self.reference_bf16 = bool(reference_bf16)

    def extra_repr(self) -> str:
        return f"rope_dim={self.rope_dim}, theta={self.theta:g}, reference_bf16={self.reference_bf16}"

    def cos_sin(self, positions: Positions, seq_len: int, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each ``[T, rope_dim // 2]`` (``[B, 1, T, rope_dim // 2]`` for per-row positions) in
        ``dtype``, for the given positions.

        Args:
            positions: LongTensor ``[T]`` of absolute positions, ``[B, T]`` per batch row, or an int offset
                (positions ``offset .. offset + T - 1``).
            seq_len: T.
        """
        if isinstance(positions, Tensor):
            if positions.dim() not in (1, 2) or positions.shape[-1] != seq_len:
                raise ValueError(f"positions must be a tensor [T] or [B, T] with T={seq_len}, got shape "
                                 f"{tuple(positions.shape)}")
            pos = positions.to(device=device)
        else:
            pos = torch.arange(int(positions), int(positions) + seq_len, device=device)
        # Angles in fp32 whatever the compute dtype: bf16 positions lose integers past 256.
        angles = pos.to(torch.float32)[..., None] * rope_frequencies(self.rope_dim, self.theta, device)
        if angles.dim() == 3:       # per-row positions [B, T]: [B, 1, T, r/2], broadcast over the heads
            angles = angles.unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        if self.reference_bf16:
            cos, sin = cos.bfloat16(), sin.bfloat16()
        return cos.to(dtype), sin.to(dtype)

    def apply_rotary(self, x: Tensor, positions: Positions) -> Tensor:
        """Rotate ``x [B, H, T, D]`` (any leading dims, T second to last); returns the same shape.

        Pair ``(x0, x1)`` at position p becomes ``(x0*cos + x1*sin, x1*cos - x0*sin)`` with angle
        ``p*f_j``; channels ``>= rope_dim`` pass through unchanged.
        """
        r = self.rope_dim
        if r > x.shape[-1]:
            raise ValueError(f"rope_dim={r} exceeds the head dim {x.shape[-1]} of x; lower rope_dim")
        if r == 0:
            return x
        cos, sin = self.cos_sin(positions, x.shape[-2], x.device, x.dtype)
        pairs = x[..., :r].unflatten(-1, (r // 2, 2))  # [..., T, r/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x0 * cos + x1 * sin, x1 * cos - x0 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, x[..., r:]), dim=-1)

    forward = apply_rotary
