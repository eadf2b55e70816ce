"""A converted layer's per-request state in fixed-shape slots (what a vLLM state slot holds; plain torch, no vLLM).

vLLM gives every running request of a stateful layer one slot of a fixed byte size, chosen at start-up. A
:class:`~kvmeans.pretrained.op.ConvertedKVMState` of one sequence grows while it runs (the rows up to the budget,
the exact window up to ``n_bswa_chunks * chunk_len`` tokens between calls), so a slot holds each tensor at its
largest and the counts of what is used (``meta``: tokens seen, tokens merged into the rows (``covered``), rows
used). Between calls the window is always the tokens ``[covered, seen)`` and ``covered = bswa_begin(seen)``, so
the slot needs no positions: the pre-RoPE modes get them back as ``arange(covered, seen)``.

* :func:`load_state` / :func:`store_state`: a slot to a ``ConvertedKVMState`` of batch 1 and back, so any call
  runs kvmeans' own op (``converted_kvm_attention``) and continues exactly as the transformers path does.
* :func:`decode_batch`: one new token for many requests at once, read straight from their slots, for the steps
  that route nothing (a token that does not move the window past a chunk boundary; one step in ``chunk_len``
  does, and goes through the op). It computes what ``converted_kvm_attention``'s one-chunk read computes.
  The rows' read-out (mean keys, mean values, the log-count bias) changes only when a block is routed, so
  :func:`store_state` writes it into the slot (``read_*``: the reserve, then the pool rows, then empty rows
  with bias ``-inf``) and a decode step reads it as it stands: the slot is ~1.5x larger, a step ~2x cheaper.

Slots are never cleared: a request's first store (``seen == 0`` before it) overwrites what a step could read
past the used counts (the read-out's empty rows, the window's unused values), so a reused slot leaks nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from kvmeans.ops.budget import as_budget
from kvmeans.ops.schedule import bswa_begin
from kvmeans.pretrained.op import ConvertedKVMState, _softcap, _state_read

Slots = Dict[str, Tensor]           # name -> [num_slots, *shape]
META = ("seen", "covered", "rows")  # the int32 counters of a slot (a fourth entry is spare)
RESERVE = tuple(f for f in ConvertedKVMState.FIELDS if f.startswith("reserve_"))   # the reserve's tensors


def pool_capacity(budget, chunk_len: int, n_bswa_chunks: int, exact_rows: int, max_len: int) -> int:
    """The most mean-pool rows a sequence of at most ``max_len`` tokens reaches (the first chunk's ``chunk_len``
    rows at least; every later block appends up to the budget less the reserve, never more than it could hold)."""
    budget = as_budget(budget)
    C, L = chunk_len, n_bswa_chunks * chunk_len
    cap = C
    for start in range(C, bswa_begin(max_len, C, n_bswa_chunks), C):      # the blocks that leave the window
        cap = max(cap, min(max(0, int(budget(start + L)) - exact_rows), start + C))
    return cap


@dataclass(frozen=True)
class SlotLayout:
    """What one slot holds for one converted layer: ``rows`` mean-pool rows, ``exact_rows`` reserve rows and a
    window of ``window`` tokens of ``num_kv_heads`` kv heads; sums in ``sum_dtype`` (float32 for half models, as
    the op keeps them), window keys/values (and gates, ``learned``) in the model's ``dtype``."""

    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    rows: int
    exact_rows: int
    window: int
    learned: bool
    dtype: torch.dtype

    @property
    def sum_dtype(self) -> torch.dtype:
        return torch.promote_types(self.dtype, torch.float32)

    @classmethod
    def for_spec(cls, spec, *, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None) -> "SlotLayout":
        """The layout for a ``kvmeans.pretrained.convert.KVMSpec`` and sequences of at most ``max_len`` tokens."""
        rows = pool_capacity(spec.budget, spec.chunk_len, spec.n_bswa_chunks, spec.exact_rows, max_len)
        return cls(num_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v, rows, spec.exact_rows,
                   spec.n_bswa_chunks * spec.chunk_len, bool(spec.learned), dtype)

    def entries(self) -> Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]:
        """``(name, shape, dtype)`` per tensor of a slot, widest elements first (so every view is aligned)."""
        H, D, Dv, M, R, L, s = (self.num_kv_heads, self.head_dim, self.head_dim_v, self.rows, self.exact_rows,
                                self.window, self.sum_dtype)
        out = [("meta", (4,), torch.int32), ("key_sum", (H, M, D), s), ("value_sum", (H, M, Dv), s),
               ("count", (H, M), s)]
        if R:
            out += [("reserve_key", (H, R, D), s), ("reserve_value", (H, R, Dv), s), ("reserve_count", (H, R), s),
                    ("reserve_score", (H, R), s), ("reserve_pos", (H, R), s)]
        out += [("read_key", (H, R + M, D), s), ("read_value", (H, R + M, Dv), s), ("read_bias", (H, R + M), s)]
        out += [("buf_k", (H, L, D), self.dtype), ("buf_v", (H, L, Dv), self.dtype)]
        if self.learned:
            out.append(("buf_g", (H, L), self.dtype))
        width = {name: torch.empty((), dtype=dt).element_size() for name, _, dt in out}
        return tuple(sorted(out, key=lambda e: -width[e[0]]))      # stable: the order above within a width

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(e[0] for e in self.entries())

    @property
    def shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return tuple(e[1] for e in self.entries())

    @property
    def dtypes(self) -> Tuple[torch.dtype, ...]:
        return tuple(e[2] for e in self.entries())

    @property
    def nbytes(self) -> int:
        """Bytes of one slot (one request, one layer)."""
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                   for _, shape, dt in self.entries())

    def allocate(self, num_slots: int, device=None) -> Slots:
        """Zeroed slots (tests; vLLM allocates its own and :meth:`bind` names them)."""
        return {name: torch.zeros(num_slots, *shape, dtype=dt, device=device) for name, shape, dt in self.entries()}

    def bind(self, tensors: Sequence[Tensor]) -> Slots:
        """Name the per-state tensors vLLM binds to a layer (in :meth:`entries` order)."""
        return dict(zip(self.names, tensors))


