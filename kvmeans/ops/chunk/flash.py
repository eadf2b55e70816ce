"""The CPU flash kernel behind SDPA, called directly: it also returns each query's log-sum-exp, which lets

* a *joined read* attend whole chunks to their state snapshot, the n - 1 previous chunks and their own chunk
  (causal) in three unmasked flash calls on views of the window, joined by their log-sum-exp
  (:func:`joined_attention`; the one-call masked SDPA computes the same keys plus a mask and a window copy per
  chunk), and
* a backward differentiate a forward that already ran, from its output and log-sum-exp, with the kernel's own
  backward (:class:`SavedFlash`, :class:`JoinedSaved`): the same gradients, no second forward.

Every call of the kernel goes through this module (``_FLASH_CPU``; None where torch lacks it).
"""
from __future__ import annotations

import torch
from torch import Tensor

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def available(q: Tensor, v: Tensor) -> bool:
    """The CPU flash kernel runs for these operands (on CPU, values as wide as the queries)."""
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def saves(q: Tensor, v: Tensor) -> bool:
    """The torch path's reconstruction backward can reuse the forward's output and log-sum-exp: the CPU flash kernel
    and its backward run (on CPU, with values as wide as the queries)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _FLASH_CPU_BACKWARD is not None \
        and _FLASH_CPU is not None


def forward_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float):
    """``(y, lse)``: masked flash attention (additive ``mask``) and each query's log-sum-exp; no autograd."""
    y, lse = _FLASH_CPU(q, k, v, attn_mask=mask, scale=scale)[:2]
    return y, lse


class SavedFlash(torch.autograd.Function):
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
        dq, dk, dv = _FLASH_CPU_BACKWARD(dy.contiguous(), q, k, v, o, lse, 0.0, False, attn_mask=mask,
                                         scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def joined_attention(y, q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, *, C, n, scale) -> Tensor:
    """Writes ``y [B, H, G*C, Dv]`` (a view, returned): G whole chunks of queries ``q [B, H, G*C, D]`` whose windows
    are whole, attending to their state snapshot ``keys, values [B, G, Hkv, 1, M, D|Dv]`` (``rows[g]`` visible), the
    n - 1 previous chunks and their own chunk (causal) of ``kk, vv [B, Hkv, N, D|Dv]`` (chunk ``g`` starts at
    ``start + g*C``). Three unmasked flash calls (the window read as views, no copy) joined by their log-sum-exp."""
    G = keys.shape[1]
    parts = joined_operands(q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, C=C, n=n)
    join(parts, scale, y.unflatten(2, (G, C)).transpose(1, 2))
    return y


def joined_operands(q, keys, values, rows, kk, vv, start, state_temp, bswa_temp, *, C, n) -> list:
    """The flash calls of a joined read (see :func:`joined_attention`; ``keys, values`` ``[B, G, Hkv, (1,) M, ...]``
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
        prev = [t[:, :, start - L:start + (G - 1) * C].unfold(2, L, C).permute(0, 2, 1, 4, 3)
                .reshape(B * G, Hkv, L, -1) for t in (kk, vv)]
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


def join(parts, scale, out: Tensor) -> Tensor:
    """Run the flash calls of ``parts`` (:func:`joined_operands`) and join them by their log-sum-exp into
    ``out [B, G, H, C, Dv]`` (any strides); returns the joint log-sum-exp ``[B*G, H, C]``."""
    runs = [_FLASH_CPU(pq, pk, pv, is_causal=causal, attn_mask=mask, scale=scale)[:2]
            for pq, pk, pv, causal, mask in parts]
    lse = [lse_part.reshape(*out.shape[:4], 1) for _, lse_part in runs]
    top = lse[0]
    for part in lse[1:]:
        top = torch.maximum(top, part)
    w = [(part - top).exp_() for part in lse]
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


class JoinedSaved(torch.autograd.Function):
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
