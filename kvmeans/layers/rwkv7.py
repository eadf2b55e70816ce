"""The RWKV-7 "Goose" time mixer, the paper's fixed-state RNN baseline (reference 4.12), and its state.

Per call, with ``x [B, T, C]`` and its predecessor row (zero before the first token, the cache's after):
token shift ``x_* = x + (x_{t-1} - x) * mu_*`` for r, w, k, v, a, g -> ``r = W_r x_r``, ``k = W_k x_k``,
``v = W_v x_v`` -> log decay ``w = -e^{-1/2} sigmoid(lora_w(x_w))`` (decay in (0.545, 1)) -> value residual
``v = lerp(v, v_first, sigmoid(lora_v(x_v)))`` (not in the first layer, whose own v is the anchor) ->
in-context learning rate ``iclr = sigmoid(lora_a(x_a))`` -> removal key ``kk = normalize(k * k_k)`` per head
-> ``k = k * (1 + (iclr - 1) * k_a)`` -> the generalised delta rule (:func:`rwkv7_attention` with
``a = -kk``, ``b = kk * iclr``) -> GroupNorm per head -> bonus ``+ (r . (k * r_k)) v`` per head -> gate
``* lora_g(x_g)`` -> ``o_proj``. Parameter names and the initialisation follow flash-linear-attention's
``RWKV7Attention`` (the authors' RWKV-7 baseline runs fla's layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvmeans.ops.rwkv7 import BACKENDS, rwkv7_attention
from kvmeans.ops.state import BatchedState
from kvmeans.utils.fields import check_field_types

__all__ = ["RWKV7Config", "RWKV7TimeMix", "RWKV7State", "LoRA"]

_LOG_DECAY_SCALE = -math.exp(-0.5)


def _bad(cfg, name, problem, fix):
    raise ValueError(f"{type(cfg).__name__}.{name}: {problem}; {fix}")


def _lora_width(factor: float, hidden: int) -> int:
    """fla's default LoRA widths: ``max(32, round(factor * sqrt(hidden) / 32) * 32)``."""
    return max(32, int(round(factor * hidden ** 0.5 / 32)) * 32)


