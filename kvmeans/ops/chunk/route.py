"""The chunked path's routing pass: where every token entering the state goes, decided before any attention.

The state recurrence depends only on k, v and the gate, so one no-grad run of it (:func:`kvmeans.ops.state.absorb`
on a detached copy) records each entering token's destination row; the differentiable state sums are then
``carried + scatter of the tokens' contributions`` (:func:`scatter_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.budget import as_budget, is_data_dependent
from kvmeans.ops.chunk import plan
from kvmeans.ops.schedule import coverage_after
from kvmeans.ops.state import KVMState, absorb, own_buffers


@dataclass
class Routes:
    dest: Tensor            # [B, Hkv, N] row each entering token joins
    created: Tensor         # [B, Hkv, N] token creates a row (initial fill or append)
    ungated: Tensor         # [B, Hkv, N] token enters with its ungated key/value
    rows_at: List[int]      # rows visible to query chunk c (0 while the state is inactive; novelty: max over (b, h))
    num_rows: int           # rows of the final state
    counts: Optional[Tensor] = None     # novelty budget: [B, Hkv, chunks] rows in use visible to chunk c
    row_count: Optional[Tensor] = None  # novelty budget: [B, Hkv] rows in use after the call


@torch.no_grad()
def record(state, kk, vv, gg, budget, ln, t1, gate_keys, gate_values, gate_appends, attn="torch") -> Routes:
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
        counts = counts_visible(state, records, t1)
        return Routes(dest, created, ungated, counts.amax((0, 1)).tolist(), scratch.num_rows, counts,
                      scratch.row_count)
    rows_at = plan.rows_visible(state, plan.planned_rows(state, budget, t1), t1)
    return Routes(dest, created, ungated, rows_at, scratch.num_rows)


def counts_visible(state: KVMState, records: list, t1: int) -> Tensor:
    """``[B, Hkv, chunks]`` rows in use per (b, h) visible to each query chunk ``c < ceil(t1 / C)`` under a novelty
    budget (:func:`kvmeans.ops.chunk.plan.rows_visible` per (b, h)); ``records`` from
    :func:`kvmeans.ops.state.absorb`."""
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


def pad_rows(t: Tensor, m: int) -> Tensor:
    """State sums ``[B, Hkv, rows, ...]`` padded with zero rows to ``m`` rows."""
    pad = [0, 0] * (t.dim() - 3) + [0, m - t.shape[2]]
    return F.pad(t, pad)


def scatter_tokens(base: Tensor, dest: Tensor, contrib: Tensor) -> Tensor:
    """``base[b, h, dest[b, h, j]] += contrib[b, h, j]`` (out of place). ``dest [B, Hkv, N]`` long."""
    idx = dest.unsqueeze(-1).expand_as(contrib) if contrib.dim() == 4 else dest
    return base.scatter_add(2, idx, contrib)


@torch.no_grad()
def route_agreement(k_ref: Tensor, v_ref: Tensor, gate_ref: Tensor, k: Tensor, v: Tensor, gate: Tensor, *,
                    chunk_len: int, n_bswa_chunks: int, sink_len: int, rope_dim: int, budget, state_norm_weight=None,
                    state_norm_bias=None, state_norm_eps: float = 1e-5, gate_keys: bool = True,
                    gate_values: bool = True, gate_appends: bool = False) -> dict:
    """Route one sequence twice (``k_ref, v_ref, gate_ref`` and e.g. their bf16-rounded copies ``k, v, gate``,
    ``[B, Hkv, T, D|Dv]`` / ``[B, Hkv, T]``, computed in float32) with the torch routing pass and compare where its
    entering tokens went: bf16 rounding can flip near-tie routes, so kernels are compared with routes pinned to the
    reference and the agreement is reported on its own.

    Returns ``{"tokens": N, "dest": share with the same destination row, "created": share with the same
    append/merge decision, "first_flip": index of the first entering token whose row differs (None if none)}``.
    After a first flip the two states differ, so later disagreements are partly consequences of it.
    """
    routes = []
    for kk, vv, gg in ((k_ref, v_ref, gate_ref), (k, v, gate)):
        kk, vv, gg = kk.float(), vv.float(), gg.float()
        B, Hkv, T, D = kk.shape
        state = KVMState.empty(B, Hkv, D, vv.shape[-1], dtype=torch.float32, device=kk.device, chunk_len=chunk_len,
                               n_bswa_chunks=n_bswa_chunks, sink_len=sink_len, rope_dim=rope_dim, value_radius=True)
        n = coverage_after(T, chunk_len, n_bswa_chunks)
        ln = (state_norm_weight, state_norm_bias, state_norm_eps)
        routes.append(record(state, kk[:, :, :n], vv[:, :, :n], gg[:, :, :n], as_budget(budget), ln, T, gate_keys,
                             gate_values, gate_appends))
    a, b = routes
    same = a.dest == b.dest
    flips = (~same).flatten(0, 1).any(0).nonzero()
    return {"tokens": same.shape[-1], "dest": same.float().mean().item(),
            "created": (a.created == b.created).float().mean().item(),
            "first_flip": int(flips[0]) if len(flips) else None}
