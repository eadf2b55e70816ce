"""The operator benchmark runs end to end and writes what it says."""
import csv
import importlib.util

from kvmeans.bench.ops import main
from kvmeans.cli import main as cli

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
