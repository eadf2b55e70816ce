"""``kvm_attention(..., numerics="reference")``: the rounding points of the authors' eager mixer.

The default ("exact") numerics compute in fp32 for half inputs, route with the ungated memory key
and read the state out in the compute dtype (docs/algorithm.md, deviation ledger). This module
instead reproduces what the authors' eager code (``model/kvm_mixer.py``, docs/reference-conventions.md
§1.6-1.11, §10) does with tensors of the model dtype ``md`` (= the dtype of q, k, v: bf16 for the
released models, fp32 or fp64 in a full-precision run):

* state raw key / value sums are stored in ``md`` (initial rows and appended rows as computed,
  merges added as ``s + onehot^T @ contributions``: an ``md`` matmul, then an ``md`` add);
  radii are fp32 (``|v.float()|``);
* prepared keys ``LN_s(k with the first rope_dim channels zeroed)`` and the JIT-normalised keys
  ``LN_s(raw sums)`` are ``md`` LayerNorms (recomputed at every read, like the reference);
* append novelty = ``(select key @ LN_s(rows)^T)`` in ``md`` (all rows, sinks included), then
  ``.float()``; the ``n_append`` lowest are appended;
* merge logits = ``(merge key @ LN_s(rows)^T)`` in ``md`` with the *gated* merge key (when keys
  are gated), sink rows ``-inf``, argmax (first index on ties);
* readout values ``(normalize(v_sum.float()) * radius)`` **hard-cast to bf16**, also in fp32 runs
  (then promoted back to ``md`` by the concatenation with the window values, as in the reference);
* temperatures multiply the keys in ``md``; attention is ``F.scaled_dot_product_attention`` in
  ``md`` with the reference's calls: the front phase of a fresh prefill is one causal SDPA over
  ``min(T, L)`` queries, every other query chunk one SDPA over ``[state ; window]`` with a
  lower-right causal mask (a decode step is the same call with one query).

Not reproduced (documented in docs/algorithm.md): the unstable ``argsort`` of the append ranking
(ties go to the lower token index here), the ``kvm_use_vlens=0`` global-divisor bug (rows read out
as running means ``v_sum / count``, in ``md``), ``rope_dim=0`` zeroing every channel, and fp16
(the reference would fail to concatenate bf16 readouts with fp16 values; here they are cast to fp16).

This path is for fidelity, not speed: plain out-of-place torch ops, one chunk at a time, the
normalised state recomputed at each read. It supports autograd (routing carries no gradient, as in
the reference) and any split of a sequence into calls (prefill, chunked prefill, one-token decode).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmeans.ops.routing import memory_keys, state_layer_norm
from kvmeans.ops.schedule import bswa_begin, plan_updates
from kvmeans.ops.state import KVMState


def reference_kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, state: KVMState, *, budget,
                            state_norm_weight, state_norm_bias, state_norm_eps: float, state_temp: Tensor,
                            bswa_temp: Tensor, scale: float, gate_keys: bool = True, gate_values: bool = True,
                            gate_appends: bool = False):
    """Same contract as :func:`kvmeans.ops.naive.naive_kvm_attention`, with the reference's rounding.

    All of q, k, v, gate, the temperatures and the state's sums / window are in the model dtype
    (q's dtype); the state's radii are fp32. Returns ``(y [B,H,T,Dv], new_state)``.
    """
    C, n, S, r = state.chunk_len, state.n_bswa_chunks, state.sink_len, state.rope_dim
    H, D = q.shape[1], q.shape[3]
    md = q.dtype
    ln_args = (state_norm_weight, state_norm_bias, state_norm_eps)     # LN_s in md (affine cast to md)
    ln = lambda x: state_layer_norm(x, *ln_args)                         # noqa: E731
    st, bt = state_temp.to(md).view(1, H, 1, 1), bswa_temp.to(md).view(1, H, 1, 1)
    sdpa_scale = None if scale == 1.0 / math.sqrt(D) else scale         # the reference uses SDPA's default
    streams = dict(rope_dim=r, ln_args=ln_args, gate_keys=gate_keys, gate_values=gate_values, gate_appends=gate_appends,
                   value_radius=state.value_radius)

    t0, T = state.seen_tokens, q.shape[2]
    K, V, R = state.rows()
    R = R.float()
    wk, wv, wg = state.window()
    w_start, cov = state.window_start, state.coverage
    outs = []
    # fresh prefill: the reference's front phase, one causal SDPA over the first min(T, L) queries
    front = min(T, n * C) if t0 == 0 else 0
    if front:
        outs.append(F.scaled_dot_product_attention(q[:, :, :front], _rep(k[:, :, :front], H) * bt,
                                                   _rep(v[:, :, :front], H), is_causal=True, scale=sdpa_scale))
    pos = t0
    while pos < t0 + T:
        e = min(t0 + T, (pos // C + 1) * C)   # queries [pos, e) lie in one chunk
        new = slice(pos - t0, e - t0)
        wk = torch.cat([wk, k[:, :, new]], 2)
        wv = torch.cat([wv, v[:, :, new]], 2)
        wg = torch.cat([wg, gate[:, :, new]], 2)

        if cov < min(e, C):                   # initial state: prepared keys, raw values, fp32 radii
            idx = slice(cov - w_start, min(e, C) - w_start)
            K = torch.cat([K, memory_keys(wk[:, :, idx], r, *ln_args)], 2)
            V = torch.cat([V, wv[:, :, idx]], 2)
            R = torch.cat([R, _radius(wv[:, :, idx], state.value_radius)], 2)
            cov = min(e, C)

        for step in plan_updates(budget, cov, K.shape[2], e, C, n):
            blk = slice(step.start - w_start, step.start + C - w_start)
            K, V, R = _update(K, V, R, wk[:, :, blk], wv[:, :, blk], wg[:, :, blk], step.n_append, S, **streams)
            cov = step.start + C

        drop = bswa_begin(e, C, n) - w_start
        wk, wv, wg = wk[:, :, drop:], wv[:, :, drop:], wg[:, :, drop:]
        w_start += drop

        if pos >= front:                      # (queries of the front phase were answered above)
            outs.append(_attend(q[:, :, new], K, V, R, wk, wv, w_start > 0, ln, st, bt, state.value_radius,
                                sdpa_scale))
        pos = e

    out_state = KVMState(K, V, R, wk, wv, wg, num_rows=K.shape[2], seen_tokens=t0 + T, coverage=cov,
                         chunk_len=C, n_bswa_chunks=n, sink_len=S, rope_dim=r, value_radius=state.value_radius,
                         extras=state.extras)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), out_state


def _rep(x: Tensor, H: int) -> Tensor:
    """KV heads -> query heads (query head h reads kv head h // (H / Hkv))."""
    return x if x.shape[1] == H else x.repeat_interleave(H // x.shape[1], dim=1)


def _radius(v: Tensor, value_radius: bool) -> Tensor:
    """fp32 radius of new rows (``|v|`` of the fp32 upcast), or a count of 1 for the ablation."""
    return torch.norm(v.float(), dim=-1) if value_radius else v.new_ones(v.shape[:-1], dtype=torch.float32)


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def _update(K, V, R, kb, vb, gb, n_append: int, sink_len: int, *, rope_dim, ln_args, gate_keys, gate_values,
            gate_appends, value_radius):
    """One overflow block ``kb/vb/gb [B,Hkv,C,*]`` enters the state (docs/reference-conventions.md §1.8)."""
    ln = lambda x: state_layer_norm(x, *ln_args)       # noqa: E731  (md in, md out)
    sel = memory_keys(kb, rope_dim, *ln_args)           # select key (ungated), in md
    g = gb.unsqueeze(-1)
    mk = sel * g if gate_keys else sel                  # merge key / value (gated)
    mv = vb * g if gate_values else vb
    ak, av = (mk, mv) if gate_appends else (sel, vb)    # append key / value
    B, Hkv, n_tok = kb.shape[:3]
    n_append = min(max(n_append, 0), n_tok)
    all_idx = torch.arange(n_tok, device=kb.device).expand(B, Hkv, n_tok)
    if n_append == 0:
        app, mrg = all_idx[..., :0], all_idx
    elif n_append == n_tok:
        app, mrg = all_idx, all_idx[..., :0]
    else:
        with torch.no_grad():
            novelty = (sel @ ln(K).transpose(-1, -2)).float().amax(-1)   # md matmul, rounded, then fp32
            order = torch.sort(novelty, dim=-1, stable=True).indices     # ascending; ties: lower token first
            app = order[..., :n_append].sort(-1).values                  # both lists back in token order
            mrg = order[..., n_append:].sort(-1).values
    if app.shape[-1]:
        new_v = _gather(av, app)
        K = torch.cat([K, _gather(ak, app)], 2)
        V = torch.cat([V, new_v], 2)
        R = torch.cat([R, _radius(new_v, value_radius)], 2)
    if not mrg.shape[-1]:
        return K, V, R
    km, vm = _gather(mk, mrg), _gather(mv, mrg)
    m = K.shape[2]
    protected = min(sink_len, m)
    if m <= protected:
        raise AssertionError("KVM state update requires at least one non-sink row before merging")
    with torch.no_grad():                               # targets against old + just-appended rows
        logits = km @ ln(K).transpose(-1, -2)           # md (gated merge key)
        logits[..., :protected] = float("-inf")
        best = logits.max(dim=-1, keepdim=True).indices
        onehot = torch.zeros_like(logits).scatter_(-1, best, 1.0)      # [B, Hkv, n_merge, m] in md
    K = K + onehot.transpose(-1, -2) @ km               # md matmul (fp32 accumulate, one rounding), md add
    V = V + onehot.transpose(-1, -2) @ vm
    if not value_radius:                                # running-mean ablation: per-row token count
        R = R + onehot.sum(-2).float()
    return K, V, R


def _attend(q, K, V, R, wk, wv, use_state: bool, ln, st, bt, value_radius: bool, scale):
    """One SDPA of ``q [B,H,t,D]`` over ``[state ; window]`` with a lower-right causal mask."""
    H, md = q.shape[1], q.dtype
    keys, values = _rep(wk, H) * bt, _rep(wv, H)
    if use_state and K.shape[2]:
        if value_radius:                                # normalise in fp32, scale, hard cast to bf16
            v_hat = (F.normalize(V.float(), dim=-1) * R.unsqueeze(-1)).bfloat16()
        else:
            v_hat = V / R.clamp_min(1).to(V.dtype).unsqueeze(-1)
        keys = torch.cat([_rep(ln(K), H) * st, keys], 2)
        values = torch.cat([_rep(v_hat, H).to(md), values], 2)
    tq, tk = q.shape[2], keys.shape[2]
    mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tq, device=q.device)[:, None] + (tk - tq)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
