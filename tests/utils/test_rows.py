"""kvmeans.utils.rows: batch rows held in groups (shared by KVMCache and ConvertedBatchState)."""
import torch

from kvmeans.utils.rows import by_count, put_real, split_selection, take_real


def test_by_count_splits_each_group_by_its_rows_count_of_tokens():
    groups = [torch.tensor([0, 2, 3]), torch.tensor([1, 4])]
    counts = torch.tensor([2, 0, 1, 2, 3])
    got = [(g, n, local.tolist(), rows.tolist()) for g, n, local, rows in by_count(groups, counts)]
    assert got == [(0, 1, [1], [2]), (0, 2, [0, 2], [0, 3]), (1, 0, [0], [1]), (1, 3, [1], [4])]


def test_take_real_and_put_real_move_only_real_tokens():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]])
    x = torch.arange(4 * 2 * 3 * 5).view(4, 2, 3, 5)               # [B, H, T, D]: tokens on axis 2
    rows = torch.tensor([0, 3])
    got = take_real(x, rows, mask, 2, 2)
    assert torch.equal(got, x[[0, 3]][:, :, 1:])
    out = torch.full_like(x, -1)
    put_real(out, rows, mask, got, 2)
    assert torch.equal(out[[0, 3]][:, :, 1:], x[[0, 3]][:, :, 1:])
    assert (out[[0, 3]][:, :, 0] == -1).all() and (out[[1, 2]] == -1).all()
    ids = torch.arange(12).view(4, 3)                                 # [B, T]: tokens on axis 1
    assert take_real(ids, torch.tensor([2]), mask, 1, 1).tolist() == [[8]]
    assert torch.equal(take_real(ids, rows, None, 3, 1), ids[[0, 3]])
    one = torch.arange(3)[None, :, None]                              # a batch of 1 is broadcast to the rows
    assert take_real(one, rows, mask, 2, 1).squeeze(-1).tolist() == [[1, 2], [1, 2]]


def test_split_selection_takes_each_new_row_from_its_group():
    groups = [torch.tensor([0, 2]), torch.tensor([1, 3])]
    got = [(g, js.tolist(), ls.tolist()) for g, js, ls in split_selection(groups, torch.tensor([3, 0, 0, 1]))]
    assert got == [(0, [1, 2], [0, 0]), (1, [0, 3], [1, 0])]
