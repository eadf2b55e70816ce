"""Checkpoint and model files: stale temp files are cleaned up, written files and folders get the umask's
permissions, and a corrupted checkpoint is refused (naming the previous one) instead of loading silently."""
import os
import stat

import pytest
import torch

from kvmeans.cli import main as cli
from kvmeans.models import KVMLanguageModel, preset
from kvmeans.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    payload_checksum,
    save_checkpoint,
)
from kvmeans.train.config import OptimSection, parse_overrides, resolve_config
from kvmeans.train.optim import build_optimizer
from kvmeans.utils.io import atomic_dir

SMALL = ["--model.vocab_size", "512", "--model.hidden_size", "32", "--model.num_layers", "1",
         "--model.num_heads", "2", "--model.chunk_len", "16", "--data.seq_len", "32", "--data.batch_size", "2",
         "--optim.mup_base_dim", "32", "--train.val_steps", "1", "--train.log_every", "1000"]


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def small_model_and_optimizer():
    model = KVMLanguageModel(preset("tiny-cpu", num_layers=1, hidden_size=32, num_heads=2, vocab_size=64))
    return model, build_optimizer(model, OptimSection())


def flip_byte_of(path, tensor):
    """Flip one byte inside ``tensor``'s stored bytes in the file (a silent bit rot)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.detach().contiguous().numpy().tobytes()[:256])
    assert at > 0
    data[at + 100] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ temp files


def test_pruning_removes_the_temp_files_of_a_killed_writer(tmp_path):
    model, opt = small_model_and_optimizer()
    save_checkpoint(tmp_path, 1, model, opt, {"data": {}}, keep=2)
    stale = [tmp_path / ".step_00000002.pt.k1l2ed.tmp", tmp_path / ".latest.x9y8z7.tmp"]
    for p in stale:
        p.write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("mine")
    save_checkpoint(tmp_path, 2, model, opt, {"data": {}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.txt", "step_00000001.pt",
                                                          "step_00000002.pt"]


# ------------------------------------------------------------------------------------------ checksums


def test_a_corrupted_checkpoint_is_refused_naming_the_previous_one(tmp_path):
    model, opt = small_model_and_optimizer()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"data": {"step": step}})
    path = latest_checkpoint(tmp_path)
    state = load_checkpoint(path)
    assert "checksum" not in state and state["step"] == 2
    flip_byte_of(path, model.lm_head.weight)
    torch.load(path, weights_only=True)                  # torch itself reads the rotten tensor silently
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is corrupted.*--resume {tmp_path}/step_00000001"):
        load_checkpoint(path)
    first = tmp_path / "step_00000001.pt"
    first.write_bytes(first.read_bytes()[:1000])          # truncated
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {first} .*no earlier checkpoint"):
        load_checkpoint(first)


def test_checksum_covers_tensors_and_plain_values(tmp_path):
    model, opt = small_model_and_optimizer()
    save_checkpoint(tmp_path, 7, model, opt, {"data": {"step": 7}, "config": {"lr": 1e-3, "betas": (0.9, 0.95)}})
    raw = torch.load(tmp_path / "step_00000007.pt", weights_only=True)
    saved = raw.pop("checksum")
    assert saved.startswith("crc32:") and saved == payload_checksum(raw)
    raw["data"]["step"] = 8
    assert payload_checksum(raw) != saved
    raw["data"]["step"] = 7
    raw["model"]["lm_head.weight"][0, 0] += 1
    assert payload_checksum(raw) != saved


def test_checkpoints_without_a_checksum_still_load(tmp_path):
    model, _ = small_model_and_optimizer()
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "step_00000003.pt")   # an older kvmeans
    assert load_checkpoint(tmp_path / "step_00000003.pt")["step"] == 3


# ------------------------------------------------------------------------------------------ permissions


def test_atomic_dir_gets_the_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_dir(tmp_path / "final") as tmp:
            (tmp / "a.json").write_text("{}")
        with atomic_dir(tmp_path / "final") as tmp:      # replaces the previous folder
            (tmp / "b.json").write_text("{}")
            os.chmod(tmp / "b.json", 0o600)               # e.g. a writer's own mkstemp + rename
    finally:
        os.umask(old)
    assert mode(tmp_path / "final") == 0o750 and [p.name for p in (tmp_path / "final").iterdir()] == ["b.json"]
    assert mode(tmp_path / "final" / "b.json") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "final") as tmp:
            raise RuntimeError("crash")
    assert (tmp_path / "final" / "b.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


# ------------------------------------------------------------------------------------------ a tiny run


def train_args(data_dir, out, steps):
    return ["train", *SMALL, "--data", str(data_dir), "--out", str(out), "--max-steps", str(steps),
            "--train.ckpt_every", "2"]


def test_run_files_permissions_cleanup_and_corrupt_resume(data_dir, tmp_path, umask_022, capsys):
    out = tmp_path / "run"
    assert cli(train_args(data_dir, out, 4)) == 0
    assert mode(out / "final") == 0o755 and mode(out / "ckpt") == 0o755
    for f in [*(out / "final").iterdir(), *(out / "ckpt").iterdir(), out / "config.json", out / "metrics.csv"]:
        assert mode(f) == 0o644, f
    # a writer killed mid-save left temp files: resuming removes them before it reads the checkpoint
    stale = out / "ckpt" / ".step_00000006.pt.a1b2c3.tmp"
    stale.write_bytes(b"partial")
    from kvmeans.train.loop import open_run
    from kvmeans.train.runtime import setup_runtime
    cfg = resolve_config(overrides=parse_overrides(SMALL + ["--data.path", str(data_dir), "--train.out", str(out),
                                                            "--train.max_steps", "6"]))
    assert open_run(cfg, setup_runtime(cfg), "latest").step == 4 and not stale.exists()
    # a corrupted latest checkpoint: one line naming it and the previous one, exit 2
    flip_byte_of(out / "ckpt" / "step_00000004.pt", load_checkpoint(out / "ckpt" / "step_00000004.pt")["model"]
                 ["lm_head.weight"])
    capsys.readouterr()
    assert cli(train_args(data_dir, out, 6) + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint {out}/ckpt/step_00000004.pt is corrupted" in err
    assert f"--resume {out}/ckpt/step_00000002.pt" in err
    assert cli(train_args(data_dir, out, 6) + ["--resume", str(out / "ckpt" / "step_00000002.pt")]) == 0
