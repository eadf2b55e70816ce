"""The operator benchmark runs end to end and writes what it says."""
import csv
import importlib.util

import pytest

from kvmeans import StateBudget
from kvmeans.bench.flops import useful_bytes, useful_flops
from kvmeans.cli import main as cli
from kvmeans.cli.bench_ops import main, parse_args

SMALL = ["--lengths", "256", "512", "--heads", "2", "--head-dim", "16", "--chunk-len", "64", "--repeats", "1",
         "--decode-steps", "4"]


def test_bench_ops_writes_csv_and_png(tmp_path, capsys):
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "ops.csv")))
    assert {(r["T"], r["mode"], r["arm"]) for r in rows} == {
        (t, m, a) for t in ("256", "512") for m in ("prefill", "backward", "decode")
        for a in ("sdpa", "kvm-fixed256", "kvm-sqrt16")}
    assert all(float(r["time_ms"]) > 0 for r in rows)
    kvm = [r for r in rows if r["arm"] != "sdpa"]
    assert all(float(r["speedup_vs_sdpa"]) > 0 and int(r["rows"]) > 0 for r in kvm)
    bwd = {(r["T"], r["arm"]): int(r["saved_bytes"]) for r in rows if r["mode"] == "backward"}
    T, H, D = 512, 2, 16       # SDPA keeps at least q, k, v and its output
    assert bwd["512", "sdpa"] >= 4 * T * H * D * 4 and all(v > 0 for v in bwd.values())
    assert all(r["saved_bytes"] == "" for r in rows if r["mode"] != "backward")
    assert all(r["numerics"] == "exact" for r in rows)
    assert (tmp_path / "env.json").exists()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "ops.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "speedup" in out and "kept by autograd for backward" in out
    assert "matmul rate (float32" in out and "of bound sdpa/fixed/sqrt" in out
    rate = {float(r["matmul_gflops"]) for r in rows}
    assert len(rate) == 1 and rate.pop() > 0        # one rate per run, the same in every row
    for r in rows:                                   # useful FLOPs / time against that rate
        gflops = float(r["useful_gflop"]) / (float(r["time_ms"]) / 1e3)
        assert float(r["gflops"]) == pytest.approx(gflops)
        assert float(r["bound_fraction"]) == pytest.approx(gflops / float(r["matmul_gflops"]))
    for r in rows:                                   # decode: bytes read per token / time against a plain read
        if r["mode"] != "decode":
            assert r["read_fraction"] == ""
            continue
        gbps = float(r["useful_read_mb"]) * 2 ** 20 / (float(r["time_ms"]) / 1e3) / 1e9
        assert float(r["read_gbps"]) == pytest.approx(gbps) and float(r["read_rate_gbps"]) > 0
        assert float(r["read_fraction"]) == pytest.approx(gbps / float(r["read_rate_gbps"]))


def test_kvm_backward_modes(tmp_path):
    """--kvm-backward picks the chunked path's backward: reconstruction keeps less for backward than the graph."""
    kept = {}
    for mode in ("graph", "reconstruct"):
        assert main(SMALL + ["--modes", "backward", "--kvm-backward", mode, "--out", str(tmp_path / mode)]) == 0
        rows = list(csv.DictReader(open(tmp_path / mode / "ops.csv")))
        assert {r["kvm_backward"] for r in rows} == {mode}
        kept[mode] = {(r["T"], r["arm"]): int(r["saved_bytes"]) for r in rows}
    for key in (("512", "kvm-fixed256"), ("512", "kvm-sqrt16")):
        assert kept["reconstruct"][key] < kept["graph"][key]
    assert kept["reconstruct"]["512", "sdpa"] == kept["graph"]["512", "sdpa"]


