"""KVMState: everything a KVM layer carries from one call to the next.

The state is a cache: ``kvm_attention(..., initial_state=s)`` advances ``s`` and returns it.
Call :meth:`KVMState.clone` first if you need the old one.

A ragged batch (rows that have seen different numbers of tokens, e.g. left-padded prompts of distinct
lengths) is one state with a :class:`RowSchedule`: each row's tokens seen, state rows and coverage. Row
``b`` keeps its state rows in ``keys[b, :, :rows[b]]`` and its window in ``window_keys[b, :, :window_len]``
of its own position; :meth:`KVMState.stack` builds one, :meth:`KVMState.split` takes it apart.

Buffer upkeep, shared by the paths that write a state in place (recurrent, the no-grad prefill, the chunked
path's routing pass, ragged decode): :func:`own_buffers` gives a state preallocated buffers of its own that grow
geometrically (:func:`reserve_rows`, :func:`reserve_window`); the read-out rows live right before the window in
one buffer per keys / values (:func:`joint_buffers`), so a one-token step reads ``[rows ; window]`` at once;
:func:`readout_cached` computes the read-out once per state version; :func:`absorb` brings the rows up to date
(the initial copy, then one routed update per block that left the window).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.routing import memory_keys, readout, route_novelty, route_overflow, state_layer_norm, token_streams
from kvmeans.ops.schedule import bswa_begin, plan_updates

__all__ = ["KVMState", "BatchedState", "RowSchedule", "own_buffers", "reserve_rows", "reserve_window", "write_window",
           "joint_buffers", "readout_cached", "absorb"]


class BatchedState:
    """Batch-wise copies and memory accounting for dataclass states whose tensor fields are
    listed in ``_TENSORS`` (batch first)."""

    _TENSORS: tuple = ()

    def _replace(self, fn):
        out = copy.copy(self)
        for name in self._TENSORS:
            t = getattr(self, name)
            setattr(out, name, None if t is None else fn(t))
        out.extras = {k: fn(v) if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in self.extras.items()}
        out._reset_caches()
        return out

    def _reset_caches(self) -> None:
        """Hook: drop derived caches on a copy."""

    def clone(self):
        return self._replace(lambda t: t.clone())

    def detach(self):
        """A copy cut from the autograd graph (truncated backpropagation through time)."""
        return self._replace(lambda t: t.detach())

    def index_select(self, batch_index: Tensor):
        """Select / reorder sequences of the batch (beam search): ``batch_index`` is ``[B']`` long."""
        idx = torch.as_tensor(batch_index, dtype=torch.long)
        return self._replace(lambda t: t.index_select(0, idx.to(t.device)))

    def reorder_(self, batch_index: Tensor):
        """In-place version of :meth:`index_select` (the object is kept, buffers are replaced)."""
        new = self.index_select(batch_index)
        for f in fields(self):
            setattr(self, f.name, getattr(new, f.name))
        return self

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the buffers (capacity included; ``extras`` and caches excluded)."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in self._TENSORS)
                   if t is not None)

    def check_batch(self, batch: int, owner: str) -> None:
        have = getattr(self, self._TENSORS[0]).shape[0]
        if have != batch:
            raise ValueError(f"{owner}: the state holds {have} sequences but x has batch {batch}; pass the "
                             f"state returned for these sequences (index_select it for beams)")


@dataclass(frozen=True)
class RowSchedule:
    """Per-row positions of a ragged batch (host ints, one per batch row; immutable, so copies share it)."""

    seen: Tuple[int, ...]           # tokens each row has seen
    rows: Tuple[int, ...]           # state rows in use
    coverage: Tuple[int, ...]       # tokens summarised by the rows

    def select(self, idx: List[int]) -> "RowSchedule":
        return RowSchedule(*(tuple(x[i] for i in idx) for x in (self.seen, self.rows, self.coverage)))

    def window_lens(self, chunk_len: int, n_bswa_chunks: int) -> List[int]:
        return [s - bswa_begin(s, chunk_len, n_bswa_chunks) for s in self.seen]

    def positions(self, T: int, device) -> Tensor:
        """``[B, T]`` absolute positions of the next ``T`` tokens of every row (shared by the layers of a step)."""
        return _positions(self.seen, T, torch.device(device))


