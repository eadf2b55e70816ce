"""Training-free KVM over a pretrained model's own queries, keys and values (docs/pretrained.md).

A converted layer keeps KVM's geometry and routing (``schedule``: block window, lazy updates on the
budget plan; ``routing.route_overflow``: sinks, least-redundant appends, argmax merges) but has no
learned LN_s, temperatures or merge gate, so it reads its state without them: a row that stands for
``m`` tokens is read as their mean key and mean value with a ``+log(m)`` logit bias (``m`` identical
tokens then get their total weight). Routing is by cosine similarity.

RoPE (``rope_mode``): ``post_rope`` merges the rotated keys; ``pre_rope_fixed`` merges unrotated keys
and reads every row as if it sat ``distance`` tokens before the query (``q_rot(p).R(p-d)k`` equals
``(R(d)q).k`` with the unrotated q, so one rotation of each query by ``d`` does it exactly);
``split`` is the paper's NoPE state (unrotated q.k, i.e. distance 0) beside the RoPE window, one softmax;
``none`` for models without RoPE (learned absolute positions).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.budget import BudgetLike, as_budget
from kvmeans.ops.routing import route_overflow
from kvmeans.ops.schedule import bswa_begin, desired_rows
from kvmeans.pretrained.reserve import block_scores, keep_most_novel
from kvmeans.pretrained.routing import merge_closest_pairs, route_novel

ROPE_MODES = ("pre_rope_fixed", "post_rope", "split", "none")


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF ``rotate_half`` RoPE on the leading ``cos.shape[-1]`` channels (partial rotary keeps the rest).
    ``x [B, H, T, D]``, ``cos``/``sin`` broadcastable to ``[B, 1, T, R]``."""
    r = cos.shape[-1]
    xr = x[..., :r] * cos + _rotate_half(x[..., :r]) * sin
    return torch.cat((xr, x[..., r:]), dim=-1) if r < x.shape[-1] else xr


def unrotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Exact inverse of :func:`rotate`, also when cos/sin carry an attention scaling ``a`` (``cos^2+sin^2 = a^2``)."""
    r = cos.shape[-1]
    xr = (x[..., :r] * cos - _rotate_half(x[..., :r]) * sin) / (cos * cos + sin * sin)
    return torch.cat((xr, x[..., r:]), dim=-1) if r < x.shape[-1] else xr


class ConvertedKVMState:
    """What a converted layer carries between calls (one per layer, all batch rows and kv heads).

    ``buf_*`` hold the tokens ``[covered, seen)`` not yet in the state: their post-RoPE keys, values and
    the keys the state merges (unrotated keys in the pre-RoPE modes, None when equal to ``buf_k``);
    ``key_sum``/``value_sum`` ``[B, Hkv, m, D]`` and ``count`` ``[B, Hkv, m]`` summarise ``[0, covered)``;
    ``buf_g`` ``[B, Hkv, n, 1]`` the buffered tokens' merge gates (None: every token weighs 1);
    ``reserve_*`` the exact rows (``exact_rows``, ``kvmeans.pretrained.reserve``; None without them):
    ``reserve_key``/``reserve_value`` ``[B, Hkv, R, D]`` one token's (gated) key and value, ``reserve_count``
    ``[B, Hkv, R]`` its weight (0: empty), ``reserve_score`` ``[B, Hkv, R]`` its novelty on arrival (-inf: empty).
    """

    FIELDS = ("buf_k", "buf_v", "buf_s", "buf_g", "key_sum", "value_sum", "count", "reserve_key", "reserve_value",
              "reserve_count", "reserve_score")

    def __init__(self):
        self.seen = 0
        self.covered = 0
        for name in self.FIELDS:
            setattr(self, name, None)

    @property
    def num_rows(self) -> int:
        """Rows read: the mean pool's and the reserve's slots."""
        return sum(0 if t is None else t.shape[-1] for t in (self.count, self.reserve_count))

    @property
    def reserve(self):
        return self.reserve_key, self.reserve_value, self.reserve_count, self.reserve_score

    def read_rows(self):
        """``(key sums, value sums, counts)`` the queries read: the pool rows then the reserve (None: no state yet)."""
        if self.count is None or self.reserve_count is None:
            return None if self.count is None else (self.key_sum, self.value_sum, self.count)
        return tuple(torch.cat(pair, -1 if pair[0].dim() == 3 else -2)
                     for pair in zip((self.key_sum, self.value_sum, self.count), self.reserve))

    def _tensors(self):
        return [t for t in (getattr(self, name) for name in self.FIELDS) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def index_select(self, idx: Tensor) -> "ConvertedKVMState":
        """Keep/reorder batch rows (beam search, batch selection) in place."""
        for name in self.FIELDS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx.to(t.device)))
        return self

    def copy(self) -> "ConvertedKVMState":
        """A snapshot sharing the tensors: they are replaced, never written in place (``kvmeans.pretrained.batch``
        relies on it for padding and crop)."""
        out = ConvertedKVMState.__new__(ConvertedKVMState)
        out.__dict__.update(self.__dict__)
        return out

    def __repr__(self) -> str:
        exact = "" if self.reserve_count is None else f", exact_rows={self.reserve_count.shape[-1]}"
        return (f"ConvertedKVMState(seen={self.seen}, rows={self.num_rows}{exact}, covered={self.covered}, "
                f"buffered={self.seen - self.covered}, nbytes={self.nbytes})")


def _cat(a: Optional[Tensor], b: Tensor) -> Tensor:
    return b if a is None else torch.cat((a, b), dim=-2)


def _advance(st: ConvertedKVMState, total: int, budget: Callable[[int], int], chunk_len: int,
             n_bswa_chunks: int, sink_len: int, novel_rows: int = 0, exact_rows: int = 0,
             layer_novelty: Optional[Callable[[int, Tensor], Tensor]] = None) -> None:
    """Bring the state up to ``bswa_begin(total)``: copy the first chunk, then route each block that left
    the window (``schedule.desired_rows``: appends on the budget, the rest merged by cosine argmax; with
    ``novel_rows`` a block appending fewer first frees rows, ``kvmeans.pretrained.routing``; with
    ``exact_rows`` the block first passes the reserve, ``kvmeans.pretrained.reserve``, and the pool's
    budget is ``exact_rows`` less; ``layer_novelty(start, score) -> score`` ranks a block by its novelty
    agreed across layers, ``kvmeans.pretrained.board``)."""
    target = bswa_begin(total, chunk_len, n_bswa_chunks)
    if target <= st.covered:
        return
    skeys = st.buf_k if st.buf_s is None else st.buf_s
    base = st.seen - st.buf_v.shape[-2]                 # token index of the buffer's first token
    acc = torch.promote_types(st.buf_v.dtype, torch.float32)   # state sums: fp32 for half inputs
    gate = None if st.buf_g is None else st.buf_g.to(acc)      # a token adds g*k, g*v and g to its row
    if st.count is None:                                 # the first chunk becomes the initial rows
        st.key_sum = skeys[..., :chunk_len, :].to(acc)
        st.value_sum = st.buf_v[..., :chunk_len, :].to(acc)
        st.count = st.key_sum.new_ones(st.key_sum.shape[:-1])
        if gate is not None:
            g = gate[..., :chunk_len, :]
            st.key_sum, st.value_sum, st.count = st.key_sum * g, st.value_sum * g, g.squeeze(-1)
        if exact_rows:
            B, H, _, D = st.key_sum.shape
            st.reserve_key, st.reserve_value = (t.new_zeros(B, H, exact_rows, t.shape[-1])
                                                for t in (st.key_sum, st.value_sum))
            st.reserve_count = st.count.new_zeros(B, H, exact_rows)
            st.reserve_score = st.count.new_full((B, H, exact_rows), float("-inf"))
        st.covered = chunk_len
    pool_budget = (lambda n: max(0, budget(n) - exact_rows)) if exact_rows else budget
    for start in range(max(st.covered, chunk_len), target, chunk_len):   # schedule.plan_updates, one step at a time
        rows = st.count.shape[-1]
        n_new = min(desired_rows(pool_budget, start, rows, chunk_len, n_bswa_chunks) - rows, chunk_len)
        blk = slice(start - base, start - base + chunk_len)
        bk, bv = skeys[..., blk, :].to(acc), st.buf_v[..., blk, :].to(acc)
        sel = F.normalize(bk, dim=-1)
        weight = torch.ones_like(sel[..., 0], dtype=st.count.dtype) if gate is None else gate[..., blk, 0]
        if gate is not None:
            bk, bv = bk * gate[..., blk, :], bv * gate[..., blk, :]
        if exact_rows:                  # empty slots fill first: R less the tokens past the first chunk, by position
            n_out = max(0, chunk_len - max(0, exact_rows - (start - chunk_len)))
            score = block_scores(sel, st.key_sum, st.reserve_key, st.reserve_score)
            if layer_novelty is not None:
                score = layer_novelty(start, score)
            kept, (bk, bv, weight, _) = keep_most_novel(st.reserve, (bk, bv, weight, score), n_out)
            st.reserve_key, st.reserve_value, st.reserve_count, st.reserve_score = kept
            if not n_out:
                continue
            sel, n_new = F.normalize(bk, dim=-1), min(n_new, n_out)
        if n_new < novel_rows and rows - sink_len > 2 * novel_rows:
            st.key_sum, st.value_sum, st.count = merge_closest_pairs(st.key_sum, st.value_sum, st.count,
                                                                     novel_rows - n_new, sink_len)
            n_new = novel_rows
            dest = route_novel(st.key_sum, sel, n_new, sink_len)
        else:
            dest, _ = route_overflow(F.normalize(st.key_sum, dim=-1), sel, sel, n_new, sink_len)
        pad = (0, 0, 0, max(n_new, 0))
        st.key_sum = F.pad(st.key_sum, pad).scatter_add_(-2, dest.unsqueeze(-1).expand_as(bk), bk)
        st.value_sum = F.pad(st.value_sum, pad).scatter_add_(-2, dest.unsqueeze(-1).expand_as(bv), bv)
        st.count = F.pad(st.count, pad[2:]).scatter_add_(-1, dest, weight)
    drop = target - base
    st.buf_k, st.buf_v = st.buf_k[..., drop:, :], st.buf_v[..., drop:, :]
    st.buf_s = None if st.buf_s is None else st.buf_s[..., drop:, :]
    st.buf_g = None if st.buf_g is None else st.buf_g[..., drop:, :]
    st.covered = target


def converted_kvm_attention(q: Tensor, k: Tensor, v: Tensor, state: ConvertedKVMState, *, scaling: float,
                            budget: BudgetLike, chunk_len: int, n_bswa_chunks: int, sink_len: int,
                            rope_mode: str = "pre_rope_fixed", cos: Optional[Tensor] = None,
                            sin: Optional[Tensor] = None, cos_d: Optional[Tensor] = None,
                            sin_d: Optional[Tensor] = None, softcap: Optional[float] = None,
                            log_count_bias: bool = True, novel_rows: int = 0, exact_rows: int = 0,
                            layer_novelty: Optional[Callable[[int, Tensor], Tensor]] = None,
                            merge_gate: Optional[Tensor] = None,
                            state_key_weight: Optional[Tensor] = None, state_key_bias: Optional[Tensor] = None,
                            state_temp: Optional[Tensor] = None, window_temp: Optional[Tensor] = None) -> Tensor:
    """Continue ``state`` by ``T`` tokens and return their attention output ``[B, H, T, Dv]``.

    ``q [B, H, T, D]`` and ``k [B, Hkv, T, D]`` as the model rotated them (post-RoPE), ``v [B, Hkv, T, Dv]``;
    ``cos``/``sin`` ``[B, T, R]`` the model's RoPE for these positions (pre-RoPE modes), ``cos_d``/``sin_d``
    ``[R]`` the RoPE of the read distance (``pre_rope_fixed``; position 0 for ``split``). Tokens are processed chunk-aligned by
    absolute position, so any split of a sequence (prefill + decode) gives the same result. ``novel_rows``:
    novelty-preserving routing at a full budget (``kvmeans.pretrained.routing``; 0: KVM's routing);
    ``exact_rows``: slots of the budget that keep the most novel tokens exactly (``kvmeans.pretrained.reserve``),
    ranked by ``layer_novelty(start, score)`` when given (novelty agreed across layers, ``kvmeans.pretrained.board``).

    Learned read-out (distillation; each None = the training-free read): ``merge_gate [B, Hkv, T]`` the
    weight each token adds to its row's key/value sums and count; ``state_key_weight``/``state_key_bias``
    ``[Hkv, D]`` an affine LN_s on the mean state keys; ``state_temp``/``window_temp`` ``[H]`` per-head
    inverse temperatures of the state and window logits (before soft-capping).
    """
    if rope_mode not in ROPE_MODES:
        raise ValueError(f"rope_mode must be one of {ROPE_MODES}, got {rope_mode!r}")
    if exact_rows and novel_rows:
        raise ValueError("exact_rows and novel_rows route the same budget two ways: set one of them to 0")
    budget = as_budget(budget)
    B, H, T, D = q.shape
    Hkv, G = k.shape[1], H // k.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    pre_rope = rope_mode in ("pre_rope_fixed", "split")
    if pre_rope:
        c, s = cos.unsqueeze(1).to(dt), sin.unsqueeze(1).to(dt)
        skeys = unrotate(k.to(dt), c, s)
        a = (cos_d * cos_d + sin_d * sin_d).sqrt()    # (R(d) q).k: a^2 R(d) on the rotary channels
        q_state = rotate(unrotate(q.to(dt), c, s), (cos_d * a).to(dt), (sin_d * a).to(dt))
    else:
        skeys, q_state = None, q
    C, L = chunk_len, n_bswa_chunks * chunk_len
    start = state.seen
    base0 = start - (0 if state.buf_v is None else state.buf_v.shape[-2])
    all_k, all_v = _cat(state.buf_k, k), _cat(state.buf_v, v)            # positions [base0, start + T)
    state.buf_k, state.buf_v, state.seen = all_k, all_v, start + T
    if skeys is not None:
        state.buf_s = _cat(state.buf_s, skeys.to(k.dtype))
    if merge_gate is not None:
        state.buf_g = _cat(state.buf_g, merge_gate.unsqueeze(-1))
    c0, c1 = start // C, -(-(start + T) // C)
    rows = []                                      # the state each chunk of queries reads (tensors are not
    for c in range(c0, c1):                        # updated in place, so these are snapshots)
        _advance(state, min((c + 1) * C, start + T), budget, C, n_bswa_chunks, sink_len, novel_rows, exact_rows,
                 layer_novelty)
        rows.append(state.read_rows())
    # every chunk at once: queries padded to whole chunks, window = the L positions ending at the chunk's end
    nc, off, p0 = c1 - c0, start - c0 * C, c0 * C - (L - C)
    def grid(x, first, width):                     # positions [first, first + width) of x (x starts at base0)
        out = x.new_zeros(*x.shape[:-2], width, x.shape[-1]).to(dt)
        lo, hi = max(first, base0), min(first + width, start + T)
        out[..., lo - first:hi - first, :] = x[..., lo - base0:hi - base0, :]
        return out
    span = (nc - 1) * C + L
    kw = grid(all_k, p0, span).unfold(-2, L, C).transpose(-1, -2)           # [B, Hkv, nc, L, D]
    vw = grid(all_v, p0, span).unfold(-2, L, C).transpose(-1, -2)
    def chunks(x):                                 # [B, H, T, D] -> [B, Hkv, nc, G*C, D] on the chunk grid
        x = F.pad(x.to(dt), (0, 0, off, nc * C - off - T))
        return x.reshape(B, Hkv, G, nc, C, D).transpose(2, 3).reshape(B, Hkv, nc, G * C, D)
    qg = chunks(q if window_temp is None else q * window_temp.view(1, H, 1, 1))
    i, l_ = torch.arange(C, device=q.device), torch.arange(L, device=q.device)
    kpos = p0 + C * torch.arange(nc, device=q.device)[:, None, None] + l_          # [nc, 1, L]
    masked = ((l_[None, :] - i[:, None] > L - C) | (kpos < 0)).repeat(1, G, 1)    # [nc, G*C, L]
    logits = _softcap(torch.matmul(qg, kw.transpose(-1, -2)) * scaling, softcap).masked_fill(masked, float("-inf"))
    if all(r is None for r in rows):
        return _from_grid(torch.matmul(torch.softmax(logits, -1), vw), G, off, T, q.dtype)
    M = max(r[2].shape[-1] for r in rows if r is not None)
    def stacked(j, like):                          # [B, Hkv, nc, M(, D)], zero rows where a chunk has fewer
        ts = [like if r is None else r[j].to(dt) for r in rows]
        return torch.stack([F.pad(t, (0, 0) * (t.dim() - 3) + (0, M - t.shape[2])) for t in ts], 2)
    cnt = stacked(2, torch.zeros(B, Hkv, 0, device=q.device, dtype=dt))
    div = cnt.masked_fill(cnt == 0, 1).unsqueeze(-1)      # padding rows: 0 / 1 (gated counts may be < 1)
    mean_k = stacked(0, torch.zeros(B, Hkv, 0, D, device=q.device, dtype=dt)) / div
    mean_v = stacked(1, torch.zeros(B, Hkv, 0, v.shape[-1], device=q.device, dtype=dt)) / div
    if state_key_weight is not None:
        mean_k = mean_k * state_key_weight.view(1, Hkv, 1, 1, D) + state_key_bias.view(1, Hkv, 1, 1, D)
    bias = cnt.log() if log_count_bias else torch.zeros_like(cnt).masked_fill(cnt == 0, float("-inf"))
    qs = q_state if state_temp is None else q_state * state_temp.view(1, H, 1, 1)
    sl = _softcap(torch.matmul(chunks(qs), mean_k.transpose(-1, -2)) * scaling, softcap)
    p = torch.softmax(torch.cat((sl + bias.unsqueeze(-2), logits), -1), -1)
    out = torch.matmul(p[..., :M], mean_v) + torch.matmul(p[..., M:], vw)
    return _from_grid(out, G, off, T, q.dtype)


def _from_grid(out: Tensor, G: int, off: int, T: int, dtype) -> Tensor:
    """``[B, Hkv, nc, G*C, Dv]`` -> ``[B, H, T, Dv]``: drop the padding queries of the chunk grid."""
    B, Hkv, nc, GC, Dv = out.shape
    out = out.reshape(B, Hkv, nc, G, GC // G, Dv).transpose(2, 3)
    return out.reshape(B, Hkv * G, nc * (GC // G), Dv)[:, :, off:off + T].to(dtype)


def _softcap(x: Tensor, cap: Optional[float]) -> Tensor:
    return x if not cap else torch.tanh(x / cap) * cap