def load_state(slots: Slots, i: int, layout: SlotLayout, sink_len: int, pre_rope: bool) -> ConvertedKVMState:
    """Slot ``i`` as a ``ConvertedKVMState`` of batch 1. Its tensors are views of the slot: the op replaces a
    state's tensors and never writes into them, and :func:`store_state` skips what is unchanged."""
    st = ConvertedKVMState()
    seen, covered, rows, _ = slots["meta"][i].tolist()
    if seen == 0:
        return st
    n = seen - covered
    st.seen, st.covered = seen, covered
    st.buf_k, st.buf_v = slots["buf_k"][i:i + 1, :, :n], slots["buf_v"][i:i + 1, :, :n]
    if pre_rope:
        st.buf_pos = torch.arange(covered, seen, device=st.buf_v.device).unsqueeze(0)
    if layout.learned:
        st.buf_g = slots["buf_g"][i:i + 1, :, :n].unsqueeze(-1)
    if rows:
        st.sink_len = sink_len
        st.key_sum, st.value_sum = slots["key_sum"][i:i + 1, :, :rows], slots["value_sum"][i:i + 1, :, :rows]
        st.count = slots["count"][i:i + 1, :, :rows]
        if layout.exact_rows:
            (st.reserve_key, st.reserve_value, st.reserve_count, st.reserve_score, st.reserve_pos) = (
                slots[name][i:i + 1] for name in RESERVE)
    return st


def _put(dest: Tensor, src: Tensor) -> None:
    if src.data_ptr() != dest.data_ptr() or src.stride() != dest.stride():
        dest.copy_(src)


def store_state(slots: Slots, i: int, st: ConvertedKVMState, layout: SlotLayout, *, log_count_bias: bool = True,
                state_key_weight: Optional[Tensor] = None, state_key_bias: Optional[Tensor] = None) -> None:
    """Write ``st`` (batch 1, after a call of the op) into slot ``i``, with the rows' read-out
    (``_state_read`` with the layer's ``log_count_bias`` and learned ``state_key_*``, as the op reads them)."""
    n = 0 if st.buf_v is None else st.buf_v.shape[-2]
    rows = 0 if st.count is None else st.count.shape[-1]
    if n != st.seen - st.covered:
        raise RuntimeError(f"KVM state: the window holds {n} tokens, expected seen - covered = {st.seen - st.covered}")
    if n > layout.window or rows > layout.rows:
        raise RuntimeError(f"KVM state outgrew its slot: {rows} rows (slot: {layout.rows}), {n} window tokens "
                           f"(slot: {layout.window}); the slot is sized for max_model_len")
    old_seen, _, old_rows = slots["meta"][i, :3].tolist()
    if old_seen == 0:                   # a new request: what a decode step reads past its counts, made inert
        slots["read_key"][i].zero_()
        slots["read_value"][i].zero_()
        slots["read_bias"][i].fill_(float("-inf"))
        slots["buf_v"][i, :, n:].zero_()
    elif rows < old_rows:
        raise RuntimeError(f"KVM state: {rows} rows after {old_rows} (a sequence's rows never shrink)")
    if n:
        _put(slots["buf_k"][i, :, :n], st.buf_k[0])
        _put(slots["buf_v"][i, :, :n], st.buf_v[0])
        if layout.learned:
            _put(slots["buf_g"][i, :, :n], st.buf_g[0, ..., 0])
    if rows:
        for name in ("key_sum", "value_sum", "count"):
            _put(slots[name][i, :, :rows], getattr(st, name)[0])
        R = layout.exact_rows
        if R:
            for name in RESERVE:
                _put(slots[name][i], getattr(st, name)[0])
        dt = layout.sum_dtype
        pool = _state_read((st.key_sum, st.value_sum, st.count), dt, state_key_weight, state_key_bias,
                           log_count_bias)
        res = (_state_read(st.reserve[:3], dt, state_key_weight, state_key_bias, log_count_bias) if R else None)
        for j, name in enumerate(("read_key", "read_value", "read_bias")):
            dest = slots[name][i]
            if R:
                dest[:, :R].copy_(res[j][0])
            dest[:, R:R + rows].copy_(pool[j][0])
    slots["meta"][i, :3] = torch.tensor([st.seen, st.covered, rows], dtype=torch.int32)


