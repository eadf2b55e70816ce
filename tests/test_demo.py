"""The demo (``kvmeans demo``): the quick run end to end, seeds that reproduce with any number of workers or
threads, progress bars only on a terminal, and a run with nothing installed but ``kvmeans[demo]``."""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmeans import demo
from kvmeans.cli import demo as demo_cli
from kvmeans.eval.synthetic import KEY, VAL, multikey_batch, passkey_needle_len

REPO = Path(__file__).resolve().parents[1]


def tiny_settings(seeds=(0, 1)):
    s = demo.demo_settings(quick=True)
    s.update(steps=3, batch=4, multiples=(1, 2), eval_samples=4, decode_tokens=1, seeds=seeds)
    return s


def per_seed(results):
    """``{model: [(seed, final_loss, recalls), ...]}`` of a demo's results."""
    return {name: [(r["seed"], r["final_loss"], [e["recall"] for e in r["evals"]]) for r in m["runs"]]
            for name, m in results["models"].items()}


def test_demo_quick_end_to_end(tmp_path, capsys, monkeypatch):
    # `kvmeans demo --quick` as a user runs it (the CLI, its quick settings: one seed, lengths 1x-8x, every model,
    # worker processes), with the quick settings' training and evaluation cut to a few steps and samples: what is
    # checked here (files, table, cache bytes and state rows per length) does not depend on how well they learn.
    asked, real_settings = [], demo.demo_settings

    def quick_but_short(quick=False, task=demo.DEFAULT_TASK):
        asked.append(quick)
        return {**real_settings(quick, task), "steps": 3, "batch": 4, "eval_samples": 4, "decode_tokens": 1}
    monkeypatch.setattr(demo, "demo_settings", quick_but_short)
    out = tmp_path / "demo"
    assert demo_cli.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert asked == [True]

    assert (out / "results.json").is_file()
    assert (out / "demo.png").is_file() and (out / "demo.png").stat().st_size > 0
    assert "recall@" in printed and "decode ms/tok" in printed and "total wall time" in printed
    assert f"[{len(demo.MODELS)}/{len(demo.MODELS)}]" in printed          # one line per finished run
    for label in demo.LABELS.values():
        assert label in printed

    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0]
    lengths = res["lengths"]
    assert lengths == [res["settings"]["train_len"] * m for m in (1, 2, 4, 8)]
    assert set(res["models"]) == set(demo.MODELS)
    for r in res["models"].values():
        assert [e["length"] for e in r["evals"]] == lengths
        assert [run["seed"] for run in r["runs"]] == [0]
        assert all(0.0 <= e["recall_min"] <= e["recall"] <= e["recall_max"] <= 1.0 and e["decode_ms_per_token"] > 0
                   for e in r["evals"])

    fixed = [e["cache_bytes"] for e in res["models"]["kvm-fixed"]["evals"]]
    assert len(set(fixed)) == 1, f"fixed-budget KVM memory must be flat, got {fixed}"
    fixed_rows = [e["state_rows"] for e in res["models"]["kvm-fixed"]["evals"]]
    assert all(rows == fixed_rows[0] for rows in fixed_rows)

    sqrt_rows = [e["state_rows"][0] for e in res["models"]["kvm-sqrt"]["evals"]]
    assert sqrt_rows == sorted(sqrt_rows) and sqrt_rows[-1] > sqrt_rows[0]

    full = [e["cache_bytes"] for e in res["models"]["full"]["evals"]]
    assert all(a < b for a, b in zip(full, full[1:])), f"full attention's cache must grow, got {full}"
    assert full[-1] > 4 * full[0]


def demo_distributions():
    """Distributions that ``pip install .[demo]`` brings in: the core dependencies, the extra, and theirs."""
    import importlib.metadata as md

    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["demo"]]
    seen = set()
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(canonicalize_name(req.name))
        todo += [Requirement(r) for r in md.requires(req.name) or []]
    return {name: md.distribution(name) for name in seen}


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory):
    """A tiny demo (2 seeds, 2 workers) in a Python that sees only the stdlib, kvmeans and ``kvmeans[demo]``."""
    tmp = tmp_path_factory.mktemp("lean")
    site = tmp / "site"                 # like a fresh venv's site-packages: links to those distributions only
    site.mkdir()
    for dist in demo_distributions().values():
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    out = tmp / "out"
    code = (f"import sys\nsys.path[:0] = [{str(site)!r}, {str(REPO)!r}]\nfrom kvmeans import demo\n"
            f"demo.run_demo({str(out)!r}, settings={tiny_settings()!r}, workers=2)\n")
    proc = subprocess.run([sys.executable, "-S", "-E", "-c", code], capture_output=True, text=True, timeout=600)
    return proc, out