@lru_cache(maxsize=4)
def _positions(seen: Tuple[int, ...], T: int, device: torch.device) -> Tensor:
    return torch.tensor(seen, device=device).view(-1, 1) + torch.arange(T, device=device)


@dataclass
class KVMState(BatchedState):
    """Carried state of one KVM attention layer for a batch of sequences of equal length.

    Buffers are preallocated with spare capacity so decoding does not reallocate per token;
    only the leading ``num_rows`` rows / ``window_len`` tokens are meaningful.

    Attributes:
        keys: ``[B, Hkv, capacity, D]`` raw key sums of the state rows (LN_s is applied at readout).
        values: ``[B, Hkv, capacity, Dv]`` raw value sums.
        radii: ``[B, Hkv, capacity]`` readout radius of each row, fixed when the row is created
            (with ``value_radius=False``: the number of tokens summed into the row).
        window_keys: ``[B, Hkv, window_capacity, D]`` uncompressed keys of tokens
            ``[window_start, seen_tokens)`` (post RoPE, as the window attends to them).
        window_values: ``[B, Hkv, window_capacity, Dv]``.
        window_gates: ``[B, Hkv, window_capacity]`` merge gates of the window tokens.
        num_rows: state rows in use (``m``).
        seen_tokens: tokens of the sequence processed so far.
        coverage: tokens summarised by the state rows (tokens ``[0, coverage)``).
        chunk_len, n_bswa_chunks, sink_len, rope_dim, value_radius: the configuration the state was
            built with; continuing with another configuration is an error.
        extras: free slot for layers (token-shift predecessors and the like).
        schedule: None when every row has seen ``seen_tokens``; a ragged batch's :class:`RowSchedule` otherwise
            (``num_rows``, ``seen_tokens``, ``coverage`` are then the rows' maxima; see the module docstring).
        row_count: None under a positional budget (every (sequence, kv head) holds ``num_rows`` rows); under a
            data-dependent one (``StateBudget.novelty``) a ``[B, Hkv]`` long tensor on the state's device: rows
            in use per sequence and kv head, ``num_rows`` is their maximum (the stored rows); rows
            ``>= row_count[b, h]`` hold zeros, are hidden from the read and are never merge targets.
    """

    keys: Tensor
    values: Tensor
    radii: Tensor
    window_keys: Tensor
    window_values: Tensor
    window_gates: Tensor
    num_rows: int = 0
    seen_tokens: int = 0
    coverage: int = 0
    chunk_len: int = 256
    n_bswa_chunks: int = 2
    sink_len: int = 1
    rope_dim: int = 0
    value_radius: bool = True
    extras: dict = field(default_factory=dict)
    schedule: Optional[RowSchedule] = None
    row_count: Optional[Tensor] = None
    # recurrent path: readout cache (LN_s keys, radius-scaled values) and whether the buffers are
    # its own preallocated ones (safe to write in place); neither is saved
    _readout: Optional[tuple] = field(default=None, repr=False, compare=False)
    _owned: bool = field(default=False, repr=False, compare=False)
    # ragged decode (kvmeans.ops.ragged): its [read-out rows ; window] buffers; not saved
    _row_readout: Optional[object] = field(default=None, repr=False, compare=False)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, value_dim: int, *, dtype: torch.dtype,
              device, chunk_len: int, n_bswa_chunks: int, sink_len: int, rope_dim: int,
              value_radius: bool, row_capacity: int = 0, window_capacity: int = 0) -> "KVMState":
        def buf(n, d=None):
            shape = (batch, kv_heads, n) if d is None else (batch, kv_heads, n, d)
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(buf(row_capacity, head_dim), buf(row_capacity, value_dim), buf(row_capacity),
                   buf(window_capacity, head_dim), buf(window_capacity, value_dim), buf(window_capacity),
                   chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks, sink_len=sink_len, rope_dim=rope_dim,
                   value_radius=value_radius)

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def window_start(self) -> int:
        return bswa_begin(self.seen_tokens, self.chunk_len, self.n_bswa_chunks)

    @property
    def window_len(self) -> int:
        """Window tokens (a ragged batch: the longest row's)."""
        if self.schedule is not None:
            return max(self.schedule.window_lens(self.chunk_len, self.n_bswa_chunks))
        return self.seen_tokens - self.window_start

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def row_capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def window_capacity(self) -> int:
        return self.window_keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def rows_in_use(self) -> Tensor:
        """``[B, Hkv]`` long: the rows each (sequence, kv head) uses, ``row_count`` or else ``num_rows`` for all."""
        if self.row_count is not None:
            return self.row_count
        return torch.full(self.keys.shape[:2], self.num_rows, dtype=torch.long, device=self.device)

    def rows(self):
        """``(keys [B,Hkv,m,D], values [B,Hkv,m,Dv], radii [B,Hkv,m])`` of the ``m`` rows in use."""
        m = self.num_rows
        return self.keys[:, :, :m], self.values[:, :, :m], self.radii[:, :, :m]

    def window(self):
        """``(keys [B,Hkv,w,D], values [B,Hkv,w,Dv], gates [B,Hkv,w])`` of the uncompressed window."""
        w = self.window_len
        return self.window_keys[:, :, :w], self.window_values[:, :, :w], self.window_gates[:, :, :w]

    def add_rows_(self, dest: Tensor, keys: Tensor, values: Tensor, radii: Tensor) -> None:
        """In place, for tokens ``j``: ``rows[b, h, dest[b, h, j]] += (keys, values, radii)[b, h, j]`` with ``dest
        [B, Hkv, N]`` below the row capacity (contiguous buffers). One accumulating ``index_put_`` per buffer over
        its rows flattened across batch and heads: same additions in the same order as ``scatter_add_`` along the
        rows, ~3x faster on CPU, and serial there (``index_add_`` and ``scatter_add_`` take a parallel sorting path
        whose thread barriers cost milliseconds per call on a loaded 2-core machine)."""
        B, Hkv, cap = self.keys.shape[:3]
        idx = (dest + torch.arange(B * Hkv, device=dest.device).view(B, Hkv, 1) * cap).flatten()
        for buf, x in ((self.keys, keys), (self.values, values), (self.radii, radii)):
            buf.view(B * Hkv * cap, -1).index_put_((idx,), x.reshape(idx.numel(), -1), accumulate=True)

    _TENSORS = ("keys", "values", "radii", "window_keys", "window_values", "window_gates")

    # ---- memory ------------------------------------------------------------------------------
    @property
    def nbytes_used(self) -> int:
        """Bytes of the rows and window tokens in use (a ragged batch: each row's own)."""
        if self.schedule is None:
            return sum(t.numel() * t.element_size() for t in (*self.rows(), *self.window()))
        slot = lambda *ts: sum(t[0, :, 0].numel() * t.element_size() for t in ts)   # one row / token, all heads
        windows = self.schedule.window_lens(self.chunk_len, self.n_bswa_chunks)
        return (sum(self.schedule.rows) * slot(self.keys, self.values, self.radii)
                + sum(windows) * slot(self.window_keys, self.window_values, self.window_gates))

    # ---- copies (clone, detach, index_select, reorder_ come from BatchedState) ----------------
    def _replace(self, fn):
        out = super()._replace(fn)
        if self.row_count is not None:      # copied, selected and moved with the rows, but never cast
            out.row_count = fn(self.row_count).long()
        return out

    def _reset_caches(self) -> None:
        self._readout, self._owned, self._row_readout = None, False, None

    # ---- ragged batches ------------------------------------------------------------------------
    def index_select(self, batch_index: Tensor) -> "KVMState":
        """Select / reorder sequences (beam search); rows of a ragged batch keep their schedules (a
        selection whose rows all stand at one position is a plain state)."""
        out = super().index_select(batch_index)
        if self.schedule is not None:
            out.set_schedule(self.schedule.select(torch.as_tensor(batch_index).flatten().tolist()))
        return out

    def set_schedule(self, schedule: RowSchedule) -> None:
        """Adopt per-row positions: plain (``schedule = None``) when all rows agree, ragged otherwise."""
        one = all(len(set(x)) == 1 for x in (schedule.seen, schedule.rows, schedule.coverage))
        self.schedule = None if one else schedule
        self.seen_tokens, self.num_rows, self.coverage = (max(x) for x in (schedule.seen, schedule.rows,
                                                                           schedule.coverage))

    def row_schedule(self) -> RowSchedule:
        """The per-row schedule (a plain state's rows all share its own)."""
        if self.schedule is not None:
            return self.schedule
        B = self.batch_size
        return RowSchedule((self.seen_tokens,) * B, (self.num_rows,) * B, (self.coverage,) * B)

    @classmethod
    def stack(cls, states: List["KVMState"]) -> "KVMState":
        """One state holding the rows of ``states`` in order (plain or ragged, same configuration, dtype and
        device; ``extras`` tensors concatenated); ragged unless every row stands at one position."""
        first = states[0]
        config = ("chunk_len", "n_bswa_chunks", "sink_len", "rope_dim", "value_radius")
        for st in states[1:]:
            for name in config:
                if getattr(st, name) != getattr(first, name):
                    raise ValueError(f"KVMState.stack: states differ in {name} ({getattr(first, name)!r} vs "
                                     f"{getattr(st, name)!r}); only states of one layer can be stacked")
            if (st.dtype, st.radii.dtype, st.device, st.keys.shape[1::2], st.values.shape[3]) != (
                    first.dtype, first.radii.dtype, first.device, first.keys.shape[1::2], first.values.shape[3]):
                raise ValueError(f"KVMState.stack: states differ in dtype, device or head sizes ({first!r} vs {st!r}); "
                                 f"only states of one layer can be stacked")
            if st.extras.keys() != first.extras.keys():
                raise ValueError(f"KVMState.stack: states carry different extras ({sorted(first.extras)} vs "
                                 f"{sorted(st.extras)}); stack the states of one layer")
        B, (Hkv, _, D), Dv = sum(st.batch_size for st in states), first.keys.shape[1:], first.values.shape[-1]
        rows, win = max(st.num_rows for st in states), max(st.window_len for st in states)
        out = cls.empty(B, Hkv, D, Dv, dtype=first.dtype, device=first.device, row_capacity=max(rows, 1),
                        window_capacity=max(win, 1), **{name: getattr(first, name) for name in config})
        out.radii = out.radii.to(first.radii.dtype)      # fp32 radii of reference numerics stay fp32
        b = 0
        for st in states:
            n, m, w = st.batch_size, st.num_rows, st.window_len
            for name, extent in zip(cls._TENSORS, (m, m, m, w, w, w)):
                getattr(out, name)[b:b + n, :, :extent] = getattr(st, name)[:, :, :extent]
            b += n
        out.extras = {k: torch.cat([st.extras[k] for st in states]) if isinstance(v, Tensor) else copy.deepcopy(v)
                      for k, v in first.extras.items()}
        parts = [st.row_schedule() for st in states]
        if any(st.row_count is not None for st in states):     # novelty growth: rows in use per (sequence, kv head)
            out.row_count = torch.cat([st.row_count if st.row_count is not None else torch.tensor(
                p.rows, device=first.device).view(-1, 1).expand(-1, Hkv) for st, p in zip(states, parts)])
        out.set_schedule(RowSchedule(*(sum((getattr(p, f) for p in parts), ()) for f in ("seen", "rows", "coverage"))))
        return out

    def split(self) -> List[Tuple[Tensor, "KVMState"]]:
        """``[(rows [G] long, plain state of those rows)]``: the batch rows grouped by position (groups in the
        order of their first row)."""
        if self.schedule is None:
            return [(torch.arange(self.batch_size), self)]
        sched, groups = self.schedule, {}
        for b, key in enumerate(zip(sched.seen, sched.rows, sched.coverage)):
            groups.setdefault(key, []).append(b)
        return [(torch.tensor(rows), self.index_select(torch.tensor(rows))) for rows in groups.values()]

    def to(self, *args, **kwargs) -> "KVMState":
        """Like ``Tensor.to``: move or cast every buffer (``state.to('cuda')``, ``state.to(torch.float64)``)."""
        return self._replace(lambda t: t.to(*args, **kwargs))

    def __repr__(self) -> str:
        B, Hkv, _, D = self.keys.shape
        return (f"KVMState(batch={B}, kv_heads={Hkv}, head_dim={D}, value_dim={self.values.shape[-1]}, "
                f"rows={self.num_rows}/{self.row_capacity}, window={self.window_len}/{self.window_capacity}, "
                f"seen_tokens={self.seen_tokens}, coverage={self.coverage}, chunk_len={self.chunk_len}, "
                f"n_bswa_chunks={self.n_bswa_chunks}, sink_len={self.sink_len}, rope_dim={self.rope_dim}, "
                f"value_radius={self.value_radius}, dtype={self.dtype}, device={self.device}"
                + ("" if self.schedule is None else f", ragged seen={list(self.schedule.seen)}") + ")")

    # ---- serialisation -------------------------------------------------------------------------
    def __getstate__(self):
        d = dict(self.__dict__)
        d["_readout"], d["_owned"], d["_row_readout"] = None, False, None
        return d

    def check_compatible(self, *, batch: int, kv_heads: int, head_dim: int, value_dim: int, chunk_len: int,
                         n_bswa_chunks: int, sink_len: int, rope_dim: int, value_radius: bool,
                         device: torch.device) -> None:
        """Raise a ValueError naming ``initial_state`` if this state cannot continue the given call."""
        expected = dict(chunk_len=chunk_len, n_bswa_chunks=n_bswa_chunks, sink_len=sink_len, rope_dim=rope_dim,
                        value_radius=value_radius)
        for name, want in expected.items():
            have = getattr(self, name)
            if have != want:
                raise ValueError(
                    f"initial_state was built with {name}={have!r} but this call uses {name}={want!r}; "
                    f"continue a sequence with the configuration that started it")
        got = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.values.shape[3])
        if got != (batch, kv_heads, head_dim, value_dim):
            raise ValueError(
                f"initial_state holds [batch, kv_heads, head_dim, value_dim] = {list(got)} but q/k/v give "
                f"{[batch, kv_heads, head_dim, value_dim]}; pass the state returned for these sequences")
        if self.device != device:
            raise ValueError(f"initial_state is on {self.device} but q is on {device}; move it with state.to(device)")


