"""kvm_attention hardening: the Triton self-check of backend="auto", cost that follows the input, masked
tokens that contribute exactly zero (issue 13)."""
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvmeans import kvm_attention                          # noqa: E402
from kvmeans.ops import kvm as kvm_mod                     # noqa: E402
from kvmeans.ops.triton import available                    # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not available(DEV), reason="Triton kernels cannot run here")
CUDA = torch.device("cuda", 0)


# ---- backend="auto" on CUDA: a one-time self-check of the Triton kernels -------------------------------------
@pytest.fixture
def selfcheck(monkeypatch):
    """The self-check module with an empty cache, run on this machine's device (the interpreter on CPU) when
    ``_kernels`` asks about a CUDA device; ``calls`` counts the runs."""
    import kvmeans.ops.triton as tri
    from kvmeans.ops.triton import selfcheck as sc
    monkeypatch.setattr(sc, "_verdicts", {})
    monkeypatch.setattr(tri, "unavailable_reason", lambda device, dtype=None: None)
    real, calls = sc.run_selfcheck, []
    monkeypatch.setattr(sc, "run_selfcheck", lambda device, dtype, numerics: calls.append((device, dtype, numerics))
                        or real(DEV, dtype, numerics))
    sc.calls = calls
    return sc


def _auto(dtype=torch.float32, numerics="exact"):
    return kvm_mod._kernels("auto", CUDA, dtype, torch.float32, numerics)[0]


@needs_triton
def test_selfcheck_passes_selects_triton_once_per_key(selfcheck):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _auto() == "triton" and _auto() == "triton"
    assert selfcheck.calls == [(CUDA, torch.float32, "exact")]          # cached per key
    assert _auto(numerics="mixed") == "triton"
    assert len(selfcheck.calls) == 2                                      # another key: checked again


@needs_triton
def test_selfcheck_compile_error_falls_back_and_warns_once(selfcheck, monkeypatch):
    from kvmeans.ops.triton import attention

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly aborted due to errors\nline 2 of the log")
    monkeypatch.setattr(attention, "chunk_attention_fwd", broken)
    with pytest.warns(RuntimeWarning, match=r"failed their self-check on cuda:0 \(torch.float32, numerics='exact'\): "
                                            r"RuntimeError: PTX assembly aborted due to errors\. .*torch path.*report"):
        assert _auto() == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                   # no second warning, no second run
        assert _auto() == "torch"
    assert len(selfcheck.calls) == 1
    assert kvm_mod._kernels("triton", DEV, torch.float32, torch.float32, "exact")[0] == "triton"   # still forced


@needs_triton
def test_selfcheck_wrong_result_falls_back(selfcheck, monkeypatch):
    from kvmeans.ops.triton import decode
    real = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda *a, **k: real(*a, **k) * 1.5)
    with pytest.warns(RuntimeWarning, match="decode step differs from the torch path by a relative 0.5"):
        assert _auto() == "torch"
    assert len(selfcheck.calls) == 1
