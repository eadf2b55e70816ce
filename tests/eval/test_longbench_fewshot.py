"""LongBench few-shot through the lm-eval `kvm` model: the documented command (`kvmeans eval lm-eval --model
DIR --tasks longbench_fewshot ...`) wired end to end on a local toy group of the same shape (two generate_until
tasks in LongBench's few-shot format, the group's unweighted mean of `score`). No download."""
import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from kvmeans.cli import main as kvmeans_cli  # noqa: E402
from tests.eval.test_harness import model_dir, offline_one_thread  # noqa: E402,F401  (fixtures)

LB = Path(__file__).parents[1] / "data" / "lmeval_longbench_toy"


def test_longbench_fewshot_command_on_a_local_toy_group(tmp_path, model_dir, monkeypatch, capsys):  # noqa: F811
    import lm_eval.tasks
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",      # skip indexing lm-eval's own tasks (speed only)
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    out = tmp_path / "out"
    assert kvmeans_cli(["eval", "lm-eval", "--model", str(model_dir), "--model_args", "dtype=float32,max_length=4096",
                        "--device", "cpu", "--tasks", "kvm_toy_longbench_fewshot", "--include_path", str(LB),
                        "--batch_size", "2", "--log_samples", "--output_path", str(out)]) == 0
    assert "kvm_toy_longbench_fewshot" in capsys.readouterr().out
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    r = res["results"]
    assert r["kvm_toy_lb_trec"]["sample_len"] == 3 and r["kvm_toy_lb_triviaqa"]["sample_len"] == 2
    mean = (r["kvm_toy_lb_trec"]["score,none"] + r["kvm_toy_lb_triviaqa"]["score,none"]) / 2
    assert r["kvm_toy_longbench_fewshot"]["score,none"] == pytest.approx(mean)     # unweighted, as longbench_fewshot
    assert res["config"]["model"] == "kvm" and res["config"]["model_args"]["max_length"] == 4096
    rows = [json.loads(line) for f in out.rglob("samples_kvm_toy_lb_trec_*.jsonl")
            for line in f.read_text().splitlines()]
    assert len(rows) == 3 and all(row["arguments"]["gen_args_0"]["arg_1"]["until"] == ["\n"] for row in rows)
    assert rows[0]["arguments"]["gen_args_0"]["arg_0"].startswith("Please determine the type of the question below.")