torch.serialization.add_safe_globals([KVMState, RowSchedule])


# ---- buffer upkeep (the recurrent path, the no-grad prefill, the routing pass, ragged decode) ----------------
def own_buffers(state: KVMState, rows: int = 0, window: int = 0) -> None:
    """Make the state's buffers its own (detached, preallocated) so they can be written in place,
    with room for at least ``rows`` rows and ``window`` window tokens (both grow geometrically on demand:
    sized by the tokens present, never by the configured maximum)."""
    if state._owned:
        reserve_rows(state, rows)
        reserve_window(state, window)
        return
    _alloc(state, max(state.num_rows, rows, 1), max(state.window_len, window, 1), *state.rows(), *state.window())


def reserve_rows(state: KVMState, rows: int) -> None:
    """Room for ``rows`` state rows in the owned buffers."""
    if rows > state.row_capacity:                    # geometric growth: amortised O(1) copies per row
        _alloc(state, max(rows, 2 * state.row_capacity), state.window_capacity, *state.rows(),
               state.window_keys, state.window_values, state.window_gates)


def reserve_window(state: KVMState, tokens: int) -> None:
    """Room for ``tokens`` window tokens (the recurrent path asks for at most ``L``; the cap ``L + C`` serves callers
    that write a chunk before absorbing the block it pushes out)."""
    if tokens > state.window_capacity:
        most = (state.n_bswa_chunks + 1) * state.chunk_len
        _alloc(state, state.row_capacity, min(max(tokens, 2 * state.window_capacity), most), *state.rows(),
               *state.window())


