"""Head-parallel no-grad prefill on CPU: the (sequence, kv head) lanes of a KVM call are independent (routing,
state and attention never mix them), so a long prefill splits them into one part per torch thread and runs
each part on its own worker thread with one intra-op thread.

Why: the chunked path's state upkeep is many small ``[B, Hkv, C, D]`` ops that torch's intra-op threads barely
split (measured: 1.45x from a second core where SDPA gains 1.8x). One part per thread keeps every core busy for
the whole call. Each part is exactly the serial path on a slice of the heads, and the merged state equals the
serial one (tested against it and against ``ops/naive.py``).

The workers set their own intra-op thread count to one (OpenMP's thread count is per thread); the process-wide
setting is restored right after, so the caller's ``torch.get_num_threads()`` is unchanged.
"""
from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

import torch

from kvmeans.ops.state import KVMState, _alloc

__all__ = ["MIN_LANE_WORK", "lane_split", "run_lanes"]

# tokens x query heads x head dim of a call below which the split costs more than it gives (thread hand-off and
# the per-part buffer copies: ~0.1 ms; a 256-token call of 8 heads of 64 channels takes ~2 ms on one core)
MIN_LANE_WORK = 1 << 17

_local = threading.local()
_pool: Optional[Tuple[int, int, ThreadPoolExecutor]] = None      # (pid, threads, pool)
_pool_lock = threading.Lock()


def lane_split(q, kk, state: KVMState, attn: str) -> Optional[Tuple[int, List[slice]]]:
    """``(dim, slices)``: how to split this call's lanes over the threads (``dim`` 1 = kv heads, 0 = sequences),
    or None to run it whole (GPU, Triton, one thread, a worker already, a small call, one lane, a ragged or
    data-dependent state)."""
    if q.device.type != "cpu" or attn != "torch" or getattr(_local, "worker", False):
        return None
    if state.schedule is not None or state.row_count is not None:
        return None
    B, H, T, D = q.shape
    if T * H * D * B < MIN_LANE_WORK:
        return None
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    Hkv = kk.shape[1]
    dim, size = (1, Hkv) if Hkv >= threads or Hkv >= B else (0, B)     # kv heads unless sequences split better
    parts = min(threads, size)
    if parts < 2:
        return None
    bounds = [size * i // parts for i in range(parts + 1)]
    return dim, [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def run_lanes(prefill, split, q, kk, vv, gg, state: KVMState, *, state_temp, bswa_temp, group_bytes, **kwargs):
    """Run ``prefill`` (:func:`kvmeans.ops.chunk.prefill.prefill_no_grad`) on each part of ``split`` in
    parallel, then join the outputs and advance ``state`` in place to the joined part states. Same contract as
    ``prefill``: returns ``(y [B, H, T, Dv], state)``."""
    dim, slices = split
    G = q.shape[1] // kk.shape[1]
    pool = _workers(torch.get_num_threads())

    def part(sl: slice):
        qsl = sl if dim == 0 else slice(sl.start * G, sl.stop * G)     # query heads of kv heads sl
        temps = [t if dim == 0 or t is None else t[qsl] for t in (state_temp, bswa_temp)]
        index = (sl,) if dim == 0 else (slice(None), sl)
        return prefill(q[(slice(None),) * dim + (qsl,)], kk[index], vv[index], gg[index], _slice_state(state, index),
                       state_temp=temps[0], bswa_temp=temps[1], group_bytes=max(1, group_bytes // len(slices)),
                       **kwargs)

    outs = [f.result() for f in [pool.submit(_as_worker, part, sl) for sl in slices]]
    y = torch.cat([o[0] for o in outs], dim)
    _join_states(state, [o[1] for o in outs], dim)
    return y, state


def _as_worker(fn, *args):
    _local.worker = True        # a call made inside a part runs whole
    return fn(*args)


def _workers(threads: int) -> ThreadPoolExecutor:
    """The pool of ``threads`` workers, each with one intra-op thread (made once per thread count and process: a
    forked child has none of its parent's threads). A worker may run on any core the process may use: a thread
    inherits its creator's CPU affinity, and an engine that pins each OpenMP thread to one core (vLLM on CPU)
    would otherwise put every worker on the caller's core."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool[:2] == (os.getpid(), threads):
            return _pool[2]
        if _pool is not None and _pool[0] == os.getpid():
            _pool[2].shutdown(wait=True)
        ready = threading.Barrier(threads + 1)

        def init():
            _free_affinity()
            torch.get_num_threads()     # the thread's lazy init (it would reset the count on first use)
            torch.set_num_threads(1)
            ready.wait()

        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvm-lanes")
        for _ in range(threads):
            pool.submit(init)
        ready.wait()
        torch.set_num_threads(threads)  # the workers' setting also changed the process-wide default: restore it
        _pool = (os.getpid(), threads, pool)
        return pool


def _free_affinity() -> None:
    """Let the calling thread run on every core of the process's cpuset (Linux; elsewhere nothing)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))     # the kernel keeps the cpuset's part of it
    except OSError:
        pass


def _slice_state(state: KVMState, index) -> KVMState:
    """A state holding the lanes ``index`` of ``state`` (views: the part copies them into buffers of its own
    before writing)."""
    part = copy.copy(state)
    for name in KVMState._TENSORS:
        setattr(part, name, getattr(state, name)[index])
    part.extras = {}
    part._reset_caches()
    return part


def _join_states(state: KVMState, parts: List[KVMState], dim: int) -> None:
    """Advance ``state`` in place to the lanes of ``parts`` joined along ``dim`` (owned buffers, as the serial
    path leaves them)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.num_rows, p.seen_tokens, p.coverage) != (first.num_rows, first.seen_tokens, first.coverage):
            raise RuntimeError("kvm lanes: the parts of one call disagree on the state's position "
                               f"({[(p.num_rows, p.seen_tokens, p.coverage) for p in parts]})")
    state.num_rows, state.seen_tokens, state.coverage = first.num_rows, first.seen_tokens, first.coverage
    joined = [torch.cat(ts, dim) for ts in zip(*(p.rows() + p.window() for p in parts))]
    state._owned = False
    _alloc(state, max(p.row_capacity for p in parts), max(p.window_capacity for p in parts), *joined)
