"""Chunk-parallel KVM for prefill and training, in plain torch (CPU and GPU).

The state recurrence depends only on k, v and the gate, never on attention outputs, so:

1. route first: one no-grad pass over the overflow blocks decides, for every token that enters
   the state, its destination row (a new row, or the merge target);
2. rebuild the state each query chunk sees as a differentiable function of the tokens:
   ``s(c) = s_carried + sum over tokens arrived by chunk c of onehot(dest) * contribution``,
   a scatter into per-chunk increments followed by a cumulative sum over chunks (radii and the
   ablation's row counts are rebuilt the same way);
3. attend all query chunks of a group to ``[readout(s(c)) ; window(c)]`` in one SDPA call with a
   boolean mask (rows not yet created and future window tokens hidden). The no-grad prefill on CPU splits
   that read for whole chunks: the snapshot, the previous chunks and the own chunk (causal) in three unmasked
   flash calls on views of the window, joined by their log-sum-exp (:func:`_joined_attention`).

Groups of chunks bound the working memory. Under autograd, small calls keep one graph; large ones
(and the Triton kernels) use :mod:`kvmeans.ops.chunk_reconstruct`, whose backward rebuilds each
group's state in reverse from the final state, so no state copy per chunk is ever kept.
Deviation from ``naive.py``: the order in which contributions are summed (tested within tolerance).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.chunk_reconstruct import GroupPlan, reconstruct_attention
from kvmeans.ops.masking import finite_tokens, poison, window_poison
from kvmeans.ops.routing import memory_keys, readout, token_streams
from kvmeans.ops.schedule import bswa_begin, coverage_after, plan_updates
from kvmeans.ops.state import KVMState, absorb, own_buffers, readout_cached

GROUP_BYTES = 256 << 20        # working set of one group's attention call (CPU; a GPU's is sized by its memory)
RECONSTRUCT_BYTES = 1 << 30    # "auto" backward: reconstruct the state when a graph would keep more than this
# ... or more than this where the reconstruction reads joined whole chunks and reuses the forward's flash output and
# log-sum-exp (CPU, D == Dv): measured as fast as the graph at T=8192 and faster, with 36% less kept, at 32768
RECONSTRUCT_BYTES_JOINED = 256 << 20
BACKWARD = "auto"              # default of chunk_kvm_attention(backward=...): "auto" | "graph" | "reconstruct"


@dataclass
class _Routes:
    dest: Tensor            # [B, Hkv, N] row each entering token joins
    created: Tensor         # [B, Hkv, N] token creates a row (initial fill or append)
    ungated: Tensor         # [B, Hkv, N] token enters with its ungated key/value
    rows_at: List[int]      # rows visible to query chunk c (0 while the state is inactive; novelty: the max over (b, h))
    num_rows: int           # rows of the final state
    counts: Optional[Tensor] = None     # novelty budget: [B, Hkv, chunks] rows in use visible to chunk c
    row_count: Optional[Tensor] = None  # novelty budget: [B, Hkv] rows in use after the call


def chunk_kvm_attention(q, k, v, gate, state: KVMState, *, budget, state_norm_weight, state_norm_bias,
                        state_norm_eps, state_temp, bswa_temp, scale, gate_keys=True, gate_values=True,
                        gate_appends=False, backward=None, group_bytes=None, attn="torch", mma_dtype=None):
    """Same contract as :func:`kvmeans.ops.naive.naive_kvm_attention`; returns ``(y, new_state)``.

    ``backward`` (with autograd): ``"graph"`` keeps the activations of every chunk (fastest for small
    calls), ``"reconstruct"`` keeps one final state and rebuilds each group's state in reverse during
    backward (:mod:`kvmeans.ops.chunk_reconstruct`: memory O(T + state), not O(chunks * state));
    ``"auto"`` picks reconstruct for the Triton kernels and for calls whose graph would exceed
    ``RECONSTRUCT_BYTES`` (``RECONSTRUCT_BYTES_JOINED`` on CPU with ``D == Dv``); None takes the module's
    ``BACKWARD``. ``group_bytes`` bounds the size of one batched attention call (None: :func:`default_group_bytes`). ``mma_dtype`` (``numerics="mixed"``): q, the window and
    the read-out state enter the attention dots in this dtype (softmax statistics and accumulation stay fp32,
    as in flash attention); the state, its routing and sums are unchanged. ``attn``: "torch" (SDPA with a mask) or "triton" (the fused
    kernel of :mod:`kvmeans.ops.triton.attention`: no window copy per chunk, no repeated GQA keys).
    """
    C, n = state.chunk_len, state.n_bswa_chunks
    ln = (state_norm_weight, state_norm_bias, state_norm_eps)
    t0, T = state.seen_tokens, q.shape[2]
    t1, w0 = t0 + T, state.window_start
    group_bytes = default_group_bytes(q.device) if group_bytes is None else group_bytes
    wk, wv, wg = state.window()
    if state.window_len:
        kk, vv, gg = torch.cat([wk, k], 2), torch.cat([wv, v], 2), torch.cat([wg, gate], 2)  # tokens [w0, t1)
    else:
        kk, vv, gg = k, v, gate
    ln_params = [t for t in (state_norm_weight, state_norm_bias, state_temp, bswa_temp) if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, kk, vv, gg, *state.rows(), *ln_params))
    if not grad and not is_data_dependent(budget):     # (novelty growth takes the path below, with or without grad)
        return _prefill_no_grad(q, kk, vv, gg, state, budget=budget, ln=ln, state_temp=state_temp,
                                bswa_temp=bswa_temp, scale=scale, group_bytes=group_bytes,
                                gates=(gate_keys, gate_values, gate_appends), attn=attn, mma_dtype=mma_dtype)
    # tokens entering the state in this call: [cov0, cov1), a contiguous range
    cov0, cov1 = state.coverage, max(state.coverage, coverage_after(t1, C, n))
    enter = slice(cov0 - w0, cov1 - w0)
    kbar = memory_keys(kk[:, :, enter], state.rope_dim, *ln)
    routes = _route(state, kk[:, :, enter].detach(), vv[:, :, enter].detach(), gg[:, :, enter].detach(), budget,
                    ln, t1, gate_keys, gate_values, gate_appends, attn)
    dk, dv, rad = token_streams(kbar, vv[:, :, enter], gg[:, :, enter], routes.ungated, gate_keys=gate_keys,
                                gate_values=gate_values, gate_appends=False)
    dr = torch.where(routes.created, rad, 0) if state.value_radius else torch.ones_like(rad)
    m_final = routes.num_rows
    base = [_pad_rows(t, m_final) for t in state.rows()]       # sums of tokens arrived before the group
    streams = (dk, dv, dr)

    c_first, c_last = t0 // C, (t1 - 1) // C
    per_row = q.shape[0] * q.shape[1] * (C + q.shape[3] + v.shape[3]) * q.element_size()
    if attn == "triton":    # per chunk only its snapshot rows (sums + readout, ~4 copies per kv head), no window
        per_row = 4 * q.shape[0] * kk.shape[1] * (q.shape[3] + v.shape[3]) * q.element_size()
    # the reconstruction backward's joined read: like chunks together (rows hidden per (b, h): never joined)
    joins = attn != "triton" and _saves_flash(q, v) and routes.counts is None
    kind = (lambda c: (routes.rows_at[c] > 0, _whole_window(c, C, n, w0))) if joins else None
    groups = _groups(c_first, c_last, routes.rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn, kind)
    backward = BACKWARD if backward is None else backward
    if backward == "auto":
        # the graph keeps per chunk SDPA's keys/values over [state ; window] plus the snapshot sums (~2x);
        # the Triton kernels' backward needs no forward re-run, so reconstruction costs little there
        saved = sum((cb - ca) * (routes.rows_at[cb - 1] + _window_geometry(ca, cb, C, n, t0, t1, w0)[3])
                    for ca, cb in groups) * \
            q.shape[0] * q.shape[1] * (q.shape[3] + v.shape[3]) * q.element_size() * 2
        limit = RECONSTRUCT_BYTES_JOINED if joins else RECONSTRUCT_BYTES
        backward = "reconstruct" if attn == "triton" or saved > min(limit, RECONSTRUCT_BYTES) else "graph"
    geo = dict(C=C, n=n, t0=t0, t1=t1, w0=w0, scale=scale, value_radius=state.value_radius, rows_at=routes.rows_at,
               ln_eps=state_norm_eps, attn=attn, counts=routes.counts)
    arrival = torch.arange(cov0, cov1, device=q.device) // C + n    # first query chunk that sees each entering token
    bounds = [0] + [int((arrival < ca).sum()) for ca, _ in groups] + [int((arrival < c_last + 1).sum()), arrival.numel()]
    cuts = [hi - lo for lo, hi in zip(bounds, bounds[1:])]            # before the groups, each group, after them
    params = (state_temp, bswa_temp, state_norm_weight, state_norm_bias)
    ka, va, bad = finite_tokens(kk, vv)         # attention operands: masked tokens must contribute exactly zero
    qa, ka, va = (x.to(mma_dtype) for x in (q, ka, va)) if mma_dtype else (q, ka, va)
    if backward == "reconstruct":
        plan = GroupPlan(groups=groups, cuts=cuts, dest=routes.dest, arrival=arrival,
                         q_spans=[(max(ca * C, t0) - t0, min(cb * C, t1) - t0) for ca, cb in groups],
                         w_spans=[(max(w0, (ca + 1 - n) * C) - w0, min(cb * C, t1) - w0) for ca, cb in groups],
                         attend=_span_attend(groups, geo), kernel_saves=attn == "triton" or _saves_flash(q, v))
        y, keys, values, radii = reconstruct_attention(plan, qa, ka, va, streams, base, params)
    elif backward == "graph":
        y = _graph_groups(groups, cuts, routes, arrival, qa, ka, va, streams, base, params, geo)
        keys, values, radii = (_scatter_tokens(_pad_rows(b, m_final), routes.dest, s)
                               for b, s in zip(state.rows(), streams))
    else:
        raise ValueError(f"backward must be 'auto', 'graph' or 'reconstruct', got {backward!r}")
    y = poison(y, window_poison(bad, w0, t0, t1, C, n))

    ws = bswa_begin(t1, C, n) - w0
    out_state = KVMState(keys, values, radii, kk[:, :, ws:], vv[:, :, ws:], gg[:, :, ws:], num_rows=m_final,
                         seen_tokens=t1, coverage=cov1, chunk_len=C, n_bswa_chunks=n,
                         sink_len=state.sink_len, rope_dim=state.rope_dim, value_radius=state.value_radius,
                         extras=state.extras, row_count=routes.row_count)
    return y, out_state


def default_group_bytes(device: torch.device) -> int:
    """Working set of one group: ``GROUP_BYTES`` on CPU; on a GPU 1/32 of its memory, within
    [GROUP_BYTES, 4 GiB] (fewer, larger launches: at B=8, H=32, D=128 a 256-row snapshot is 256 MiB)."""
    if device.type != "cuda":
        return GROUP_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return max(GROUP_BYTES, min(total // 32, 4 << 30))


def _graph_groups(groups, cuts, routes, arrival, q, kk, vv, streams, base, params, geo):
    """All groups with one autograd graph (activations kept per chunk: for small calls). ``[B, H, T, Dv]``."""
    C, n, t0, t1, w0 = geo["C"], geo["n"], geo["t0"], geo["t1"], geo["w0"]
    # Split q once into per-group pieces (split's backward is a cat; a slice per group would allocate a zero
    # gradient of full size per group, as the window slices do: they overlap, and this path is for small calls)
    q_parts = q.split([min(cb * C, t1) - max(ca * C, t0) for ca, cb in groups], 2)
    if geo["attn"] == "triton":    # the kernel indexes window keys by position: one slice per group, no unfold copy
        span = [slice(max(0, (ca + 1 - n) * C - w0), min(cb * C, t1) - w0) for ca, cb in groups]
        kw_parts, vw_parts = [kk[:, :, s] for s in span], [vv[:, :, s] for s in span]
    else:
        kw_parts, vw_parts = ([_windows(x, w0, *_window_geometry(ca, cb, C, n, t0, t1, w0)[1:], C) for ca, cb in groups]
                              for x in (kk, vv))
    pieces = [x.split(cuts, 2) for x in (*streams, routes.dest, arrival.expand(1, 1, -1))]
    base = [_scatter_tokens(b, pieces[3][0], s[0]) if cuts[0] else b for b, s in zip(base, pieces[:3])]
    outs = []
    for i, (ca, cb) in enumerate(groups):
        part = [x[i + 1] for x in pieces]
        outs.append(_attend_group(ca, cb, q_parts[i], kw_parts[i], vw_parts[i], *base, *part[:3], part[3],
                                  part[4][0, 0], *params, **geo))
        if i + 1 < len(groups) and cuts[i + 1]:
            base = [_scatter_tokens(b, part[3], s) for b, s in zip(base, part[:3])]
    return torch.cat(outs, 2)


def _span_attend(groups, geo):
    """Group ``i``'s attention from the spans of q / window tokens it reads (see :class:`GroupPlan`)."""
    C, n, t0, t1, w0 = geo["C"], geo["n"], geo["t0"], geo["t1"], geo["w0"]

    def attend(i, q_span, kw_span, vw_span, base, streams, dest, arrival, params, saved=None, with_lse=False):
        ca, cb = groups[i]
        if geo["attn"] != "triton" and geo["counts"] is None and (saved is not None or with_lse) and \
                _joinable(ca, cb, q_span, vw_span, geo["rows_at"], C, n, w0):
            out = _joined_group(ca, cb, q_span, kw_span, vw_span, *base, *streams, dest, arrival, *params, **geo,
                                saved=saved, with_lse=with_lse)
            if out is not None:
                return out
        if geo["attn"] != "triton":     # the span holds tokens from max(w0, (ca+1-n)*C) on
            geometry = _window_geometry(ca, cb, C, n, t0, t1, w0)[1:]
            kw_span, vw_span = (_windows(x, max(w0, (ca + 1 - n) * C), *geometry, C) for x in (kw_span, vw_span))
        return _attend_group(ca, cb, q_span, kw_span, vw_span, *base, *streams, dest, arrival, *params, **geo,
                             saved=saved, with_lse=with_lse)
    return attend


