"""End-to-end check of the demo (``python -m kvmeans.demo --quick``): files, table, memory story."""
import json

from kvmeans import demo


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    assert (out / "results.json").is_file()
    assert (out / "demo.png").is_file() and (out / "demo.png").stat().st_size > 0
    assert "recall@" in printed and "decode ms/tok" in printed and "total wall time" in printed
    for label in demo.LABELS.values():
        assert label in printed

    res = json.loads((out / "results.json").read_text())
    lengths = res["lengths"]
    assert lengths == [res["settings"]["train_len"] * m for m in (1, 2, 4, 8)]
    assert set(res["models"]) == set(demo.MODELS)
    for r in res["models"].values():
        assert [e["length"] for e in r["evals"]] == lengths
        assert all(0.0 <= e["recall"] <= 1.0 and e["decode_ms_per_token"] > 0 for e in r["evals"])

    fixed = [e["cache_bytes"] for e in res["models"]["kvm-fixed"]["evals"]]
    assert len(set(fixed)) == 1, f"fixed-budget KVM memory must be flat, got {fixed}"
    fixed_rows = [e["state_rows"] for e in res["models"]["kvm-fixed"]["evals"]]
    assert all(rows == fixed_rows[0] for rows in fixed_rows)

    sqrt_rows = [e["state_rows"][0] for e in res["models"]["kvm-sqrt"]["evals"]]
    assert sqrt_rows == sorted(sqrt_rows) and sqrt_rows[-1] > sqrt_rows[0]

    full = [e["cache_bytes"] for e in res["models"]["full"]["evals"]]
    assert all(a < b for a, b in zip(full, full[1:])), f"full attention's cache must grow, got {full}"
    assert full[-1] > 4 * full[0]
