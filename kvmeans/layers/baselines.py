"""Softmax-attention baselines on the GPTAlpha-2 preparation (reference 4.8-4.10).

* :class:`FullAttention` - causal attention over every past token (the paper's "GPTA").
* :class:`SlidingWindowAttention` - key j visible to query i iff ``i - W < j <= i``.
* :class:`BlockSlidingWindowAttention` - causal, key chunk ``>= query chunk - n + 1`` (chunks of C
  tokens at absolute positions), plus ``sink_len`` always-visible leading tokens.

They share :class:`GPTAlphaAttention`'s parameters and names (no ``ln_s_k``, ``key_weighting`` or
temperatures). Each ``forward(x, state=None, v_first=None)`` returns ``(y, state)``; the state is a
:class:`KVCacheState`, advanced in place when passed in. SWA / BSWA keep only the tokens a later
query can see (bounded memory); full attention grows its buffers geometrically.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.layers.attention import AttentionConfig, GPTAlphaAttention, _bad
from kvmeans.layers.states import KVCacheState, empty_kv_state, expand_kv, needs_graph, pack_rows

__all__ = ["SWAConfig", "BSWAConfig", "FullAttention", "SlidingWindowAttention", "BlockSlidingWindowAttention"]


@dataclass
class SWAConfig(AttentionConfig):
    """Sliding-window attention: ``window`` W (256 in the paper's hybrids)."""

    window: int = 256
    query_block: int = 512      # queries per SDPA call in long calls (memory O(T * (block + W)))

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            _bad(self, "window", f"must be >= 1, got {self.window}", "use e.g. 256")
        if self.query_block < 1:
            _bad(self, "query_block", f"must be >= 1, got {self.query_block}", "use e.g. 512")


@dataclass
class BSWAConfig(AttentionConfig):
    """Block sliding window: ``n_chunks`` chunks of ``chunk_len`` tokens, ``sink_len`` sinks."""

    chunk_len: int = 256
    n_chunks: int = 3
    sink_len: int = 0
    query_block: int = 512

    def __post_init__(self):
        super().__post_init__()
        for name in ("chunk_len", "n_chunks", "query_block"):
            if getattr(self, name) < 1:
                _bad(self, name, f"must be >= 1, got {getattr(self, name)}", f"pass a positive {name}")
        if self.sink_len < 0:
            _bad(self, "sink_len", f"must be >= 0, got {self.sink_len}", "use 0 for no sinks")


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, causal: bool = False,
          scale: Optional[float] = None) -> Tensor:
    """``q [B, H, Tq, D]`` over ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]`` -> ``[B, H, Tq, Dv]``.

    ``mask``: ``[Tq, L]`` boolean (True = visible) or additive float, broadcastable to ``[B, H, Tq, L]``.
    """
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, expand_kv(k, g), expand_kv(v, g), attn_mask=mask,
                                          is_causal=causal, scale=scale)


def _begin(layer, x: Tensor, state: Optional[KVCacheState], v_first: Optional[Tensor], capacity: int):
    """Shared start of a baseline forward: check the state's batch, prepare q/k/v, make an empty cache."""
    if state is not None:
        state.check_batch(x.shape[0], type(layer).__name__)
    q, k, v, _, extras = layer._prepare(x, state, None, v_first)
    if state is None:
        state = empty_kv_state(q.shape[0], k.shape[1], k.shape[3], v.shape[3], like=k, capacity=capacity)
    return q, k, v, extras, state


class FullAttention(GPTAlphaAttention):
    """Causal softmax attention over all past tokens (GPTAlpha-2 baseline).

    Shapes: x ``[B, T, hidden]``; cache keys ``[B, Hkv, capacity, D]`` grow by doubling.
    """

    def forward(self, x: Tensor, state: Optional[KVCacheState] = None, v_first: Optional[Tensor] = None):
        """``x [B, T, hidden]`` -> ``(y [B, T, hidden], state)``; ``v_first [B, T, Hkv*Dv]`` or None."""
        q, k, v, extras, state = _begin(self, x, state, v_first, capacity=0)
        B, _, T, _ = q.shape
        n = state.length
        k_all, v_all = self._append(state, k, v)
        if n == 0:
            y = _sdpa(q, k_all, v_all, causal=T > 1)
        else:
            # lower-right causal: query t sits at row n + t of the cache
            mask = None if T == 1 else torch.ones(T, n + T, dtype=torch.bool, device=q.device).tril(n)
            y = _sdpa(q, k_all, v_all, mask)
        state.extras.update(extras)
        return self._project_out(y), state

    @staticmethod
    def _append(state: KVCacheState, k: Tensor, v: Tensor):
        """Append ``k [B, Hkv, T, D]``, ``v`` to the cache; returns all rows ``(keys, values)``."""
        n, T = state.length, k.shape[2]
        if n == 0:
            # adopt the first call's tensors (no copy); full capacity, so the next append reallocates
            state.keys, state.values = k, v
        elif needs_graph(k, v, state.keys, state.values):
            # autograd: fresh tensors, since a later in-place write would invalidate saved views
            state.keys = torch.cat((state.keys[:, :, :n], k), dim=2)
            state.values = torch.cat((state.values[:, :, :n], v), dim=2)
        else:
            if n + T > state.keys.shape[2]:
                cap = max(n + T, 2 * state.keys.shape[2])
                state.keys = pack_rows(state.keys[:, :, :n], cap)
                state.values = pack_rows(state.values[:, :, :n], cap)
            state.keys[:, :, n:n + T] = k
            state.values[:, :, n:n + T] = v
        state.length, state.seen_tokens = n + T, state.seen_tokens + T
        return state.keys[:, :, :n + T], state.values[:, :, :n + T]


