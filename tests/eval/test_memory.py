"""`kvmeans eval memory`: state rows equal the budget schedule, cache bytes equal KVMCache.nbytes,
the full-attention reference formula, schedule-only curves up to 1M tokens, JSON/CSV/PNG outputs."""
import csv
import json
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvmeans.cli import main as kvmeans_cli  # noqa: E402
from kvmeans.eval.memory import PAPER_BUDGETS, full_attention_kv_bytes, measure_model, parse_budget, schedule_curves  # noqa: E402
from kvmeans.models import KVMLanguageModel, KVMModelConfig, preset  # noqa: E402
from kvmeans.models.hf import KVMForCausalLM  # noqa: E402
from kvmeans.models.hf_compat import cache_from  # noqa: E402
from kvmeans.ops.budget import StateBudget  # noqa: E402
from kvmeans.ops.schedule import rows_after  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")


def tiny(**kw) -> KVMForCausalLM:
    cfg = KVMModelConfig(**{**dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                   chunk_len=8, n_bswa_chunks=2, swa_window=12, alt_mixer="swa", alt_every=2,
                                   budget={"kind": "power_law", "factor": 3.0, "exponent": 0.5, "min_len": 8}), **kw})
    return KVMForCausalLM.from_language_model(KVMLanguageModel(cfg)).eval()


def test_measurements_match_schedule_cache_and_formula():
    model = tiny()
    cfg = model.config.to_model_config()
    lengths = [5, 40, 100]
    res = measure_model(model, lengths, decode_tokens=3, batch_size=2, log=lambda *_: None)
    assert [r["N"] for r in res] == lengths
    for r in res:
        n = r["N"]
        want_rows = rows_after(cfg.state_budget(), n, cfg.chunk_len, cfg.n_bswa_chunks)
        kvm = [x for x in r["layers"] if x["mixer"] == "kvm"]
        swa = [x for x in r["layers"] if x["mixer"] == "swa"]
        assert len(kvm) == 2 and len(swa) == 2
        assert all(x["state_rows"] == want_rows for x in kvm) and r["state_rows"] == want_rows
        assert all(0 < x["used_nbytes"] <= x["mixer_nbytes"] < x["nbytes"] for x in kvm)
        assert all(x["kv_rows"] == min(n, 12 - 1) and x["state_rows"] is None for x in swa)   # W - 1 cached
        # cache bytes are exactly what the transformers cache reports after the same prefill
        ids = torch.randint(0, 64, (2, n))
        with torch.no_grad():
            cache = cache_from(model(ids, use_cache=True))
        assert r["cache_bytes"] == cache.nbytes == sum(x["nbytes"] for x in r["layers"])
        assert [x["nbytes"] for x in r["layers"]] == [cache.layer_nbytes(i) for i in range(4)]
        assert r["full_attn_kv_bytes"] == 2 * 4 * 2 * 2 * n * 8 * 4 == full_attention_kv_bytes(cfg, n, 2, torch.float32)
        assert r["cache_vs_full"] == pytest.approx(r["cache_bytes"] / r["full_attn_kv_bytes"])
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_tokens"] == 3
    # the schedule grows the state: more rows at 100 tokens than at 40
    assert res[2]["state_rows"] > res[1]["state_rows"]
    assert full_attention_kv_bytes(cfg, 10, 1, torch.bfloat16) == 2 * 4 * 2 * 10 * 8 * 2


def test_schedule_curves_paper_budgets_to_a_million_tokens():
    lengths = [256, 4096, 2 ** 20]
    t0 = time.perf_counter()
    rows = schedule_curves(lengths)
    assert time.perf_counter() - t0 < 10
    got = {(r["budget"], r["N"]): r["state_rows"] for r in rows}
    for label, b in PAPER_BUDGETS.items():
        for n in lengths:
            assert got[(label, n)] == rows_after(b, n, 256, 2)
    assert [got[("fixed-256", n)] for n in lengths] == [256, 256, 256]
    assert got[("16*sqrt(N)", 4096)] == 991                     # the README's quick-start state
    assert 1000 < got[("saturating-1024", 2 ** 20)] <= 1024
    assert got[("16*sqrt(N)", 2 ** 20)] > got[("saturating-1024", 2 ** 20)]
    assert all(r["full_attention_rows"] == r["N"] and 0 < r["window_tokens"] <= 512 for r in rows)


