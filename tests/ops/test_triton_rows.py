"""The Triton kernels with a state row count per (batch row, kv head): outputs and gradients against a masked
torch softmax. Rows past a head's count are NaN-poisoned in the kernels' operands (they must never be read);
counts include 0 (a head with no rows) and the full buffer. Without CUDA the kernels run in Triton's CPU
interpreter (``TRITON_INTERPRET=1`` from conftest.py)."""
import pytest
import torch

pytest.importorskip("triton")

from kvmeans.ops.triton import attention as tri_attn  # noqa: E402
from kvmeans.ops.triton import available, unavailable_reason  # noqa: E402
from kvmeans.ops.triton.attention import chunk_attention  # noqa: E402
from kvmeans.ops.triton.decode import decode_attention  # noqa: E402
from kvmeans.utils.testing import TOLERANCES, assert_close  # noqa: E402

DEV = torch.device("cpu" if tri_attn.INTERPRETED else "cuda")
if not available(DEV):
    pytest.skip(f"Triton kernels cannot run: {unavailable_reason(DEV)}", allow_module_level=True)

TOL = TOLERANCES[torch.float32]


def masked_attention(q, sk, sv, rows, wk, wv, st, bt, qpos, C, n, scale):
    """Softmax of each query over ``[its snapshot's first rows[b, kv head, g] rows ; its causal window]``.

    ``q [B, H, TQ, D]`` at positions ``qpos [TQ]`` (chunk ``g = qpos // C - qpos[0] // C``),
    ``sk / sv [B, G, Hkv, M, .]``, ``rows [B, Hkv, G]``, ``wk / wv [B, Hkv, N, .]`` from position 0; returns
    ``[B, H, TQ, Dv]``."""
    B, H, TQ, _ = q.shape
    rep = H // wk.shape[1]
    heads = lambda x, dim: x.repeat_interleave(rep, dim)
    g = qpos // C - qpos[0] // C
    skq, svq = (heads(x, 2)[:, g].transpose(1, 2) for x in (sk, sv))        # [B, H, TQ, M, .]
    s_state = torch.einsum("bhtd,bhtmd->bhtm", q, skq) * st.view(1, H, 1, 1)
    seen_state = torch.arange(sk.shape[3]) < heads(rows, 1)[:, :, g].unsqueeze(-1)          # [B, H, TQ, M]
    kpos = torch.arange(wk.shape[2])
    s_window = q @ heads(wk, 1).transpose(-1, -2) * bt.view(1, H, 1, 1)
    seen_window = (kpos <= qpos[:, None]) & (kpos >= (qpos[:, None] // C + 1 - n) * C)     # [TQ, N]
    scores = torch.cat([s_state, s_window.expand(B, H, TQ, -1)], -1) * scale
    seen = torch.cat([seen_state, seen_window.expand(B, H, TQ, -1)], -1)
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("bhtm,bhtmd->bhtd", p[..., :sk.shape[3]], svq) + p[..., sk.shape[3]:] @ heads(wv, 1)


def poison_past(x, counts, dim):
    """``x`` with the rows at index ``>= counts`` (broadcast against x's first dims, rows along ``dim``) set to NaN."""
    idx = torch.arange(x.shape[dim]).view(-1, *[1] * (x.dim() - dim - 1))
    return torch.where(idx >= counts.view(*counts.shape, *[1] * (x.dim() - counts.dim())), float("nan"), x)


@pytest.mark.parametrize("rep", [1, 3])
def test_chunk_attention_rows_per_batch_row_and_head(rep):
    """Forward and every gradient (q, snapshot keys / values, window keys / values, both temperatures) with
    different counts per (b, kv head, chunk), including 0 rows and all M rows."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, D, Dv, C, n, M = 2, 2, 12, 10, 4, 2, 9
    H, q_lo, q_hi = Hkv * rep, 4, 16                       # chunks 1..3 (G = 3), window from position 0
    G, TQ = 3, q_hi - q_lo
    r = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    x = dict(q=r(B, H, TQ, D), sk=r(B, G, Hkv, M, D), sv=r(B, G, Hkv, M, Dv), wk=r(B, Hkv, q_hi, D),
             wv=r(B, Hkv, q_hi, Dv), st=(torch.rand(H, generator=g) + .5).requires_grad_(),
             bt=(torch.rand(H, generator=g) + .5).requires_grad_())
    rows = torch.tensor([[[0, 3, 9], [5, 0, 2]], [[9, 9, 9], [1, 4, 0]]])              # [B, Hkv, G]
    hidden = rows.permute(0, 2, 1)                                                      # [B, G, Hkv]
    sk_nan, sv_nan = poison_past(x["sk"], hidden, 3), poison_past(x["sv"], hidden, 3)
    y = chunk_attention(*(t.to(DEV) for t in (x["q"], sk_nan, sv_nan, rows, x["wk"], x["wv"], x["st"], x["bt"])),
                        q_start=q_lo, q_lo=q_lo, q_hi=q_hi, k_start=0, chunk_len=C, n_bswa_chunks=n, scale=0.3)
    y_ref = masked_attention(x["q"], x["sk"], x["sv"], rows, x["wk"], x["wv"], x["st"], x["bt"],
                             torch.arange(q_lo, q_hi), C, n, 0.3)
    assert_close("y", y_ref, y, TOL)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad((y * dy.to(DEV)).sum(), list(x.values()))
    want = torch.autograd.grad((y_ref * dy).sum(), list(x.values()))
    for name, a, b in zip(x, want, got):
        assert_close("d" + name, a, b, TOL)


def test_chunk_attention_rows_broadcast_form_is_unchanged():
    """``rows [G]`` gives the same output as the same counts spelled out per (b, kv head); a wrong shape is refused."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, D, C, M, G = 2, 4, 2, 8, 4, 5, 2
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    q, sk, sv, wk, wv = r(B, H, 8, D), r(B, G, Hkv, M, D), r(B, G, Hkv, M, D), r(B, Hkv, 8, D), r(B, Hkv, 8, D)
    temps = (torch.ones(H, device=DEV), torch.ones(H, device=DEV))
    geo = dict(q_start=0, q_lo=0, q_hi=8, k_start=0, chunk_len=C, n_bswa_chunks=2, scale=0.3)
    per_chunk = torch.tensor([2, 5])
    y = chunk_attention(q, sk, sv, per_chunk, wk, wv, *temps, **geo)
    assert torch.equal(y, chunk_attention(q, sk, sv, per_chunk.expand(B, Hkv, G), wk, wv, *temps, **geo))
    with pytest.raises(ValueError, match=r"rows has shape \(2, 2\); pass \[G\] = \[2\] or \[B, Hkv, G\]"):
        chunk_attention(q, sk, sv, per_chunk.expand(B, G), wk, wv, *temps, **geo)


@pytest.mark.parametrize("t", [1, 3])
def test_decode_kernel_lengths_per_batch_row_and_head(t):
    """``lengths [B, Hkv, 2]``: every (b, kv head) reads its own rows (0 included) and window length; what lies
    past them is NaN and never read; t > 1 queries are causal."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, D, Dv, M, W = 3, 4, 2, 16, 12, 11, 9
    r = lambda *s: torch.randn(*s, generator=g)
    q, sk, sv, wk, wv = r(B, H, t, D), r(B, Hkv, M, D), r(B, Hkv, M, Dv), r(B, Hkv, W, D), r(B, Hkv, W, Dv)
    st, bt = torch.rand(H, generator=g) + .5, torch.rand(H, generator=g) + .5
    rows = torch.tensor([[0, 7], [11, 3], [5, 0]])
    win = torch.tensor([[9, 9], [4, 6], [3, 8]])
    lengths = torch.stack([rows, win], -1).to(torch.int32)
    y = decode_attention(*(x.to(DEV) for x in (q, poison_past(sk, rows, 2), sv, poison_past(wk, win, 2), wv,
                                               lengths, st, bt)), 0.25)
    for b in range(B):
        for h in range(Hkv):
            heads = slice(h * (H // Hkv), (h + 1) * (H // Hkv))
            w = int(win[b, h])
            sel = lambda x: x[b:b + 1, h:h + 1]
            ref = masked_attention(q[b:b + 1, heads], sel(sk)[:, None], sel(sv)[:, None], rows[b:b + 1, h:h + 1, None],
                                   sel(wk)[:, :, :w], sel(wv)[:, :, :w], st[heads], bt[heads],
                                   torch.arange(w - t, w), C=64, n=1, scale=0.25)
            assert_close(f"decode b={b} h={h}", ref, y[b:b + 1, heads], TOL)
    with pytest.raises(ValueError, match=r"lengths has shape \(3, 1, 2\); pass a contiguous int32"):
        decode_attention(q.to(DEV), sk.to(DEV), sv.to(DEV), wk.to(DEV), wv.to(DEV), lengths[:, :1].to(DEV),
                         st.to(DEV), bt.to(DEV), 0.25)
