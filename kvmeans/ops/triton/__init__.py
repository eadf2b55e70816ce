"""Triton kernels for KVM (GPU fast path; tested on CPU with ``TRITON_INTERPRET=1``).

Importing this package does not import Triton: the kernels live in :mod:`.attention` and
:mod:`.decode`, imported on first use, so ``kvmeans.ops.backends`` can ask :func:`unavailable_reason` cheaply.
See ``kvmeans/ops/triton/README.md`` for the kernels, their grids and how they are tested.
Row counts per (sequence, kv head) (a ``StateBudget.novelty`` budget, ``backend="triton"`` only) are verified in
the interpreter only: no GPU run yet, and ``backend="auto"`` keeps such budgets on the torch paths.
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

#: dtypes the kernels take (float64 stays on the torch path: Triton's fp64 dot is not portable)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device, dtype: torch.dtype = torch.float32):
    """None if the Triton kernels can run on tensors of ``device`` / ``dtype`` (Triton installed, CUDA or
    the interpreter, a kernel dtype); else why not, in words."""
    if not triton_installed():
        return "triton is not installed (pip install triton)"
    if dtype not in KERNEL_DTYPES:
        return f"the kernels compute in {', '.join(str(d) for d in KERNEL_DTYPES)}, not {dtype}"
    if torch.device(device).type != "cuda" and not interpreting():
        return (f"tensors are on {torch.device(device).type}; the kernels need CUDA (or TRITON_INTERPRET=1, "
                f"set before triton is imported, to run them slowly on CPU)")
    return None


def available(device, dtype: torch.dtype = torch.float32) -> bool:
    """The Triton kernels can run on tensors of ``device`` / ``dtype``."""
    return unavailable_reason(device, dtype) is None