class _BandedAttention(GPTAlphaAttention):
    """Attention whose visible keys are a band ending at the query plus fixed sink tokens.

    Subclasses define ``_lowest(p)`` (first non-sink position visible to query p, non-decreasing
    in p), ``_visible(q_pos, k_pos)`` (boolean rule), ``sink_len`` and ``capacity`` (rows kept).
    """

    sink_len = 0

    def forward(self, x: Tensor, state: Optional[KVCacheState] = None, v_first: Optional[Tensor] = None):
        """``x [B, T, hidden]`` -> ``(y [B, T, hidden], state)``; ``v_first [B, T, Hkv*Dv]`` or None."""
        q, k, v, extras, state = _begin(self, x, state, v_first, capacity=self.capacity)
        B, _, T, _ = q.shape
        past_k, past_v = state.rows()
        k_all, v_all = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        seen, n_sinks, run_start = state.seen_tokens, state.n_sinks, state.run_start

        def row(p):  # row of position p in k_all (positions: [0, n_sinks) then [run_start, seen + T))
            return p if p < n_sinks else n_sinks + p - run_start

        ys, block = [], self.config.query_block
        for a in range(0, T, block):
            qa, qb = seen + a, seen + min(T, a + block)
            s_end = min(self.sink_len, qb)                  # sink positions [0, s_end) are always kept
            r0 = max(self._lowest(qa), s_end)
            idx = [(0, row(s_end - 1) + 1)] if s_end else []
            idx.append((row(r0), row(qb - 1) + 1))
            ks = torch.cat([k_all[:, :, i:j] for i, j in idx], dim=2)
            vs = torch.cat([v_all[:, :, i:j] for i, j in idx], dim=2)
            dev = q.device
            k_pos = torch.cat((torch.arange(s_end, device=dev), torch.arange(r0, qb, device=dev)))
            q_pos = torch.arange(qa, qb, device=dev)
            ys.append(_sdpa(q[:, :, a:a + block], ks, vs, self._visible(q_pos[:, None], k_pos[None, :])))

        total = seen + T
        ns = min(self.sink_len, total)
        r0 = max(self._lowest(total), ns)                   # what the next query can still see
        keep = [(0, row(ns - 1) + 1)] if ns else []
        keep.append((row(r0), row(total - 1) + 1) if r0 < total else (0, 0))
        kept_k = torch.cat([k_all[:, :, i:j] for i, j in keep], dim=2)
        kept_v = torch.cat([v_all[:, :, i:j] for i, j in keep], dim=2)
        state.keys, state.values = pack_rows(kept_k, self.capacity), pack_rows(kept_v, self.capacity)
        state.length, state.n_sinks, state.seen_tokens = kept_k.shape[2], ns, total
        state.extras.update(extras)
        return self._project_out(torch.cat(ys, dim=2)), state


class SlidingWindowAttention(_BandedAttention):
    """Token sliding window: key j visible to query i iff ``i - W < j <= i``; caches W - 1 tokens."""

    def __init__(self, config: SWAConfig):
        super().__init__(config)
        self.capacity = config.window - 1

    def _lowest(self, p: int) -> int:
        return max(0, p - self.config.window + 1)

    def _visible(self, qp: Tensor, kp: Tensor) -> Tensor:
        return (kp <= qp) & (kp > qp - self.config.window)


class BlockSlidingWindowAttention(_BandedAttention):
    """Block sliding window: causal, ``key // C >= query // C - n + 1`` or ``key < sink_len``.

    Caches the sinks plus the chunk-aligned window: at most ``sink_len + n*C - 1`` tokens.
    """

    def __init__(self, config: BSWAConfig):
        super().__init__(config)
        self.sink_len = config.sink_len
        self.capacity = config.sink_len + config.n_chunks * config.chunk_len - 1

    def _lowest(self, p: int) -> int:
        c = self.config
        return max(0, (p // c.chunk_len - c.n_chunks + 1) * c.chunk_len)

    def _visible(self, qp: Tensor, kp: Tensor) -> Tensor:
        c = self.config
        near = torch.div(kp, c.chunk_len, rounding_mode="floor") >= \
            torch.div(qp, c.chunk_len, rounding_mode="floor") - c.n_chunks + 1
        return (kp <= qp) & (near | (kp < c.sink_len))
