"""The ways a group of query chunks attends to ``[readout(state snapshot) ; window]``, differentiably.

* masked SDPA (:func:`group_sdpa`): all chunks of the group in one call with a boolean mask (rows not yet
  created and future window tokens hidden); on CPU the flash kernel's forward can be kept and differentiated
  later (:mod:`kvmeans.ops.chunk.flash`);
* the joined read (:func:`joined_group`): whole chunks with whole windows, three unmasked flash calls joined by
  their log-sum-exp (CPU, ``D == Dv``);
* the fused Triton kernel (:func:`triton_group`, :mod:`kvmeans.ops.triton.attention`): no window copy per chunk,
  no repeated GQA keys.

The snapshot chunk ``c`` sees is the state before the group plus the tokens that arrived in the group before
``c`` (:func:`snapshots`): a scatter into per-chunk increments followed by a cumulative sum over chunks.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.chunk import flash, plan
from kvmeans.ops.chunk.route import scatter_tokens
from kvmeans.ops.masking import finite_tokens, poison
from kvmeans.ops.routing import readout


def group_attention(ca, cb, q, kw, vw, base_k, base_v, base_r, dk, dv, dr, dest, arrival, state_temp, bswa_temp,
                    ln_w, ln_b, *, C, n, t0, t1, w0, scale, value_radius, rows_at, ln_eps, attn="torch", saved=None,
                    with_lse=False, counts=None):
    """Outputs ``[B, H, qb - qa, Dv]`` of query chunks ``[ca, cb)`` (G = cb - ca), differentiably.

    ``q [B, H, qb - qa, D]`` their queries and ``kw, vw [B, Hkv, G, D|Dv, W]`` each chunk's window (positions
    ``qa, qb, W``: :func:`kvmeans.ops.chunk.plan.window_geometry`);
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
        return triton_group(ca, cb, q, None, None, *tri_args, **tri_geo)
    if not tri:
        keys, values = group_operands(q, kw, vw, bswa_temp, M)
    if M:
        k_hat, v_hat, stale = snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius,
                                        ln_w, ln_b, ln_eps)
        if tri:
            out = triton_group(ca, cb, q, k_hat.to(q.dtype), v_hat.to(q.dtype), *tri_args, **tri_geo)
            return (poison_chunks(out[0], stale), out[1]) if with_lse else poison_chunks(out, stale)
        keys[..., :M, :] = k_hat.unsqueeze(3) * by_head(state_temp, Hkv)
        values[..., :M, :] = v_hat.unsqueeze(3)
    stale = stale if M else None        # a stale snapshot's outputs are poisoned: differentiate a fresh forward
    mask = plan.group_mask(ca, cb, C, n, t0, t1, w0, rows_at, M, q.device)
    if counts is not None and M:        # [B, G, H, Cq, M + W]: rows beyond each (b, h)'s count hidden too
        hidden = torch.arange(M, device=q.device) >= counts[:, :, ca:cb].transpose(1, 2).unsqueeze(-1)
        hidden = hidden.repeat_interleave(q.shape[1] // Hkv, 2).unsqueeze(3)          # [B, G, H, 1, M]
        mask = mask.unsqueeze(1) & F.pad(~hidden, (0, mask.shape[-1] - M), value=True)
    out = group_sdpa(q, keys, values, mask, scale, saved=None if stale is not None else saved, with_lse=with_lse)
    if with_lse:
        return poison_chunks(out[0], stale), out[1]
    return poison_chunks(out, stale)


def snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius, ln_w, ln_b, ln_eps):
    """``(k_hat, v_hat [B, G, Hkv, M, D|Dv], stale [B, G, Hkv] or None)``: the read-out state each chunk ``ca + g``
    sees (base sums plus the tokens that arrived in the group before it; non-finite rows zeroed and flagged)."""
    B, Hkv = base_k.shape[:2]
    snap = []   # state sums seen by each chunk: base + cumulative increments of tokens arriving in the group
    heads = torch.arange(Hkv, device=dest.device).view(Hkv, 1)
    slot = (((arrival - ca) * Hkv + heads) * M + dest).flatten(1, 2).unsqueeze(1)
    for b, s in zip((base_k, base_v, base_r), (dk, dv, dr)):
        inc = b.new_zeros(B, 1, G * Hkv * M, *b.shape[3:])                          # [B, 1, G*Hkv*M, ...]
        inc = scatter_tokens(inc, slot, s.flatten(1, 2).unsqueeze(1)).squeeze(1)
        snap.append(inc.unflatten(1, (G, Hkv, M)).cumsum(1) + b[:, :, :M].unsqueeze(1))
    k_hat, v_hat, bad_rows = finite_tokens(*readout(*snap, value_radius, ln_w, ln_b, ln_eps))
    return k_hat, v_hat, None if bad_rows is None else bad_rows.any(-1)


