"""KVMState: counters, memory, copies, serialisation, batch reordering."""
import copy
import io

import torch

from kvmeans import KVMState, StateBudget, kvm_attention
from kvmeans.utils.testing import assert_close, make_inputs

CFG = dict(chunk_len=4, n_bswa_chunks=2, sink_len=1, rope_dim=2, budget=StateBudget.power_law(2, 0.5))


def run(inputs, lo, hi, state=None):
    x = {k: (v[:, :, lo:hi] if k in ("q", "k", "v", "gate") else v) for k, v in inputs.items()}
    return kvm_attention(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("gate"), initial_state=state,
                         return_state=True, **x, **CFG)


def prefix_state(B=3):
    inputs = make_inputs(B=B, T=40)
    with torch.no_grad():
        _, s = run(inputs, 0, 30)
    return inputs, s


def test_counters_and_bytes():
    inputs, s = prefix_state()
    assert s.seen_tokens == 30 and s.coverage == 24 and s.window_len == 6 and s.num_rows == 10
    K, V, R = s.rows()
    assert K.shape == (3, 2, 10, 8) and V.shape == (3, 2, 10, 8) and R.shape == (3, 2, 10)
    used = (K.numel() + V.numel() + R.numel() + 6 * (2 * 8 + 1) * 3 * 2) * 8
    assert s.nbytes_used == used and s.nbytes >= used


def test_continuing_a_copy_leaves_the_original_alone():
    inputs, s = prefix_state()
    with torch.no_grad():
        y_a, _ = run(inputs, 30, 40, copy.deepcopy(s))
        y_b, _ = run(inputs, 30, 40, s.clone())
        y_c, s_after = run(inputs, 30, 40, s)
    assert torch.equal(y_a, y_b) and torch.equal(y_a, y_c)
    assert s_after is s and s.seen_tokens == 40                     # the passed state is advanced in place


def test_save_load_roundtrip():
    inputs, s = prefix_state()
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf)                                       # weights_only: KVMState is an allowed global
    with torch.no_grad():
        y1, _ = run(inputs, 30, 40, loaded)
        y2, _ = run(inputs, 30, 40, s)
    assert torch.equal(y1, y2)


def test_to_dtype_and_detach():
    inputs, s = prefix_state()
    s32 = s.to(torch.float32)
    assert s32.dtype == torch.float32 and s.dtype == torch.float64
    assert s.detach().keys.requires_grad is False


def test_index_select_and_reorder_match_running_alone():
    inputs, s = prefix_state()
    order = torch.tensor([2, 0, 2])
    with torch.no_grad():
        y_full, _ = run(inputs, 30, 40, s.clone())
        picked = {k: (v[order] if k in ("q", "k", "v", "gate") else v) for k, v in inputs.items()}
        y_sel, _ = run(picked, 30, 40, s.index_select(order))
        s.reorder_(order)
        y_re, _ = run(picked, 30, 40, s)
    assert_close("index_select", y_full[order], y_sel, 1e-12)
    assert torch.equal(y_sel, y_re)


def test_empty_and_repr():
    s = KVMState.empty(1, 2, 8, 8, dtype=torch.float32, device="cpu", chunk_len=4, n_bswa_chunks=2, sink_len=1,
                       rope_dim=0, value_radius=True)
    assert s.num_rows == 0 and s.nbytes == 0 and "KVMState" in repr(s)
