"""Training: config resolution and errors, parameter groups / muP / AdamC / schedule, atomic checkpoints,
and end-to-end tiny runs (loss falls, bitwise resume, accumulation, torchrun gloo == one process,
SIGTERM -> checkpoint + exit 0, OUT/final loads with transformers)."""
import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvmeans.cli.train import main as train_main
from kvmeans.models import KVMLanguageModel, preset
from kvmeans.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from kvmeans.train.config import RUN_PRESETS, ConfigError, OptimSection, parse_overrides, resolve_config
from kvmeans.train.metrics import COLUMNS
from kvmeans.train.optim import apply_schedule, build_optimizer, build_param_groups, lr_factor

REPO = Path(__file__).resolve().parents[2]
# a 2-layer, 64-wide KVM (the state takes overflow tokens after 32 of the 64 positions)
TINY = ["--model.vocab_size", "512", "--model.hidden_size", "64", "--model.num_layers", "2",
        "--model.num_heads", "2", "--model.chunk_len", "16", "--data.seq_len", "64", "--data.batch_size", "4",
        "--optim.mup_base_dim", "64", "--optim.lr", "3e-3", "--optim.warmup_steps", "20",
        "--train.val_steps", "2", "--train.log_every", "1000"]

def tiny_config(data_dir, out, *extra):
    return resolve_config(overrides=parse_overrides(TINY + ["--data.path", str(data_dir), "--train.out", str(out),
                                                            *map(str, extra)]))


