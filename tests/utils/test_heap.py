"""kvmeans.utils.heap: glibc's mmap threshold fixed once per process, where a segmented CPU prefill runs;
the user's own settings win; a bad value names the variable."""
import subprocess
import sys
import textwrap

import pytest
import torch

from kvmeans.utils import heap

GLIBC = heap._libc() is not None

# Is a 4 MiB block allocated after a 4 MiB block was freed mmapped? glibc marks a chunk it mmapped with bit 0x2
# of the size word just before the pointer. By default the free raises the threshold, so the second block comes
# from the heap; with the threshold fixed it is mmapped again (and the OS gets it back on free).
# The probe loads heap.py alone by its path (it imports the standard library only): a fresh interpreter that does not
# import torch starts in a fraction of the time, and mallopt sets the process's threshold whatever it has imported.
PROBE = textwrap.dedent("""
    import ctypes, importlib.util, sys
    spec = importlib.util.spec_from_file_location("kvmeans_heap", sys.argv[2])
    heap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heap)
    if sys.argv[1] == "bound":
        print(heap.bound_heap())
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(4 << 20))
    q = libc.malloc(4 << 20)
    print("mmapped" if ctypes.c_size_t.from_address(q - 8).value & 2 else "heap")
""")


def probe(mode, **env):
    import os
    run_env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", heap.ENV)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, heap.__file__], capture_output=True, text=True, check=True,
                         env={**run_env, **env})
    return out.stdout.splitlines()


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_bound_heap_mmaps_large_blocks_after_a_free():
    assert probe("default") == ["heap"]
    assert probe("bound") == ["mmap_threshold=1048576", "mmapped"]
    assert probe("bound", KVMEANS_MMAP_THRESHOLD="0") == [f"off ({heap.ENV}=0)", "heap"]
    assert probe("bound", MALLOC_MMAP_THRESHOLD_="131072") == ["user's MALLOC_MMAP_THRESHOLD_=131072", "mmapped"]


class FakeLibc:
    def __init__(self, answer=1):
        self.calls, self.answer = [], answer

    def mallopt(self, param, value):
        self.calls.append((param.value, value.value))
        return self.answer


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.delenv(heap.ENV, raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    lib = FakeLibc()
    monkeypatch.setattr(heap, "_libc", lambda: lib)
    return lib


def test_applied_once_with_the_env_value(fresh, monkeypatch):
    monkeypatch.setenv(heap.ENV, "4194304")
    assert heap.heap_setting() is None
    assert heap.bound_heap() == "mmap_threshold=4194304"
    assert heap.bound_heap() == "mmap_threshold=4194304" == heap.heap_setting()
    assert fresh.calls == [(heap.M_MMAP_THRESHOLD, 4194304), (heap.M_TRIM_THRESHOLD, 8388608)]


def test_off_user_setting_refusal_and_other_libcs(fresh, monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.bound_heap().startswith("off") and not fresh.calls
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.delenv(heap.ENV)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.bound_heap() == "user's MALLOC_MMAP_THRESHOLD_=65536" and not fresh.calls
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    fresh.answer = 0
    assert heap.bound_heap() == "mallopt refused 1048576" and fresh.calls == [(heap.M_MMAP_THRESHOLD, 1 << 20)]
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.bound_heap() == "not glibc"


@pytest.mark.parametrize("bad", ["-5", "1MB"])
def test_bad_value_names_the_variable(fresh, monkeypatch, bad):
    monkeypatch.setenv(heap.ENV, bad)
    with pytest.raises(ValueError, match=rf"KVMEANS_MMAP_THRESHOLD={bad!r}: expected a number of bytes"):
        heap.bound_heap()


@torch.no_grad()
def test_segmented_cpu_prefill_sets_it_and_a_short_call_does_not(fresh):
    pytest.importorskip("transformers")
    from kvmeans.pretrained.convert import convert_hf
    from tests.pretrained.test_convert import SMALL, ids, tiny
    model = convert_hf(tiny("llama"), **SMALL, prefill_segment=24)
    model(ids(20))                                   # one call: no segments
    assert heap.heap_setting() is None and not fresh.calls
    model(ids(60))
    assert heap.heap_setting() == "mmap_threshold=1048576"
    assert fresh.calls == [(heap.M_MMAP_THRESHOLD, 1 << 20), (heap.M_TRIM_THRESHOLD, 2 << 20)]