@torch.no_grad()
def _prefill_no_grad(q, kk, vv, gg, state: KVMState, *, budget, ln, state_temp, bswa_temp, scale, group_bytes, gates,
                     attn="torch", mma_dtype=None):
    """Inference prefill: advance ``state`` in place chunk by chunk (the recurrent path's buffers and
    cached readout, one LN_s per state version shared by routing and attention) while attending all
    chunks of a group in one SDPA call. ``kk, vv, gg`` hold tokens ``[window_start, t1)``."""
    C, n = state.chunk_len, state.n_bswa_chunks
    B, H, T, _ = q.shape
    Hkv, t0, w0 = kk.shape[1], state.seen_tokens, state.window_start
    t1 = t0 + T
    rows_at = _rows_visible(state, _planned_rows(state, budget, t1), t1)
    own_buffers(state, rows=max(rows_at + [state.num_rows]), window=t1 - bswa_begin(t1, C, n))
    c_first, c_last = t0 // C, (t1 - 1) // C
    tri = attn == "triton"      # snapshots [B, G, Hkv, 1, M, D] without temperature; the window is read from kk/vv
    per_row = B * H * (C + q.shape[3] + vv.shape[3]) * q.element_size()
    if tri:                 # snapshot rows per chunk only (read-out keys and values per kv head)
        per_row = B * Hkv * (q.shape[3] + vv.shape[3]) * q.element_size()
    split = not tri and _FLASH_CPU is not None and q.device.type == "cpu" and q.shape[3] == vv.shape[3]
    kind = (lambda c: (rows_at[c] > 0, _whole_window(c, C, n, w0))) if split else None
    groups = _groups(c_first, c_last, rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn, kind)
    ka, va, bad = finite_tokens(kk, vv)         # attention operands: masked tokens must contribute exactly zero
    qa, ka, va = (x.to(mma_dtype) for x in (q, ka, va)) if mma_dtype else (q, ka, va)
    temp = state_temp.view(1, Hkv, H // Hkv, 1, 1)
    y = q.new_empty(B, H, T, vv.shape[3])
    for ca, cb in groups:
        M, G = rows_at[cb - 1], cb - ca
        lo, hi = max(ca * C, t0) - t0, min(cb * C, t1) - t0
        qg = qa[:, :, lo:hi]
        joined = split and hi - lo == G * C and _whole_window(ca, C, n, w0)
        if tri or joined:       # snapshots per kv head: the temperature goes with the queries
            keys, values = (qa.new_empty(B, G, Hkv, 1, M, x.shape[-1]) for x in (kk, vv))
        else:
            kw, vw = (_windows(x, w0, *_window_geometry(ca, cb, C, n, t0, t1, w0)[1:], C) for x in (ka, va))
            keys, values = _group_operands(qg, kw, vw, bswa_temp, M)
        stale = None        # [B, G, Hkv]: the chunk's snapshot holds a non-finite row (None: none does)
        for g, c in enumerate(range(ca, cb) if M else ()):
            m = 0
            if c >= n:      # bring the state to what chunk c sees, then read it out once
                absorb(state, kk, vv, gg, w0, (c + 1) * C, budget, ln, *gates, attn=attn)
                k_hat, v_hat, bad_rows = finite_tokens(*readout_cached(state, ln))
                if bad_rows is not None:
                    stale = q.new_zeros(B, G, Hkv, dtype=torch.bool) if stale is None else stale
                    stale[:, g] = bad_rows.any(-1)
                m = state.num_rows
                if tri or joined:
                    keys[:, g, :, 0, :m] = k_hat
                else:
                    torch.mul(k_hat.unsqueeze(2), temp, out=keys[:, g, :, :, :m])   # written once, no temporary
                values[:, g, :, :, :m] = v_hat.unsqueeze(2)
            keys[:, g, :, :, m:M] = 0                   # hidden by the mask, but must be finite
            values[:, g, :, :, m:M] = 0
        if joined:
            out = _joined_attention(y[:, :, lo:hi], qg, keys, values, rows_at[ca:cb], ka, va, ca * C - w0,
                                    state_temp, bswa_temp, C=C, n=n, scale=scale)
        elif tri:
            out = _triton_group(ca, cb, qg, keys.squeeze(3) if M else None, values.squeeze(3) if M else None,
                                ka, va, w0, state_temp, bswa_temp, C=C, n=n, t0=t0, t1=t1, rows_at=rows_at, scale=scale)
        else:
            out = _group_sdpa(qg, keys, values, _group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, q.device), scale)
        if not joined or stale is not None:
            y[:, :, lo:hi] = _poison_chunks(out, stale)
    y = poison(y, window_poison(bad, w0, t0, t1, C, n))
    absorb(state, kk, vv, gg, w0, t1, budget, ln, *gates, attn=attn)          # the lazy final coverage
    ws, wl = bswa_begin(t1, C, n) - w0, t1 - bswa_begin(t1, C, n)
    state.window_keys[:, :, :wl] = kk[:, :, ws:]
    state.window_values[:, :, :wl] = vv[:, :, ws:]
    state.window_gates[:, :, :wl] = gg[:, :, ws:]
    state.seen_tokens = t1
    return y, state