def _alloc(state, rows_cap, win_cap, keys, values, radii, wk, wv, wg):
    """New owned buffers of ``rows_cap`` rows and ``win_cap`` window tokens holding the given rows and window."""
    B, Hkv, D, Dv = keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]
    fresh = KVMState.empty(B, Hkv, D, Dv, dtype=keys.dtype, device=keys.device, chunk_len=state.chunk_len,
                           n_bswa_chunks=state.n_bswa_chunks, sink_len=state.sink_len, rope_dim=state.rope_dim,
                           value_radius=state.value_radius, row_capacity=rows_cap, window_capacity=0)
    # [read-out rows (right-aligned, written by readout_cached) ; window]: the window buffers are views of these
    joint = [keys.new_zeros(B, Hkv, rows_cap + win_cap, d) for d in (D, Dv)]
    fresh.window_keys, fresh.window_values = (j[:, :, rows_cap:] for j in joint)
    fresh.window_gates = wg.new_zeros(B, Hkv, win_cap)
    m, w = keys.shape[2], wk.shape[2]
    fresh.keys[:, :, :m], fresh.values[:, :, :m], fresh.radii[:, :, :m] = keys, values, radii
    fresh.window_keys[:, :, :w], fresh.window_values[:, :, :w], fresh.window_gates[:, :, :w] = wk, wv, wg
    for name in ("keys", "values", "radii", "window_keys", "window_values", "window_gates"):
        setattr(state, name, getattr(fresh, name))
    state._joint = joint
    # the decode kernel's [rows, window_len] (int32, on the device; the recurrent path keeps it current): kept when
    # an owned state grows its rows, new for a state that is not owned yet (a copy must not share it)
    if not state._owned or getattr(state, "_lengths", None) is None:
        state._lengths = (torch.zeros(2, dtype=torch.int32, device=keys.device), [0, 0])
    state._owned, state._readout = True, None