def test_useful_flops_by_hand():
    """T=10, C=2, n=2, one head of width 1 (4 FLOPs per key seen, 2 per routing score). Keys seen per chunk of two
    queries: window 1+2, 3+4, then 3+4 plus 2 state rows each; blocks [2,4) and [4,6) route 2 tokens against 2 rows."""
    kw = dict(batch=1, heads=1, kv_heads=1, head_dim=1, chunk_len=2, n_bswa_chunks=2, decode_steps=1)
    fixed = StateBudget.fixed(2)
    assert useful_flops("kvm", "prefill", 10, budget=fixed, **kw) == 4 * (3 + 7 + 11 + 11 + 11) + 2 * (4 + 4)
    assert useful_flops("kvm", "backward", 10, budget=fixed, **kw) == 2 * 4 * 43
    assert useful_flops("sdpa", "prefill", 10, **kw) == 4 * sum(range(1, 11))
    # a budget of 3 rows: block [2,4) appends one row and merges the other token (scored against 2 + 1 rows)
    assert useful_flops("kvm", "prefill", 10, budget=lambda n: 3, **kw) == 4 * (3 + 7 + 11 + 13 + 13) + 2 * (6 + 6)
    # decode, per token over positions 10 and 11: window 3 and 4 keys plus 2 rows; block [6,8) is routed at 10
    kw["decode_steps"] = 2
    assert useful_flops("kvm", "decode", 10, budget=fixed, **kw) == (4 * (5 + 6) + 2 * 4) / 2
    assert useful_flops("sdpa", "decode", 10, **kw) == 4 * (11 + 12) / 2


def test_useful_bytes_by_hand():
    """Decode after T=10 (C=2, n=2, fixed 2 rows), positions 10 and 11: 3 and 4 window keys plus 2 rows each, read
    once per kv head: 2 (k, v) * B * Hkv * D * elem bytes per key."""
    kw = dict(batch=1, kv_heads=2, head_dim=3, chunk_len=2, n_bswa_chunks=2, decode_steps=2, elem=4)
    assert useful_bytes("kvm", 10, budget=StateBudget.fixed(2), **kw) == 2 * 2 * 3 * 4 * (5 + 6) / 2
    assert useful_bytes("sdpa", 10, **kw) == 2 * 2 * 3 * 4 * (11 + 12) / 2


def test_decode_steps_default_to_one_chunk():
    """The mean per decode token carries one chunk-boundary update per chunk_len tokens, as a long generation."""
    assert parse_args(["--chunk-len", "64"]).decode_steps == 64
    assert parse_args(["--quick"]).decode_steps == 16


def test_cli_routes_to_bench(tmp_path):
    assert cli(["bench", "ops"] + SMALL[:2] + ["--modes", "prefill"] + SMALL[3:] + ["--out", str(tmp_path)]) == 0
    assert (tmp_path / "ops.csv").exists()
    assert cli(["nope"]) == 2


def test_cli_lists_and_routes_every_command(capsys):
    assert cli(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("demo", "bench", "generate", "convert", "train", "data"):
        assert f"  {name}" in listed
    assert cli(["data", "--help"]) == 0 and cli(["data", "nope"]) == 2


def test_threads_are_measured_in_turn(tmp_path, capsys):
    """--threads 1 2: every (T, mode, arm) at each count, the thread count restored after, and thread_speedup the
    arm's time at the first count over its time at this one."""
    import torch
    before = torch.get_num_threads()
    assert main(SMALL[:2] + SMALL[3:] + ["--modes", "prefill", "--threads", "1", "2",
                                        "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == before
    rows = list(csv.DictReader(open(tmp_path / "ops.csv")))
    assert sorted((r["arm"], r["threads"]) for r in rows) == sorted(
        (a, t) for a in ("sdpa", "kvm-fixed256", "kvm-sqrt16") for t in ("1", "2"))
    time = {(r["arm"], r["threads"]): float(r["time_ms"]) for r in rows}
    for r in rows:
        assert float(r["thread_speedup"]) == pytest.approx(time[r["arm"], "1"] / time[r["arm"], r["threads"]])
    assert "vs 1 thread(s) sdpa/fixed/sqrt" in capsys.readouterr().out