@dataclass
class RWKV7Config:
    """One RWKV-7 time mixer; ``None`` LoRA widths take fla's defaults (64/64/32/128 at C=768, head 64)."""

    hidden_size: int
    num_heads: int
    layer_idx: int = 0
    num_layers: int = 1
    value_residual: bool = True             # layers after the first mix their value with the first layer's
    decay_lora: Optional[int] = None        # -> 2.5 sqrt(C) * head_dim/64, rounded to 32
    iclr_lora: Optional[int] = None         # -> as decay_lora
    value_lora: Optional[int] = None        # -> 1.7 sqrt(C) * head_dim/64
    gate_lora: Optional[int] = None         # -> 5 sqrt(C)
    norm_eps: float = 1e-5                  # GroupNorm eps = head_dim * norm_eps (64e-5 at head_dim 64)
    chunk_size: int = 64
    backend: str = "auto"
    init_output_zero: bool = True           # o_proj starts at zero (each block the identity); tests need False

    def __post_init__(self):
        check_field_types(self)
        for name in ("hidden_size", "num_heads", "num_layers", "chunk_size"):
            if getattr(self, name) < 1:
                _bad(self, name, f"must be >= 1, got {getattr(self, name)}", f"pass a positive {name}")
        if self.hidden_size % self.num_heads:
            _bad(self, "num_heads", f"{self.num_heads} does not divide hidden_size={self.hidden_size}",
                 "RWKV-7 splits the hidden size into heads: pick a divisor (head_dim 64 is the usual)")
        if not 0 <= self.layer_idx < self.num_layers:
            _bad(self, "layer_idx", f"must be in [0, num_layers={self.num_layers}), got {self.layer_idx}",
                 "pass the layer's index and the model depth")
        scale = self.head_dim / 64
        defaults = {"decay_lora": 2.5 * scale, "iclr_lora": 2.5 * scale, "value_lora": 1.7 * scale, "gate_lora": 5.0}
        for name, factor in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, _lora_width(factor, self.hidden_size))
            elif getattr(self, name) < 1:
                _bad(self, name, f"must be >= 1, got {getattr(self, name)}", "pass a positive width or None")
        if not self.norm_eps > 0:
            _bad(self, "norm_eps", f"must be > 0, got {self.norm_eps}", "use e.g. 1e-5")
        if self.backend not in BACKENDS:
            _bad(self, "backend", f"must be one of {BACKENDS}, got {self.backend!r}",
                 "use 'auto' (fla's kernels on CUDA when installed, torch otherwise)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class LoRA(nn.Module):
    """``lora.2(act(lora.0(x)))`` (fla's module and key names); ``lora.0`` starts at zero, ``lora.2``
    orthogonal with gain 0.1, the bias at zero (set by the owner)."""

    def __init__(self, dim_in: int, dim_out: int, width: int, activation: Optional[nn.Module], bias: bool = True):
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(dim_in, width, bias=False), activation or nn.Identity(),
                                  nn.Linear(width, dim_out, bias=bias))
        with torch.no_grad():
            nn.init.zeros_(self.lora[0].weight)
            gain = math.sqrt(width / dim_out) if width > dim_out else 1.0
            _orthogonal_(self.lora[2].weight, 0.1 * gain)
            if bias:
                nn.init.zeros_(self.lora[2].bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.lora(x)


def _orthogonal_(weight: Tensor, gain: float) -> None:
    """Orthogonal init computed in fp32 (QR has no bf16 kernel)."""
    w = weight.detach().float()
    nn.init.orthogonal_(w, gain=gain)
    weight.data.copy_(w)


@dataclass
class RWKV7State(BatchedState):
    """Carried state of one RWKV-7 time mixer: the same bytes after 10 tokens or 10 million.

    Attributes:
        state: ``[B, H, K, V]`` float32 matrix state of the delta rule.
        x_prev: ``[B, C]`` the last input row (the next call's token-shift predecessor).
        seen_tokens: tokens processed (the longest row's, after :meth:`stack`).  extras: unused (the common
            state interface).
    """

    state: Tensor
    x_prev: Tensor
    seen_tokens: int = 0
    extras: dict = field(default_factory=dict)

    _TENSORS = ("state", "x_prev")

    @classmethod
    def stack(cls, states: List["RWKV7State"]) -> "RWKV7State":
        """One state holding the rows of ``states`` in order. Rows may have seen different numbers of tokens:
        nothing in the recurrence depends on positions, so such a batch continues in one call."""
        return cls(torch.cat([s.state for s in states]), torch.cat([s.x_prev for s in states]),
                   max(s.seen_tokens for s in states))

    def __repr__(self) -> str:
        B, H, K, V = self.state.shape
        return (f"RWKV7State(batch={B}, heads={H}, state={K}x{V}, seen_tokens={self.seen_tokens}, "
                f"dtype={self.state.dtype})")


torch.serialization.add_safe_globals([RWKV7State])      # torch.load(..., weights_only=True) reads it


class RWKV7TimeMix(nn.Module):
    """RWKV-7 time mixer. Shapes: x ``[B, T, C]``, H heads of K = C/H channels.

    Parameters: ``x_r, x_w, x_k, x_v, x_a, x_g [1, 1, C]`` (token-shift mixes), ``k_k, k_a [C]``, ``r_k [H, K]``
    (bonus), ``r_proj, k_proj, v_proj, o_proj [C, C]``, ``w_lora`` (tanh), ``a_lora``, ``v_lora`` (value_residual,
    not in layer 0), ``g_lora`` (sigmoid, no bias), ``g_norm`` (GroupNorm(H, C)).
    """

    def __init__(self, config: RWKV7Config):
        super().__init__()
        self.config = c = config
        C, H, K = c.hidden_size, c.num_heads, c.head_dim
        ratio_0_to_1 = c.layer_idx / max(c.num_layers - 1, 1)
        ratio_1_to_0 = 1.0 - c.layer_idx / c.num_layers
        n = torch.arange(C, dtype=torch.float64)
        frac = (n / C).view(1, 1, C)
        linear = n / max(C - 1, 1) - 0.5
        zigzag = ((n % K) - (K - 1) / 2) / max((K - 1) / 2, 0.5)
        zigzag = zigzag * zigzag.abs()
        decay = -6 + 6 * (n / max(C - 1, 1)) ** (1 + ratio_0_to_1 ** 0.3)
        dt = torch.get_default_dtype()
        mix = lambda p: nn.Parameter((1.0 - frac.pow(p * ratio_1_to_0)).to(dt))
        self.x_r, self.x_w, self.x_k = mix(0.2), mix(0.9), mix(0.7)
        self.x_v, self.x_a, self.x_g = mix(0.7), mix(0.9), mix(0.2)
        self.k_k = nn.Parameter((0.71 - 0.1 * linear).to(dt))
        self.k_a = nn.Parameter(torch.full((C,), 1.02, dtype=dt))
        self.r_k = nn.Parameter(torch.full((H, K), -0.04, dtype=dt))
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.w_lora = LoRA(C, C, c.decay_lora, nn.Tanh())
        self.v_lora = LoRA(C, C, c.value_lora, None) if c.value_residual and c.layer_idx > 0 else None
        self.a_lora = LoRA(C, C, c.iclr_lora, None)
        self.g_lora = LoRA(C, C, c.gate_lora, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(H, C, eps=K * c.norm_eps)
        with torch.no_grad():
            self.w_lora.lora[2].bias.copy_(decay + 0.5 + 2.5 * zigzag)
            self.a_lora.lora[2].bias.copy_(-0.19 + 0.3 * zigzag + 0.4 * linear)
            if self.v_lora is not None:
                self.v_lora.lora[2].bias.copy_(0.73 - 0.4 * linear)
            self.g_norm.weight.fill_(((c.layer_idx + 1) / c.num_layers) ** 0.7)
            _orthogonal_(self.r_proj.weight, 1.0)
            _orthogonal_(self.k_proj.weight, 0.1)
            _orthogonal_(self.v_proj.weight, 1.0)
            if c.init_output_zero:
                self.o_proj.weight.zero_()

    def _shift_delta(self, x: Tensor, state: Optional[RWKV7State]) -> Tensor:
        """``x_{t-1} - x_t`` for ``x [B, T, C]``; the predecessor of the first token is the state's last row
        (zeros at the start of a sequence)."""
        head = x.new_zeros(x.shape[0], 1, x.shape[2]) if state is None else state.x_prev.to(x.dtype).unsqueeze(1)
        return torch.cat((head, x[:, :-1]), dim=1) - x

    def value_anchor(self, x: Tensor, state: Optional[RWKV7State] = None) -> Tensor:
        """This layer's value ``v_proj(x_v) [B, T, C]`` for input ``x``: the value-residual anchor (``v_first``)
        of the layers after it when it is the model's first layer."""
        return self.v_proj(x + self._shift_delta(x, state) * self.x_v)

    def forward(self, x: Tensor, state: Optional[RWKV7State] = None,
                v_first: Optional[Tensor] = None) -> Tuple[Tensor, RWKV7State]:
        """``x [B, T, C]`` -> ``(y [B, T, C], state)``.

        Args:
            state: None to start sequences, or the state returned by the previous call (not modified: a new
                one is returned, so a kept state is a snapshot).
            v_first: ``[B, T, C]`` the first layer's value (:meth:`value_anchor`); None (or no ``v_lora``): no mix.
        """
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.hidden_size or x.shape[1] == 0:
            raise ValueError(f"RWKV7TimeMix: x must be [B, T>=1, hidden_size={c.hidden_size}], got {list(x.shape)}")
        if state is not None:
            state.check_batch(x.shape[0], type(self).__name__)
        B, T, C = x.shape
        H, K = c.num_heads, c.head_dim
        delta = self._shift_delta(x, state)
        xr, xw, xk, xv, xa, xg = (x + delta * mu for mu in (self.x_r, self.x_w, self.x_k, self.x_v,
                                                           self.x_a, self.x_g))
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = _LOG_DECAY_SCALE * torch.sigmoid(self.w_lora(xw))
        if self.v_lora is not None and v_first is not None:
            if v_first.shape != v.shape:
                raise ValueError(f"RWKV7TimeMix: v_first must be [B, T, C] = {list(v.shape)}, "
                                 f"got {list(v_first.shape)}")
            v = torch.lerp(v, v_first.to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        iclr = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.k_k).view(B, T, H, K), dim=-1)
        k = k * (1 + (iclr - 1) * self.k_a)
        heads = lambda t: t.view(B, T, H, K)
        r, w, k, v, iclr = heads(r), heads(w), heads(k), heads(v), heads(iclr)
        o, S = rwkv7_attention(r, w, k, v, -kk, kk * iclr, chunk_size=c.chunk_size, backend=c.backend,
                               initial_state=None if state is None else state.state)
        o = self.g_norm(o.reshape(B * T, C)).view(B, T, H, K)
        o = o + (r * k * self.r_k).sum(-1, keepdim=True) * v              # the bonus: the current token's own value
        y = self.o_proj(o.reshape(B, T, C) * g)
        seen = 0 if state is None else state.seen_tokens
        # clone: a view would keep the whole call's input alive inside the state
        return y, RWKV7State(S, x[:, -1].clone(), seen + T)