def write_window(state: KVMState, at: int, k: Tensor, v: Tensor, g: Tensor) -> None:
    """Write tokens ``k, v, g`` (``[B, Hkv, t, ...]``) into the window buffers from slot ``at``."""
    reserve_window(state, at + k.shape[2])
    sl = slice(at, at + k.shape[2])
    state.window_keys[:, :, sl], state.window_values[:, :, sl], state.window_gates[:, :, sl] = k, v, g


def joint_buffers(state: KVMState):
    """``(keys, values, cap)``: the buffers ``[B, Hkv, cap + window_capacity, D|Dv]`` whose slots from ``cap`` on are
    the state's window buffers (:func:`_alloc`), or None when the state's buffers are not laid out so."""
    joint = getattr(state, "_joint", None) if state._owned else None
    if joint is None or state.window_keys._base is not joint[0] or state.window_values._base is not joint[1]:
        return None
    cap = joint[0].shape[2] - state.window_capacity
    return (*joint, cap) if state.num_rows <= cap else None


def readout_cached(state: KVMState, ln):
    """``(k_hat [B, Hkv, m, D], v_hat [B, Hkv, m, Dv])``: the read-out state rows (LN_s keys, radius-scaled
    values), computed once per state version and LN_s parameters (``ln = (weight, bias, eps)``); shared by the
    routing of an update and the attention read."""
    w, b, eps = ln
    key = (state.num_rows, id(w), None if w is None else w._version, id(b), None if b is None else b._version, eps)
    if state._readout is None or state._readout[0] != key:
        k_hat, v_hat = readout(*state.rows(), state.value_radius, *ln)
        joint = joint_buffers(state)
        if joint is not None:           # kept right before the window: one read of [rows ; window] per step
            kj, vj, cap = joint
            m = state.num_rows
            k_hat, v_hat = kj[:, :, cap - m:cap].copy_(k_hat), vj[:, :, cap - m:cap].copy_(v_hat)
        state._readout = (key, k_hat, v_hat)
    return state._readout[1], state._readout[2]


