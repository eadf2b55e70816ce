"""Chunk-parallel KVM for prefill and training, in plain torch (CPU and GPU) or with the Triton kernels.

The state recurrence depends only on k, v and the gate, never on attention outputs, so:

1. route first (:mod:`.route`): one no-grad pass over the overflow blocks decides, for every token that enters
   the state, its destination row (a new row, or the merge target);
2. rebuild the state each query chunk sees as a differentiable function of the tokens:
   ``s(c) = s_carried + sum over tokens arrived by chunk c of onehot(dest) * contribution``,
   a scatter into per-chunk increments followed by a cumulative sum over chunks (radii and the
   ablation's row counts are rebuilt the same way);
3. attend all query chunks of a group (:mod:`.plan`) to ``[readout(s(c)) ; window(c)]`` (:mod:`.attend`): one
   masked SDPA call, the joined flash read of whole chunks on CPU (:mod:`.flash`) or the Triton kernel.

Groups of chunks bound the working memory. Under autograd, small calls keep one graph; large ones
(and the Triton kernels) use :mod:`.reconstruct`, whose backward rebuilds each group's state in reverse
from the final state, so no state copy per chunk is ever kept. Without autograd the state advances in place
(:mod:`.prefill`). Deviation from ``naive.py``: the order in which contributions are summed (tested within
tolerance).
"""
from __future__ import annotations

import torch

from kvmeans.ops.budget import is_data_dependent
from kvmeans.ops.chunk import attend, flash, lanes, plan, route
from kvmeans.ops.chunk.prefill import prefill_no_grad
from kvmeans.ops.chunk.reconstruct import GroupPlan, reconstruct_attention
from kvmeans.ops.masking import finite_tokens, poison, window_poison
from kvmeans.ops.routing import memory_keys, token_streams
from kvmeans.ops.schedule import bswa_begin, coverage_after
from kvmeans.ops.state import KVMState

__all__ = ["chunk_kvm_attention", "default_group_bytes", "BACKWARD", "GROUP_BYTES", "RECONSTRUCT_BYTES",
           "RECONSTRUCT_BYTES_JOINED"]

GROUP_BYTES = 256 << 20        # working set of one group's attention call (CPU; a GPU's is sized by its memory)
RECONSTRUCT_BYTES = 1 << 30    # "auto" backward: reconstruct the state when a graph would keep more than this
# ... or more than this where the reconstruction reads joined whole chunks and reuses the forward's flash output and
# log-sum-exp (CPU, D == Dv): measured as fast as the graph at T=8192 and faster, with 36% less kept, at 32768
RECONSTRUCT_BYTES_JOINED = 256 << 20
BACKWARD = "auto"              # default of chunk_kvm_attention(backward=...): "auto" | "graph" | "reconstruct"