def _attend_group(ca, cb, q, kw, vw, base_k, base_v, base_r, dk, dv, dr, dest, arrival, state_temp, bswa_temp,
                  ln_w, ln_b, *, C, n, t0, t1, w0, scale, value_radius, rows_at, ln_eps, attn="torch", saved=None,
                  with_lse=False, counts=None):
    """Outputs ``[B, H, qb - qa, Dv]`` of query chunks ``[ca, cb)`` (G = cb - ca), differentiably.

    ``q [B, H, qb - qa, D]`` their queries and ``kw, vw [B, Hkv, G, D|Dv, W]`` each chunk's window (positions
    ``qa, qb, W``: :func:`_window_geometry`);
    ``base_*`` the state sums before the group; ``dk, dv, dr`` the tokens arriving inside it.
    With ``attn="triton"``, ``kw, vw [B, Hkv, N, D|Dv]`` hold the tokens from ``max(w0, (ca+1-n)*C)`` on;
    ``with_lse`` returns ``(o, lse2)`` from the forward kernel only (no graph) and ``saved=(o, lse2)``
    reuses them instead of launching it (torch attention ignores both; ``with_lse`` gives ``(o, None)``).
    ``counts [B, Hkv, chunks]`` (novelty budget): the rows in use per (b, h) each chunk sees; the others are hidden.
    """
    Hkv, G = kw.shape[1], cb - ca
    M = rows_at[cb - 1]
    tri = attn == "triton"
    tri_args = (kw, vw, max(w0, (ca + 1 - n) * C), state_temp, bswa_temp)
    tri_geo = dict(C=C, n=n, t0=t0, t1=t1, rows_at=rows_at, scale=scale, saved=saved, with_lse=with_lse,
                   counts=counts)
    if tri and not M:
        return _triton_group(ca, cb, q, None, None, *tri_args, **tri_geo)
    if not tri:
        keys, values = _group_operands(q, kw, vw, bswa_temp, M)
    if M:
        k_hat, v_hat, stale = _snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius,
                                         ln_w, ln_b, ln_eps)
        if tri:
            out = _triton_group(ca, cb, q, k_hat.to(q.dtype), v_hat.to(q.dtype), *tri_args, **tri_geo)
            return (_poison_chunks(out[0], stale), out[1]) if with_lse else _poison_chunks(out, stale)
        keys[..., :M, :] = k_hat.unsqueeze(3) * _by_head(state_temp, Hkv)
        values[..., :M, :] = v_hat.unsqueeze(3)
    stale = stale if M else None        # a stale snapshot's outputs are poisoned: differentiate a fresh forward
    mask = _group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, q.device)
    if counts is not None and M:        # [B, G, H, Cq, M + W]: rows beyond each (b, h)'s count hidden too
        hidden = torch.arange(M, device=q.device) >= counts[:, :, ca:cb].transpose(1, 2).unsqueeze(-1)
        hidden = hidden.repeat_interleave(q.shape[1] // Hkv, 2).unsqueeze(3)          # [B, G, H, 1, M]
        mask = mask.unsqueeze(1) & F.pad(~hidden, (0, mask.shape[-1] - M), value=True)
    out = _group_sdpa(q, keys, values, mask, scale, saved=None if stale is not None else saved, with_lse=with_lse)
    if with_lse:
        return _poison_chunks(out[0], stale), out[1]
    return _poison_chunks(out, stale)


def _snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius, ln_w, ln_b, ln_eps):
    """``(k_hat, v_hat [B, G, Hkv, M, D|Dv], stale [B, G, Hkv] or None)``: the read-out state each chunk ``ca + g``
    sees (base sums plus the tokens that arrived in the group before it; non-finite rows zeroed and flagged)."""
    B, Hkv = base_k.shape[:2]
    snap = []   # state sums seen by each chunk: base + cumulative increments of tokens arriving in the group
    heads = torch.arange(Hkv, device=dest.device).view(Hkv, 1)
    slot = (((arrival - ca) * Hkv + heads) * M + dest).flatten(1, 2).unsqueeze(1)
    for b, s in zip((base_k, base_v, base_r), (dk, dv, dr)):
        inc = b.new_zeros(B, 1, G * Hkv * M, *b.shape[3:])                          # [B, 1, G*Hkv*M, ...]
        inc = _scatter_tokens(inc, slot, s.flatten(1, 2).unsqueeze(1)).squeeze(1)
        snap.append(inc.unflatten(1, (G, Hkv, M)).cumsum(1) + b[:, :, :M].unsqueeze(1))
    k_hat, v_hat, bad_rows = finite_tokens(*readout(*snap, value_radius, ln_w, ln_b, ln_eps))
    return k_hat, v_hat, None if bad_rows is None else bad_rows.any(-1)