def absorb(state: KVMState, keys: Tensor, values: Tensor, gates: Tensor, origin: int, total: int, budget, ln,
           gate_keys=True, gate_values=True, gate_appends=False, attn="torch") -> list:
    """Bring the state rows up to date for a sequence of ``total`` tokens, in place: copy the first
    chunk, then absorb every block that has left the window. Token ``p`` is read from
    ``keys/values/gates[:, :, p - origin]`` (``[B, Hkv, N, D]``, ``[B, Hkv, N, Dv]``, ``[B, Hkv, N]``).

    Returns what happened, ``[(start, n_tokens, dest, appended)]``: ``dest [B, Hkv, n]`` rows the tokens
    joined and ``appended [B, Hkv, n]`` which created them (both None for the initial copy, whose
    tokens become rows ``rows_before, ...`` in order). ``attn="triton"``: the updates use the Triton
    routing / scatter kernels (:func:`_update`).
    """
    C, cov, records = state.chunk_len, state.coverage, []
    fill = min(total, C) - cov
    if fill > 0:                                     # the first chunk is copied: rows k_bar, v, |v|
        reserve_rows(state, state.num_rows + fill)
        m, loc = state.num_rows, slice(cov - origin, cov + fill - origin)
        vals = values[:, :, loc]
        state.keys[:, :, m:m + fill] = memory_keys(keys[:, :, loc], state.rope_dim, *ln)
        state.values[:, :, m:m + fill] = vals
        state.radii[:, :, m:m + fill] = vals.norm(dim=-1) if state.value_radius else 1
        state.num_rows, state.coverage, state._readout = m + fill, cov + fill, None
        records.append((cov, fill, None, None))
    for step in plan_updates(budget, state.coverage, state.num_rows, total, C, state.n_bswa_chunks):
        loc = slice(step.start - origin, step.start + C - origin)
        dest, app = _update(state, step, keys[:, :, loc], values[:, :, loc], gates[:, :, loc], ln, gate_keys,
                            gate_values, gate_appends, attn, budget if is_data_dependent(budget) else None)
        records.append((step.start, C, dest, app))
    return records