def decode_batch(slots: Slots, layout: SlotLayout, idx: Tensor, meta: Tensor, q: Tensor, k: Tensor, v: Tensor,
                 q_state: Tensor, *, scaling: float, softcap: Optional[float] = None,
                 gate: Optional[Tensor] = None, state_temp: Optional[Tensor] = None,
                 window_temp: Optional[Tensor] = None) -> Tensor:
    """One new token for each of ``N`` requests whose step routes nothing (``bswa_begin(seen + 1) == covered``)
    and that have been stored once (``seen > 0``): append its key/value (and merge gate) to the slot's window,
    read the rows' stored read-out and the window, advance ``seen``.

    ``idx [N]`` slot ids, ``meta [N, 4]`` their counters before the step; ``q [N, H, D]`` (post-RoPE),
    ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]``; ``q_state [N, H, D]`` the query that reads the rows (the pre-RoPE
    modes' rotated query, else ``q``); ``gate [N, Hkv]``. Returns ``[N, H, Dv]`` in ``q``'s dtype: what
    ``converted_kvm_attention`` returns for the same state and token (``_attend_one_chunk``; the reserve's
    rows come first in the softmax here, so equal up to rounding)."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    dev = q.device
    dt = torch.promote_types(q.dtype, torch.float32)
    counters = meta[:, :3].tolist()             # one read of the counters (a host sync on a GPU)
    if any(seen == 0 for seen, _, _ in counters):
        raise ValueError("decode_batch: a request's first call goes through the op (its slot holds no state yet)")
    rows = max(r for _, _, r in counters)
    W = max(seen - covered for seen, covered, _ in counters) + 1
    n_buf = (meta[:, 0] - meta[:, 1]).long().to(dev)
    slots["buf_k"][idx, :, n_buf] = k.to(layout.dtype)
    slots["buf_v"][idx, :, n_buf] = v.to(layout.dtype)
    if gate is not None:
        slots["buf_g"][idx, :, n_buf] = gate.to(layout.dtype)
    kw = slots["buf_k"][idx, :, :W].to(dt)                                             # [N, Hkv, W, D]
    vw = slots["buf_v"][idx, :, :W].to(dt)     # past a request's own tokens: its older values or zeros, p = 0
    qw = q if window_temp is None else q * window_temp.view(1, H, 1)
    logits = _softcap(torch.matmul(qw.to(dt).reshape(N, Hkv, G, D), kw.transpose(-1, -2)) * scaling, softcap)
    logits = logits.masked_fill((torch.arange(W, device=dev) > n_buf[:, None])[:, None, None, :], float("-inf"))
    if rows == 0:
        out = torch.matmul(torch.softmax(logits, -1), vw)
    else:
        RM = layout.exact_rows + rows          # the reserve, then the pool rows; a request's unused: bias -inf
        mean_k, mean_v, bias = (slots[name][idx, :, :RM] for name in ("read_key", "read_value", "read_bias"))
        qs = q_state if state_temp is None else q_state * state_temp.view(1, H, 1)
        sl = _softcap(torch.matmul(qs.to(dt).reshape(N, Hkv, G, D), mean_k.transpose(-1, -2)) * scaling, softcap)
        p = torch.softmax(torch.cat((sl + bias.unsqueeze(-2), logits), -1), -1)
        out = torch.matmul(p[..., :RM], mean_v) + torch.matmul(p[..., RM:], vw)
    slots["meta"][idx, 0] = (meta[:, 0] + 1).to(torch.int32).to(slots["meta"].device)
    return out.reshape(N, H, -1).to(q.dtype)


def needs_routing(seen: int, covered: int, chunk_len: int, n_bswa_chunks: int) -> bool:
    """Whether one more token moves the window past a chunk boundary (a block leaves it, or the first chunk
    becomes the rows): then the step goes through the op; otherwise :func:`decode_batch` can take it."""
    return bswa_begin(seen + 1, chunk_len, n_bswa_chunks) > covered


__all__ = ["SlotLayout", "Slots", "pool_capacity", "load_state", "store_state", "decode_batch", "needs_routing"]
