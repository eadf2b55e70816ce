"""In-place state upkeep: rows accumulated by index_add_ exactly as by scatter_add_, append keys only when used."""
import torch

from kvmeans.ops.routing import route_overflow
from kvmeans.ops.state import KVMState


def test_add_rows_matches_scatter_add_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    B, Hkv, N, D, Dv, cap = 2, 3, 40, 8, 6, 16
    state = KVMState.empty(B, Hkv, D, Dv, dtype=torch.float32, device="cpu", chunk_len=4, n_bswa_chunks=2,
                           sink_len=1, rope_dim=0, value_radius=True, row_capacity=cap)
    for t in state.rows():
        t.copy_(torch.randn(t.shape, generator=g))
    state.num_rows = cap
    dest = torch.randint(0, 10, (B, Hkv, N), generator=g)          # many tokens per row: the order of sums counts
    dk, dv, dr = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, Dv, generator=g), torch.rand(B, Hkv, N)
    want = [state.keys.scatter_add(2, dest.unsqueeze(-1).expand_as(dk), dk),
            state.values.scatter_add(2, dest.unsqueeze(-1).expand_as(dv), dv), state.radii.scatter_add(2, dest, dr)]
    state.add_rows_(dest, dk, dv, dr)
    for a, b in zip(want, (state.keys, state.values, state.radii)):
        assert torch.equal(a, b)


def test_route_overflow_without_appends_needs_no_append_keys():
    g = torch.Generator().manual_seed(1)
    rows = torch.nn.functional.layer_norm(torch.randn(1, 2, 6, 8, generator=g), (8,))
    sel = torch.randn(1, 2, 4, 8, generator=g)
    dest, appended = route_overflow(rows, sel, None, 0, 1)
    assert not appended.any() and (dest >= 1).all()                   # merged into non-sink rows only
    assert torch.equal(dest, (sel @ rows[..., 1:, :].transpose(-1, -2)).argmax(-1) + 1)


def test_first_max_is_max_with_its_tie_rule():
    """Wide rows take the two-pass path: same maxima and first indices as torch.max, ties, NaN and inf included."""
    from kvmeans.ops.routing import first_max
    g = torch.Generator().manual_seed(2)
    for x in (torch.randint(0, 3, (4, 7, 700), generator=g).float(), torch.randn(3, 5, 1000, generator=g),
              torch.randn(2, 3, 100, generator=g)):
        M = x.shape[-1]
        nan, inf = float("nan"), float("inf")
        x[0, 0, 511 % M], x[1, 2, 5], x[1, 2, 600 % M], x[-1, -1, -1] = nan, nan, nan, inf
        best, idx = first_max(x[..., 1:])                              # a column slice, as routing passes it
        want = x[..., 1:].max(-1)
        assert torch.equal(best.nan_to_num(), want.values.nan_to_num()) and torch.equal(idx, want.indices)
