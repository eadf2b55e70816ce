"""A one-time self-check of the Triton kernels before ``backend="auto"`` trusts them on a GPU.

The kernels are tested in Triton's CPU interpreter; a GPU compiles them for the first time in the user's
run. So ``auto`` first runs them once per (device, dtype, numerics) on a tiny input (prefill with gradients,
then a decode step) and compares with the torch path. On a compile error or a mismatch it warns once and
keeps the torch path; ``backend="triton"`` still forces the kernels.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from kvmeans.ops.budget import StateBudget

#: relative L2 error allowed against the torch path (TF32 / half dots); a broken kernel is off by O(1)
RATIO = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 5e-2}
TOKENS = ("q", "k", "v", "gate")
REPORT = ("please report it to the kvmeans maintainers with this message, `nvidia-smi`, `pip show torch triton` "
          "and the output of `python -m pytest -m gpu tests/test_triton.py`")

_verdicts: Dict[Tuple[torch.device, torch.dtype, str], Optional[str]] = {}   # None: passed; else the failure


def triton_verified(device, dtype: torch.dtype, numerics: str, op: Callable) -> bool:
    """Whether the kernels passed their self-check for ``(device, dtype, numerics)``; runs it on first ask (through
    ``op``, :func:`kvmeans.ops.kvm.kvm_attention`, passed by its caller), warns once on failure."""
    key = (torch.device(device), dtype, numerics)
    if key not in _verdicts:
        _verdicts[key] = failure = run_selfcheck(*key, op)
        if failure is not None:
            warnings.warn(f"kvmeans: the Triton kernels failed their self-check on {key[0]} ({dtype}, "
                          f"numerics={numerics!r}): {failure}. backend='auto' uses the torch path instead "
                          f"(backend='triton' forces the kernels); {REPORT}", RuntimeWarning, stacklevel=3)
    return _verdicts[key] is None


def run_selfcheck(device: torch.device, dtype: torch.dtype, numerics: str, op: Callable) -> Optional[str]:
    """None if the Triton path of ``op`` (:func:`kvmeans.ops.kvm.kvm_attention`) matches its torch path on a tiny
    input, else the failure in one line."""
    from kvmeans.utils.testing import make_inputs

    x = make_inputs(B=1, H=2, Hkv=1, T=21, D=16, Dv=16, dtype=torch.float32, seed=0)
    cfg = dict(chunk_len=4, n_bswa_chunks=2, budget=StateBudget.power_law(2, 0.5, min_len=4), numerics=numerics)
    ratio = RATIO.get(dtype, 1e-2)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            runs = {}
            for backend in ("triton", "chunked"):
                t = {k: v.to(device, dtype).requires_grad_() for k, v in x.items()}
                params = {k: t[k] for k in ("state_norm_weight", "state_norm_bias", "state_temp", "bswa_temp")}
                y, state = op(*(t[k][:, :, :-1] for k in ("q", "k", "v", "gate")), **cfg, **params,
                              return_state=True, backend=backend)
                runs[backend] = [y, *torch.autograd.grad(y.float().square().sum(), [t[k] for k in TOKENS])]
            with torch.no_grad():           # one decode step from the torch path's state
                for backend, decode in (("triton", "triton"), ("chunked", "recurrent")):
                    runs[backend].append(op(*(t[k][:, :, -1:] for k in TOKENS), **cfg, **params,
                                            initial_state=state.clone(), backend=decode))
    except Exception as err:            # compile errors, launch failures: anything means "do not trust it"
        first = str(err).strip().splitlines()
        return f"{type(err).__name__}: {first[0] if first else ''}"
    for name, got, want in zip(("output", "dq", "dk", "dv", "dgate", "decode step"), runs["triton"],
                               runs["chunked"]):
        err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
        if not bool(err <= ratio):
            return f"{name} differs from the torch path by a relative {float(err):.3g} (allowed {ratio:g})"
    return None
