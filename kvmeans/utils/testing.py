"""Helpers for holding the fast paths equal to the spec: inputs, tolerances, named comparisons."""
from __future__ import annotations

import torch
from torch import Tensor, nn

# relative RMS error allowed against the float64/float32 spec, per input dtype
TOLERANCES = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_close(name: str, ref: Tensor, out: Tensor, ratio: float, atol_floor: float = 1e-12) -> None:
    """Fail unless ``|ref - out|_2 <= ratio * |ref|_2 + atol_floor`` (fla-style), naming the tensor."""
    ref, out = ref.detach().double(), out.detach().to(ref.device).double()     # a CPU reference vs a GPU output
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}")
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: non-finite values")
    err = (ref - out).norm().item()
    bound = ratio * ref.norm().item() + atol_floor * (ref.numel() ** 0.5)
    if err > bound:
        max_abs = (ref - out).abs().max().item()
        raise AssertionError(f"{name}: rms error {err:.3e} > {bound:.3e} (max abs diff {max_abs:.3e})")


def make_inputs(B=2, H=4, Hkv=2, T=37, D=8, Dv=None, dtype=torch.float64, seed=0, requires_grad=False):
    """Random op inputs: ``dict(q, k, v, gate, state_norm_weight, state_norm_bias, state_temp, bswa_temp)``."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)
    t = dict(q=r(B, H, T, D), k=r(B, Hkv, T, D), v=r(B, Hkv, T, Dv), gate=u(B, Hkv, T) + 0.5,
             state_norm_weight=1 + 0.3 * r(D), state_norm_bias=0.3 * r(D), state_temp=u(H) + 0.5, bswa_temp=u(H) + 0.5)
    return {k: v.to(dtype).requires_grad_(requires_grad) for k, v in t.items()}


@torch.no_grad()
def perturb_identity_init(model: nn.Module, std: float = 0.2) -> nn.Module:
    """Make a freshly initialised GPTAlpha-2 model non-trivial for tests (in place; returns it).

    The paper's init zeroes every block's output projection and the value-residual LoRA, so each
    block is the identity: draw those (``std``) and the embedding (unit normal) at random instead.
    """
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or "v_gate1" in name:
            p.normal_(std=std)
        elif name.endswith("wte.weight"):
            p.normal_()
    return model

