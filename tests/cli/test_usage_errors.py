"""User mistakes on the `kvmeans` command line: one line `kvmeans <cmd>: error: ...` on stderr, exit code 2,
no traceback, before any heavy work."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmeans.cli import main as cli

REPO = Path(__file__).resolve().parents[2]


def fails(argv, capsys, *needles):
    """Run ``kvmeans argv`` in-process: exit 2 and exactly one stderr line naming the command and ``needles``."""
    assert cli(argv) == 2
    err = capsys.readouterr().err
    prog = "kvmeans " + " ".join(argv[:2] if argv[0] in ("bench", "eval", "data", "models") else argv[:1])
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    assert all(n in err for n in needles), err
    return err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    (tmp_path / "bad.json").write_text('{"train": ')
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "no_tokenizer" / "config.json").write_text("{}")
    return tmp_path


def test_train_errors(files, capsys):
    fails(["train", "--data.batch_size", "0"], capsys, "data.batch_size must be >= 1, got 0")
    fails(["train", "--data.micro_batch_size", "-2"], capsys, "data.micro_batch_size must be >= 1, got -2")
    fails(["train", "--config", str(files / "missing.yaml")], capsys, "--config", "missing.yaml", "cannot read")
    fails(["train", "--config", str(files / "bad.yaml")], capsys, "bad.yaml: not valid YAML at line 2")
    fails(["train", "--config", str(files / "bad.json")], capsys, "bad.json: not valid JSON")
    fails(["train", "--out", str(files / "a_file"), "--max-steps", "1"], capsys, "a_file is a file")
    assert (files / "a_file").read_text() == "x"


@pytest.mark.parametrize("args, needles", [
    (["--model", "/nonexistent"], ["--model /nonexistent: not a directory"]),
    (["--model", "{tmp}/a_file"], ["a_file: not a directory"]),
    (["--model", "{tmp}"], ["no config.json"]),
    (["--model", "{tmp}/no_tokenizer"], ["no_tokenizer: no tokenizer"]),
    (["--model", "{tmp}/no_tokenizer", "--device", "nope"], ["--device 'nope' is not a device"]),
    (["--model", "{tmp}/no_tokenizer", "--device", "cuda:x"], ["--device 'cuda:x' is not a device"]),
])
def test_generate_errors(files, capsys, args, needles):
    fails(["generate", "--prompt", "hi"] + [a.format(tmp=files) for a in args], capsys, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine(files, capsys):
    fails(["generate", "--prompt", "hi", "--model", str(files / "no_tokenizer"), "--device", "cuda"], capsys,
          "--device cuda: no cuda device", "use cpu")
    fails(["bench", "ops", "--device", "cuda"], capsys, "--device cuda: no cuda device")


@pytest.mark.parametrize("args, needle", [
    (["--chunk-len", "0"], "--chunk-len must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--decode-steps", "0"], "--decode-steps must be >= 1, got 0"),
    (["--sink-len", "64", "--chunk-len", "64"], "--sink-len 64 must be below --chunk-len 64"),
    (["--rope-dim", "65"], "--rope-dim 65 must be at most --head-dim 64"),
    (["--lengths", "512", "0"], "--lengths must be >= 1, got 0"),
    # an explicit 0 is an error, not the default (it ran the whole benchmark at B=1 / H=8 / D=64)
    (["--batch", "0", "--repeats", "0"], "--batch must be >= 1, got 0"),
    (["--heads", "0", "--repeats", "0"], "--heads must be >= 1, got 0"),
    (["--kv-heads", "0", "--repeats", "0"], "--kv-heads must be >= 1, got 0"),
    (["--head-dim", "0", "--repeats", "0"], "--head-dim must be >= 1, got 0"),
    (["--threads", "2", "0"], "--threads must be >= 1, got 0"),
])
def test_bench_ops_errors(capsys, args, needle):
    fails(["bench", "ops"] + args, capsys, needle)


def test_argparse_errors_name_the_command(capsys):
    """argparse's own errors (usage, then one ``error:`` line) carry the command as the user typed it."""
    with pytest.raises(SystemExit) as e:
        cli(["bench", "ops", "--lengths", "x"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith("kvmeans bench ops: error: argument --lengths"), last


def test_bench_ops_out_file(files, capsys):
    fails(["bench", "ops", "--out", str(files / "a_file")], capsys, "--out", "a_file is a file")


def test_eval_errors(files, capsys):
    fails(["eval", "niah", "--model", "/nonexistent"], capsys, "--model /nonexistent: not a directory")
    fails(["eval", "niah", "--model", str(files / "no_tokenizer"), "--device", "nope"], capsys, "--device 'nope'")
    fails(["eval", "position-loss", "--model", str(files), "--data", str(files / "x.bin"), "--device", "nope"],
          capsys, "--device 'nope'")
    fails(["eval", "memory", "--preset", "tiny-cpu", "--device", "nope"], capsys, "--device 'nope'")
    fails(["eval", "memory", "--preset", "tiny-cpu", "--out", str(files / "a_file")], capsys, "a_file is a file")


def test_lm_eval_missing_model(capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    fails(["eval", "lm-eval", "--model", "/nonexistent", "--tasks", "piqa"], capsys,
          "--model /nonexistent: not a directory")
    fails(["eval", "lm-eval", "--model", "kvm", "--model_args", "pretrained=/nonexistent", "--tasks", "piqa"],
          capsys, "pretrained=/nonexistent: not a directory")


def test_lm_eval_arguments_are_checked_before_lm_eval_is_imported():
    code = ("import sys; from kvmeans.cli import main; "
            "rc = main(['eval', 'lm-eval', '--model', '/nonexistent']); print(rc, 'lm_eval' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert p.stdout.split() == ["2", "False"], p.stderr[-2000:]


def test_no_traceback_reaches_stderr(files):
    """A fresh interpreter, as a user runs it: one line on stderr, exit code 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for argv in (["train", "--config", str(files / "bad.yaml")], ["generate", "--model", "/nonexistent",
                                                                  "--prompt", "hi"]):
        p = subprocess.run([sys.executable, "-m", "kvmeans.cli", *argv], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith(f"kvmeans {argv[0]}: error:"), \
            p.stderr


@pytest.fixture
def no_weights(files):
    """A KVM model folder with config.json and a tokenizer but no weights."""
    pytest.importorskip("transformers")
    from kvmeans.models.hf import KVMConfig
    from kvmeans.train.tokenizers import gpt2_hf_tokenizer, save_tokenizer
    d = files / "no_weights"
    KVMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2).save_pretrained(d)
    save_tokenizer(gpt2_hf_tokenizer(), d)
    return d


def test_model_folder_without_weights(files, no_weights, capsys):
    d = no_weights
    fails(["generate", "--prompt", "hi", "--model", str(d)], capsys, f"--model {d}: ", "model.safetensors")
    fails(["eval", "memory", "--model", str(d), "--lengths", "8"], capsys, f"--model {d}: ", "model.safetensors")
    fails(["eval", "memory", "--model", str(files)], capsys, "no config.json")


def test_demo_errors(files, capsys):
    if not torch.cuda.is_available():
        fails(["demo", "--device", "cuda"], capsys, "--device cuda: no cuda device")
    fails(["demo", "--out", str(files / "a_file")], capsys, "--out", "a_file is a file")


def test_convert_and_data_prepare_errors(files, capsys):
    fails(["convert", "/nonexistent", str(files / "dst")], capsys, "SRC /nonexistent: not a directory")
    fails(["convert", str(files / "no_tokenizer"), str(files / "a_file")], capsys, "DST", "a_file is a file")
    fails(["convert", str(files / "no_tokenizer"), str(files / "dst")], capsys, "lacks required key")
    fails(["data", "prepare", "--input", "builtin", "--out", str(files / "a_file")], capsys, "a_file is a file")
    # flags named as typed (was val_fraction), a 1-token cram window refused (was written, with no targets)
    fails(["data", "prepare", "--input", "builtin", "--out", str(files / "o"), "--val-fraction", "2"], capsys,
          "--val-fraction must be in [0, 1), got 2.0")
    fails(["data", "prepare", "--input", "builtin", "--out", str(files / "o"), "--packing", "cram", "--seq-len", "0"],
          capsys, "--seq-len must be >= 1, got 0")
    assert not (files / "o").exists()


def test_cram_refuses_windows_without_targets(tmp_path):
    from kvmeans.train.prepare import prepare_tokens
    with pytest.raises(ValueError, match="seq_len must be >= 1 for cram packing, got 0"):
        prepare_tokens(["builtin"], tmp_path / "o", "builtin", packing="cram", seq_len=0)


def test_generate_empty_prompt_is_refused_before_the_model_loads(no_weights, capsys):
    fails(["generate", "--prompt", "", "--model", str(no_weights)], capsys, "--prompt '' encodes to no tokens")


def test_output_folders_that_are_files(files, capsys):
    """Refused up front (they raised FileExistsError / NotADirectoryError tracebacks, eval ppl after its run)."""
    model = str(files / "no_tokenizer")                 # has a config.json
    fails(["bench", "pretrained", "--model", model, "--out", str(files / "a_file")], capsys, "--out",
          "a_file is a file")
    fails(["eval", "ppl", "--model", model, "--out", str(files / "a_file")], capsys, "--out", "a_file is a file")
    fails(["models", "fetch", "smollm2-135m", "--cache-dir", str(files / "a_file")], capsys, "--cache-dir",
          "a_file is a file")
    assert (files / "a_file").read_text() == "x"


def test_eval_ppl_errors_name_the_argument(files, capsys):
    fails(["eval", "ppl", "--model", str(files / "no_tokenizer"), "--arms", "full,nope"], capsys,
          "--arms full,nope: arm 'nope'")
    fails(["eval", "ppl", "--model", str(files / "no_tokenizer"), "--text", str(files / "a_file"),
           str(files / "nope.txt")], capsys, f"--text {files / 'nope.txt'}: no such file")   # was a traceback


def test_train_budget_takes_the_budget_grammar(capsys):
    """--model.budget takes what every command's --budget takes (it wanted a dict or an int)."""
    from kvmeans.train.config import parse_overrides, resolve_config
    cfg = resolve_config("tiny-cpu",
                         overrides=parse_overrides(["--model.budget", "power_law:16:0.5:256"])).model.build()
    assert cfg.budget == {"kind": "power_law", "factor": 16.0, "min_len": 256} and cfg.state_budget()(4096) == 1024
    cfg = resolve_config("tiny-cpu", overrides=parse_overrides(["--model.budget", "novelty:0.3:512"])).model.build()
    assert cfg.budget == {"kind": "novelty", "n": 512, "threshold": 0.3}
    fails(["train", "--model.budget", "nope"], capsys, "model.budget: budget 'nope' is not one of N, fixed:N,")


def test_eval_input_errors_are_one_error_line(files, no_weights, capsys):
    """position-loss, niah and ruler printed ``<prog>: <message>`` (no ``error:``); a file that is no token file
    did not name --data."""
    fails(["eval", "position-loss", "--model", str(files), "--data", str(files / "a_file")], capsys,
          f"--data {files / 'a_file'}: not a kvmeans token file")
    fails(["eval", "position-loss", "--model", str(files), "--data", str(files / "nope.bin")], capsys,
          "--data", "no such token file")
    for task in ("niah", "ruler"):
        fails(["eval", task, "--model", str(no_weights), "--lengths", "256", "--haystack-file",
               str(files / "nope.json")], capsys, "--haystack-file", "no such file")


def test_lm_eval_unknown_task(no_weights, capsys, monkeypatch):
    """lm-eval raised its unknown-task ValueError as a traceback. lm-eval's own task index is built here from the
    toy tasks only (indexing its built-in ones takes 16 s; test_python_m_harness_subprocess, -m slow, builds it)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    import lm_eval.tasks

    class ToyTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *a, **kw):
            kw["include_defaults"] = False
            kw["include_path"] = kw.get("include_path") or str(REPO / "tests" / "data" / "lmeval_toy")
            super().__init__(*a, **kw)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", ToyTasksOnly)          # what lm-eval's CLI imports
    fails(["eval", "lm-eval", "--model", str(no_weights), "--tasks", "no_such_task_xyz"], capsys,
          "--tasks: Tasks not found: no_such_task_xyz")


def test_transformers_folder_without_a_tokenizer(files, capsys):
    """eval ppl, bench pretrained and distill loaded it with AutoTokenizer: a ValueError traceback."""
    pytest.importorskip("transformers")
    d = files / "llama"
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(d)
    capsys.readouterr()
    fails(["eval", "ppl", "--model", str(d)], capsys, f"--model {d}: cannot load its tokenizer")
    fails(["bench", "pretrained", "--model", str(d), "--out", str(files / "o"), "--samples-only"], capsys,
          f"--model {d}: cannot load its tokenizer")
    fails(["distill", "--teacher", str(d), "--kvm", "budget=fixed:8", "--out", str(files / "d")], capsys,
          f"--teacher {d}: cannot load its tokenizer")


def test_lm_eval_model_without_a_tokenizer(files, capsys):
    """Checked before lm-eval starts (the kvm model's loader raised it inside lm-eval: a traceback)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    d = files / "no_tokenizer"
    fails(["eval", "lm-eval", "--model", str(d), "--tasks", "piqa"], capsys,
          f"--model_args pretrained={d}: ", "no tokenizer", "pass tokenizer=PATH")
