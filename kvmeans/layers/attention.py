"""GPTAlpha-2 attention preparation (reference 4.4) and the KVMAttention layer built on it.

Per call: ``q, k, v = x Wq, x Wk, x Wv`` -> value residual on v -> token shift on q, k, v ->
heads -> ``ln_q`` / ``ln_k`` over D -> RoPE on the first ``rope_dim`` channels -> a mixing core
(KVM here; full / sliding-window / OVQ in ``baselines.py`` / ``ovq.py``) -> ``c_proj``.
Parameter names follow the authors' checkpoints (docs/reference-conventions.md §5.3).
No attention maths lives here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvmeans.layers.rope import RotaryEmbedding
from kvmeans.layers.token_shift import attention_shift_alphas, token_shift
from kvmeans.ops.budget import BudgetLike, StateBudget, as_budget
from kvmeans.ops.kvm import BACKENDS, NUMERICS, kvm_attention
from kvmeans.utils.fields import check_field_types

__all__ = ["AttentionConfig", "GPTAlphaAttention", "Prepared", "KVMAttentionConfig", "KVMAttention"]


def _bad(cfg, name, problem, fix):
    raise ValueError(f"{type(cfg).__name__}.{name}: {problem}; {fix}")


@dataclass
class AttentionConfig:
    """The GPTAlpha-2 preparation shared by every mixer; ``None`` sizes are derived in ``__post_init__``.

    The flags are the paper's ablation switches: each one off removes its parameters.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: Optional[int] = None      # -> num_heads (GQA when smaller)
    head_dim: Optional[int] = None          # -> hidden_size // num_heads
    value_head_dim: Optional[int] = None    # -> head_dim
    rope_dim: Optional[int] = None          # -> head_dim // 2 rounded down to even; 0 = NoPE
    rope_theta: float = 10000.0
    rope_reference_bf16: bool = False       # round cos/sin to bf16 like the authors (checkpoint parity)
    token_shift: bool = True
    qk_norm: bool = True
    value_residual: bool = False
    layer_idx: int = 0
    num_layers: int = 1
    init_output_zero: bool = True           # reference inits c_proj to zeros; tests need False

    def __post_init__(self):
        check_field_types(self)
        for name in ("hidden_size", "num_heads", "num_layers"):
            if getattr(self, name) < 1:
                _bad(self, name, f"must be >= 1, got {getattr(self, name)}", f"pass a positive {name}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_kv_heads < 1:
            _bad(self, "num_kv_heads", f"must be >= 1, got {self.num_kv_heads}", "pass a positive count or None")
        if self.num_heads % self.num_kv_heads:
            _bad(self, "num_kv_heads", f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                 f"{self.num_kv_heads}", "choose num_kv_heads dividing num_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                _bad(self, "head_dim", f"hidden_size={self.hidden_size} is not divisible by num_heads="
                     f"{self.num_heads}", "pass head_dim explicitly or change num_heads")
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim < 1:
            _bad(self, "head_dim", f"must be >= 1, got {self.head_dim}", "pass a positive head_dim")
        if self.value_head_dim is None:
            self.value_head_dim = self.head_dim
        if self.value_head_dim < 1:
            _bad(self, "value_head_dim", f"must be >= 1, got {self.value_head_dim}", "pass a positive value_head_dim")
        if self.rope_dim is None:
            self.rope_dim = self.head_dim // 4 * 2
        if self.rope_dim < 0 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            _bad(self, "rope_dim", f"must be even and in [0, head_dim={self.head_dim}], got {self.rope_dim}",
                 "use an even rope_dim <= head_dim (0 disables RoPE)")
        if not self.rope_theta > 0:
            _bad(self, "rope_theta", f"must be > 0, got {self.rope_theta}", "use e.g. 10000.0")
        if not 0 <= self.layer_idx < self.num_layers:
            _bad(self, "layer_idx", f"must be in [0, num_layers={self.num_layers}), got {self.layer_idx}",
                 "pass the layer's index and the model depth")


@dataclass
class KVMAttentionConfig(AttentionConfig):
    """Configuration of one KVM attention layer: the shared preparation plus the KVM op's settings."""

    chunk_len: int = 256
    n_bswa_chunks: int = 2
    sink_len: int = 1
    budget: BudgetLike = field(default_factory=lambda: StateBudget.fixed(256))
    merge_gate: bool = True
    gate_appends: bool = False              # the authors' kvm_apply_merge_gate_to_appends (read it from config.json)
    head_temps: bool = True
    value_radius: bool = True
    sinks: bool = True                      # False -> no sink rows (sink_len treated as 0)
    state_norm_eps: float = 1e-5
    backend: str = "auto"
    numerics: str = "exact"                 # "mixed": half attention dots; "reference": the authors' eager rounding

    def __post_init__(self):
        super().__post_init__()
        if self.numerics not in NUMERICS:
            _bad(self, "numerics", f"must be one of {NUMERICS}, got {self.numerics!r}",
                 "use 'reference' to reproduce the authors' eager rounding, 'mixed' for half-precision attention "
                 "dots (fast on GPU), else 'exact'")
        if self.chunk_len < 1:
            _bad(self, "chunk_len", f"must be >= 1, got {self.chunk_len}", "pass a positive chunk_len")
        if self.n_bswa_chunks < 1:
            _bad(self, "n_bswa_chunks", f"must be >= 1, got {self.n_bswa_chunks}",
                 "the window needs at least the current chunk")
        if self.sink_len < 0:
            _bad(self, "sink_len", f"must be >= 0, got {self.sink_len}", "use 0 for no sinks")
        if self.sinks and self.sink_len >= self.chunk_len:
            _bad(self, "sink_len", f"sink_len={self.sink_len} must be < chunk_len={self.chunk_len}",
                 "lower sink_len so the first chunk leaves mergeable rows")
        if not self.state_norm_eps > 0:
            _bad(self, "state_norm_eps", f"must be > 0, got {self.state_norm_eps}", "use e.g. 1e-5")
        if self.backend not in BACKENDS:
            _bad(self, "backend", f"must be one of {BACKENDS}, got {self.backend!r}",
                 "use 'auto' (Triton on CUDA when installed, torch otherwise)")
        try:
            self.budget = as_budget(self.budget)
        except (TypeError, ValueError) as err:
            raise type(err)(f"KVMAttentionConfig.budget: {err}") from None

    @property
    def effective_sink_len(self) -> int:
        return self.sink_len if self.sinks else 0


class Prepared(NamedTuple):
    """Output of :meth:`GPTAlphaAttention._prepare`."""

    q: Tensor       # [B, H, T, D]   after ln_q and RoPE
    k: Tensor       # [B, Hkv, T, D] after ln_k and RoPE
    v: Tensor       # [B, Hkv, T, Dv] after value residual and token shift
    start: int      # absolute position of x[:, 0]
    extras: dict    # this call's last pre-shift q, k, v rows ([B, width] each): the next call's predecessors


class GPTAlphaAttention(nn.Module):
    """Parameters and preparation shared by the attention mixers; subclasses add a mixing core.

    Shapes: x ``[B, T, hidden]``; H = num_heads, Hkv = num_kv_heads, D = head_dim, Dv = value_head_dim.

    Parameters (present only with their flag): ``c_q [H*D, hidden]``, ``c_k [Hkv*D, hidden]``,
    ``c_v [Hkv*Dv, hidden]``, ``c_proj [hidden, H*Dv]``, ``ln_q``/``ln_k`` (qk_norm; LayerNorm(D)
    shared by heads), ``x_q [H*D]``, ``x_k [Hkv*D]``, ``x_v [Hkv*Dv]`` (token_shift alphas),
    ``v_gate0 [1,1,Hkv*Dv]``, ``v_gate1 [lora, hidden]``, ``v_gate2 [Hkv*Dv, lora]`` (value_residual).
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = c = config
        H, Hkv, D, Dv = c.num_heads, c.num_kv_heads, c.head_dim, c.value_head_dim
        d_q, d_k, d_v = H * D, Hkv * D, Hkv * Dv

        if c.token_shift:
            a_q, a_k, a_v = attention_shift_alphas(d_q, d_k, d_v, c.layer_idx, c.num_layers)
            self.x_q, self.x_k, self.x_v = nn.Parameter(a_q), nn.Parameter(a_k), nn.Parameter(a_v)
        else:
            self.x_q = self.x_k = self.x_v = None
        self._init_direct_parameters()
        if c.value_residual:
            # LoRA width as the reference: max(32, round(1.3*sqrt(hidden)/32)*32) (32 up to ~1.4k wide).
            lora = max(32, int(round(1.3 * math.sqrt(c.hidden_size) / 32)) * 32)
            ramp = torch.arange(d_v, dtype=torch.float32) / max(d_v - 1, 1) - 0.5
            self.v_gate0 = nn.Parameter((0.73 - 0.4 * ramp).view(1, 1, d_v).to(torch.get_default_dtype()))
            self.v_gate1 = nn.Linear(c.hidden_size, lora, bias=False)
            self.v_gate2 = nn.Linear(lora, d_v, bias=False)
            with torch.no_grad():
                self.v_gate1.weight.zero_()  # the mix starts as a per-channel constant
                nn.init.orthogonal_(self.v_gate2.weight, gain=0.1)
        else:
            self.v_gate0 = self.v_gate1 = self.v_gate2 = None

        self.c_q = nn.Linear(c.hidden_size, d_q, bias=False)
        self.c_k = nn.Linear(c.hidden_size, d_k, bias=False)
        self.c_v = nn.Linear(c.hidden_size, d_v, bias=False)
        self.ln_q = nn.LayerNorm(D) if c.qk_norm else None
        self.ln_k = nn.LayerNorm(D) if c.qk_norm else None
        self.c_proj = nn.Linear(H * Dv, c.hidden_size, bias=False)
        if c.init_output_zero:
            nn.init.zeros_(self.c_proj.weight)  # each block starts as the identity (reference init)
        self.rotary = RotaryEmbedding(c.rope_dim, c.rope_theta, c.rope_reference_bf16)

    def _init_direct_parameters(self) -> None:
        """Hook for subclass parameters created before the projections (keeps the RNG order stable)."""

    def _prepare(self, x: Tensor, state=None, position_offset: Optional[int] = None,
                 v_first: Optional[Tensor] = None) -> Prepared:
        """GPTAlpha-2 preparation of ``x [B, T, hidden]`` continuing ``state`` (None at position 0).

        ``v_first`` ``[B, T, Hkv*Dv]`` is the value-residual anchor (None: the layer is its own anchor,
        so the mix is a no-op). RoPE positions start at ``position_offset`` (default ``state.seen_tokens``).
        """
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.hidden_size or x.shape[1] == 0:
            raise ValueError(f"x must be [B, T>=1, hidden_size={c.hidden_size}], got {list(x.shape)}")
        B, T, _ = x.shape
        seen = 0 if state is None else state.seen_tokens
        start = seen if position_offset is None else int(position_offset)
        if position_offset is None and getattr(state, "schedule", None) is not None:
            start = state.schedule.positions(T, x.device)              # a ragged batch: [B, T] per row

        q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        if c.value_residual:
            v_first = self._check_v_first(v_first, v)
            mix = torch.sigmoid(self.v_gate0 + self.v_gate2(self.v_gate1(x)))
            v = v + (v_first.to(v.dtype) - v) * mix.to(v.dtype)
        extras = {}
        if c.token_shift:
            prev = self._shift_predecessors(state, seen)
            # clone: a view would keep the whole [B, T, width] projections alive inside the state
            extras = {"shift_q": q[:, -1].clone(), "shift_k": k[:, -1].clone(), "shift_v": v[:, -1].clone()}
            q = token_shift(q, self.x_q, prev["shift_q"], "first")
            k = token_shift(k, self.x_k, prev["shift_k"], "first")
            v = token_shift(v, self.x_v, prev["shift_v"], "first")

        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.ln_q(q), self.ln_k(k)
        q = self.rotary(q.transpose(1, 2), start)                       # [B, H, T, D]
        k = self.rotary(k.transpose(1, 2), start)                       # [B, Hkv, T, D]
        v = v.view(B, T, c.num_kv_heads, c.value_head_dim).transpose(1, 2)  # [B, Hkv, T, Dv]
        return Prepared(q, k, v, start, extras)

    def _project_out(self, y: Tensor) -> Tensor:
        """``y [B, H, T, Dv]`` -> ``c_proj`` output ``[B, T, hidden]``."""
        B, H, T, Dv = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(B, T, H * Dv))

    def _check_v_first(self, v_first: Optional[Tensor], v: Tensor) -> Tensor:
        if v_first is None:
            return v  # this is the first layer: its own plain projection is the anchor
        if v_first.shape != v.shape:
            raise ValueError(f"v_first must be [B, T, Hkv*Dv] = {list(v.shape)}, got {list(v_first.shape)}")
        return v_first

    def _shift_predecessors(self, state, seen: int) -> dict:
        """Last pre-shift q, k, v rows of the previous call (``[B, width]`` each), or Nones."""
        names = ("shift_q", "shift_k", "shift_v")
        extras = {} if state is None else (getattr(state, "extras", None) or {})
        if seen == 0:
            return dict.fromkeys(names)
        missing = [n for n in names if n not in extras]
        if missing:
            raise ValueError(f"state has seen {seen} tokens but carries no token-shift predecessors "
                             f"{missing}; pass the state returned by this layer, not one built elsewhere")
        return {n: extras[n] for n in names}


# torch.compile traces the layer around the op, not the op: its chunk schedule and routing are Python over
# the state's token count and buffer sizes (guards change at every chunk boundary and per layer, so tracing
# it recompiled until the limit and broke the graph in routing); its GPU work is its own Triton kernels
_kvm_attention_eager = torch.compiler.disable(kvm_attention)


class KVMAttention(GPTAlphaAttention):
    """Key-Value Means attention layer: the GPTAlpha-2 preparation, then ``kvm_attention``.

    Shapes: x ``[B, T, hidden]``; see :class:`GPTAlphaAttention` for the shared parameters.
    KVM-only parameters: ``ln_s_k`` (LN_s, LayerNorm(D)), ``key_weighting [Hkv, hidden]``
    (merge_gate), ``state_head_temp``/``front_head_temp [H]`` (head_temps).
    """

    def __init__(self, config: KVMAttentionConfig):
        super().__init__(config)
        c = config
        self.ln_s_k = nn.LayerNorm(c.head_dim, eps=c.state_norm_eps)
        self.key_weighting = nn.Linear(c.hidden_size, c.num_kv_heads, bias=False) if c.merge_gate else None

    def _init_direct_parameters(self) -> None:
        if self.config.head_temps:
            self.state_head_temp = nn.Parameter(torch.ones(self.config.num_heads))
            self.front_head_temp = nn.Parameter(torch.ones(self.config.num_heads))
        else:
            self.state_head_temp = self.front_head_temp = None

    def forward(self, x: Tensor, state=None, position_offset: Optional[int] = None,
                v_first: Optional[Tensor] = None):
        """Attend over ``x [B, T, hidden]``, continuing ``state`` if given.

        Args:
            state: None to start a sequence at position 0, or the state returned by the previous
                call for these sequences (advanced in place by the op, and returned).
            position_offset: absolute RoPE position of ``x[:, 0]``; default ``state.seen_tokens``
                (0 without a state).
            v_first: ``[B, T, Hkv*Dv]`` value-residual anchor (the first layer's ``c_v(x0)``);
                ignored unless ``config.value_residual``.

        Returns:
            ``(y [B, T, hidden], state)``. Without ``v_first`` the value-residual mix is a no-op (the
            layer is its own anchor, as the first layer of a model).
        """
        c = self.config
        q, k, v, _, extras = self._prepare(x, state, position_offset, v_first)
        gate = None
        if c.merge_gate:
            gate = (1.0 + F.elu(self.key_weighting(x))).transpose(1, 2)  # [B, Hkv, T], > 0

        y, state = _kvm_attention_eager(
            q, k, v, gate, chunk_len=c.chunk_len, n_bswa_chunks=c.n_bswa_chunks,
            sink_len=c.effective_sink_len, rope_dim=c.rope_dim, budget=c.budget,
            state_norm_weight=self.ln_s_k.weight, state_norm_bias=self.ln_s_k.bias,
            state_norm_eps=c.state_norm_eps, state_temp=self.state_head_temp,
            bswa_temp=self.front_head_temp, value_radius=c.value_radius, initial_state=state,
            return_state=True, gate_keys=c.merge_gate, gate_values=c.merge_gate,
            gate_appends=c.gate_appends, backend=c.backend, numerics=c.numerics)
        state.extras.update(extras)
        return self._project_out(y), state