def test_parse_budget():
    # this command's aliases
    assert parse_budget("sqrt:16") == ("16*sqrt(N)", PAPER_BUDGETS["16*sqrt(N)"])
    assert parse_budget("power:2:0.75:64") == ("2*N^0.75 (min 64)", StateBudget.power_law(2, 0.75, min_len=64))
    assert parse_budget("power:2:0.75")[1] == StateBudget.power_law(2, 0.75)
    # every other command's grammar (parse_budget_spec), one label per distinct budget
    assert parse_budget("fixed:128") == parse_budget("128") == ("fixed-128", StateBudget.fixed(128))
    assert parse_budget("power_law:16:0.5:256") == ("16*N^0.5 (min 256)", PAPER_BUDGETS["16*sqrt(N)"])
    assert parse_budget("power_law:3") == ("3*N^0.5", StateBudget.power_law(3))
    assert parse_budget("saturating:1024") == ("saturating-1024", StateBudget.saturating(1024))
    assert parse_budget("saturating:1024:1") == ("saturating-1024 (min 1)", PAPER_BUDGETS["saturating-1024"])
    assert parse_budget("novelty:0.3:512") == ("novelty-0.3 (cap 512)", StateBudget.novelty(0.3, 512))
    assert parse_budget("power_law:0.1:0.5")[0] != parse_budget("power_law:0.1000001:0.5")[0]
    # saturating:N means min 0 now (as everywhere); the rows are the paper's min-1 budget's at every length
    assert all(rows_after(StateBudget.saturating(1024), n, 256, 2) == rows_after(PAPER_BUDGETS["saturating-1024"], n,
                                                                                 256, 2) for n in (1, 300, 5000))
    for bad in ("sqrt", "cube:3", "power:1", "fixed:x", "novelty:3:512", "sqrt:1:2"):
        with pytest.raises(ValueError, match=r"^--budget '.*' is not one of N, fixed:N, .*novelty:THRESHOLD:CAP.* "
                                             r"aliases sqrt:F .* power:F:E\[:MIN\]$"):
            parse_budget(bad)


def test_schedule_curves_novelty_is_a_bound():
    """Under a novelty budget the schedule knows only the most rows (every token novel, up to the cap), which the
    op reaches with threshold 0 on random keys; threshold 2 keeps the first chunk's rows."""
    from kvmeans import kvm_attention
    from kvmeans.utils.testing import make_inputs
    C, nb, cap = 4, 2, 9
    rows = schedule_curves([3, 13, 61], {"nov": StateBudget.novelty(0.0, cap), "fixed": StateBudget.fixed(6)}, C, nb)
    got = {(r["budget"], r["N"]): (r["state_rows"], r["max_state_rows"]) for r in rows}
    assert got[("nov", 3)] == (None, 3) and got[("nov", 13)] == (None, 8) and got[("nov", 61)] == (None, cap)
    assert got[("fixed", 61)] == (6, 6)
    for t in (3, 13, 61):
        x = make_inputs(T=t, D=8)
        for threshold, want in ((0.0, got[("nov", t)][1]), (2.0, min(t, C))):
            _, st = kvm_attention(x["q"], x["k"], x["v"], chunk_len=C, n_bswa_chunks=nb, sink_len=1,
                                  budget=StateBudget.novelty(threshold, cap), return_state=True, backend="naive")
            assert st.num_rows == want
    with pytest.raises(ValueError, match="cap 3 is below chunk_len 4"):
        schedule_curves([8], {"nov": StateBudget.novelty(0.5, 3)}, C, nb)


