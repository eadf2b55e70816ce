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

Memory. A state holds the merged rows, the reserve and the exact window's post-RoPE keys and values (the
tokens not merged yet) with their positions, nothing per token beyond the window: the pre-RoPE modes
unrotate a block's keys when it leaves the window, from the model's own RoPE at the stored positions. A call
of ``T`` tokens works on its ``T`` tokens and the window; calls that stay inside one chunk (decode steps)
read the state directly, longer ones attend every chunk of queries at once on the chunk grid.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.budget import BudgetLike, as_budget
from kvmeans.ops.routing import first_max, route_overflow
from kvmeans.ops.schedule import bswa_begin, desired_rows
from kvmeans.pretrained.reserve import block_scores, join_runs, keep_most_novel
from kvmeans.pretrained.routing import merge_closest_pairs, route_novel

ROPE_MODES = ("pre_rope_fixed", "post_rope", "split", "none")
EXACT_RANKS = ("novelty", "attention")


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


def state_query(q: Tensor, cos: Tensor, sin: Tensor, cos_d: Tensor, sin_d: Tensor) -> Tensor:
    """The query of the pre-RoPE modes that reads the state rows (float32 at least): ``q [..., T, D]`` as the model
    rotated it, unrotated at its positions (``cos``/``sin`` broadcastable to ``[..., T, R]``) and rotated by the read
    distance (``cos_d``/``sin_d [R]``): ``(R(d) q).k`` equals ``q_rot(p).R(p-d)k``; ``a^2 R(d)`` where the model's
    RoPE carries an attention scaling ``a``."""
    dt = torch.promote_types(q.dtype, torch.float32)
    cos, sin, cos_d, sin_d = (t.to(dt) for t in (cos, sin, cos_d, sin_d))
    # one rotation by d - p, its tables composed at [.., T, R] (heads times fewer values than q): what rotating the
    # unrotated query by d gives (rotate_half commutes with the tables, whose two halves are equal)
    scale = (cos_d * cos_d + sin_d * sin_d).sqrt() / (cos * cos + sin * sin)
    return rotate(q.to(dt), (cos_d * cos + sin_d * sin) * scale, (sin_d * cos - cos_d * sin) * scale)


RopeFn = Callable[[Tensor], Tuple[Tensor, Tensor]]        # positions [B, n] -> (cos, sin) [B, n, R]


class ConvertedKVMState:
    """What a converted layer carries between calls (one per layer, all batch rows and kv heads).

    ``buf_k``/``buf_v`` ``[B, Hkv, n, D]`` hold the tokens ``[covered, seen)`` not yet in the state (the exact
    window and the chunk filling up): their post-RoPE keys and values; ``buf_pos`` ``[B, n]`` their positions
    (the pre-RoPE modes unrotate a block's keys from them when it leaves the window; None otherwise);
    ``buf_g`` ``[B, Hkv, n, 1]`` their merge gates (None: every token weighs 1);
    ``key_sum``/``value_sum`` ``[B, Hkv, m, D]`` and ``count`` ``[B, Hkv, m]`` summarise ``[0, covered)``
    (the first ``sink_len`` rows are sinks, never merged into);
    ``reserve_*`` the exact rows (``exact_rows``, ``kvmeans.pretrained.reserve``; None without them):
    ``reserve_key``/``reserve_value`` ``[B, Hkv, R, D]`` one token's (gated) key and value, ``reserve_count``
    ``[B, Hkv, R]`` its weight (0: empty), ``reserve_score`` ``[B, Hkv, R]`` its novelty on arrival (-inf: empty;
    +inf: dead, a slot past its kv head's cap with ``exact_caps``, never filled),
    ``reserve_pos`` ``[B, Hkv, R]`` its index in the sequence (a float of the sums' dtype; -inf: empty).
    """

    FIELDS = ("buf_k", "buf_v", "buf_pos", "buf_g", "buf_att", "key_sum", "value_sum", "count", "reserve_key",
              "reserve_value", "reserve_count", "reserve_score", "reserve_pos")
    # what each field is, for :meth:`nbytes_by_kind` (the sinks are split off the rows there)
    KINDS = {"buf_k": "window", "buf_v": "window", "buf_pos": "window", "buf_g": "window", "buf_att": "window",
             "key_sum": "rows",
             "value_sum": "rows", "count": "rows", "reserve_key": "reserve", "reserve_value": "reserve",
             "reserve_count": "reserve", "reserve_score": "reserve", "reserve_pos": "reserve"}

    def __init__(self):
        self.seen = 0
        self.covered = 0
        self.sink_len = 0
        self.unrotated = None       # the buffer's keys unrotated, within one call (``_state_keys``)
        self.unit = None            # and normalised (``_unit_keys``)
        for name in self.FIELDS:
            setattr(self, name, None)

    @property
    def num_rows(self) -> int:
        """Rows read: the mean pool's and the reserve's slots."""
        return sum(0 if t is None else t.shape[-1] for t in (self.count, self.reserve_count))

    @property
    def reserve(self):
        return self.reserve_key, self.reserve_value, self.reserve_count, self.reserve_score, self.reserve_pos

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

    def nbytes_by_kind(self) -> Dict[str, int]:
        """Bytes held per kind: ``sinks`` (the first ``sink_len`` pool rows), ``rows`` (the other pool rows),
        ``reserve`` (exact rows), ``window`` (tokens not merged yet: the exact window and the chunk filling up)."""
        out = {"sinks": 0, "rows": 0, "reserve": 0, "window": 0}
        for name in self.FIELDS:
            t = getattr(self, name)
            if t is not None:
                out[self.KINDS[name]] += t.numel() * t.element_size()
        if self.count is not None and self.sink_len:
            sinks = min(self.sink_len, self.count.shape[-1])
            per_row = sum(t.numel() * t.element_size() // t.shape[2]
                          for t in (self.key_sum, self.value_sum, self.count))
            out["sinks"], out["rows"] = sinks * per_row, out["rows"] - sinks * per_row
        return out

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