def joined_group(ca, cb, q, kw, vw, base_k, base_v, base_r, dk, dv, dr, dest, arrival, state_temp, bswa_temp,
                 ln_w, ln_b, *, C, n, scale, value_radius, rows_at, ln_eps, saved=None, with_lse=False, **_):
    """:func:`group_attention` for the reconstruction backward on CPU when the group's chunks are whole, their
    windows whole and their snapshots active (or all inactive): the read of
    :func:`kvmeans.ops.chunk.flash.joined_attention` (window spans ``kw, vw [B, Hkv, N, D|Dv]`` from position
    ``(ca + 1 - n) * C``, no window copy, no mask). ``with_lse``: ``(y, lse)`` (no graph); ``saved=(y, lse)`` from
    that call: ``y`` differentiable through :class:`kvmeans.ops.chunk.flash.JoinedSaved`. None where a snapshot
    holds a non-finite row (the caller takes the masked path, which poisons its chunks)."""
    B, H, G = q.shape[0], q.shape[1], cb - ca
    M = rows_at[cb - 1]
    k_hat = v_hat = None
    if M:
        k_hat, v_hat, stale = snapshots(ca, G, M, base_k, base_v, base_r, dk, dv, dr, dest, arrival, value_radius,
                                        ln_w, ln_b, ln_eps)
        if stale is not None:
            return None
    parts = flash.joined_operands(q, k_hat, v_hat, rows_at[ca:cb], kw, vw, (n - 1) * C, state_temp, bswa_temp,
                                  C=C, n=n)
    heads = lambda y: y.view(B, G, H, C, -1).transpose(1, 2).flatten(2, 3)     # [B*G, H, C, Dv] -> [B, H, G*C, Dv]
    if with_lse:
        o = q.new_empty(B, G, H, C, vw.shape[-1])
        lse = flash.join(parts, scale, o)
        return heads(o), lse
    o = saved[0].unflatten(2, (G, C)).transpose(1, 2).flatten(0, 1)
    return heads(flash.JoinedSaved.apply(o, saved[1], scale, [(c, m) for *_, c, m in parts],
                                         *(t for part in parts for t in part[:3])))


def joinable(ca, cb, q, v, rows_at, C, n, w0) -> bool:
    """The group can take :func:`joined_group`: whole chunks with whole windows, every snapshot active or none."""
    active = {rows_at[c] > 0 for c in range(ca, cb)}
    return flash.saves(q, v) and q.shape[2] == (cb - ca) * C and plan.whole_window(ca, C, n, w0) and len(active) == 1