def read_metrics(out):
    with open(Path(out) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def losses(rows):
    return [float(r["loss"]) for r in rows]


def subprocess_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_command(cmd, timeout=180):
    """Run ``cmd`` in its own process group; on a timeout kill the group and fail showing its output."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{log[-6000:]}")
    return proc.returncode, log


# ------------------------------------------------------------------------------------------ config


def test_presets_follow_the_paper_recipe():
    for name in ("kvm-120m", "kvm-sqrt-120m", "kvm-swa-120m", "gpta-120m", "bswa-120m", "ovq-swa-120m"):
        cfg = resolve_config(name)
        assert cfg.tokens_per_step() == 524_288 and cfg.data.seq_len == 8192 and cfg.data.batch_size == 64
        assert (cfg.total_steps(), cfg.optim.lr, cfg.optim.weight_decay) == (6000, 2e-3, 0.2)
        assert cfg.optim.adamc and cfg.optim.warmup_steps == 200 and cfg.optim.betas == (0.9, 0.95)
        assert cfg.model.preset == name
    big = resolve_config("kvm-sqrt-350m")
    assert (big.total_steps(), big.optim.lr, big.optim.weight_decay) == (15000, 1.26491e-3, 0.126491)
    assert big.total_steps() * big.tokens_per_step() > 7.8e9 and big.train.grad_checkpointing
    assert set(RUN_PRESETS) >= {"tiny-cpu", "kvm-120m", "kvm-sqrt-350m"}
    with pytest.raises(ConfigError, match="data.path is empty.*--data DIR"):
        resolve_config("kvm-120m").check(8)


def test_overrides_types_and_budget():
    cfg = resolve_config("tiny-cpu", overrides=parse_overrides(
        ["--model.hidden_size", "64", "--optim.betas", "(0.8, 0.9)", "--optim.grad_clip=1", "--train.seed", "-3",
         "--train.out", "123", "--train.compile", "true", "--train.token_budget", "1e6"]))
    assert cfg.model.build().hidden_size == 64 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.grad_clip == 1.0 and isinstance(cfg.optim.grad_clip, float)
    assert cfg.train.seed == -3 and cfg.train.out == "123" and cfg.train.compile is True
    # token_budget replaces the preset's max_steps: 1e6 / (8 x 256 tokens) rounded up
    assert cfg.train.max_steps is None and cfg.total_steps() == math.ceil(1e6 / 2048)
    # never evaluated: a str field keeps the text, other fields reject it
    text = "__import__('os')"
    assert resolve_config(overrides=parse_overrides(["--train.out", text])).train.out == text
    with pytest.raises(ConfigError, match=r"train.seed must be int, got \"__import__"):
        resolve_config(overrides=parse_overrides(["--train.seed", "__import__('os').getpid()"]))


def test_budget_override_forms():
    """--model.budget takes an int (StateBudget.fixed, as the op and KVMConfig do) or a dict of StateBudget fields."""
    as_int = resolve_config("tiny-cpu", overrides=parse_overrides(["--model.budget", "48"])).model.build()
    assert as_int.budget == {"kind": "fixed", "n": 48} and as_int.state_budget()(10_000) == 48
    spec = "{'kind': 'power_law', 'factor': 2.0, 'exponent': 0.5}"
    as_dict = resolve_config("tiny-cpu", overrides=parse_overrides(["--model.budget", spec])).model.build()
    assert as_dict.state_budget()(10_000) == 200
    with pytest.raises(ConfigError, match="model.budget"):
        resolve_config("tiny-cpu", overrides=parse_overrides(["--model.budget", "True"]))


@pytest.mark.parametrize("args, message", [
    (["--train.max_stps", "3"], r"unknown config key train.max_stps; valid keys in 'train': .*max_steps"),
    (["--trian.max_steps", "3"], r"unknown config section 'trian'.*valid sections: model, data, optim, train"),
    (["--model.hiden_size", "3"], r"unknown config key model.hiden_size; valid keys in 'model': .*hidden_size"),
    (["--train.max_steps", "abc"], r"train.max_steps must be int, got 'abc'"),
    (["--optim.lr", "[1]"], r"optim.lr must be float"),
    (["--train.compile", "3"], r"train.compile must be bool"),
    (["--train.strategy", "zero3"], r"train.strategy must be one of ddp, fsdp"),
    (["--model.preset", "kvm-1b"], r"unknown model preset 'kvm-1b'; available: .*kvm-120m"),
    (["--model.num_heads", "5"], r"model: KVMModelConfig.num_heads"),
    (["train.max_steps", "3"], r"expected --section.key value"),
])
def test_config_errors_name_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config("tiny-cpu", overrides=parse_overrides(args))


def test_unknown_preset_and_cli_errors(capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown preset 'kvm-9000'; available: .*kvm-sqrt-120m.*tiny-cpu"):
        resolve_config("kvm-9000")
    assert train_main(["--preset", "kvm-9000"]) == 2
    assert "kvmeans train: error: unknown preset" in capsys.readouterr().err
    assert train_main(["--out", str(tmp_path), "--train.val_stepz", "1"]) == 2
    assert "train.val_stepz" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        resolve_config("tiny-cpu").check(3)
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide"):
        resolve_config("tiny-cpu", overrides=[("data", "micro_batch_size", 3)]).check(1)


def test_config_files_merge_over_the_preset(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"preset": "kvm-120m", "model": {"num_layers": 2},
                                                 "optim": {"betas": [0.9, 0.99]}, "train": {"token_budget": 3e9}}))
    cfg = resolve_config(config_file=str(tmp_path / "a.json"), overrides=[("model", "hidden_size", 384)])
    assert cfg.name == "kvm-120m" and cfg.model.overrides == {"num_layers": 2, "hidden_size": 384}
    assert cfg.optim.betas == (0.9, 0.99) and cfg.total_steps() == math.ceil(3e9 / 524_288)
    if importlib.util.find_spec("yaml"):
        (tmp_path / "b.yaml").write_text("model:\n  overrides: {num_layers: 3}\noptim:\n  lr: 2e-3\n  eps: -1E-7\n")
        cfg = resolve_config("tiny-cpu", str(tmp_path / "b.yaml"))
        assert (cfg.model.overrides, cfg.optim.lr, cfg.optim.eps) == ({"num_layers": 3}, 2e-3, -1e-7)
        (tmp_path / "c.yaml").write_text("train:\n  typo: 1\n")
        with pytest.raises(ConfigError, match="unknown config key train.typo"):
            resolve_config("tiny-cpu", str(tmp_path / "c.yaml"))
    # a saved config.json round-trips
    saved = resolve_config("kvm-sqrt-120m", overrides=[("data", "path", "x")]).to_dict()
    assert resolve_config(base=json.loads(json.dumps(saved))).to_dict() == saved


# ------------------------------------------------------------------------------- optimiser, schedule


def _model(**overrides):
    torch.manual_seed(0)
    return KVMLanguageModel(preset("tiny-cpu", vocab_size=128, hidden_size=64, num_layers=2, num_heads=2,
                                   chunk_len=16, **overrides))


@pytest.mark.parametrize("arch", [dict(), dict(mixer="ovq", alt_mixer="swa", alt_every=2)], ids=["kvm", "ovq+swa"])
def test_param_groups_decay_exactly_the_matrices(arch):
    model = _model(**arch)
    groups = {g["name"]: g for g in build_param_groups(model, OptimSection(mup_base_dim=64))}
    assert set(groups) == {"embedding", "matrix", "lora", "lm_head", "scalars"}
    named = dict(model.named_parameters())
    # vectors: ndim < 2 once singleton dims are dropped (v_gate0 and mlp.x_k are stored [1, 1, d])
    vectors = {n for n, p in named.items() if sum(s > 1 for s in p.shape) < 2}
    assert set(groups["scalars"]["param_names"]) == vectors and groups["scalars"]["weight_decay"] == 0
    assert {"transformer.h.0.attn.v_gate0", "transformer.h.1.mlp.x_k", "transformer.ln_head.bias"} <= vectors
    assert any(n.endswith("ln_s_k.weight") or n.endswith("attn.beta") for n in vectors)
    assert groups["embedding"]["param_names"] == ["transformer.wte.weight"]
    assert groups["lm_head"]["param_names"] == ["lm_head.weight"]
    assert all(named[n].ndim == 2 for n in groups["matrix"]["param_names"] + groups["lora"]["param_names"])
    assert {n.split(".")[-2] for n in groups["lora"]["param_names"]} == {"v_gate1", "v_gate2"}
    assert sum(len(g["params"]) for g in groups.values()) == len(named)


def test_mup_ratio_scales_matrix_lr_and_wd():
    cfg = OptimSection(lr=1e-3, weight_decay=0.1, mup_base_dim=32)        # hidden 64 -> ratio 2
    groups = {g["name"]: g for g in build_param_groups(_model(), cfg)}
    for name in ("matrix", "lm_head"):
        assert groups[name]["lr"] == pytest.approx(5e-4) and groups[name]["weight_decay"] == pytest.approx(0.2)
    # the value-gate LoRA scales with its own width (32 at any width up to ~1.4k: ratio 1, as the authors)
    assert groups["lora"]["lr"] == 1e-3 and groups["lora"]["weight_decay"] == 0.1
    assert groups["embedding"]["lr"] == 1e-3 and groups["embedding"]["weight_decay"] == 0.1
    assert groups["scalars"]["lr"] == 1e-3 and groups["scalars"]["weight_decay"] == 0.0


def test_schedule_and_adamc():
    cfg = OptimSection(lr=1e-3, weight_decay=0.1, warmup_steps=10, mup_base_dim=32)
    assert lr_factor(0, 100, cfg) == pytest.approx(0.1) and lr_factor(9, 100, cfg) == 1.0
    assert lr_factor(10, 100, cfg) == 1.0 and lr_factor(55, 100, cfg) == pytest.approx(0.5)
    assert lr_factor(99, 100, cfg) == pytest.approx(1 / 90)
    floor = OptimSection(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert lr_factor(100, 100, floor) == pytest.approx(0.1)
    opt = build_optimizer(_model(), cfg)
    for step in (0, 5, 40, 99):
        base = apply_schedule(opt, step, 100, cfg)
        f = lr_factor(step, 100, cfg)
        assert base == pytest.approx(1e-3 * f)
        for g in opt.param_groups:     # AdamC: wd / wd_peak == lr / lr_peak
            assert g["lr"] == pytest.approx(g["peak_lr"] * f)
            assert g["weight_decay"] == pytest.approx(g["peak_weight_decay"] * f)
    plain = OptimSection(lr=1e-3, weight_decay=0.1, warmup_steps=10, adamc=False)
    apply_schedule(opt, 50, 100, plain)
    assert {g["weight_decay"] for g in opt.param_groups} == {g["peak_weight_decay"] for g in opt.param_groups}


def test_unused_parameter_probe_for_ddp():
    """At seq_len <= the window the KVM state never fills: DDP must be told about those parameters."""
    from kvmeans.train.runtime import Runtime, _unused_parameters
    model = _model()
    short = resolve_config(overrides=[("data", "seq_len", 32)])
    assert sorted(_unused_parameters(model, short, Runtime())) == sorted(
        f"transformer.h.{i}.attn.{n}" for i in range(2)
        for n in ("state_head_temp", "ln_s_k.weight", "ln_s_k.bias", "key_weighting.weight"))
    assert _unused_parameters(model, resolve_config(overrides=[("data", "seq_len", 64)]), Runtime()) == []
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------------ checkpoints


def test_checkpoints_are_atomic_and_pruned(tmp_path, monkeypatch):
    model = _model()
    opt = build_optimizer(model, OptimSection())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"data": {"step": step}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002.pt", "step_00000003.pt"]
    assert latest_checkpoint(tmp_path).name == "step_00000003.pt"

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, model, opt, {"data": {"step": 4}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002.pt", "step_00000003.pt"]
    monkeypatch.undo()
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 3 and state["data"] == {"step": 3} and set(state["rng"]) >= {"python", "torch"}


# --------------------------------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    """40 steps in-process: validation every 10, checkpoints at 20 and 40."""
    from kvmeans.train import train
    out = tmp_path_factory.mktemp("run") / "a"
    cfg = tiny_config(data_dir, out, "--train.max_steps", 40, "--train.val_every", 10, "--train.ckpt_every", 20)
    t0 = time.perf_counter()
    summary = train(cfg, log_fn=lambda m: None)
    return out, summary, time.perf_counter() - t0


def test_tiny_run_learns_and_writes_its_files(tiny_run):
    out, summary, seconds = tiny_run
    rows = read_metrics(out)
    assert tuple(rows[0]) == COLUMNS and [int(r["step"]) for r in rows] == list(range(1, 41))
    first, last = losses(rows[:10]), losses(rows[-10:])
    print(f"mean loss: first 10 steps {sum(first) / 10:.3f}, last 10 {sum(last) / 10:.3f}")
    assert sum(last) / 10 < sum(first) / 10 - 0.5, (first, last)
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [10, 20, 30, 40]
    assert summary["steps"] == 40 and not summary["stopped_early"] and summary["final_loss"] == losses(rows)[-1]
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 40
    assert json.loads((out / "env.json").read_text())["torch"] == torch.__version__
    assert sorted(p.name for p in (out / "ckpt").glob("step_*.pt")) == ["step_00000020.pt", "step_00000040.pt"]
    print(f"tiny run: 40 steps in {seconds:.1f} s")


def test_final_model_loads_with_transformers(tiny_run):
    pytest.importorskip("transformers")
    from kvmeans.models.hf import KVMForCausalLM
    out = tiny_run[0]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in (out / "final").iterdir()}
    hf = KVMForCausalLM.from_pretrained(out / "final").eval()
    state = load_checkpoint(latest_checkpoint(out / "ckpt"))
    lm = KVMLanguageModel(hf.config.to_model_config())
    lm.load_state_dict(state["model"])
    x = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, lm(x)[0], rtol=0, atol=0)


def test_resume_is_bitwise_exact(tiny_run, data_dir, tmp_path):
    """Steps 21..40 from the step-20 checkpoint in a fresh run == the uninterrupted run, bit for bit."""
    from kvmeans.train import train
    out, _, _ = tiny_run
    (tmp_path / "b" / "ckpt").mkdir(parents=True)
    shutil.copy(out / "ckpt" / "step_00000020.pt", tmp_path / "b" / "ckpt")
    cfg = tiny_config(data_dir, tmp_path / "b", "--train.max_steps", 40, "--train.val_every", 10,
                      "--train.ckpt_every", 20)
    train(cfg, resume="latest", log_fn=lambda m: None)
    straight = [(r["step"], r["loss"], r["lr"], r["val_loss"]) for r in read_metrics(out)[20:]]
    resumed = [(r["step"], r["loss"], r["lr"], r["val_loss"]) for r in read_metrics(tmp_path / "b")]
    assert resumed == straight
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(cfg, log_fn=lambda m: None)
    with pytest.raises(ConfigError, match="was trained with model"):
        train(tiny_config(data_dir, tmp_path / "b", "--model.num_layers", 3), resume="latest", log_fn=lambda m: None)


def test_gradient_accumulation_matches(tiny_run, data_dir, tmp_path):
    """4 micro steps of 1 sequence == 1 step of 4 (in warm-up the lr does not depend on max_steps)."""
    from kvmeans.train import train
    train(tiny_config(data_dir, tmp_path, "--train.max_steps", 10, "--data.micro_batch_size", 1,
                      "--train.val_every", 10), log_fn=lambda m: None)
    torch.testing.assert_close(torch.tensor(losses(read_metrics(tmp_path))),
                               torch.tensor(losses(read_metrics(tiny_run[0])[:10])), rtol=0, atol=1e-5)


@pytest.mark.parametrize("extra", [[], ["--train.strategy", "fsdp", "--data.micro_batch_size", "1",
                                         "--train.grad_checkpointing", "True"]], ids=["ddp", "fsdp-accum-ckpt"])
def test_torchrun_two_processes_match_one(tiny_run, data_dir, tmp_path, extra):
    """2 gloo processes (2 rows each; DDP, or FSDP2 with 2 micro steps and activation checkpointing)
    == 1 process (4 rows): losses and val loss to 1e-5."""
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "kvmeans", "train", *TINY, "--data", str(data_dir), "--out", str(out), "--max-steps", "10",
           "--train.val_every", "10", *extra]
    rc, log = run_command(cmd)
    assert rc == 0 and "2 process(es) on cpu" in log, log[-6000:]
    two, one = read_metrics(out), read_metrics(tiny_run[0])[:10]
    torch.testing.assert_close(torch.tensor(losses(two)), torch.tensor(losses(one)), rtol=0, atol=1e-5)
    assert float(two[-1]["val_loss"]) == pytest.approx(float(one[-1]["val_loss"]), abs=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")    # torch.jit notices from inside inductor
def test_compiled_blocks_match_eager(tiny_run, data_dir, tmp_path):
    """torch.compile per block (+ activation checkpointing) gives the eager losses."""
    from kvmeans.train import train
    train(tiny_config(data_dir, tmp_path, "--train.max_steps", 5, "--train.compile", True,
                      "--train.grad_checkpointing", True), log_fn=lambda m: None)
    torch.testing.assert_close(torch.tensor(losses(read_metrics(tmp_path))),
                               torch.tensor(losses(read_metrics(tiny_run[0])[:5])), rtol=0, atol=1e-5)


def test_sigterm_checkpoints_and_exits_zero(data_dir, tmp_path):
    out = tmp_path / "sig"
    cmd = [sys.executable, "-m", "kvmeans", "train", *TINY, "--data", str(data_dir), "--out", str(out),
           "--max-steps", "100000", "--train.val_every", "0", "--train.ckpt_every", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.csv").exists() and len(read_metrics(out)) >= 2):
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    assert "stopped by SIGTERM" in log
    state = load_checkpoint(latest_checkpoint(out / "ckpt"))
    rows = read_metrics(out)
    assert state["step"] == int(rows[-1]["step"]) >= 2 and state["data"]["step"] == state["step"]
    assert not (out / "final").exists()