def _update(state: KVMState, step, kb, vb, gb, ln, gate_keys, gate_values, gate_appends, attn="torch", growth=None):
    """The overflow block ``[step.start, step.start + C)`` (raw keys ``kb``, values, gates) enters the state;
    returns its routing ``(dest, appended)``, each ``[B, Hkv, C]``. ``attn="triton"`` (fp32 state): routing by
    ``route_overflow_triton`` (same rule and ties as ``route_overflow``), sums by ``scatter_add_rows``.
    ``growth``: a novelty budget (``route_novelty``, rows per kv head in ``state.row_count``; torch only)."""
    kbar = memory_keys(kb, state.rope_dim, *ln)
    append_hat = None                                # LN_s of the key each token would get as a new row
    if step.n_append > 0 or growth is not None:
        everyone = torch.ones_like(gb, dtype=torch.bool)
        ak, _, _ = token_streams(kbar, vb, gb, everyone, gate_keys=gate_keys, gate_values=gate_values,
                                 gate_appends=gate_appends)
        append_hat = state_layer_norm(ak, *ln)
    rows_hat, _ = readout_cached(state, ln)         # LN_s of the state: shared with the attention readout
    fused = attn == "triton" and state.keys.dtype == torch.float32 and state.radii.dtype == torch.float32
    if fused:
        from kvmeans.ops.triton import update as tri
        route = tri.route_overflow_triton
    else:
        route = route_overflow
    if growth is not None:
        dest, app, state.row_count = route_novelty(rows_hat, state.rows_in_use(), kbar, append_hat, growth.threshold,
                                                   growth.n, state.sink_len)
        m1 = max(state.num_rows, int(state.row_count.max()))
    else:
        dest, app = route(rows_hat, kbar, append_hat, step.n_append, state.sink_len)
        m1 = step.rows_after
    dk, dv, rad = token_streams(kbar, vb, gb, app, gate_keys=gate_keys, gate_values=gate_values,
                                gate_appends=gate_appends)
    reserve_rows(state, m1)
    if fused:                                        # fp32 atomics into the preallocated buffers
        d32 = dest.to(torch.int32)
        tri.scatter_add_rows(state.keys, d32, dk)
        tri.scatter_add_rows(state.values, d32, dv)
        radius = torch.where(app, rad, 0) if state.value_radius else torch.ones_like(rad)
        tri.scatter_add_rows(state.radii.unsqueeze(-1), d32, radius.unsqueeze(-1))
    else:
        state.add_rows_(dest, dk, dv, torch.where(app, rad, 0) if state.value_radius else torch.ones_like(rad))
    state.num_rows, state.coverage, state._readout = m1, step.start + state.chunk_len, None
    return dest, app
