"""Backward of the chunked op that keeps no state copy per chunk: reverse state reconstruction.

The forward attends each group of query chunks exactly as :mod:`kvmeans.ops.chunk` does, but without an
autograd graph. It saves the final state sums and, for every token that entered the state, a *stash*:
the value its destination row had in the state before the token's group (tokens of one group all read
the group's base state, so tokens sharing a row stash equal values). The backward walks the groups in
reverse (docs/reference-conventions.md §3.4, "reconstruct the live state"):

1. restoring the stash of a group's tokens turns the state after the group into the state before it,
   bit for bit (a scatter of copied values, no subtraction);
2. the group's snapshots are rebuilt from that base with autograd and its attention is differentiated
   (the Triton kernels' backward on the saved output and log-sum-exp, with no forward re-run; the torch
   path re-runs its SDPA for the graph);
3. ``g``, the gradient of the loss w.r.t. the state after the group, holds every later read of each
   row: a token of the group receives ``g[its row]`` plus what the group's own snapshots send it, and
   ``g`` grows by the group's gradient w.r.t. its base.

Saved for backward: q, the window tokens, the token streams and routes, the final state, the stash
(token sized), the output and the LSE: O(T + M) memory, never O(chunks * M). The autograd graph of
one group exists only while that group is differentiated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch
from torch import Tensor


@dataclass
class GroupPlan:
    """The call's geometry (all positions known before the call; nothing here carries gradient).

    ``groups`` query-chunk ranges ``(ca, cb)``; ``cuts`` tokens entering the state before the first group,
    in each group, after the last (they sum to N); ``dest [B, Hkv, N]`` each token's row; ``arrival [N]``
    the first query chunk that sees it;
    ``q_spans`` / ``w_spans`` the ranges of q rows / window tokens each group reads (its output rows are its q rows);
    ``attend(i, q_span, kw_span, vw_span, base, streams, dest, arrival, params, saved=None, with_lse=False)``
    group i's output ``[B, H, qb - qa, Dv]`` (``with_lse``: ``(o, lse or None)``); ``kernel_saves``: ``attend``
    accepts ``saved=(o, lse)`` from its own forward (the Triton kernels) instead of re-running it.
    """
    groups: List[Tuple[int, int]]
    cuts: List[int]
    dest: Tensor
    arrival: Tensor
    q_spans: List[Tuple[int, int]]
    w_spans: List[Tuple[int, int]]
    attend: Callable
    kernel_saves: bool


def reconstruct_attention(plan: GroupPlan, q: Tensor, kk: Tensor, vv: Tensor, streams: Sequence[Tensor],
                          base: Sequence[Tensor], params: Sequence):
    """``(y [B, H, T, Dv], keys, values, radii)``: the call's outputs and final state sums, differentiable.

    ``q [B, H, T, D]``; ``kk, vv [B, Hkv, N_w, D|Dv]`` the window tokens from ``window_start``;
    ``streams = (dk, dv, dr)`` what each entering token adds to its row; ``base`` the carried sums padded
    to the final row count; ``params = (state_temp, bswa_temp, ln_weight, ln_bias)`` (LN ones may be None).
    """
    return _Reconstruct.apply(plan, q, kk, vv, *streams, *base, *params)


def _rows_index(dest: Tensor, like: Tensor) -> Tensor:
    return dest.unsqueeze(-1).expand(*dest.shape, like.shape[-1]) if like.dim() == 4 else dest


def _piece_bounds(cuts: List[int]) -> List[Tuple[int, int]]:
    bounds, lo = [], 0
    for c in cuts:
        bounds.append((lo, lo + c))
        lo += c
    return bounds


class _Reconstruct(torch.autograd.Function):

    @staticmethod
    def forward(ctx, plan: GroupPlan, q, kk, vv, dk, dv, dr, base_k, base_v, base_r, st, bt, lw, lb):
        streams, params = (dk, dv, dr), (st, bt, lw, lb)
        live = [b.clone() for b in (base_k, base_v, base_r)]
        stash = [torch.empty_like(s) for s in streams]
        outs, lses = [], []
        for p, (lo, hi) in enumerate(_piece_bounds(plan.cuts)):
            dest = plan.dest[:, :, lo:hi]
            for sh, row in zip(stash, live):                          # the rows as this piece's tokens found them
                sh[:, :, lo:hi] = row.gather(2, _rows_index(dest, row))
            if 0 < p <= len(plan.groups):
                i = p - 1
                (qa, qb), (wa, wb) = plan.q_spans[i], plan.w_spans[i]
                o, lse = plan.attend(i, q[:, :, qa:qb], kk[:, :, wa:wb], vv[:, :, wa:wb], live,
                                     [s[:, :, lo:hi] for s in streams], dest, plan.arrival[lo:hi], params,
                                     with_lse=True)
                outs.append(o)
                lses.append(lse)
            for row, s in zip(live, streams):
                row.scatter_add_(2, _rows_index(dest, row), s[:, :, lo:hi])
        y = torch.cat(outs, 2)
        ctx.plan = plan
        ctx.has_lse = lses[0] is not None
        ctx.save_for_backward(q, kk, vv, *streams, *stash, *live, *params, y, *(lses if ctx.has_lse else ()))
        # the returned state is a cache that later calls may advance in place: hand out copies
        return (y, *(row.clone() for row in live))

    @staticmethod
    def backward(ctx, dy, *d_final):
        plan = ctx.plan
        saved = ctx.saved_tensors
        q, kk, vv = saved[:3]
        streams, stash, final, params = saved[3:6], saved[6:9], saved[9:12], list(saved[12:16])
        y, lses = saved[16], saved[17:]
        g = [torch.zeros_like(f) if d is None else d.clone() for d, f in zip(d_final, final)]
        live = [f.clone() for f in final]
        dq, dkk, dvv = torch.zeros_like(q), torch.zeros_like(kk), torch.zeros_like(vv)
        d_streams = [torch.zeros_like(s) for s in streams]
        d_params = [None] * 4
        dy = torch.zeros_like(y) if dy is None else dy
        bounds = _piece_bounds(plan.cuts)
        for p in reversed(range(len(bounds))):
            lo, hi = bounds[p]
            dest = plan.dest[:, :, lo:hi]
            for row, sh in zip(live, stash):                          # state after the piece -> state before it
                row.scatter_(2, _rows_index(dest, row), sh[:, :, lo:hi])
            local = [None] * 3
            if 0 < p <= len(plan.groups):
                i = p - 1
                (qa, qb), (wa, wb) = plan.q_spans[i], plan.w_spans[i]
                kept = (y[:, :, qa:qb], lses[i]) if plan.kernel_saves else None
                with torch.enable_grad():
                    spans = (q[:, :, qa:qb], kk[:, :, wa:wb], vv[:, :, wa:wb], *live,
                             *(s[:, :, lo:hi] for s in streams))
                    leaves = [t.detach().requires_grad_() for t in spans]
                    par = [None if t is None else t.detach().requires_grad_() for t in params]
                    o = plan.attend(i, *leaves[:3], leaves[3:6], leaves[6:9], dest, plan.arrival[lo:hi], par,
                                    saved=kept)
                    inputs = leaves + [t for t in par if t is not None]
                    grads = torch.autograd.grad(o, inputs, dy[:, :, qa:qb], allow_unused=True)
                for acc, grad, span in ((dq, grads[0], (qa, qb)), (dkk, grads[1], (wa, wb)), (dvv, grads[2], (wa, wb))):
                    if grad is not None:
                        acc[:, :, span[0]:span[1]] += grad
                base_grads, local = grads[3:6], grads[6:9]
                it = iter(grads[9:])
                for j, t in enumerate(par):
                    if t is not None:
                        gj = next(it)
                        if gj is not None:
                            d_params[j] = gj if d_params[j] is None else d_params[j] + gj
            for k in range(3):                                        # every later read of the token's row
                d_streams[k][:, :, lo:hi] = g[k].gather(2, _rows_index(dest, g[k]))
                if local[k] is not None:
                    d_streams[k][:, :, lo:hi] += local[k]
            if 0 < p <= len(plan.groups):
                for k in range(3):
                    if base_grads[k] is not None:
                        g[k] += base_grads[k]
        d_params = [None if t is None else (d if d is not None else torch.zeros_like(t))
                    for t, d in zip(params, d_params)]
        return (None, dq, dkk, dvv, *d_streams, *g, *d_params)

