"""The torch path's reconstruction backward on CPU differentiates the flash kernel's saved forward (output and
log-sum-exp) instead of running the attention again, and reads whole chunks as the no-grad prefill does (state,
previous chunks, own chunk: three flash calls joined by their log-sum-exp), with the naive spec's gradients."""
import pytest
import torch

import kvmeans.ops.chunk as chunk_mod
from kvmeans import StateBudget, kvm_attention
from kvmeans.ops.chunk import flash as flash_mod
from kvmeans.utils.testing import assert_close, make_inputs


@pytest.mark.parametrize("budget", [StateBudget.fixed(4), StateBudget.power_law(2, 0.5, min_len=4)])
def test_reconstruction_backward_runs_no_second_forward(budget, monkeypatch):
    monkeypatch.setattr(chunk_mod, "BACKWARD", "reconstruct")
    monkeypatch.setattr(chunk_mod, "GROUP_BYTES", 1 << 14)          # several groups
    cfg = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=budget)
    x = make_inputs(T=37, requires_grad=True)
    args = [x.pop(k) for k in ("q", "k", "v", "gate")]
    leaves = args + list(x.values())
    dy = torch.randn(2, 4, 37, 8, dtype=torch.float64)
    ref = torch.autograd.grad((kvm_attention(*args, **x, **cfg, backend="naive") * dy).sum(), leaves)
    joins, join = [], flash_mod.join
    monkeypatch.setattr(flash_mod, "join", lambda *a, **k: joins.append(1) or join(*a, **k))
    y = kvm_attention(*args, **x, **cfg, backend="chunked")
    assert joins, "whole chunks with whole windows take the joined read (three flash calls, no window copy)"
    forwards, flash, sdpa = [], flash_mod._FLASH_CPU, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(flash_mod, "_FLASH_CPU", lambda *a, **k: forwards.append(1) or flash(*a, **k))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: forwards.append(1) or sdpa(*a, **k))
    grads = torch.autograd.grad((y * dy).sum(), leaves)
    assert forwards == [], "the backward ran the attention forward again"
    for name, a, b in zip(("q", "k", "v", "gate", *x), ref, grads):
        assert_close("d" + name, a, b, 1e-10)


def test_auto_reconstructs_sooner_where_the_read_is_joined(monkeypatch):
    """"auto" reconstructs past RECONSTRUCT_BYTES_JOINED where the CPU flash read applies (D == Dv), and keeps the
    graph up to RECONSTRUCT_BYTES where it does not (Dv != D)."""
    import kvmeans.ops.chunk.reconstruct as rec
    calls, real = [], rec._Reconstruct.apply
    monkeypatch.setattr(rec._Reconstruct, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(chunk_mod, "RECONSTRUCT_BYTES_JOINED", 0)
    for Dv, reconstructs in ((8, True), (6, False)):
        calls.clear()
        x = make_inputs(T=24, Dv=Dv, requires_grad=True)
        y = kvm_attention(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("gate"), **x, chunk_len=4, budget=4,
                          backend="chunked")
        y.sum().backward()
        assert bool(calls) == reconstructs
