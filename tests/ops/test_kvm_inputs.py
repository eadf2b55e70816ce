"""kvm_attention hardening: the Triton self-check of backend="auto", cost that follows the input, masked
tokens that contribute exactly zero (issue 13)."""
import os
import time
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvmeans import kvm_attention  # noqa: E402
from kvmeans.ops import backends  # noqa: E402
from kvmeans.ops.triton import available  # noqa: E402
from kvmeans.utils.testing import TOLERANCES, assert_close, make_inputs  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not available(DEV), reason="Triton kernels cannot run here")
CUDA = torch.device("cuda", 0)


# ---- backend="auto" on CUDA: a one-time self-check of the Triton kernels -------------------------------------
@pytest.fixture
def selfcheck(monkeypatch):
    """The self-check module with an empty cache, run on this machine's device (the interpreter on CPU) when
    ``backends.kernels`` asks about a CUDA device; ``calls`` counts the runs."""
    import kvmeans.ops.triton as tri
    from kvmeans.ops.triton import selfcheck as sc
    monkeypatch.setattr(sc, "_verdicts", {})
    monkeypatch.setattr(tri, "unavailable_reason", lambda device, dtype=None: None)
    real, calls = sc.run_selfcheck, []
    monkeypatch.setattr(sc, "run_selfcheck", lambda device, dtype, numerics, op: calls.append((device, dtype, numerics))
                        or real(DEV, dtype, numerics, op))
    sc.calls = calls
    return sc


def _auto(dtype=torch.float32, numerics="exact"):
    return backends.kernels("auto", CUDA, dtype, torch.float32, numerics, kvm_attention)[0]


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
    # still forced
    assert backends.kernels("triton", DEV, torch.float32, torch.float32, "exact", kvm_attention)[0] == "triton"


@needs_triton
def test_selfcheck_wrong_result_falls_back(selfcheck, monkeypatch):
    from kvmeans.ops.triton import decode
    real = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda *a, **k: real(*a, **k) * 1.5)
    with pytest.warns(RuntimeWarning, match="decode step differs from the torch path by a relative 0.5"):
        assert _auto() == "torch"
    assert len(selfcheck.calls) == 1


# ---- cost follows the input, not the settings ---------------------------------------------------------------
class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) any op produces while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


def _small_inputs(T=20, requires_grad=False):
    x = make_inputs(B=1, H=2, Hkv=1, T=T, D=8, dtype=torch.float32, requires_grad=requires_grad)
    return [x.pop(k) for k in ("q", "k", "v", "gate")], x


@pytest.mark.parametrize("settings", [dict(chunk_len=16000, budget=16000), dict(chunk_len=100_000, budget=100_000),
                                      dict(chunk_len=4, budget=4, n_bswa_chunks=10**5)], ids=["C16k", "C100k", "n1e5"])
@pytest.mark.parametrize("mode", ["prefill", "graph", "reconstruct", "continue"])
def test_buffers_follow_the_tokens_not_the_settings(settings, mode, monkeypatch):
    """20 tokens with a huge chunk_len or window: no tensor beyond a few KB, the state's buffers hold the tokens
    present, well under a second, and the same result as naive."""
    import kvmeans.ops.chunk as chunk_mod
    monkeypatch.setattr(chunk_mod, "BACKWARD", mode if mode in ("graph", "reconstruct") else "auto")
    tokens, params = _small_inputs(requires_grad=mode in ("graph", "reconstruct"))
    ref = kvm_attention(*tokens, **settings, **params, backend="naive")

    def run():
        if mode == "continue":      # a prefill of 7 tokens, then the recurrent path
            _, state = kvm_attention(*(t[:, :, :7] for t in tokens), **settings, **params, return_state=True)
            y, state = kvm_attention(*(t[:, :, 7:] for t in tokens), **settings, **params, initial_state=state,
                                     return_state=True, backend="recurrent")
            return torch.cat([ref[:, :, :7], y], 2), state
        y, state = kvm_attention(*tokens, **settings, **params, return_state=True, backend="chunked")
        if y.requires_grad:
            y.sum().backward()
        return y, state
    with _LargestAllocation() as largest:
        y, state = run()
    start = time.perf_counter()
    run()
    assert time.perf_counter() - start < 5
    assert largest.bytes < 64 << 10, f"largest allocation {largest.bytes} bytes for 20 tokens"
    assert state.window_capacity <= 40 and state.row_capacity <= 40
    assert_close("y", ref, y, TOLERANCES[torch.float32])


# ---- a non-finite token never reaches earlier outputs --------------------------------------------------------
PATHS = [("naive", {}), ("chunked", {}), ("chunked", dict(grad="graph")), ("chunked", dict(grad="reconstruct")),
         ("recurrent", {}),
         pytest.param("triton", {}, marks=needs_triton),
         pytest.param("triton", dict(grad="reconstruct"), marks=needs_triton),
         pytest.param("triton", dict(split=9), marks=needs_triton)]


@pytest.mark.parametrize("where", ["k", "v", "gate"])
@pytest.mark.parametrize("backend,how", PATHS,
                         ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
def test_nan_token_does_not_reach_earlier_outputs(backend, how, where, monkeypatch):
    """A NaN at position 13 (C=4, n=2: it is in the window of queries 13-15, then in the state): outputs before it
    equal those of clean inputs, outputs that see it are NaN. ``split``: a prefill, then multi-token steps."""
    import kvmeans.ops.chunk as chunk_mod
    x = make_inputs(B=2, H=2, Hkv=1, T=26, D=16, dtype=torch.float32)
    x = {k: v.to(DEV).requires_grad_("grad" in how) for k, v in x.items()}
    tokens = [x.pop(k) for k in ("q", "k", "v", "gate")]
    bad = [t.detach().clone().requires_grad_(t.requires_grad) for t in tokens]
    with torch.no_grad():
        bad[("q", "k", "v", "gate").index(where)][1, 0, 13] = float("nan")
    cfg = dict(chunk_len=4, n_bswa_chunks=2, budget=4, **x)
    if "grad" in how:
        monkeypatch.setattr(chunk_mod, "BACKWARD", how["grad"])

    def run(q, k, v, g):
        if backend == "recurrent" or "split" in how:
            s = how.get("split", 9)
            _, state = kvm_attention(q[:, :, :s], k[:, :, :s], v[:, :, :s], g[:, :, :s], **cfg, return_state=True,
                                     backend="chunked" if backend == "recurrent" else backend)
            ys = [kvm_attention(*(t[:, :, a:a + 3] for t in (q, k, v, g)), **cfg, initial_state=state, backend=backend)
                  for a in range(s, 26, 3)]
            return torch.cat([kvm_attention(q, k, v, g, **cfg, backend="naive")[:, :, :s]] + ys, 2)
        return kvm_attention(q, k, v, g, **cfg, backend=backend)
    clean, y = run(*tokens), run(*bad)
    first_bad = 13 if where in ("k", "v") else 16       # a gate acts once its token is merged (at position 16)
    assert torch.isfinite(y[:, :, :first_bad]).all()
    assert_close("outputs before the NaN token", clean[:, :, :first_bad], y[:, :, :first_bad],
                 TOLERANCES[torch.float32])
    assert torch.isfinite(y[0]).all()                   # the other sequence of the batch
    if where != "gate":
        assert torch.isnan(y[1, :, first_bad:]).any(-1).all()