SLAB_BYTES = 1 << 20    # the logits of one slab of chunks in _attend_chunk_grid: ~1 MB (1-2 MB fastest on CPU)


def _unit(x: Tensor) -> Tensor:
    """``F.normalize(x, dim=-1)``, the same values, without its Python wrappers (called ~4 times per routed block)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


def check_exact_lead(exact_lead: int, chunk_len: int, n_bswa_chunks: int) -> None:
    """A ``ValueError`` naming ``exact_lead`` unless the window holds the tokens it looks ahead to in every split."""
    most = (n_bswa_chunks - 1) * chunk_len + 1
    if not 0 <= exact_lead <= most:
        raise ValueError(f"exact_lead must be in [0, (n_bswa_chunks - 1) * chunk_len + 1 = {most}] (the tokens "
                         f"after a block that the window still holds), got {exact_lead}")


def _reserve_holds(score: Tensor, weakest: Tensor) -> bool:
    """Whether no token of a block (``score [B, Hkv, C]``) outscores the weakest filled slot (``weakest [B, Hkv]``,
    the slots' lowest score; ties stay with the slots): then :func:`keep_most_novel` keeps the slots as they are
    (on CPU only: the check is a host sync, and on a GPU the sort costs less than one)."""
    return score.device.type == "cpu" and bool((score.amax(-1) <= weakest).all())


def _slot_read(st: ConvertedKVMState) -> Tuple[Tensor, Tensor, Tensor, Optional[bool]]:
    """What routing reads of the reserve and what changes only with it (most blocks leave it as it is, so
    :func:`_advance` keeps this until ``st.reserve_key`` is replaced): ``(reserve_key, unit keys, weakest score
    [B, Hkv], filled)``, ``filled`` whether every slot holds a token (CPU; None on a GPU: no host sync)."""
    filled = None if st.reserve_score.device.type != "cpu" else not bool(st.reserve_score.isinf().any())
    return st.reserve_key, _unit(st.reserve_key), st.reserve_score.amin(-1), filled


def _join(st: ConvertedKVMState, score: Tensor, ext: Tensor, start: int, chunk_len: int, pool_hat: Tensor,
          slot_hat: Tensor) -> Tensor:
    """``exact_join``: the block at ``start``'s scores with a leading run that continues the run the slots hold
    from the block before (its last token held) scored without that block's slots, as inside one block
    (``reserve.join_runs``)."""
    tail_held = (st.reserve_pos == start - 1).any(-1, keepdim=True)
    if tail_held.device.type == "cpu" and not bool(tail_held.any()):
        return score                    # most blocks: nothing held of the block before's end (a CPU check)
    recent = st.reserve_pos >= start - chunk_len
    alone = block_scores(ext, st.key_sum, st.reserve_key, st.reserve_score.masked_fill(recent, float("-inf")),
                         pool_hat=pool_hat, slot_hat=slot_hat, filled=False)
    return join_runs(score, alone, tail_held)


def _cat(a: Optional[Tensor], b: Tensor, dim: int = -2) -> Tensor:
    return b if a is None else torch.cat((a, b), dim=dim)


def _state_keys(st: ConvertedKVMState, lo: int, hi: int, acc: torch.dtype, rope: Optional[RopeFn]) -> Tensor:
    """The keys the state merges for buffered tokens ``[lo, hi)`` (buffer indices) in ``acc``: post-RoPE keys
    unrotated at their positions (pre-RoPE modes, ``rope`` given) or as they are. The whole buffer is unrotated
    once per call (``st.unrotated``, dropped by :func:`_trim`): per chunk it cost ~20 small ops (GPU launches)."""
    if rope is None:
        return st.buf_k[..., lo:hi, :].to(acc)
    if st.unrotated is None:
        cos, sin = rope(st.buf_pos)
        st.unrotated = unrotate(st.buf_k.to(acc), cos.unsqueeze(1).to(acc), sin.unsqueeze(1).to(acc))
    return st.unrotated[..., lo:hi, :]


def _unit_keys(st: ConvertedKVMState, lo: int, hi: int, acc: torch.dtype, rope: Optional[RopeFn]) -> Tensor:
    """The unit vectors of :func:`_state_keys` ``[lo, hi)``, what routing scores: the whole buffer's once per call
    (``st.unit``, dropped with ``st.unrotated``; normalising is row-wise, so each block's rows are the same)."""
    if st.unit is None:
        st.unit = _unit(_state_keys(st, 0, st.buf_v.shape[-2], acc, rope))
    return st.unit[..., lo:hi, :]


def _advance(st: ConvertedKVMState, total: int, budget: Callable[[int], int], chunk_len: int,
             n_bswa_chunks: int, sink_len: int, novel_rows: int = 0, exact_rows: int = 0,
             layer_novelty: Optional[Callable[[int, Tensor], Tensor]] = None, rope: Optional[RopeFn] = None,
             exact_rank: str = "novelty", exact_lead: int = 0, exact_join: bool = False,
             exact_caps: Optional[Tensor] = None) -> None:
    """Bring the state up to ``bswa_begin(total)``: copy the first chunk, then route each block that left
    the window (``schedule.desired_rows``: appends on the budget, the rest merged by cosine argmax; with
    ``novel_rows`` a block appending fewer first frees rows, ``kvmeans.pretrained.routing``; with
    ``exact_rows`` the block first passes the reserve, ``kvmeans.pretrained.reserve``, and the pool's
    budget is ``exact_rows`` less; ``layer_novelty(start, score) -> score`` ranks a block by its novelty
    agreed across layers, ``kvmeans.pretrained.board``; ``exact_rank="attention"`` ranks by the attention the
    token received while in the window, ``buf_att``, instead of by its novelty; ``exact_lead``: a token's novelty
    is the most of its own and the next ``exact_lead`` tokens', which are still in the window; ``exact_join``: a
    block's leading run that continues a run the slots hold is scored as within the block before; ``exact_caps``
    ``[Hkv]``: the slots of each kv head, the reserve as many as the largest, a head's slots past its cap dead). The
    merged tokens stay in the buffer until :func:`_trim` (once per call: trimming per chunk would copy the buffer
    per chunk)."""
    target = bswa_begin(total, chunk_len, n_bswa_chunks)
    if target <= st.covered:
        return
    base = st.seen - st.buf_v.shape[-2]                 # token index of the buffer's first token
    acc = torch.promote_types(st.buf_v.dtype, torch.float32)   # state sums: fp32 for half inputs
    gate = None if st.buf_g is None else st.buf_g.to(acc)      # a token adds g*k, g*v and g to its row
    if st.count is None:                                 # the first chunk becomes the initial rows
        st.key_sum = _state_keys(st, 0, chunk_len, acc, rope).clone()     # not a view of the whole call's keys
        st.value_sum = st.buf_v[..., :chunk_len, :].to(acc)
        st.count = st.key_sum.new_ones(st.key_sum.shape[:-1])
        st.sink_len = sink_len
        if gate is not None:
            g = gate[..., :chunk_len, :]
            st.key_sum, st.value_sum, st.count = st.key_sum * g, st.value_sum * g, g.squeeze(-1)
        if exact_rows:
            B, H, _, D = st.key_sum.shape
            n_slots = exact_rows if exact_caps is None else int(exact_caps.max())
            st.reserve_key, st.reserve_value = (t.new_zeros(B, H, n_slots, t.shape[-1])
                                                for t in (st.key_sum, st.value_sum))
            st.reserve_count = st.count.new_zeros(B, H, n_slots)
            st.reserve_score = st.count.new_full((B, H, n_slots), float("-inf"))
            st.reserve_pos = st.reserve_score.clone()
            if exact_caps is not None:  # dead slots score +inf: always kept, never read (count 0), hidden from novelty
                dead = torch.arange(n_slots, device=st.count.device) >= exact_caps.to(st.count.device)[:, None]
                st.reserve_score = st.reserve_score.masked_fill(dead, float("inf"))
        st.covered = chunk_len
    pool_budget = (lambda n: max(0, budget(n) - exact_rows)) if exact_rows else budget
    ones, slots = None, None
    # the slots that fill first, by position: the fewest any kv head has (a head with more passes its empty slots on
    # to the pool while it fills: weight 0, they add nothing)
    fill = exact_rows if exact_caps is None else int(exact_caps.min())
    for start in range(max(st.covered, chunk_len), target, chunk_len):   # schedule.plan_updates, one step at a time
        rows = st.count.shape[-1]
        n_new = min(desired_rows(pool_budget, start, rows, chunk_len, n_bswa_chunks) - rows, chunk_len)
        lo = start - base
        bk, bv = _state_keys(st, lo, lo + chunk_len, acc, rope), st.buf_v[..., lo:lo + chunk_len, :].to(acc)
        sel = _unit_keys(st, lo, lo + chunk_len, acc, rope)
        if gate is None:                # never written: one tensor of ones serves every block
            if ones is None:
                ones = torch.ones_like(sel[..., 0], dtype=st.count.dtype)
            weight = ones
        else:
            weight = gate[..., lo:lo + chunk_len, 0]
            bk, bv = bk * gate[..., lo:lo + chunk_len, :], bv * gate[..., lo:lo + chunk_len, :]
        pool_hat = _unit(st.key_sum)    # the pool as it stands: scored against and routed into
        if exact_rows:                  # empty slots fill first: R less the tokens past the first chunk, by position
            n_out = max(0, chunk_len - max(0, fill - (start - chunk_len)))
            if slots is None or slots[0] is not st.reserve_key:
                slots = _slot_read(st)
            _, slot_hat, weakest, filled = slots
            if exact_rank == "attention":       # one score per token, the mean over the kv heads (as novelty's)
                score = st.buf_att[..., lo:lo + chunk_len].mean(1, keepdim=True).expand(sel.shape[:-1])
            else:                       # with a lead, the next tokens' novelty too (in the window: any split has them)
                ext = _unit_keys(st, lo, lo + chunk_len + exact_lead, acc, rope) if exact_lead else sel
                score = block_scores(ext, st.key_sum, st.reserve_key, st.reserve_score, pool_hat=pool_hat,
                                     slot_hat=slot_hat, filled=filled)
                if exact_join:
                    score = _join(st, score, ext, start, chunk_len, pool_hat, slot_hat)
            if layer_novelty is not None:
                score = layer_novelty(start, score)
            if score.shape[-1] > chunk_len:     # a token scores the most of itself and the next exact_lead tokens
                score = score.unfold(-1, exact_lead + 1, 1).amax(-1)
            if n_out == chunk_len and _reserve_holds(score, weakest):
                pass            # the sort would keep every slot and hand the block on as it is
            else:               # the unit keys travel with the candidates (normalising is row-wise)
                pos = torch.arange(start, start + chunk_len, device=score.device,
                                   dtype=st.reserve_pos.dtype).expand_as(score)
                kept, (bk, bv, weight, _, _, sel) = keep_most_novel(st.reserve + (slot_hat,),
                                                                    (bk, bv, weight, score, pos, sel), n_out)
                (st.reserve_key, st.reserve_value, st.reserve_count, st.reserve_score,
                 st.reserve_pos) = kept[:5]
            if not n_out:
                continue
            n_new = min(n_new, n_out)
        if n_new < novel_rows and rows - sink_len > 2 * novel_rows:
            st.key_sum, st.value_sum, st.count = merge_closest_pairs(st.key_sum, st.value_sum, st.count,
                                                                     novel_rows - n_new, sink_len)
            n_new = novel_rows
            dest = route_novel(st.key_sum, sel, n_new, sink_len)
        elif n_new <= 0:                # every token merges (a full budget): route_overflow's argmax, nothing else
            s = min(sink_len, rows)
            dest = first_max((sel @ pool_hat.transpose(-1, -2))[..., s:])[1] + s
        else:
            dest, _ = route_overflow(pool_hat, sel, sel, n_new, sink_len)
        idx = dest.unsqueeze(-1)
        if n_new > 0:                   # new rows: the sums grow, then take the block (new tensors: see copy())
            pad = (0, 0, 0, n_new)
            st.key_sum = F.pad(st.key_sum, pad).scatter_add_(-2, idx.expand_as(bk), bk)
            st.value_sum = F.pad(st.value_sum, pad).scatter_add_(-2, idx.expand_as(bv), bv)
            st.count = F.pad(st.count, pad[2:]).scatter_add_(-1, dest, weight)
        else:                           # out of place: the same additions on a copy, without the pad's copy
            st.key_sum = st.key_sum.scatter_add(-2, idx.expand_as(bk), bk)
            st.value_sum = st.value_sum.scatter_add(-2, idx.expand_as(bv), bv)
            st.count = st.count.scatter_add(-1, dest, weight)
    st.covered = target


def _trim(st: ConvertedKVMState) -> None:
    """Drop the merged tokens from the buffer, copying what stays: a view would keep the whole call's keys and
    values alive (the buffer grows from a call's full inputs)."""
    st.unrotated = st.unit = None
    drop = 0 if st.buf_v is None else st.covered - (st.seen - st.buf_v.shape[-2])
    if drop <= 0:
        return
    for name, axis in (("buf_k", -2), ("buf_v", -2), ("buf_g", -2), ("buf_pos", -1), ("buf_att", -1)):
        t = getattr(st, name)
        if t is not None:
            setattr(st, name, t.narrow(axis, drop, t.shape[axis] - drop).clone())


def converted_kvm_attention(q: Tensor, k: Tensor, v: Tensor, state: ConvertedKVMState, *, scaling: float,
                            budget: BudgetLike, chunk_len: int, n_bswa_chunks: int, sink_len: int,
                            rope_mode: str = "pre_rope_fixed", cos: Optional[Tensor] = None,
                            sin: Optional[Tensor] = None, cos_d: Optional[Tensor] = None,
                            sin_d: Optional[Tensor] = None, rope: Optional[RopeFn] = None,
                            positions: Optional[Tensor] = None, softcap: Optional[float] = None,
                            log_count_bias: bool = True, novel_rows: int = 0, exact_rows: int = 0,
                            exact_rank: str = "novelty", exact_lead: int = 0, exact_join: bool = False,
                            exact_caps: Optional[Tensor] = None,
                            layer_novelty: Optional[Callable[[int, Tensor], Tensor]] = None,
                            merge_gate: Optional[Tensor] = None,
                            state_key_weight: Optional[Tensor] = None, state_key_bias: Optional[Tensor] = None,
                            state_temp: Optional[Tensor] = None, window_temp: Optional[Tensor] = None) -> Tensor:
    """Continue ``state`` by ``T`` tokens and return their attention output ``[B, H, T, Dv]``.

    ``q [B, H, T, D]`` and ``k [B, Hkv, T, D]`` as the model rotated them (post-RoPE), ``v [B, Hkv, T, Dv]``;
    ``cos``/``sin`` ``[B, T, R]`` the model's RoPE for these positions (pre-RoPE modes), ``cos_d``/``sin_d``
    ``[R]`` the RoPE of the read distance (``pre_rope_fixed``; position 0 for ``split``); ``rope(positions
    [B, n]) -> (cos, sin) [B, n, R]`` the model's RoPE at any positions (pre-RoPE modes: it unrotates the keys
    of a block leaving the window) and ``positions [B, T]`` these tokens' (default: ``state.seen`` on).
    Tokens are processed chunk-aligned by their index in the state, so any split of a sequence (prefill +
    decode) gives the same result. ``novel_rows``: novelty-preserving routing at a full budget
    (``kvmeans.pretrained.routing``; 0: KVM's routing); ``exact_rows``: slots of the budget that keep the most
    novel tokens exactly (``kvmeans.pretrained.reserve``), ranked by ``layer_novelty(start, score)`` when given
    (novelty agreed across layers, ``kvmeans.pretrained.board``). ``exact_rank``: what the reserve ranks by,
    ``"novelty"``, ``"attention"`` (the attention the token received from the last chunk of queries that see it,
    ``n_bswa_chunks - 1`` chunks after its own: softmax over the window alone, summed over those queries, mean
    over the kv group's heads; ``state.buf_att``; SnapKV's observation window, at the moment the token leaves).
    ``exact_lead``: with novelty ranking (attention ranking ignores it), a token leaving the window scores the
    most of its own novelty and the next ``exact_lead`` tokens' (scored against the same rows), so the first token
    of a novel run, which the model needs to find the run (a needle's first digit), is kept with it; at most
    ``(n_bswa_chunks - 1) * chunk_len + 1``, the tokens every split still holds in the window. ``exact_join``: with
    novelty ranking, when the slots hold the last token of the block before, the block's leading run of tokens
    that score higher without the slots that block filled is scored so (``state.reserve_pos``), as it would be
    inside one block: a novel run cut by a block boundary keeps its second part, which otherwise meets the first
    part in the slots and looks known; the other tokens keep their scores. ``exact_caps`` ``[Hkv]`` (long): the slots
    each kv head fills (``kvmeans.pretrained.heads``: per-head budgets; ``exact_rows`` stays the mean, which the
    pool's budget leaves out), the reserve holding as many as the largest cap.

    Learned read-out (distillation; each None = the training-free read): ``merge_gate [B, Hkv, T]`` the
    weight each token adds to its row's key/value sums and count; ``state_key_weight``/``state_key_bias``
    ``[Hkv, D]`` an affine LN_s on the mean state keys; ``state_temp``/``window_temp`` ``[H]`` per-head
    inverse temperatures of the state and window logits (before soft-capping).
    """
    if rope_mode not in ROPE_MODES:
        raise ValueError(f"rope_mode must be one of {ROPE_MODES}, got {rope_mode!r}")
    if exact_rows and novel_rows:
        raise ValueError("exact_rows and novel_rows route the same budget two ways: set one of them to 0")
    if exact_rank not in EXACT_RANKS:
        raise ValueError(f"exact_rank must be one of {EXACT_RANKS}, got {exact_rank!r}")
    check_exact_lead(exact_lead, chunk_len, n_bswa_chunks)
    if exact_caps is not None and (not exact_rows or exact_caps.shape != (k.shape[1],) or bool((exact_caps < 0).any())):
        raise ValueError(f"exact_caps must be [Hkv={k.shape[1]}] non-negative slot counts and needs exact_rows > 0, "
                         f"got shape {tuple(exact_caps.shape)} with exact_rows={exact_rows}")
    pre_rope = rope_mode in ("pre_rope_fixed", "split")
    if pre_rope and rope is None:
        raise ValueError(f"rope_mode={rope_mode!r} needs rope= (positions -> the model's cos, sin): the keys of a "
                         "block are unrotated when it leaves the window")
    budget = as_budget(budget)
    B, H, T, D = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    C, L = chunk_len, n_bswa_chunks * chunk_len
    start = state.seen
    if pre_rope:
        q_state = state_query(q, cos.unsqueeze(1), sin.unsqueeze(1), cos_d, sin_d)
        if positions is None:
            positions = torch.arange(start, start + T, device=k.device).expand(B, T)
        state.buf_pos = _cat(state.buf_pos, positions.to(k.device).expand(B, T).contiguous(), -1)
    else:
        q_state = q
    base0 = start - (0 if state.buf_v is None else state.buf_v.shape[-2])
    state.buf_k, state.buf_v, state.seen = _cat(state.buf_k, k), _cat(state.buf_v, v), start + T
    state.unrotated = state.unit = None
    if merge_gate is not None:
        state.buf_g = _cat(state.buf_g, merge_gate.unsqueeze(-1))
    attention_rank = bool(exact_rows) and exact_rank == "attention"
    if attention_rank:
        state.buf_att = _cat(state.buf_att, k.new_zeros(B, k.shape[1], T, dtype=dt), -1)
    routing = dict(novel_rows=novel_rows, exact_rows=exact_rows, layer_novelty=layer_novelty,
                   rope=rope if pre_rope else None, exact_rank=exact_rank,
                   exact_lead=exact_lead if exact_rank == "novelty" else 0,
                   exact_join=bool(exact_join) and exact_rank == "novelty", exact_caps=exact_caps)
    c0, c1 = start // C, -(-(start + T) // C)
    read = dict(scaling=scaling, softcap=softcap, log_count_bias=log_count_bias, state_key_weight=state_key_weight,
                state_key_bias=state_key_bias, state_temp=state_temp, window_temp=window_temp,
                attention_rank=attention_rank)
    if c1 - c0 == 1:                # inside one chunk (decode steps): the window and the state as they are
        _advance(state, start + T, budget, C, n_bswa_chunks, sink_len, **routing)
        out = _attend_one_chunk(q, q_state, state, base0, start, c0 * C - (L - C), dt, chunk_len=C, **read)
    else:
        out = _attend_chunk_grid(q, q_state, state, base0, start, budget, C, n_bswa_chunks, sink_len, routing, dt,
                                 **read)
    _trim(state)
    return out


def _state_read(rows, dt, state_key_weight, state_key_bias, log_count_bias):
    """Mean keys ``[.., M, D]``, mean values and the logit bias ``[.., M]`` of ``(key sums, value sums, counts)``:
    ``+log(count)`` (empty rows -inf), or 0 without ``log_count_bias``."""
    key_sum, value_sum, cnt = (t.to(dt) for t in rows)
    div = cnt.masked_fill(cnt == 0, 1).unsqueeze(-1)      # empty rows: 0 / 1 (gated counts may be < 1)
    mean_k, mean_v = key_sum / div, value_sum / div
    if state_key_weight is not None:
        shape = (1, -1) + (1,) * (mean_k.dim() - 3) + (mean_k.shape[-1],)
        mean_k = mean_k * state_key_weight.view(shape) + state_key_bias.view(shape)
    bias = cnt.log() if log_count_bias else torch.zeros_like(cnt).masked_fill(cnt == 0, float("-inf"))
    return mean_k, mean_v, bias


def _attend_one_chunk(q, q_state, state, base0, start, w0, dt, *, scaling, softcap, log_count_bias,
                      state_key_weight, state_key_bias, state_temp, window_temp, attention_rank=False,
                      chunk_len=0) -> Tensor:
    """The ``T`` queries of one chunk (positions ``[start, start + T)``) against the state's rows and the window
    ``[max(w0, 0), start + T)`` (causal among the new tokens); ``[B, H, T, Dv]``. ``attention_rank``: also add the
    attention these queries give the window's oldest block to its ``state.buf_att`` (:func:`_window_mass`)."""
    B, H, T, D = q.shape
    Hkv = state.buf_k.shape[1]
    G = H // Hkv
    lo = max(w0, 0) - base0
    kw, vw = state.buf_k[..., lo:, :].to(dt), state.buf_v[..., lo:, :].to(dt)       # [B, Hkv, W, D]
    qw = q if window_temp is None else q * window_temp.view(1, H, 1, 1)
    qw = qw.to(dt).reshape(B, Hkv, G * T, D)
    logits = _softcap(torch.matmul(qw, kw.transpose(-1, -2)) * scaling, softcap)     # [B, Hkv, G*T, W]
    if T > 1:
        W = kw.shape[-2]
        future = torch.arange(W, device=q.device) > torch.arange(W - T, W, device=q.device)[:, None]
        logits = logits.masked_fill(future.repeat(G, 1), float("-inf"))
    if attention_rank and w0 >= 0:      # the oldest block [w0, w0 + C): these queries are the last that see it
        n = min(chunk_len, kw.shape[-2])
        state.buf_att[..., lo:lo + n] += _window_mass(logits)[..., :n].sum(-2) / G
    rows = state.read_rows()
    if rows is None:
        return torch.matmul(torch.softmax(logits, -1), vw).reshape(B, H, T, -1).to(q.dtype)
    mean_k, mean_v, bias = _state_read(rows, dt, state_key_weight, state_key_bias, log_count_bias)
    qs = q_state if state_temp is None else q_state * state_temp.view(1, H, 1, 1)
    sl = _softcap(torch.matmul(qs.to(dt).reshape(B, Hkv, G * T, D), mean_k.transpose(-1, -2)) * scaling, softcap)
    M = mean_k.shape[-2]
    p = torch.softmax(torch.cat((sl + bias.unsqueeze(-2), logits), -1), -1)
    out = torch.matmul(p[..., :M], mean_v) + torch.matmul(p[..., M:], vw)
    return out.reshape(B, H, T, -1).to(q.dtype)


def _attend_chunk_grid(q, q_state, state, base0, start, budget, C, n_bswa_chunks, sink_len, routing, dt, *,
                       scaling, softcap, log_count_bias, state_key_weight, state_key_bias, state_temp,
                       window_temp, attention_rank=False) -> Tensor:
    """Every chunk of queries at once: queries padded to whole chunks, each chunk's window the ``L`` positions
    ending at its end, each chunk reading the state as it stood then (``_advance`` per chunk; the tensors are
    replaced, not written in place, so the per-chunk rows are snapshots). The window logits do not depend on the
    state, so they come first: with ``attention_rank`` the oldest block of every chunk's window gets the
    attention of that chunk's queries (the last ones that see it) in ``buf_att`` before the next chunk routes it."""
    B, H, T, D = q.shape
    Hkv = state.buf_k.shape[1]
    G, L = H // Hkv, n_bswa_chunks * C
    c0, c1 = start // C, -(-(start + T) // C)
    nc, off, p0 = c1 - c0, start - c0 * C, c0 * C - (L - C)
    all_k, all_v = state.buf_k, state.buf_v                                    # positions [base0, start + T)
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
    def window_logits(c):                          # the chunks c (a slice) against their windows
        lg = _softcap(torch.matmul(qg[:, :, c], kw[:, :, c].transpose(-1, -2)) * scaling, softcap)
        return lg.masked_fill(masked[c], float("-inf"))
    logits = None
    if attention_rank:                             # queries of this call only (the grid pads before and after)
        logits = window_logits(slice(None))
        qpos = c0 * C + C * torch.arange(nc, device=q.device)[:, None] + i                # [nc, C]
        real = ((qpos >= start) & (qpos < start + T)).repeat(1, G).unsqueeze(-1)        # [nc, G*C, 1]
        mass = (_window_mass(logits)[..., :C] * real).sum(-2) / G                        # [B, Hkv, nc, C]
        at = (kpos.squeeze(1)[:, :C] - base0).expand_as(mass)                            # buffer index
        ok = (at >= 0) & (at < state.buf_att.shape[-1])
        state.buf_att = state.buf_att.scatter_add(-1, at.where(ok, 0).flatten(2), mass.where(ok, 0).flatten(2))
    rows = []                                      # per chunk: the pool's and the reserve's tensors as they stood
    for c in range(c0, c1):
        _advance(state, min((c + 1) * C, start + T), budget, C, n_bswa_chunks, sink_len, **routing)
        rows.append(None if state.count is None else
                    (state.key_sum, state.value_sum, state.count) + (() if state.reserve_count is None else
                                                                   state.reserve[:3]))
    M = max((sum(t.shape[-1] for t in r[2::3]) for r in rows if r is not None), default=0)
    if M:                                          # [B, Hkv, nc, M(, D)]: zero rows where a chunk has fewer
        Dv, pieces = all_v.shape[-1], []
        for n_rows, group in itertools.groupby(rows, key=lambda r: None if r is None else r[2].shape[-1]):
            group = list(group)                    # consecutive chunks with as many pool rows: stacked at once
            if n_rows is None:
                n = len(group)
                pieces.append((q.new_zeros(B, Hkv, n, M, D, dtype=dt), q.new_zeros(B, Hkv, n, M, Dv, dtype=dt),
                               q.new_zeros(B, Hkv, n, M, dtype=dt)))
                continue
            parts = [torch.stack([r[j] for r in group], 2).to(dt) for j in range(len(group[0]))]
            joined = [parts[j] if len(parts) == 3 else torch.cat((parts[j], parts[j + 3]), -1 if j == 2 else -2)
                      for j in range(3)]        # the pool rows then the reserve (ConvertedKVMState.read_rows)
            pad = M - joined[2].shape[-1]
            pieces.append(tuple(F.pad(t, (0, 0) * (t.dim() - 4) + (0, pad)) if pad else t for t in joined))
        stacked_rows = tuple(ps[0] if len(ps) == 1 else torch.cat(ps, 2) for ps in zip(*pieces))
        mean_k, mean_v, bias = _state_read(stacked_rows, dt, state_key_weight, state_key_bias, log_count_bias)
        qs = chunks(q_state if state_temp is None else q_state * state_temp.view(1, H, 1, 1))
    # the attention in slabs of chunks: the logits of a slab stay in the CPU's cache (of all chunks at once they
    # were ~300 MB per layer for an 8K call, each pass over them from memory); every chunk's result is the same
    out = qg.new_empty(*qg.shape[:-1], all_v.shape[-1])
    slab = max(1, SLAB_BYTES // (B * Hkv * qg.shape[-2] * (M + L) * 4))
    for a in range(0, nc, slab):
        c = slice(a, min(a + slab, nc))
        lg = window_logits(c) if logits is None else logits[:, :, c]
        if not M:
            out[:, :, c] = torch.matmul(torch.softmax(lg, -1), vw[:, :, c])
            continue
        sl = _softcap(torch.matmul(qs[:, :, c], mean_k[:, :, c].transpose(-1, -2)) * scaling, softcap)
        p = torch.softmax(torch.cat((sl + bias[:, :, c].unsqueeze(-2), lg), -1), -1)
        out[:, :, c] = torch.matmul(p[..., :M], mean_v[:, :, c]) + torch.matmul(p[..., M:], vw[:, :, c])
    return _from_grid(out, G, off, T, q.dtype)


def _window_mass(logits: Tensor) -> Tensor:
    """The attention each query gives each window key, softmax over the window alone (a query's state rows do not
    enter, so the two attention paths score alike): ``logits [..., Q, W]`` (masked: -inf) -> ``[..., Q, W]``."""
    return torch.softmax(logits, -1).nan_to_num(0.0)


def _from_grid(out: Tensor, G: int, off: int, T: int, dtype) -> Tensor:
    """``[B, Hkv, nc, G*C, Dv]`` -> ``[B, H, T, Dv]``: drop the padding queries of the chunk grid."""
    B, Hkv, nc, GC, Dv = out.shape
    out = out.reshape(B, Hkv, nc, G, GC // G, Dv).transpose(2, 3)
    return out.reshape(B, Hkv * G, nc * (GC // G), Dv)[:, :, off:off + T].to(dtype)


def _softcap(x: Tensor, cap: Optional[float]) -> Tensor:
    return x if not cap else torch.tanh(x / cap) * cap
