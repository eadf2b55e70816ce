"""Flat peak memory for long prefills on CPU: glibc's mmap threshold.

A segmented prefill allocates and frees the same few block sizes (a segment's activations: 0.5-6 MB) for every
segment. glibc serves blocks of 128 KiB and more with ``mmap`` at first, but raises that threshold each time such a
block is freed (up to 32 MiB), after which they come from the heap, and the heap fragments: on a converted
SmolLM2 the peak above the model grew 1.3-1.65x from 2K to 131K tokens while the live tensors stayed the same
size (docs/pretrained.md). A fixed threshold of 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, which also turns off the
adjustment; the trim threshold goes back to twice it) sends the large blocks back to the OS on free: the peak then
measured within 1.15x of its 2K value up to 131K tokens (benchmarks/results/longctx-heap-cpu) at a prefill cost
within the machine's noise. It is a process-wide setting, applied once, and only where it matters: the first time
a converted or native KVM model prefills in segments on the CPU.

``KVMEANS_MMAP_THRESHOLD``: bytes (``0``: leave malloc alone). glibc's own ``MALLOC_MMAP_THRESHOLD_``, when set,
wins: kvmeans then changes nothing. Other C libraries (musl, macOS) are left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

__all__ = ["DEFAULT_THRESHOLD", "ENV", "bound_heap", "heap_setting"]

DEFAULT_THRESHOLD = 1 << 20
ENV = "KVMEANS_MMAP_THRESHOLD"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's malloc.h
_applied: Optional[str] = None  # what this process did, once decided (see heap_setting)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "gnu_get_libc_version") else None


def _threshold() -> int:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV}={raw!r}: expected a number of bytes (e.g. 1048576), or 0 to leave malloc alone")
    return value


def bound_heap() -> str:
    """Set glibc's mmap threshold for this process (once; later calls return the first answer). Returns what
    was done: ``"mmap_threshold=N"``, or why nothing was: ``"off (KVMEANS_MMAP_THRESHOLD=0)"``, ``"user's
    MALLOC_MMAP_THRESHOLD_=N"``, ``"not glibc"``, ``"mallopt refused N"``."""
    global _applied
    if _applied is not None:
        return _applied
    threshold = _threshold()
    if threshold == 0:
        _applied = f"off ({ENV}=0)"
    elif os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        _applied = f"user's MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    else:
        lib = _libc()
        if lib is None:
            _applied = "not glibc"
        elif lib.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
            _applied = f"mallopt refused {threshold}"
        else:
            # the dynamic threshold also raised the trim threshold (to twice its own, up to 64 MiB), which keeps
            # that much free memory at the heap's top resident: back to glibc's rule at the fixed threshold, and
            # what loading and warm-up left free returned now
            lib.mallopt(ctypes.c_int(M_TRIM_THRESHOLD), ctypes.c_int(2 * threshold))
            if hasattr(lib, "malloc_trim"):
                lib.malloc_trim(ctypes.c_size_t(0))
            _applied = f"mmap_threshold={threshold}"
    return _applied


def heap_setting() -> Optional[str]:
    """What :func:`bound_heap` did in this process (None: not called yet)."""
    return _applied