def test_demo_runs_with_only_the_demo_extra(lean_run):
    proc, out = lean_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "results.json").is_file()
    assert "matplotlib is not installed; skipping demo.png" in proc.stdout and not (out / "demo.png").exists()
    runs = 2 * len(demo.MODELS)
    assert f"[{runs}/{runs}]" in proc.stdout            # every model x 2 seeds, one line each
    assert "\r" not in proc.stdout + proc.stderr and "step/s" not in proc.stderr, "no bars unless a terminal"
    assert "NumPy" not in proc.stderr, "torch warns at import when numpy is missing"


def test_seed_results_do_not_depend_on_workers_or_threads(lean_run, tmp_path):
    proc, out = lean_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = demo.run_demo(tmp_path, settings=tiny_settings(), workers=1)     # one worker; 2 threads set here
        assert torch.get_num_threads() == 2, "the demo restores the caller's thread count"
    finally:
        torch.set_num_threads(threads)
    assert per_seed(res) == per_seed(json.loads((out / "results.json").read_text()))
    losses = per_seed(res)["kvm-fixed"]
    assert losses[0][1] != losses[1][1], "two seeds, two different runs"


@pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="the demo fixes its CPU code paths on AVX2 CPUs")
def test_seed_results_do_not_depend_on_the_cpus_code_paths(lean_run, tmp_path, monkeypatch):
    # torch and oneMKL pick their kernels by the CPU (AVX-512 here, AVX2 on the machine of the README's earlier
    # tables); they round differently and 800 steps of training turn the last bit into other recall per seed. The
    # workers take the same paths on every CPU with AVX2: a run whose environment asks for other paths (ATen's
    # unvectorised kernels and oneMKL's SSE2 branch, as an older CPU would take) gives the plain run's numbers.
    proc, out = lean_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    res = demo.run_demo(tmp_path, settings=tiny_settings(), workers=2)
    assert per_seed(res) == per_seed(json.loads((out / "results.json").read_text()))
    assert res["cpu"]["capability"] == "AVX2" and res["cpu"]["paths"] == demo.CPU_PATHS
    assert res["cpu"]["torch"] == torch.__version__


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_per_model_on_a_terminal(tmp_path, monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    demo.run_demo(tmp_path, settings=tiny_settings(seeds=(0,)), models=("bswa", "full"), workers=1)
    bars = err.getvalue()
    for label in ("BSWA", "full attention"):
        assert label in bars
    assert "100%" in bars and "3/3" in bars and "seed 0 loss" in bars and "<" in bars   # steps, loss, remaining


def test_bad_workers_and_seeds_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo_cli.main(["--workers", "0", "--out", str(tmp_path)])
    assert "--workers 0: use --workers >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seeds is empty"):
        demo.run_demo(tmp_path, settings=tiny_settings(seeds=()))
    with pytest.raises(ValueError, match="workers=2: .*workers=1 with device='cuda'"):
        demo.run_demo(tmp_path, settings=tiny_settings(), device="cuda", workers=2)


def test_recall_table_gives_mean_and_range_over_seeds_or_the_one_seed():
    def run(seed, recall):
        ev = dict(length=128, recall=recall, cache_bytes=1024, state_rows=[], decode_ms_per_token=1.0)
        return dict(model="bswa", seed=seed, config={}, params=1, train_s=1.0, final_loss=1.0, evals=[ev])

    for runs, cell, note in [([run(0, 0.5)], " 0.50 ", "(recall: seed 0;"),
                             ([run(0, 0.2), run(1, 0.8)], " 0.50 (0.20-0.80) ",
                              "(recall: mean (min-max) over seeds 0, 1;")]:
        res = dict(lengths=[128], seeds=[r["seed"] for r in runs], models=demo.summarize(runs, ["bswa"], [128]))
        table = demo.format_table(res)
        assert cell in table and note in table