def span_attend(groups, geo):
    """Group ``i``'s attention from the spans of q / window tokens it reads: the ``attend`` of
    :class:`kvmeans.ops.chunk.reconstruct.GroupPlan` (the joined read where it applies, else the masked one)."""
    C, n, t0, t1, w0 = geo["C"], geo["n"], geo["t0"], geo["t1"], geo["w0"]

    def attend(i, q_span, kw_span, vw_span, base, streams, dest, arrival, params, saved=None, with_lse=False):
        ca, cb = groups[i]
        if geo["attn"] != "triton" and geo["counts"] is None and (saved is not None or with_lse) and \
                joinable(ca, cb, q_span, vw_span, geo["rows_at"], C, n, w0):
            out = joined_group(ca, cb, q_span, kw_span, vw_span, *base, *streams, dest, arrival, *params, **geo,
                               saved=saved, with_lse=with_lse)
            if out is not None:
                return out
        if geo["attn"] != "triton":     # the span holds tokens from max(w0, (ca+1-n)*C) on
            geometry = plan.window_geometry(ca, cb, C, n, t0, t1, w0)[1:]
            kw_span, vw_span = (plan.windows(x, max(w0, (ca + 1 - n) * C), *geometry, C) for x in (kw_span, vw_span))
        return group_attention(ca, cb, q_span, kw_span, vw_span, *base, *streams, dest, arrival, *params, **geo,
                               saved=saved, with_lse=with_lse)
    return attend


def poison_chunks(y: Tensor, stale) -> Tensor:
    """NaN in the outputs ``y [B, H, G*Cq, Dv]`` of the chunks whose state snapshot holds a non-finite row
    (``stale [B, G, Hkv]``, None: none)."""
    if stale is None:
        return y
    return poison(y, stale.transpose(1, 2).repeat_interleave(y.shape[2] // stale.shape[1], -1))


def triton_group(ca, cb, q, k_hat, v_hat, kw, vw, k_start, state_temp, bswa_temp, *, C, n, t0, t1, rows_at, scale,
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


def group_operands(q, kw, vw, bswa_temp, M):
    """SDPA key/value buffers ``[B, G, Hkv, rep, M + W, D|Dv]`` with the window part written (state rows
    ``[:M]`` are left for the caller): written once, no cat / transpose copies."""
    B, H = q.shape[:2]
    Hkv, G, D, W = kw.shape[1], kw.shape[2], kw.shape[3], kw.shape[4]
    keys = q.new_empty(B, G, Hkv, H // Hkv, M + W, D)
    values = q.new_empty(B, G, Hkv, H // Hkv, M + W, vw.shape[3])
    keys[..., M:, :] = kw.permute(0, 2, 1, 4, 3).unsqueeze(3) * by_head(bswa_temp, Hkv)
    values[..., M:, :] = vw.permute(0, 2, 1, 4, 3).unsqueeze(3)
    return keys, values


def by_head(t: Tensor, Hkv: int) -> Tensor:
    """A per-query-head ``[H]`` tensor viewed ``[1, 1, Hkv, H / Hkv, 1, 1]``: grouped under its kv head."""
    return t.view(1, 1, Hkv, -1, 1, 1)


def group_sdpa(q, keys, values, mask, scale, saved=None, with_lse=False):
    """One SDPA call for all chunks of a group; ``q [B, H, G*Cq, D]`` -> ``[B, H, G*Cq, Dv]``. Where the CPU flash
    kernel runs (:func:`kvmeans.ops.chunk.flash.saves`), ``with_lse`` returns ``(y, lse)`` from it (no graph) and
    ``saved=(y, lse)`` from such a call differentiates with its backward instead of running the forward again
    (``with_lse`` elsewhere: ``(y, None)``)."""
    B, G, C = q.shape[0], keys.shape[1], mask.shape[-2]
    by_chunk = lambda t: t.unflatten(2, (G, C)).transpose(1, 2).flatten(0, 1)         # [B*G, H, C, D]
    qs, k, v = by_chunk(q), keys.flatten(2, 3).flatten(0, 1), values.flatten(2, 3).flatten(0, 1)
    mask = mask.flatten(0, 1) if mask.dim() == 5 else mask.unsqueeze(1).repeat(B, 1, 1, 1)   # [B*G, H or 1, Cq, K]
    heads = lambda y: y.unflatten(0, (B, G)).transpose(1, 2).flatten(2, 3)
    if (with_lse or saved is not None) and flash.saves(q, values):
        add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        if with_lse:
            y, lse = flash.forward_with_lse(qs, k, v, add, scale)
            return heads(y), lse
        return heads(flash.SavedFlash.apply(qs, k, v, add, scale, by_chunk(saved[0]), saved[1]))
    y = heads(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale))
    return (y, None) if with_lse else y