def test_cli_schedule_takes_every_commands_budget_forms(tmp_path, capsys):
    out = tmp_path / "s"
    assert kvmeans_cli(["eval", "memory", "--schedule", "--lengths", "256", "4096", "--budget", "power_law:16:0.5:256",
                        "--budget", "novelty:0.3:1024", "--budget", "sqrt:16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "<= 1024 (novelty)" in printed and "16*N^0.5 (min 256)" in printed and "16*sqrt(N)" in printed
    rows = {(r["budget"], r["N"]): r for r in csv.DictReader(open(out / "schedule.csv"))}
    assert rows[("novelty-0.3 (cap 1024)", "4096")]["state_rows"] == ""
    assert rows[("novelty-0.3 (cap 1024)", "4096")]["max_state_rows"] == "1024"
    assert rows[("16*N^0.5 (min 256)", "4096")]["state_rows"] == rows[("16*sqrt(N)", "4096")]["state_rows"] == "991"


def test_cli_preset_and_schedule_write_outputs(tmp_path, capsys):
    out = tmp_path / "mem"
    rc = kvmeans_cli(["eval", "memory", "--preset", "tiny-cpu", "--lengths", "33", "70", "--decode-tokens", "2",
                      "--threads", "1", "--schedule", "--budget", "fixed:16", "--budget", "sqrt:4",
                      "--chunk-len", "32", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny-cpu" in printed and "full-attn KV" in printed and "fixed-16" in printed
    res = json.loads((out / "memory.json").read_text())
    (m,) = res["models"]
    cfg = preset("tiny-cpu")
    assert m["label"] == "tiny-cpu" and m["mixers"] == ["kvm"] * 4 and m["kv_heads"] == cfg.kv_heads
    for r in m["results"]:
        assert r["state_rows"] == rows_after(cfg.state_budget(), r["N"], cfg.chunk_len, cfg.n_bswa_chunks)
        assert r["full_attn_kv_bytes"] == full_attention_kv_bytes(cfg, r["N"], 1, torch.float32)
        assert len(r["layers"]) == 4 and r["cache_bytes"] == sum(x["nbytes"] for x in r["layers"])
    rows = list(csv.DictReader(open(out / "memory.csv")))
    assert [int(r["N"]) for r in rows] == [33, 70] and rows[1]["state_rows"] == str(m["results"][1]["state_rows"])
    assert len(rows[0]["layer_nbytes"].split()) == 4
    sched = json.loads((out / "schedule.json").read_text())
    assert {(r["budget"], r["N"]): r["state_rows"] for r in sched["rows"]} == {
        ("fixed-16", 33): 32, ("fixed-16", 70): 32,          # the first chunk (32 tokens) fills the state first
        ("4*sqrt(N)", 33): rows_after(StateBudget.power_law(4, 0.5, min_len=256), 33, 32, 2),
        ("4*sqrt(N)", 70): rows_after(StateBudget.power_law(4, 0.5, min_len=256), 70, 32, 2)}
    for name in ("memory.png", "schedule.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert len(list(csv.DictReader(open(out / "schedule.csv")))) == 4


@pytest.mark.parametrize("args, msg", [
    ([], "--model DIR"),
    (["--preset", "nope"], "--preset 'nope'"),
    (["--schedule", "--budget", "cube:3"], "--budget 'cube:3' is not one of N, fixed:N,"),
    (["--schedule", "--budget", "novelty:0.5:100"], "--budget novelty-0.5 (cap 100): cap 100 is below chunk_len 256"),
    (["--preset", "tiny-cpu", "--budget", "fixed:8"], "--budget sets the --schedule curves"),
    (["--preset", "tiny-cpu", "--label", "a", "--label", "b"], "--label"),
    (["--model", "/no/such/dir"], "--model /no/such/dir"),
])
def test_cli_errors_name_the_argument(args, msg, capsys):
    """One line, ``kvmeans eval memory: error: ...``, exit code 2 (no usage block)."""
    assert kvmeans_cli(["eval", "memory", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmeans eval memory: error: ") and err.count("\n") == 1 and msg in err, err
