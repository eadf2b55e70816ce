"""Budgets and the positional schedule (docs/reference-conventions.md §1.4, the table)."""
import pytest

from kvmeans import StateBudget
from kvmeans.ops.schedule import bswa_begin, coverage_after, plan_updates, rows_after

SQRT16 = StateBudget.power_law(16, 0.5, min_len=256)
SAT = StateBudget.saturating(1024, min_len=1)


@pytest.mark.parametrize("T,fixed,sqrt,sat", [
    (512, 256, 256, 256), (1024, 256, 443, 438), (2048, 256, 677, 651), (4096, 256, 991, 808),
    (8192, 256, 1425, 906), (16384, 256, 2031, 962), (32768, 256, 2884, 992), (131072, 256, 5786, 1016)])
def test_state_sizes_match_the_reference_table(T, fixed, sqrt, sat):
    assert rows_after(StateBudget.fixed(256), T, 256, 2) == fixed
    assert rows_after(SQRT16, T, 256, 2) == sqrt
    assert rows_after(SAT, T, 256, 2) == sat


def test_sqrt_schedule_per_query_chunk_at_8192():
    steps = plan_updates(SQRT16, 256, 256, 8192, 256, 2)
    rows = [256] + [s.rows_after for s in steps]         # rows seen by query chunks 2, 3, ...
    assert rows[:8] == [256, 443, 512, 572, 627, 677, 724, 768] and rows[-2:] == [1402, 1425]


def test_budget_values():
    assert StateBudget.fixed(7)(10**6) == 7
    assert StateBudget.power_law(16, 0.5)(1024) == 512
    assert StateBudget.power_law(16, 0.5, min_len=600)(1024) == 600
    assert StateBudget.power_law(16, 0.5, round_down=100)(1024) == 500
    assert StateBudget.power_law(16, 0.5, max_len=300)(1024) == 300
    assert StateBudget.saturating(1024)(1024) == 512
    assert StateBudget.saturating(1024)(0) == 0


def test_state_never_shrinks_and_grows_at_most_one_chunk_per_update():
    wobbly = lambda t: 10_000 if (t // 64) % 2 else 3          # a non-monotone callable budget
    steps = plan_updates(wobbly, 64, 64, 5000, 64, 2)
    rows = [s.rows_before for s in steps] + [steps[-1].rows_after]
    assert all(b >= a for a, b in zip(rows, rows[1:]))
    assert all(0 <= s.n_append <= 64 for s in steps)
    assert all(s.rows_after <= s.start + 64 for s in steps)    # never more rows than covered tokens


def test_geometry():
    assert [bswa_begin(t, 4, 2) for t in (0, 1, 8, 9, 12, 13)] == [0, 0, 0, 4, 4, 8]
    assert [coverage_after(t, 4, 2) for t in (0, 3, 4, 8, 9, 13)] == [0, 3, 4, 4, 4, 8]


@pytest.mark.parametrize("make,match", [
    (lambda: StateBudget.fixed(0), "n must be >= 1"),
    (lambda: StateBudget.power_law(-1), "factor must be > 0"),
    (lambda: StateBudget.power_law(16, round_down=0), "round_down"),
    (lambda: StateBudget.saturating(1024, min_len=10, max_len=5), "max_len=5 is below min_len=10"),
])
def test_bad_budgets(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_callable_budget():
    with pytest.raises(ValueError, match="must return >= 0"):
        plan_updates(lambda t: -1, 4, 4, 40, 4, 2)
    with pytest.raises(TypeError, match="must return a finite int"):
        plan_updates(lambda t: "many", 4, 4, 40, 4, 2)


def test_int_budget_is_fixed_budget():
    import torch

    from kvmeans import kvm_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    for n in (4, 9):
        y_int, s_int = kvm_attention(q, k, v, chunk_len=4, budget=n, return_state=True)
        y_fix, s_fix = kvm_attention(q, k, v, chunk_len=4, budget=StateBudget.fixed(n), return_state=True)
        assert s_int.num_rows == s_fix.num_rows == n and torch.equal(y_int, y_fix)
    for budget in (3, StateBudget.fixed(3)):           # below the initial chunk: both refused alike
        with pytest.raises(ValueError, match=r"budget=3 \(fixed\) would shrink .* use budget=4"):
            kvm_attention(q, k, v, chunk_len=4, budget=budget)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: StateBudget.fixed(3.7), TypeError, "n must be an int, got 3.7"),
    (lambda: StateBudget.fixed(True), TypeError, "n must be an int, got True"),
    (lambda: StateBudget.power_law(float("inf")), ValueError, "factor must be a finite number"),
    (lambda: StateBudget.power_law(16, float("nan")), ValueError, "exponent must be a finite number"),
    (lambda: StateBudget.saturating(1024, min_len=0.5), TypeError, "min_len must be an int"),
    (lambda: StateBudget.saturating(1024, max_len=1e4), TypeError, "max_len must be an int"),
])
def test_budget_fields_are_typed(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_budgets_past_float_range():
    assert StateBudget.power_law(1, 80.0)(10**6) > 10**9          # overflows a float: "as many as can exist"
    # every covered token
    assert rows_after(StateBudget.power_law(1, 80.0), 64, 4, 2) == rows_after(lambda t: 10**400, 64, 4, 2) == 56
    with pytest.raises(TypeError, match="returned inf; a budget must return a finite int"):
        plan_updates(lambda t: float("inf"), 4, 4, 40, 4, 2)