def _joined_group(ca, cb, q, kw, vw, base_k, base_v, base_r, dk, dv, dr, dest, arrival, state_temp, bswa_temp,
                  ln_w, ln_b, *, C, n, scale, value_radius, rows_at, ln_eps, saved=None, with_lse=False, **_):
    """:func:`_attend_group` for the reconstruction backward on CPU when the group's chunks are whole, their windows
    whole and their snapshots active (or all inactive): the read of :func:`_joined_attention` (window spans ``kw, vw
    [B, Hkv, N, D|Dv]`` from position ``(ca + 1 - n) * C``, no window copy, no mask). ``with_lse``: ``(y, lse)`` (no
    graph); ``saved=(y, lse)`` from that call: ``y`` differentiable through :class:`_JoinedSaved`. None where a
    snapshot holds a non-finite row (the caller takes the masked path, which poisons its chunks)."""
    B, H, G = q.shape[0], q.shape[1], cb - ca
    M = rows_at[cb - 1]
    k_hat = v_hat = None
    if M:
        k_hat, v_hat, stale = _snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius,
                                         ln_w, ln_b, ln_eps)
        if stale is not None:
            return None
    parts = _joined_operands(q, k_hat, v_hat, rows_at[ca:cb], kw, vw, (n - 1) * C, state_temp, bswa_temp, C=C, n=n)
    heads = lambda y: y.view(B, G, H, C, -1).transpose(1, 2).flatten(2, 3)           # [B*G, H, C, Dv] -> [B, H, G*C, Dv]
    if with_lse:
        o = q.new_empty(B, G, H, C, vw.shape[-1])
        lse = _join(parts, scale, o)
        return heads(o), lse
    o = saved[0].unflatten(2, (G, C)).transpose(1, 2).flatten(0, 1)
    return heads(_JoinedSaved.apply(o, saved[1], scale, [(c, m) for *_, c, m in parts],
                                    *(t for part in parts for t in part[:3])))