def test_passkey_trains_on_the_query_key_too():
    s = demo.demo_settings()
    x, y = demo.make_batch(s, 4, s["train_len"], seed=3)
    target = demo.train_targets(s, x, y)
    q = s["train_len"] - passkey_needle_len(s["key_len"])              # the query's KEY
    assert (x[:, q] == KEY).all() and (x[:, q + 3] == VAL).all()
    assert torch.equal(target[:, q:q + 2], x[:, q + 1:q + 3])         # KEY -> k_1, k_1 -> k_2
    assert (y[:, q:q + 2] == -100).all()                              # evaluation scores the digits only
    digits = y != -100
    assert digits.sum(1).tolist() == [3] * 4 and torch.equal(target[digits], y[digits])
    assert ((target != -100) & ~digits).sum(1).tolist() == [2] * 4
    assert demo.train_targets({**s, "key_targets": False}, x, y) is y
    mk = demo.demo_settings(task="multikey")
    xm, ym = demo.make_batch(mk, 2, 128, seed=0)
    assert demo.train_targets(mk, xm, ym) is ym                       # other tasks train on what they score

    # the key targets change the training, and the reported loss stays the answer's
    tiny = {**tiny_settings(), "steps": 2, "warmup": 1}
    runs = {flag: demo.train_model("bswa", {**tiny, "key_targets": flag}, 0, "cpu") for flag in (True, False)}
    w = [r["model"].lm_head.weight for r in runs.values()]
    assert not torch.equal(w[0], w[1])
    first = dict(tiny, steps=1)
    reported = []
    model = demo.train_model("bswa", {**first, "lr": 0.0}, 0, "cpu", lambda n, loss: reported.append(loss))["model"]
    x, y = demo.make_batch(first, first["batch"], first["train_len"], seed=0)
    with torch.no_grad():
        assert reported[0] == pytest.approx(float(model.loss(x, y)), rel=1e-5)


def test_task_choice_and_unknown_task_refused(tmp_path, monkeypatch, capsys):
    assert demo.demo_settings()["task"] == "passkey"
    for task in demo.TASKS:
        s = demo.demo_settings(task=task)
        x, y = demo.make_batch(s, 2, s["train_len"] * 2, seed=0)
        assert x.shape == y.shape == (2, 2 * s["train_len"]) and (y != -100).any()
    s = demo.demo_settings(task="multikey")
    x, y = demo.make_batch(s, 3, 1024, seed=5)
    want = multikey_batch(3, 1024, 5, pair_every=s["pair_every"], num_queries=s["num_queries"], vocab_size=64)
    assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    assert (x == KEY).sum(1).tolist() == [1024 // s["pair_every"] + s["num_queries"]] * 3   # needles grow with length
    with pytest.raises(ValueError, match="task='niah': choose one of passkey, multikey, mqar"):
        demo.demo_settings(task="niah")
    with pytest.raises(ValueError, match="task='niah': choose one of"):
        demo.make_batch({**s, "task": "niah"}, 1, 128, seed=0)

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: seen.update(kw))
    assert demo_cli.main(["--task", "multikey", "--out", str(tmp_path)]) == 0 and seen["task"] == "multikey"
    assert demo_cli.main(["--out", str(tmp_path)]) == 0 and seen["task"] == "passkey"
    with pytest.raises(SystemExit):
        demo_cli.main(["--task", "niah"])
    assert "invalid choice: 'niah'" in capsys.readouterr().err


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("task", sorted(demo.TASKS))
def test_every_task_makes_batches_at_every_evaluation_length(task, quick):
    # multikey at 16x (64 needles) had only 50 one-token keys: a full run trained every model, then crashed
    s = demo.demo_settings(quick=quick, task=task)
    lengths = demo.check_lengths(s)
    assert lengths == [s["train_len"] * m for m in s["multiples"]] and lengths[0] == s["train_len"]
    for t in lengths:
        x, y = demo.make_batch(s, 2, t, seed=1)
        assert x.shape == y.shape == (2, t) and (y != -100).any()


def test_a_length_the_task_cannot_make_is_refused_before_training(tmp_path, monkeypatch):
    s = {**demo.demo_settings(task="multikey"), "multiples": (1, 16)}
    monkeypatch.setattr(demo, "run_all", lambda *a, **k: pytest.fail("trained before checking the lengths"))
    with pytest.raises(ValueError, match=r"task='multikey' cannot be evaluated at 2048 tokens \(16x train_len=128\)"
                                         r": 50\*\*key_len=1 distinct keys < 64 needles"):
        demo.run_demo(tmp_path / "out", settings=s)
    assert not (tmp_path / "out").exists()
