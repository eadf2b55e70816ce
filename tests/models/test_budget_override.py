"""Changing the state schedule between training and test: ``KVMForCausalLM.from_pretrained(dir, budget=...)``
and ``--budget SPEC`` on the eval/generate commands (no retraining)."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvmeans.cli import main as kvmeans_cli  # noqa: E402
from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.config import with_budget  # noqa: E402
from kvmeans.models.hf import KVMConfig, KVMForCausalLM  # noqa: E402
from kvmeans.models.hf_compat import cache_from  # noqa: E402
from kvmeans.models.load import load_model
from kvmeans.models.reference_checkpoint import build_tiny_reference_checkpoint  # noqa: E402
from kvmeans.ops.budget import StateBudget, parse_budget_spec  # noqa: E402
from kvmeans.ops.schedule import rows_after  # noqa: E402
from kvmeans.pretrained.convert import parse_kvm_spec  # noqa: E402
from kvmeans.train.data import write_token_file  # noqa: E402
from kvmeans.utils.args import UsageError  # noqa: E402
from kvmeans.utils.testing import perturb_identity_init  # noqa: E402

C, NB = 8, 2
TINY = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, chunk_len=C, n_bswa_chunks=NB,
            budget={"kind": "fixed", "n": 16}, swa_window=8)
SQRT = StateBudget.power_law(4, 0.5, min_len=C)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)         # tiny matmuls on a shared 2-core machine
    yield
    torch.set_num_threads(n)


def saved(tmp_path, **overrides):
    """A tiny trained-looking model saved with a fixed-16 budget (or ``overrides``)."""
    torch.manual_seed(0)
    lm = KVMLanguageModel(KVMModelConfig(**{**TINY, **overrides}))
    perturb_identity_init(lm)
    KVMForCausalLM.from_language_model(lm).save_pretrained(tmp_path / "m")
    return tmp_path / "m", lm


def kvm_rows(model, ids):
    """State rows of every KVM layer after a prefill of ``ids``."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = cache_from(out).groups[0].cache
    return [st.num_rows for st, m in zip(cache.layers, cache.mixers) if m == "kvm"], out.logits


def test_parse_budget_spec_lives_in_ops_and_convert_hf_still_parses_it():
    assert parse_budget_spec("64") == 64
    assert parse_budget_spec("fixed:64") == StateBudget.fixed(64)
    assert parse_budget_spec("saturating:512:8") == StateBudget.saturating(512, min_len=8)
    assert parse_budget_spec("power_law:16:0.5:256") == StateBudget.power_law(16, 0.5, min_len=256)
    assert parse_kvm_spec("budget=power_law:16")["budget"] == StateBudget.power_law(16)
    with pytest.raises(ValueError, match="not one of N, fixed:N"):
        parse_budget_spec("sqrt:16")


@pytest.mark.parametrize("budget", [SQRT, "power_law:4:0.5:8", {"kind": "power_law", "factor": 4.0, "min_len": 8}])
def test_load_with_another_schedule_grows_the_state_as_it_says(tmp_path, budget):
    path, lm = saved(tmp_path, mixer_types=["kvm", "swa", "kvm"])
    model = KVMForCausalLM.from_pretrained(path, budget=budget).eval()
    assert model.config.budget == {"kind": "power_law", "factor": 4.0, "min_len": 8}
    ids = torch.randint(1, 64, (1, 200), generator=torch.Generator().manual_seed(1))
    rows, logits = kvm_rows(model, ids)
    assert rows == [rows_after(SQRT, 200, C, NB)] * 2 and rows[0] > 16      # every KVM layer, beyond fixed-16
    assert kvm_rows(KVMForCausalLM.from_pretrained(path).eval(), ids)[0] == [16, 16]
    # the same weights in a model built with that budget directly
    direct = KVMLanguageModel(KVMModelConfig(**{**TINY, "mixer_types": ["kvm", "swa", "kvm"], "budget": SQRT}))
    direct.load_state_dict(lm.state_dict())
    want_rows, want = kvm_rows(KVMForCausalLM.from_language_model(direct).eval(), ids)
    assert rows == want_rows
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_override_of_a_given_config_and_of_the_authors_layout(tmp_path):
    path, _ = saved(tmp_path)
    cfg = KVMConfig.from_pretrained(path)
    model = KVMForCausalLM.from_pretrained(path, config=cfg, budget="saturating:64:8")
    assert model.config.budget == {"kind": "saturating", "n": 64, "min_len": 8}
    assert cfg.budget == {"kind": "fixed", "n": 16}                     # the caller's config is not changed
    ref = tmp_path / "ref"
    build_tiny_reference_checkpoint(ref)
    model = KVMForCausalLM.from_pretrained(ref, dtype=torch.float32, budget="power_law:4:0.5:8")
    assert model.config.budget == {"kind": "power_law", "factor": 4.0, "min_len": 8}
    assert model.transformer.h[0].attn.config.budget == SQRT