def _joinable(ca, cb, q, v, rows_at, C, n, w0) -> bool:
    """The group can take :func:`_joined_group`: whole chunks with whole windows, every snapshot active or none."""
    active = {rows_at[c] > 0 for c in range(ca, cb)}
    return _saves_flash(q, v) and q.shape[2] == (cb - ca) * C and _whole_window(ca, C, n, w0) and len(active) == 1


def _poison_chunks(y: Tensor, stale) -> Tensor:
    """NaN in the outputs ``y [B, H, G*Cq, Dv]`` of the chunks whose state snapshot holds a non-finite row
    (``stale [B, G, Hkv]``, None: none)."""
    if stale is None:
        return y
    return poison(y, stale.transpose(1, 2).repeat_interleave(y.shape[2] // stale.shape[1], -1))


def _triton_group(ca, cb, q, k_hat, v_hat, kw, vw, k_start, state_temp, bswa_temp, *, C, n, t0, t1, rows_at, scale,
                  saved=None, with_lse=False, counts=None):
    """The fused Triton kernel for query chunks ``[ca, cb)``: ``q [B, H, qb - qa, D]`` from position ``qa``,
    snapshots ``[B, G, Hkv, M, D|Dv]`` (or None), window tokens from position ``k_start``; ``counts`` (novelty
    budget): the rows each (b, kv head) sees per chunk, ``[B, Hkv, chunks]``."""
    from kvmeans.ops.triton.attention import chunk_attention, chunk_attention_fwd
    rows = None if k_hat is None else (
        torch.tensor(rows_at[ca:cb], dtype=torch.int32, device=q.device) if counts is None else counts[:, :, ca:cb])
    fn = chunk_attention_fwd if with_lse else partial(chunk_attention, saved=saved)
    return fn(q, k_hat, v_hat, rows, kw, vw, state_temp, bswa_temp, q_start=max(ca * C, t0), q_lo=max(ca * C, t0),
              q_hi=min(cb * C, t1), k_start=k_start, chunk_len=C, n_bswa_chunks=n, scale=scale)


def _group_operands(q, kw, vw, bswa_temp, M):
    """SDPA key/value buffers ``[B, G, Hkv, rep, M + W, D|Dv]`` with the window part written (state rows
    ``[:M]`` are left for the caller): written once, no cat / transpose copies."""
    B, H = q.shape[:2]
    Hkv, G, D, W = kw.shape[1], kw.shape[2], kw.shape[3], kw.shape[4]
    keys = q.new_empty(B, G, Hkv, H // Hkv, M + W, D)
    values = q.new_empty(B, G, Hkv, H // Hkv, M + W, vw.shape[3])
    keys[..., M:, :] = kw.permute(0, 2, 1, 4, 3).unsqueeze(3) * _by_head(bswa_temp, Hkv)
    values[..., M:, :] = vw.permute(0, 2, 1, 4, 3).unsqueeze(3)
    return keys, values


def _by_head(t: Tensor, Hkv: int) -> Tensor:
    return t.view(1, 1, Hkv, -1, 1, 1)            # per query head, grouped under its kv head


def _group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, device) -> Tensor:
    """``[G, Cq, M + W]`` bool (see :func:`_window_geometry`): state rows that exist for each chunk, then the
    causal window."""
    qa, qb, e0, W = _window_geometry(ca, cb, C, n, t0, t1, w0)
    G = cb - ca
    q_pos = (qa + C * torch.arange(G, device=device)).view(G, 1, 1) + torch.arange((qb - qa) // G, device=device).view(1, -1, 1)
    k_pos = (e0 - W + C * torch.arange(G, device=device)).view(G, 1, 1) + torch.arange(W, device=device)
    mask = (k_pos <= q_pos) & (k_pos >= w0)
    if not M:
        return mask
    visible = torch.arange(M, device=device) < torch.tensor(rows_at[ca:cb], device=device).view(G, 1, 1)
    return torch.cat([visible.expand(G, mask.shape[1], M), mask], 2)


def _window_geometry(ca, cb, C, n, t0, t1, w0):
    """``(qa, qb, e0, W)`` of query chunks ``[ca, cb)``, sized by the tokens present (never by C or n*C alone):
    the group's queries are the positions ``[qa, qb)`` (``Cq = (qb - qa) / G`` per chunk: only a group of one
    chunk may be partial), chunk ``ca + g`` sees the ``W`` window positions ending at ``e0 + g*C``."""
    qa, qb = max(ca * C, t0), min(cb * C, t1)
    return qa, qb, qb - (cb - 1 - ca) * C, qb - max(w0, (cb - n) * C)


def _windows(x: Tensor, origin: int, qb: int, e0: int, W: int, C: int) -> Tensor:
    """``[B, Hkv, G, D, W]`` windows (see :func:`_window_geometry`) of ``x``, whose token 0 is at ``origin``."""
    return _time_slice(x, e0 - W - origin, qb - origin).unfold(2, W, C)


def _group_sdpa(q, keys, values, mask, scale, saved=None, with_lse=False):
    """One SDPA call for all chunks of a group; ``q [B, H, G*Cq, D]`` -> ``[B, H, G*Cq, Dv]``. Where the CPU flash
    kernel runs (:func:`_saves_flash`), ``with_lse`` returns ``(y, lse)`` from it (no graph) and ``saved=(y, lse)``
    from such a call differentiates with its backward instead of running the forward again (``with_lse``
    elsewhere: ``(y, None)``)."""
    B, G, C = q.shape[0], keys.shape[1], mask.shape[-2]
    by_chunk = lambda t: t.unflatten(2, (G, C)).transpose(1, 2).flatten(0, 1)         # [B*G, H, C, D]
    qs, k, v = by_chunk(q), keys.flatten(2, 3).flatten(0, 1), values.flatten(2, 3).flatten(0, 1)
    mask = mask.flatten(0, 1) if mask.dim() == 5 else mask.unsqueeze(1).repeat(B, 1, 1, 1)   # [B*G, H or 1, Cq, K]
    heads = lambda y: y.unflatten(0, (B, G)).transpose(1, 2).flatten(2, 3)
    if (with_lse or saved is not None) and _saves_flash(q, values):
        add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        if with_lse:
            y, lse = _FLASH_CPU(qs, k, v, attn_mask=add, scale=scale)
            return heads(y), lse
        return heads(_SavedFlash.apply(qs, k, v, add, scale, by_chunk(saved[0]), saved[1]))
    y = heads(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale))
    return (y, None) if with_lse else y


# the CPU flash kernel behind SDPA, which also returns each query's log-sum-exp (no autograd for it), and its backward
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _saves_flash(q: Tensor, v: Tensor) -> bool:
    """The torch path's reconstruction backward can reuse the forward's output and log-sum-exp: the CPU flash kernel
    runs (on CPU, with values as wide as the queries)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _FLASH_CPU_BACKWARD is not None \
        and _FLASH_CPU is not None


class _SavedFlash(torch.autograd.Function):
    """Masked flash attention whose forward already ran (output ``o``, log-sum-exp ``lse``): returns ``o`` and
    differentiates with the kernel's backward (the same kernel SDPA runs: the same gradients, no second forward)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, o, lse):
        o = o.contiguous()
        ctx.save_for_backward(q, k, v, mask, o, lse)
        ctx.scale = scale
        return o.clone()

    @staticmethod
    def backward(ctx, dy):
        q, k, v, mask, o, lse = ctx.saved_tensors
        dq, dk, dv = _FLASH_CPU_BACKWARD(dy.contiguous(), q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def _whole_window(c: int, C: int, n: int, w0: int) -> bool:
    """Chunk ``c``'s n - 1 previous chunks all exist (from position ``w0`` on)."""
    return (c + 1 - n) * C >= w0


def _joined_attention(y, q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, *, C, n, scale) -> Tensor:
    """Writes ``y [B, H, G*C, Dv]`` (a view, returned): G whole chunks of queries ``q [B, H, G*C, D]`` whose windows
    are whole, attending to their state snapshot ``keys, values [B, G, Hkv, 1, M, D|Dv]`` (``rows[g]`` visible), the
    n - 1 previous chunks and their own chunk (causal) of ``kk, vv [B, Hkv, N, D|Dv]`` (chunk ``g`` starts at
    ``start + g*C``). Three unmasked flash calls (the window read as views, no copy) joined by their log-sum-exp;
    the one-call masked SDPA computes the same keys plus a mask and a window copy per chunk."""
    B, H, _, _ = q.shape
    G = keys.shape[1]
    parts = _joined_operands(q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, C=C, n=n)
    _join(parts, scale, y.unflatten(2, (G, C)).transpose(1, 2))
    return y


def _joined_operands(q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, *, C, n) -> list:
    """The flash calls of a joined read (see :func:`_joined_attention`; ``keys, values`` ``[B, G, Hkv, (1,) M, ...]``
    or None without state rows): ``[(q, k, v, is_causal, mask)]``, queries ``[B*G, H, C, D]`` (own chunk) or
    ``[B*G, Hkv, rep*C, D]`` (the same memory: each kv head's query heads together), differentiable when their
    inputs are."""
    B, H, _, D = q.shape
    Hkv, G = kk.shape[1], q.shape[2] // C
    rep = H // Hkv
    grouped = q.unflatten(2, (G, C)).unflatten(1, (Hkv, rep)).permute(0, 3, 1, 2, 4, 5)   # [B, G, Hkv, rep, C, D]

    def queries(temp):      # [B*G, Hkv, rep*C, D]: the query heads of a kv head together, temperature applied
        temp = temp.view(1, 1, Hkv, rep, 1, 1)
        if torch.is_grad_enabled() and (q.requires_grad or temp.requires_grad):
            return (grouped * temp).reshape(B * G, Hkv, rep * C, D)
        out = q.new_empty(B, G, Hkv, rep, C, D)
        torch.mul(grouped, temp, out=out)
        return out.view(B * G, Hkv, rep * C, D)
    qw = queries(bswa_temp)
    own = [t[:, :, start:start + G * C].unflatten(2, (G, C)).transpose(1, 2).reshape(B * G, Hkv, C, t.shape[-1])
           for t in (kk, vv)]
    own = [t.repeat_interleave(rep, 1) for t in own] if rep > 1 else own
    parts = [(qw.view(B * G, H, C, D), *own, True, None)]
    if n > 1:
        L = (n - 1) * C
        prev = [t[:, :, start - L:start + (G - 1) * C].unfold(2, L, C).permute(0, 2, 1, 4, 3).reshape(B * G, Hkv, L, -1)
                for t in (kk, vv)]
        parts.append((qw, *prev, False, None))
    M = 0 if keys is None else keys.shape[-2]
    if M:
        mask = None
        if min(rows) < M:   # rows created after this chunk's snapshot
            hidden = torch.arange(M, device=q.device) >= torch.tensor(rows, device=q.device).view(G, 1)
            mask = q.new_zeros(G, M).masked_fill_(hidden, float("-inf")).repeat(B, 1).view(B * G, 1, 1, M)
        parts.append((queries(state_temp), keys.reshape(B * G, Hkv, M, D), values.reshape(B * G, Hkv, M, -1), False,
                      mask))
    return parts


def _join(parts, scale, out: Tensor) -> Tensor:
    """Run the flash calls of ``parts`` (:func:`_joined_operands`) and join them by their log-sum-exp into
    ``out [B, G, H, C, Dv]`` (any strides); returns the joint log-sum-exp ``[B*G, H, C]``."""
    runs = [_FLASH_CPU(pq, pk, pv, is_causal=causal, attn_mask=mask, scale=scale)[:2]
            for pq, pk, pv, causal, mask in parts]
    lse = [l.reshape(*out.shape[:4], 1) for _, l in runs]
    top = lse[0]
    for l in lse[1:]:
        top = torch.maximum(top, l)
    w = [(l - top).exp_() for l in lse]
    total = w[0] + w[1] if len(w) > 1 else w[0]
    for x in w[2:]:
        total += x
    joint = (top + total.log()).flatten(0, 1).squeeze(-1).contiguous()
    for i, ((y, _), x) in enumerate(zip(runs, w)):
        if i == 0:
            torch.mul(y.view(out.shape), x.div_(total), out=out)
        else:
            out.addcmul_(y.view(out.shape), x.div_(total))
    return joint


class _JoinedSaved(torch.autograd.Function):
    """A joined read whose forward already ran (output ``o [B*G, H, C, Dv]``, joint log-sum-exp ``lse``): returns
    ``o``; the backward runs the flash kernel's backward on each part with the joint ``o`` and ``lse`` (a part's
    probabilities are its share of the one softmax), so no forward runs again."""

    @staticmethod
    def forward(ctx, o, lse, scale, flags, *operands):
        o = o.contiguous()
        ctx.save_for_backward(o, lse, *operands)
        ctx.scale, ctx.flags = scale, flags
        return o.clone()

    @staticmethod
    def backward(ctx, dy):
        o, lse, *ops = ctx.saved_tensors
        dy, grads = dy.contiguous(), []
        for i, (causal, mask) in enumerate(ctx.flags):
            pq, pk, pv = ops[3 * i:3 * i + 3]
            lay = lambda t: t.view(*pq.shape[:3], t.shape[-1])                  # the part's query layout
            grads += _FLASH_CPU_BACKWARD(lay(dy), pq, pk, pv, lay(o), lse.view(pq.shape[:3]), 0.0, causal,
                                         attn_mask=mask, scale=ctx.scale)
        return (None, None, None, None, *grads)


def _rows_visible(state: KVMState, block_rows: dict, t1: int) -> List[int]:
    """Rows visible to each query chunk ``c < ceil(t1 / C)``: block b is in the state from chunk b + n on
    (0 while the state is inactive). ``block_rows``: block index -> rows once it entered."""
    rows_at, rows, n = [], state.num_rows, state.n_bswa_chunks
    for c in range((t1 - 1) // state.chunk_len + 1):
        rows = block_rows.get(c - n, rows)
        rows_at.append(rows if c >= n else 0)
    return rows_at


def _planned_rows(state: KVMState, budget, t1: int) -> dict:
    """``block index -> rows once it entered`` for the blocks entering in a call ending at ``t1`` (positions only)."""
    C, m, cov = state.chunk_len, state.num_rows, state.coverage
    fill = max(0, min(t1, C) - cov)
    rows = {0: m + fill} if fill else {}
    for step in plan_updates(budget, cov + fill, m + fill, t1, C, state.n_bswa_chunks):
        rows[step.start // C] = step.rows_after
    return rows


def _groups(c_first, c_last, rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn, kind=None):
    """Split query chunks ``[c_first, c_last]`` into runs whose attention working set fits ``group_bytes``.
    Only whole chunks share a run: a partial first or last chunk attends alone, with just its queries;
    ``kind(c)`` (if given) must also be equal within a run."""
    def fits(ca, cb):
        window = 0 if attn == "triton" else _window_geometry(ca, cb, C, n, t0, t1, w0)[3]
        return (cb - ca) * (rows_at[cb - 1] + window) * per_row <= group_bytes
    whole = lambda c: t0 <= c * C and (c + 1) * C <= t1
    groups, ca = [], c_first
    while ca <= c_last:
        cb = ca + 1
        while cb <= c_last and whole(ca) and whole(cb) and fits(ca, cb + 1) and (kind is None or kind(cb) == kind(ca)):
            cb += 1
        groups.append((ca, cb))
        ca = cb
    return groups


def _time_slice(x: Tensor, start: int, end: int) -> Tensor:
    """``x[:, :, start:end]`` with zeros where the range leaves ``[0, x.shape[2])``."""
    lo, hi = max(start, 0), min(end, x.shape[2])
    core = x[:, :, lo:max(hi, lo)]
    pad = [0, 0] * (x.dim() - 3) + [lo - start, end - max(hi, lo)]
    return F.pad(core, pad) if any(pad) else core


def _pad_rows(t: Tensor, m: int) -> Tensor:
    pad = [0, 0] * (t.dim() - 3) + [0, m - t.shape[2]]
    return F.pad(t, pad)


def _scatter_tokens(base: Tensor, dest: Tensor, contrib: Tensor) -> Tensor:
    """``base[b, h, dest[b, h, j]] += contrib[b, h, j]`` (out of place). ``dest [B, Hkv, N]`` long."""
    idx = dest.unsqueeze(-1).expand_as(contrib) if contrib.dim() == 4 else dest
    return base.scatter_add(2, idx, contrib)


@torch.no_grad()
def _route(state, kk, vv, gg, budget, ln, t1, gate_keys, gate_values, gate_appends, attn="torch") -> _Routes:
    """Run the state recurrence once without gradients (:func:`kvmeans.ops.state.absorb` on a
    detached copy; ``attn="triton"``: its routing / scatter kernels); record where each token went.

    ``kk, vv, gg`` hold the raw tokens entering the state, ``[state.coverage, coverage_after(t1))``."""
    B, Hkv, N, _ = kk.shape
    scratch = state.detach()
    own_buffers(scratch)
    records = absorb(scratch, kk, vv, gg, state.coverage, t1, budget, ln, gate_keys, gate_values, gate_appends,
                     attn=attn)
    dest = torch.full((B, Hkv, N), -1, dtype=torch.long, device=kk.device)
    created = torch.zeros(B, Hkv, N, dtype=torch.bool, device=kk.device)
    ungated = created.clone()
    rows = state.num_rows
    for start, n, d, app in records:
        loc = slice(start - state.coverage, start - state.coverage + n)
        if d is None:                                 # the initial copy: rows in token order, ungated
            dest[:, :, loc] = torch.arange(rows, rows + n, device=kk.device)
            created[:, :, loc] = ungated[:, :, loc] = True
            rows += n
        else:
            dest[:, :, loc], created[:, :, loc], ungated[:, :, loc] = d, app, app & (not gate_appends)
    if is_data_dependent(budget):
        counts = _counts_visible(state, records, t1)
        return _Routes(dest, created, ungated, counts.amax((0, 1)).tolist(), scratch.num_rows, counts,
                       scratch.row_count)
    rows_at = _rows_visible(state, _planned_rows(state, budget, t1), t1)
    return _Routes(dest, created, ungated, rows_at, scratch.num_rows)


def _counts_visible(state: KVMState, records: list, t1: int) -> Tensor:
    """``[B, Hkv, chunks]`` rows in use per (b, h) visible to each query chunk ``c < ceil(t1 / C)`` under a novelty
    budget (:func:`_rows_visible` per (b, h)); ``records`` from :func:`absorb`."""
    C, n = state.chunk_len, state.n_bswa_chunks
    count = state.rows_in_use()
    after, grown = {}, count                          # block index -> rows in use once it entered
    for start, k, _, app in records:
        grown = grown + (k if app is None else app.sum(-1))
        after[start // C] = grown
    out = []
    for c in range((t1 - 1) // C + 1):
        count = after.get(c - n, count)
        out.append(count if c >= n else torch.zeros_like(count))
    return torch.stack(out, -1)