def chunk_kvm_attention(q, k, v, gate, state: KVMState, *, budget, state_norm_weight, state_norm_bias,
                        state_norm_eps, state_temp, bswa_temp, scale, gate_keys=True, gate_values=True,
                        gate_appends=False, backward=None, group_bytes=None, attn="torch", mma_dtype=None):
    """Same contract as :func:`kvmeans.ops.naive.naive_kvm_attention`; returns ``(y, new_state)``.

    ``backward`` (with autograd): ``"graph"`` keeps the activations of every chunk (fastest for small
    calls), ``"reconstruct"`` keeps one final state and rebuilds each group's state in reverse during
    backward (:mod:`.reconstruct`: memory O(T + state), not O(chunks * state)); ``"auto"`` picks reconstruct for
    the Triton kernels and for calls whose graph would exceed ``RECONSTRUCT_BYTES`` (``RECONSTRUCT_BYTES_JOINED``
    on CPU with ``D == Dv``); None takes the module's ``BACKWARD``. ``group_bytes`` bounds the size of one batched
    attention call (None: :func:`default_group_bytes`). ``mma_dtype`` (``numerics="mixed"``): q, the window and
    the read-out state enter the attention dots in this dtype (softmax statistics and accumulation stay fp32,
    as in flash attention); the state, its routing and sums are unchanged. ``attn``: "torch" (SDPA with a mask)
    or "triton" (the fused kernel of :mod:`kvmeans.ops.triton.attention`: no window copy per chunk, no repeated
    GQA keys).
    """
    C, n = state.chunk_len, state.n_bswa_chunks
    ln = (state_norm_weight, state_norm_bias, state_norm_eps)
    t0, T = state.seen_tokens, q.shape[2]
    t1, w0 = t0 + T, state.window_start
    group_bytes = default_group_bytes(q.device) if group_bytes is None else group_bytes
    kk, vv, gg = _window_and_new(state, k, v, gate)                     # tokens [w0, t1)
    ln_params = [t for t in (state_norm_weight, state_norm_bias, state_temp, bswa_temp) if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, kk, vv, gg, *state.rows(), *ln_params))
    if not grad and not is_data_dependent(budget):     # (novelty growth takes the path below, with or without grad)
        args = dict(budget=budget, ln=ln, state_temp=state_temp, bswa_temp=bswa_temp, scale=scale,
                    group_bytes=group_bytes, gates=(gate_keys, gate_values, gate_appends), attn=attn,
                    mma_dtype=mma_dtype)
        split = lanes.lane_split(q, kk, state, attn)
        if split is not None:                           # CPU, several threads: one part of the heads per thread
            return lanes.run_lanes(prefill_no_grad, split, q, kk, vv, gg, state, **args)
        return prefill_no_grad(q, kk, vv, gg, state, **args)
    # tokens entering the state in this call: [cov0, cov1), a contiguous range
    cov0, cov1 = state.coverage, max(state.coverage, coverage_after(t1, C, n))
    enter = slice(cov0 - w0, cov1 - w0)
    routes = route.record(state, kk[:, :, enter].detach(), vv[:, :, enter].detach(), gg[:, :, enter].detach(),
                          budget, ln, t1, gate_keys, gate_values, gate_appends, attn)
    streams = _streams(state, kk[:, :, enter], vv[:, :, enter], gg[:, :, enter], routes, ln, gate_keys, gate_values)
    base = [route.pad_rows(t, routes.num_rows) for t in state.rows()]       # sums of tokens arrived before the call
    groups, joins = _groups(q, v, kk.shape[1], routes, attn, group_bytes, C, n, t0, t1, w0)
    backward = BACKWARD if backward is None else backward
    if backward == "auto":
        backward = _auto_backward(groups, routes.rows_at, q, v, joins, attn, C, n, t0, t1, w0)
    geo = dict(C=C, n=n, t0=t0, t1=t1, w0=w0, scale=scale, value_radius=state.value_radius, rows_at=routes.rows_at,
               ln_eps=state_norm_eps, attn=attn, counts=routes.counts)
    arrival = torch.arange(cov0, cov1, device=q.device) // C + n    # first query chunk that sees each entering token
    cuts = _cuts(arrival, groups, (t1 - 1) // C)
    params = (state_temp, bswa_temp, state_norm_weight, state_norm_bias)
    ka, va, bad = finite_tokens(kk, vv)         # attention operands: masked tokens must contribute exactly zero
    qa, ka, va = (x.to(mma_dtype) for x in (q, ka, va)) if mma_dtype else (q, ka, va)
    if backward == "reconstruct":
        group_plan = GroupPlan(groups=groups, cuts=cuts, dest=routes.dest, arrival=arrival,
                               q_spans=[(max(ca * C, t0) - t0, min(cb * C, t1) - t0) for ca, cb in groups],
                               w_spans=[(max(w0, (ca + 1 - n) * C) - w0, min(cb * C, t1) - w0) for ca, cb in groups],
                               attend=attend.span_attend(groups, geo), kernel_saves=attn == "triton" or
                               flash.saves(q, v))
        y, *sums = reconstruct_attention(group_plan, qa, ka, va, streams, base, params)
    elif backward == "graph":
        y = _graph_groups(groups, cuts, routes, arrival, qa, ka, va, streams, base, params, geo)
        sums = [route.scatter_tokens(route.pad_rows(b, routes.num_rows), routes.dest, s)
                for b, s in zip(state.rows(), streams)]
    else:
        raise ValueError(f"backward must be 'auto', 'graph' or 'reconstruct', got {backward!r}")
    y = poison(y, window_poison(bad, w0, t0, t1, C, n))
    ws = bswa_begin(t1, C, n) - w0
    return y, KVMState(*sums, kk[:, :, ws:], vv[:, :, ws:], gg[:, :, ws:], num_rows=routes.num_rows, seen_tokens=t1,
                       coverage=cov1, chunk_len=C, n_bswa_chunks=n, sink_len=state.sink_len, rope_dim=state.rope_dim,
                       value_radius=state.value_radius, extras=state.extras, row_count=routes.row_count)


def default_group_bytes(device: torch.device) -> int:
    """Working set of one group: ``GROUP_BYTES`` on CPU; on a GPU 1/32 of its memory, within
    [GROUP_BYTES, 4 GiB] (fewer, larger launches: at B=8, H=32, D=128 a 256-row snapshot is 256 MiB)."""
    if device.type != "cuda":
        return GROUP_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return max(GROUP_BYTES, min(total // 32, 4 << 30))


def _window_and_new(state: KVMState, k, v, gate):
    """The carried window tokens followed by this call's: ``(keys, values, gates)`` of ``[window_start, t1)``."""
    if not state.window_len:
        return k, v, gate
    wk, wv, wg = state.window()
    return torch.cat([wk, k], 2), torch.cat([wv, v], 2), torch.cat([wg, gate], 2)


def _streams(state: KVMState, kk, vv, gg, routes, ln, gate_keys, gate_values):
    """``(dk, dv, dr)``: what each entering token (``kk, vv, gg`` raw, in order) adds to its row's key, value and
    radius sums, differentiably (the radius only where the token creates its row; the ablation counts tokens)."""
    kbar = memory_keys(kk, state.rope_dim, *ln)
    dk, dv, rad = token_streams(kbar, vv, gg, routes.ungated, gate_keys=gate_keys, gate_values=gate_values,
                                gate_appends=False)
    dr = torch.where(routes.created, rad, 0) if state.value_radius else torch.ones_like(rad)
    return dk, dv, dr


def _groups(q, v, kv_heads, routes, attn, group_bytes, C, n, t0, t1, w0):
    """``(groups, joins)``: the query-chunk groups of the call (:func:`kvmeans.ops.chunk.plan.groups`) and whether
    the reconstruction backward may read them joined (then like chunks are grouped together)."""
    per_row = q.shape[0] * q.shape[1] * (C + q.shape[3] + v.shape[3]) * q.element_size()
    if attn == "triton":    # per chunk only its snapshot rows (sums + readout, ~4 copies per kv head), no window
        per_row = 4 * q.shape[0] * kv_heads * (q.shape[3] + v.shape[3]) * q.element_size()
    # the reconstruction backward's joined read: like chunks together (rows hidden per (b, h): never joined)
    joins = attn != "triton" and flash.saves(q, v) and routes.counts is None
    kind = (lambda c: (routes.rows_at[c] > 0, plan.whole_window(c, C, n, w0))) if joins else None
    return plan.groups(t0 // C, (t1 - 1) // C, routes.rows_at, per_row, group_bytes, C, n, t0, t1, w0, attn,
                       kind), joins


def _cuts(arrival, groups, c_last):
    """Entering tokens (by ``arrival``, the first query chunk that sees each) before the first group, in each group
    and after the last."""
    bounds = [0] + [int((arrival < ca).sum()) for ca, _ in groups] + [int((arrival < c_last + 1).sum()),
                                                                      arrival.numel()]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _auto_backward(groups, rows_at, q, v, joins, attn, C, n, t0, t1, w0) -> str:
    """``"reconstruct"`` for the Triton kernels (their backward needs no forward re-run, so reconstruction costs
    little) and where a graph would keep more than ``RECONSTRUCT_BYTES`` (``RECONSTRUCT_BYTES_JOINED`` where the
    read is joined), else ``"graph"``. The graph keeps per chunk SDPA's keys / values over ``[state ; window]``
    plus the snapshot sums (~2x)."""
    saved = sum((cb - ca) * (rows_at[cb - 1] + plan.window_geometry(ca, cb, C, n, t0, t1, w0)[3])
                for ca, cb in groups) * q.shape[0] * q.shape[1] * (q.shape[3] + v.shape[3]) * q.element_size() * 2
    limit = RECONSTRUCT_BYTES_JOINED if joins else RECONSTRUCT_BYTES
    return "reconstruct" if attn == "triton" or saved > min(limit, RECONSTRUCT_BYTES) else "graph"


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
        kw_parts, vw_parts = ([plan.windows(x, w0, *plan.window_geometry(ca, cb, C, n, t0, t1, w0)[1:], C)
                               for ca, cb in groups] for x in (kk, vv))
    pieces = [x.split(cuts, 2) for x in (*streams, routes.dest, arrival.expand(1, 1, -1))]
    base = [route.scatter_tokens(b, pieces[3][0], s[0]) if cuts[0] else b for b, s in zip(base, pieces[:3])]
    outs = []
    for i, (ca, cb) in enumerate(groups):
        part = [x[i + 1] for x in pieces]
        outs.append(attend.group_attention(ca, cb, q_parts[i], kw_parts[i], vw_parts[i], *base, *part[:3], part[3],
                                           part[4][0, 0], *params, **geo))
        if i + 1 < len(groups) and cuts[i + 1]:
            base = [route.scatter_tokens(b, part[3], s) for b, s in zip(base, part[:3])]
    return torch.cat(outs, 2)