def test_errors(tmp_path):
    path, _ = saved(tmp_path, mixer="full")
    with pytest.raises(ValueError, match="no KVM layer .*drop budget / --budget"):
        KVMForCausalLM.from_pretrained(path, budget=64)
    with pytest.raises(UsageError, match="--budget"):
        load_model(str(path), torch.float32, "cpu", budget=64)
    with pytest.raises(ValueError, match="not one of N, fixed:N"):
        with_budget(KVMModelConfig(**TINY), "sqrt:16")
    # a budget below the chunk length: the op's error, at load (one line from the CLI)
    path, _ = saved(tmp_path / "k")
    with pytest.raises(ValueError, match="fixed 4 rows would shrink the state below the initial state of chunk_len=8"):
        KVMForCausalLM.from_pretrained(path, budget=4)
    with pytest.raises(UsageError, match="^--budget: budget override: fixed 4 rows"):
        load_model(str(path), torch.float32, "cpu", budget=4)


def test_cli_budget_is_applied_and_recorded(tmp_path, capsys):
    path, _ = saved(tmp_path)
    rng = np.random.default_rng(0)
    toks = np.concatenate([np.append(rng.integers(1, 64, size=n), 0) for n in (150, 160)])
    write_token_file(tmp_path / "d.bin", toks, vocab_size=64, tokenizer_id="test", eos_id=0, packing="concat")
    runs = {}
    for name, extra in (("saved", []), ("sqrt", ["--budget", "power_law:4:0.5:8"])):
        out = tmp_path / name
        assert kvmeans_cli(["eval", "position-loss", "--model", str(path), "--data", str(tmp_path / "d.bin"),
                            "--ctx", "144", "--block", "48", "--out", str(out), *extra]) == 0
        runs[name] = json.loads((out / "position_loss.json").read_text())
    assert runs["saved"]["config"]["budget"] is None and runs["sqrt"]["config"]["budget"] == "power_law:4:0.5:8"
    model = KVMForCausalLM.from_pretrained(path, budget=SQRT).eval()
    want = np.zeros(144)
    for a in runs["sqrt"]["config"]["doc_starts"]:      # the per-position sums are this model's
        ids = torch.from_numpy(toks[a:a + 145].astype(np.int64))[None]
        with torch.no_grad():
            lg = model(ids[:, :-1], use_cache=False).logits[0]
        want += torch.nn.functional.cross_entropy(lg, ids[0, 1:], reduction="none").double().numpy()
    got = runs["sqrt"]["models"][0]["per_position"]["sums"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(runs["saved"]["models"][0]["per_position"]["sums"], want, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert kvmeans_cli(["eval", "position-loss", "--model", str(path), "--data", str(tmp_path / "d.bin"),
                        "--budget", "sqrt:16"]) == 2
    assert "--budget: budget 'sqrt:16' is not one of" in capsys.readouterr().err


def test_lm_eval_budget_argument(tmp_path):
    from kvmeans.cli import eval_lm_eval as lm_eval_cli
    path, _ = saved(tmp_path)
    assert lm_eval_cli.translate_args(["--model", str(path), "--budget", "power_law:4:0.5:8", "--tasks", "x"]) == \
        ["run", "--model", "kvm", "--model_args", f"pretrained={path}", "--model_args", "budget=power_law:4:0.5:8",
         "--tasks", "x"]
    with pytest.raises(UsageError, match="--budget: budget 'x' is not one of"):
        lm_eval_cli.translate_args(["--budget", "x"])
    pytest.importorskip("lm_eval")
    from kvmeans.eval.harness import KVMLM
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer, save_tokenizer
    save_tokenizer(gpt2_hf_tokenizer(), path)
    lm = KVMLM(pretrained=str(path), budget="power_law:4:0.5:8", device="cpu")
    assert lm.model.config.budget == {"kind": "power_law", "factor": 4.0, "min_len": 8}
    with pytest.raises(ValueError, match="budget= applies when loading a model directory"):
        KVMLM(pretrained=lm.model, budget=64)


def test_demo_schedule_swap_script_evaluates_one_model_under_every_schedule():
    import importlib.util
    from pathlib import Path

    from kvmeans.demo import demo_settings
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_schedule_swap.py"
    spec = importlib.util.spec_from_file_location("demo_schedule_swap", path)
    swap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swap)
    s = {**demo_settings(), "steps": 1, "batch": 2, "eval_samples": 1, "multiples": (1, 4), "decode_tokens": 1}
    rows = swap.run("kvm-fixed", 0, s)
    got = {(r["schedule"], r["length"]): r["state_rows"] for r in rows}
    assert got == {(name, t): [rows_after(b, t, s["chunk_len"], s["window_chunks"])] * s["num_layers"]
                   for name, b in swap.SCHEDULES.items() for t in (128, 512)}
    assert got[("fixed-16", 512)] == [16, 16] and got[("2*sqrt(N)", 512)][0] > 16
    assert "KVM fixed  2*sqrt(N)" in swap.table(rows + [{**r, "model": "kvm-sqrt"} for r in rows], [128, 512])


@pytest.mark.parametrize("budget", ["power_law:4:0.5:8", {"kind": "power_law", "factor": 4.0, "min_len": 8}])
def test_auto_class_override_is_normalised_and_saves(tmp_path, budget):
    from transformers import AutoModelForCausalLM
    path, _ = saved(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, budget=budget)
    assert model.config.budget == {"kind": "power_law", "factor": 4.0, "min_len": 8}
    model.save_pretrained(tmp_path / "again")
    assert KVMForCausalLM.from_pretrained(tmp_path / "again").config.budget == model.config.budget


def test_demo_growth_ablation_script_keeps_and_reuses_its_weights(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from kvmeans.demo import demo_settings
    from kvmeans.ops.budget import StateBudget
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_growth_ablation.py"
    spec = importlib.util.spec_from_file_location("demo_growth_ablation", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    s = {**demo_settings(), "steps": 1, "batch": 2, "eval_samples": 1, "multiples": (1,), "decode_tokens": 1}
    budgets = {"novelty(0.3, cap 32)": StateBudget.novelty(0.3, 32)}
    first = ab.run("kvm-fixed", 0, s, budgets, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvm-fixed-seed0.json", "kvm-fixed-seed0.pt"]  # no temps
    monkeypatch.setattr(ab, "train_model", lambda *a, **k: pytest.fail("retrained weights it had kept"))
    again = ab.run("kvm-fixed", 0, s, budgets, str(tmp_path))
    assert again == first and [r["budget"] for r in first] == ["own", "novelty(0.3, cap 32)"]
    assert first[0]["rows"] == {"mean": 16.0, "min": 16, "max": 16} and first[1]["rows"]["max"] <= 32
