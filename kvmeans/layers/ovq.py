"""Online Vector-Quantised attention (OVQ), the paper's second baseline (reference 4.11).

After the GPTAlpha-2 preparation *without* qk-LayerNorm and RoPE, q and k are L2-normalised
(``x / (|x| + 1e-5)``) and q is scaled by ``beta_h * sqrt(D)`` (SDPA scale 1). Tokens are
processed in chunks of C at absolute positions; chunk c attends to ``[dictionary ; chunk c
causal]`` with an additive ``log(count)`` bias on the dictionary logits. After a chunk completes,
the dictionary grows to ``min(floor(t*N/(t+N)), N)`` rows (t = tokens so far, N = max_centroids):
every chunk token goes to its most similar centroid, the ``num_new`` tokens with the lowest
best-similarity become new centroids instead, and centroids become exact running means of their
assigned keys / values. The tokens of an unfinished chunk wait in the state ("pending").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from kvmeans.layers.attention import AttentionConfig, GPTAlphaAttention, _bad
from kvmeans.layers.baselines import _sdpa
from kvmeans.layers.states import BatchedState, expand_kv, pack_rows

__all__ = ["OVQConfig", "OVQAttention", "OVQState", "ovq_dict_size"]


@dataclass
class OVQConfig(AttentionConfig):
    """OVQ layer: ``chunk_len`` C (256 in the paper), ``max_centroids`` N (1024)."""

    rope_dim: Optional[int] = 0             # OVQ ignores positions entirely
    qk_norm: bool = False
    chunk_len: int = 256
    max_centroids: int = 1024
    norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        if self.rope_dim or self.qk_norm:
            _bad(self, "rope_dim" if self.rope_dim else "qk_norm", "OVQ has no RoPE and no qk-LayerNorm "
                 "(reference 4.11)", "leave rope_dim=0 and qk_norm=False")
        for name in ("chunk_len", "max_centroids"):
            if getattr(self, name) < 1:
                _bad(self, name, f"must be >= 1, got {getattr(self, name)}", f"pass a positive {name}")


def ovq_dict_size(tokens: int, max_centroids: int) -> int:
    """Dictionary rows once ``tokens`` (a multiple of C) are absorbed: ``min(floor(t*N/(t+N)), N)``.

    ``t*N/(t+N)`` increases with t, so the floor is already non-decreasing: the reference's
    running max never binds and the size depends on t alone.
    """
    return min(tokens * max_centroids // (tokens + max_centroids), max_centroids) if tokens > 0 else 0


@dataclass
class OVQState(BatchedState):
    """Carried state of one OVQ layer.

    Attributes:
        dict_keys: ``[B, Hkv, N, D]`` centroid keys (rows ``[0, size)`` in use).
        dict_values: ``[B, Hkv, N, Dv]`` centroid values.
        counts: ``[B, Hkv, N]`` fp32 tokens assigned to each centroid.
        pending_keys: ``[B, Hkv, C-1, D]`` normalised keys of the unfinished chunk (first
            ``pending_len`` rows in use).  pending_values: ``[B, Hkv, C-1, Dv]``.
        size: dictionary rows in use.  seen_tokens: tokens processed.  extras: token-shift rows.
    """

    dict_keys: Tensor
    dict_values: Tensor
    counts: Tensor
    pending_keys: Tensor
    pending_values: Tensor
    size: int = 0
    pending_len: int = 0
    seen_tokens: int = 0
    extras: dict = field(default_factory=dict)

    _TENSORS = ("dict_keys", "dict_values", "counts", "pending_keys", "pending_values")

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, value_dim: int, max_centroids: int,
              chunk_len: int, like: Tensor) -> "OVQState":
        z = lambda n, *d: like.new_zeros(batch, kv_heads, n, *d)
        return cls(z(max_centroids, head_dim), z(max_centroids, value_dim),
                   z(max_centroids).float(), z(chunk_len - 1, head_dim), z(chunk_len - 1, value_dim))

    def __repr__(self) -> str:
        B, Hkv, N, D = self.dict_keys.shape
        return (f"OVQState(batch={B}, kv_heads={Hkv}, head_dim={D}, centroids={self.size}/{N}, "
                f"pending={self.pending_len}, seen_tokens={self.seen_tokens}, dtype={self.dict_keys.dtype})")


def _l2(x: Tensor, eps: float) -> Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


@torch.no_grad()
def _assign(dict_keys: Tensor, size: int, keys: Tensor, num_new: int) -> Tensor:
    """Centroid index ``[B, Hkv, C]`` of each chunk key ``keys [B, Hkv, C, D]`` (no gradient flows
    through argmax): nearest old centroid, except the ``num_new`` least similar tokens, which get
    the new rows ``size, size+1, ...``. An empty dictionary uses token 0 as the yardstick."""
    B, Hkv, C, _ = keys.shape
    if size == 0:
        assign = keys.new_zeros(B, Hkv, C, dtype=torch.long)
        if num_new <= 1:
            return assign
        sim = (keys * keys[:, :, :1]).sum(-1)
        sim[:, :, 0] = float("inf")                         # token 0 is centroid 0 already
        low, first_id = sim.topk(num_new - 1, dim=-1, largest=False).indices, 1
    else:
        best, assign = (keys @ dict_keys[:, :, :size].transpose(-1, -2)).max(dim=-1)
        if num_new == 0:
            return assign
        low, first_id = best.topk(num_new, dim=-1, largest=False).indices, size
    ids = torch.arange(first_id, first_id + low.shape[-1], device=keys.device).expand(B, Hkv, -1)
    return assign.scatter(2, low, ids)


def _absorb(dk: Tensor, dv: Tensor, counts: Tensor, size: int, keys: Tensor, values: Tensor, num_new: int):
    """Fold one full chunk ``keys [B, Hkv, C, D]``, ``values`` into the dictionary (functional).

    Returns new ``(dict_keys, dict_values, counts)``; centroids are count-weighted running means.
    """
    assign = _assign(dk, size, keys, num_new)                               # [B, Hkv, C]
    added = torch.zeros_like(counts).scatter_add(2, assign, torch.ones_like(assign, dtype=counts.dtype))
    total = counts + added
    w_old = (counts / total.clamp_min(1)).to(dk.dtype).unsqueeze(-1)       # untouched rows: 1
    inv = (1.0 / total.clamp_min(1)).to(dk.dtype).unsqueeze(-1)

    def mean(d: Tensor, x: Tensor) -> Tensor:
        sums = torch.zeros_like(d).scatter_add(2, assign.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]), x)
        return torch.where(added.unsqueeze(-1) > 0, d * w_old + sums * inv, d)

    return mean(dk, keys), mean(dv, values), total


class OVQAttention(GPTAlphaAttention):
    """OVQ attention layer: GPTAlpha-2 preparation (no qk-LN, no RoPE) plus ``beta [H]`` (init 1).

    Shapes: x ``[B, T, hidden]``; dictionary per KV head (query head h reads kv head ``h // (H/Hkv)``).
    """

    def __init__(self, config: OVQConfig):
        super().__init__(config)
        self.beta = nn.Parameter(torch.ones(config.num_heads))

    def forward(self, x: Tensor, state: Optional[OVQState] = None, v_first: Optional[Tensor] = None):
        """``x [B, T, hidden]`` -> ``(y [B, T, hidden], state)``; ``v_first [B, T, Hkv*Dv]`` or None.

        ``state`` (None at position 0) is advanced in place and returned.
        """
        c = self.config
        if state is not None:
            state.check_batch(x.shape[0], type(self).__name__)
        q, k, v, _, extras = self._prepare(x, state, None, v_first)
        B, H, T, D = q.shape
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        q = _l2(q, c.norm_eps) * (self.beta.to(compute) * math.sqrt(D)).view(1, H, 1, 1)
        k = _l2(k, c.norm_eps)
        if state is None:
            state = OVQState.empty(B, k.shape[1], D, v.shape[3], c.max_centroids, c.chunk_len, like=k)
        L, N = c.chunk_len, c.max_centroids
        dk, dv, counts, size = state.dict_keys, state.dict_values, state.counts, state.size
        pk = state.pending_keys[:, :, :state.pending_len]
        pv = state.pending_values[:, :, :state.pending_len]

        ys, pos, i = [], state.seen_tokens, 0
        while i < T:
            seg = min(T - i, L - pos % L)                   # up to the next chunk boundary
            pk, pv = torch.cat((pk, k[:, :, i:i + seg]), dim=2), torch.cat((pv, v[:, :, i:i + seg]), dim=2)
            ys.append(self._attend(q[:, :, i:i + seg], dk[:, :, :size], dv[:, :, :size], counts[:, :, :size], pk, pv))
            pos, i = pos + seg, i + seg
            if pos % L == 0:                                # chunk complete: update the dictionary
                new_size = ovq_dict_size(pos, N)
                dk, dv, counts = _absorb(dk, dv, counts, size, pk, pv, new_size - size)
                size, pk, pv = new_size, pk[:, :, :0], pv[:, :, :0]

        state.dict_keys, state.dict_values, state.counts, state.size = dk, dv, counts, size
        state.pending_keys, state.pending_values = pack_rows(pk, L - 1), pack_rows(pv, L - 1)
        state.pending_len, state.seen_tokens = pk.shape[2], pos
        state.extras.update(extras)
        return self._project_out(torch.cat(ys, dim=2).to(x.dtype)), state

    @staticmethod
    def _attend(q: Tensor, dk: Tensor, dv: Tensor, counts: Tensor, ck: Tensor, cv: Tensor) -> Tensor:
        """``q [B, H, s, D]`` (the last s tokens of the chunk so far ``ck [B, Hkv, p+s, D]``) over
        ``[centroids dk [B, Hkv, d, D] ; chunk causal]`` with ``log(counts [B, Hkv, d])`` added to the
        centroid logits. Returns ``[B, H, s, Dv]``."""
        B, H, s, _ = q.shape
        n = ck.shape[2]
        g = H // ck.shape[1]
        causal = torch.ones(s, n, dtype=torch.bool, device=q.device).tril(n - s)
        chunk_bias = torch.zeros(s, n, dtype=q.dtype, device=q.device).masked_fill(~causal, float("-inf"))
        dict_bias = expand_kv(counts.log().to(q.dtype).unsqueeze(-1), g).transpose(-1, -2)  # [B, H, 1, d]
        bias = torch.cat((dict_bias.expand(B, H, s, -1), chunk_bias.expand(B, H, s, n)), dim=-1)
        k_star, v_star = torch.cat((dk, ck), dim=2), torch.cat((dv, cv), dim=2)
        return _sdpa(q, k_star, v_star, bias, scale=1.0)
