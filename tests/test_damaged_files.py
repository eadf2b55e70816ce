"""Damaged files on disk and package exports: a corrupt weights file is one error naming it and the fix;
atomic writes clean up what killed writers of the same target left; every ``__all__`` name imports."""
import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvmeans  # noqa: E402
from kvmeans.models.hf import KVMConfig, KVMForCausalLM  # noqa: E402
from kvmeans.models.reference_checkpoint import (  # noqa: E402
    build_tiny_reference_checkpoint,
    convert_reference_checkpoint,
    read_converted_checkpoint,
)
from kvmeans.pretrained.convert import convert_hf, load_converted  # noqa: E402
from kvmeans.train.tokenizers import gpt2_hf_tokenizer  # noqa: E402
from kvmeans.utils.io import atomic_dir, atomic_write  # noqa: E402
from kvmeans.utils.weights import CorruptWeightsError, named_weight_errors  # noqa: E402
from tests.cli.test_usage_errors import fails  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

DAMAGE = {"truncated": lambda data: data[: len(data) // 2], "garbage": lambda data: b"not weights " * 40,
          "empty": lambda data: b""}
SMALL = "budget=fixed:8,chunk_len=8,n_bswa_chunks=2,sink_len=2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Intact folders: a KVM model, a plain Llama and the Llama converted, each with a tokenizer."""
    root = tmp_path_factory.mktemp("intact")
    torch.manual_seed(0)
    KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(root / "kvm")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    llama.save_pretrained(root / "llama")
    convert_hf(llama, budget=8, chunk_len=8, n_bswa_chunks=2, sink_len=2).save_pretrained(root / "converted")
    for name in ("kvm", "llama", "converted"):
        gpt2_hf_tokenizer().save_pretrained(root / name)
    return root


def damaged(src, dst, how, file="model.safetensors"):
    """A copy of folder ``src`` whose ``file`` is damaged ``how``; returns (folder, damaged file)."""
    shutil.copytree(src, dst)
    (dst / file).write_bytes(DAMAGE[how]((dst / file).read_bytes()))
    return dst, dst / file


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_corrupt_safetensors_is_one_error_naming_the_file_and_the_fix(saved, tmp_path, how):
    d, file = damaged(saved / "kvm", tmp_path / "kvm", how)
    with pytest.raises(CorruptWeightsError, match=rf"^{file} is corrupt or truncated \(.* bytes: .*\); delete it "
                       r"and save the model again"):
        KVMForCausalLM.from_pretrained(d)
    c, cfile = damaged(saved / "converted", tmp_path / "converted", how)
    with pytest.raises(CorruptWeightsError, match=rf"^{cfile} is corrupt"):
        load_converted(c)


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_corrupt_pytorch_model_bin(saved, tmp_path, how):
    d = tmp_path / "bin"
    shutil.copytree(saved / "kvm", d)
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    assert isinstance(KVMForCausalLM.from_pretrained(d), KVMForCausalLM)         # the intact .bin loads
    (d / "pytorch_model.bin").write_bytes(DAMAGE[how]((d / "pytorch_model.bin").read_bytes()))
    with pytest.raises(CorruptWeightsError, match=rf"^{d / 'pytorch_model.bin'} is corrupt") as err:
        KVMForCausalLM.from_pretrained(d)
    assert "weights_only" not in str(err.value)          # torch's advice to unpickle unsafely is no cure here


def test_an_unreadable_training_checkpoint_names_an_intact_previous_one(tmp_path):
    from kvmeans.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    paths = [save_checkpoint(tmp_path, step, model, opt, {}) for step in (1, 2, 3)]
    paths[2].write_bytes(b"not a checkpoint " * 10)
    with pytest.raises(CheckpointError, match=rf"not a torch.save file: .*--resume {paths[1]}$") as err:
        load_checkpoint(paths[2])
    assert "weights_only" not in str(err.value)        # torch's advice to unpickle unsafely is no cure here
    paths[1].write_bytes(paths[1].read_bytes()[:300])  # cut short: the hint skips it
    with pytest.raises(CheckpointError, match=rf"--resume {paths[0]}$"):
        load_checkpoint(paths[2])
    paths[0].write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no earlier checkpoint next to it is intact; start a new run"):
        load_checkpoint(paths[2])


def test_corrupt_authors_checkpoint(tmp_path, capsys):
    src = tmp_path / "ref"
    build_tiny_reference_checkpoint(src)
    convert_reference_checkpoint(src, tmp_path / "ours")
    ours = tmp_path / "ours" / "model.safetensors"
    ours.write_bytes(b"")
    with pytest.raises(CorruptWeightsError, match=rf"^{ours} is corrupt"):
        read_converted_checkpoint(tmp_path / "ours")
    file = src / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CorruptWeightsError, match=rf"^{file} is corrupt"):
        KVMForCausalLM.from_pretrained(src)
    with pytest.raises(CorruptWeightsError, match=rf"^{file} is corrupt"):
        convert_reference_checkpoint(src, tmp_path / "dst")
    fails(["convert", str(src), str(tmp_path / "dst")], capsys, f"{file} is corrupt or truncated")


def test_a_fetched_folder_names_the_fetch_command(saved, tmp_path):
    d, file = damaged(saved / "llama", tmp_path / "fetched", "truncated")
    (d / "kvmeans_fetch.json").write_text(json.dumps({"name": "smollm2-135m"}))
    from kvmeans.models.load import load_model
    from kvmeans.utils.args import UsageError
    with pytest.raises(UsageError, match=rf"^--model {d}: {file} is corrupt .*; fetch the model again: "
                       r"kvmeans models fetch smollm2-135m --force$"):
        load_model(str(d), torch.float32, "cpu")


def test_other_load_errors_pass_unchanged(saved):
    with pytest.raises(KeyError, match="not about the files"), named_weight_errors(saved / "kvm"):
        raise KeyError("not about the files")
    with pytest.raises(KeyError), named_weight_errors("some/hub-name"):       # not a folder: nothing is read
        raise KeyError("x")


def test_cli_commands_report_corrupt_weights_in_one_line(saved, tmp_path, capsys):
    d, file = damaged(saved / "kvm", tmp_path / "kvm", "truncated")
    fails(["generate", "--prompt", "hi", "--model", str(d)], capsys, f"--model {d}: {file} is corrupt")
    fails(["eval", "memory", "--model", str(d), "--lengths", "8"], capsys, f"{file} is corrupt")
    c, cfile = damaged(saved / "converted", tmp_path / "converted", "garbage")
    fails(["generate", "--prompt", "hi", "--model", str(c)], capsys, f"{cfile} is corrupt")
    p, pfile = damaged(saved / "llama", tmp_path / "llama", "empty")
    fails(["generate", "--prompt", "hi", "--model", str(p), "--kvm", SMALL], capsys, f"{pfile} is corrupt")
    # a short text file instead of the default Shakespeare, which both commands tokenize (10 s each) before they load
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)
    fails(["eval", "ppl", "--model", str(p), "--length", "16", "--windows", "1", "--text", str(text), "--out",
           str(tmp_path / "o")], capsys, f"--model {p}: {pfile} is corrupt")
    fails(["distill", "--teacher", str(p), "--kvm", SMALL, "--data", str(text), "--seq-len", "64", "--out",
           str(tmp_path / "d")], capsys, f"--teacher {p}: {pfile} is corrupt")


def test_first_mistakes_on_the_command_line_are_one_line_naming_the_argument(saved, tmp_path, capsys):
    kvm = str(saved / "kvm")
    fails(["generate", "--prompt", "hi", "--model", kvm, "--budget", "0"], capsys, "--budget: ", "must be >= 1, got 0")
    fails(["eval", "niah", "--model", kvm, "--budget", "2"], capsys,
          "--budget: budget override: fixed 2 rows would shrink the state", "use at least 256")
    run = tmp_path / "run"                               # a training run's OUT instead of OUT/final
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"preset": "tiny-cpu"}}))
    fails(["eval", "memory", "--model", str(run), "--lengths", "8"], capsys,
          f"--model {run}: config.json has no model_type", "give the folder of a saved model")
    shutil.copy(saved / "kvm" / "config.json", run / "final")
    fails(["eval", "memory", "--model", str(run), "--lengths", "8"], capsys,
          f"a training run's folder: its model is {run / 'final'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    fails(["convert", str(empty), str(tmp_path / "dst")], capsys, f"SRC {empty}: no config.json in it")
    fails(["eval", "ppl", "--model", str(empty)], capsys, f"--model {empty}: no config.json there")
    fails(["bench", "pretrained", "--model", str(empty), "--out", str(tmp_path / "b")], capsys,
          f"--model {empty}: no config.json there")
    fails(["distill", "--teacher", kvm, "--kvm", SMALL, "--out", str(tmp_path / "d")], capsys,
          f"--teacher {kvm} is a KVM-native model")
    fails(["generate", "--prompt", "a long prompt", "--model", kvm], capsys,       # GPT-2's tokenizer, 64 embeddings
          f"--model {kvm}: the prompt has token id ", "but the model has 64 embeddings")


def _killed_mid_write(target, folder):
    """Start a writer of ``target`` (an atomic_dir when ``folder``, else atomic_write) that stalls mid-write;
    returns (process, its temp)."""
    go = target.parent / f"{target.name}.started"
    body = (f"with atomic_dir({str(target)!r}) as tmp:\n    (tmp / 'part').write_text('x'); "
            f"open({str(go)!r}, 'w').close(); "
            f"time.sleep(300)" if folder else f"atomic_write({str(target)!r}, lambda tmp: (open(tmp, 'w').write('x'), "
            f"open({str(go)!r}, 'w').close(), time.sleep(300)))")
    proc = subprocess.Popen([sys.executable, "-c",
                             f"import time\nfrom kvmeans.utils.io import atomic_dir, atomic_write\n{body}"])
    deadline = time.time() + 120
    while not go.exists():
        assert proc.poll() is None and time.time() < deadline, "the writer did not start"
        time.sleep(0.05)
    go.unlink()
    (temp,) = target.parent.glob(f".{target.name}.*.tmp")
    return proc, temp


@pytest.mark.parametrize("folder", [True, False], ids=["atomic_dir", "atomic_write"])
def test_a_write_removes_the_temps_killed_writers_of_its_target_left(tmp_path, folder):
    target = tmp_path / "final"

    def write():
        if folder:
            with atomic_dir(target) as tmp:
                (tmp / "part").write_text("y")
        else:
            atomic_write(target, lambda tmp: open(tmp, "w").write("y"))

    proc, temp = _killed_mid_write(target, folder)
    others = [tmp_path / n for n in (".other.abc123.tmp", "final.abc123.tmp", ".final.abc123.tmp.keep",
                                      ".final.a.b.tmp", ".finals.abc123.tmp", "notes.txt")]
    for p in others:
        p.write_text("not ours")
    (tmp_path / ".final.link.tmp").symlink_to(others[-1])
    try:
        write()                                          # its writer is alive: the temp is in use
        assert temp.exists()
    finally:
        proc.kill()
        proc.wait()
    write()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in others] + [".final.link.tmp", "final"])
    assert all(p.read_text() == "not ours" for p in others)
    assert (target / "part" if folder else target).read_text() == "y"


def test_a_one_token_call_without_a_gate_reuses_one_ones_tensor(monkeypatch):
    from kvmeans import kvm_attention
    from kvmeans.ops import backends as kvm_mod
    seen = []
    for name in ("recurrent_kvm_attention", "chunk_kvm_attention"):
        real = getattr(kvm_mod, name)
        monkeypatch.setattr(kvm_mod, name, lambda *a, real=real, **kw: seen.append(a[3]) or real(*a, **kw))
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    _, state = kvm_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], chunk_len=4, budget=4, return_state=True)
    with torch.inference_mode():                     # decode steps (the first one makes the shared ones)
        for _ in range(2):
            y = kvm_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], chunk_len=4, budget=4, initial_state=state.clone())
        ones = kvm_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], torch.ones(1, 2, 1), chunk_len=4, budget=4,
                             initial_state=state.clone())
    assert seen[1] is seen[2] and torch.equal(seen[1], torch.ones(1, 2, 1)) and torch.equal(y, ones)
    qg = q[:, :, 8:].clone().requires_grad_()        # a one-token call under autograd uses it too
    kvm_attention(qg, k[:, :, 8:], v[:, :, 8:], chunk_len=4, budget=4, backend="chunked").sum().backward()
    assert seen[-1] is seen[1] and not seen[1].is_inference() and torch.isfinite(qg.grad).all()


def test_every_mixer_is_exported_by_kvmeans_layers():
    import kvmeans.layers
    from kvmeans.models.config import MIXERS, KVMModelConfig
    from kvmeans.models.transformer import build_mixer
    for kind in MIXERS:
        mixer = build_mixer(KVMModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, mixer=kind), 0)
        for cls in (type(mixer), type(mixer.config)):
            assert cls.__name__ in kvmeans.layers.__all__ and getattr(kvmeans.layers, cls.__name__) is cls, kind
    assert kvmeans.layers.RWKV7State.__module__ == "kvmeans.layers.rwkv7"


@pytest.mark.parametrize("package", ["kvmeans"] + [m.name for m in pkgutil.walk_packages(kvmeans.__path__, "kvmeans.")
                                                   if m.ispkg])
def test_every_name_in_all_imports(package):
    module = importlib.import_module(package)
    names = getattr(module, "__all__", [])
    assert len(names) == len(set(names)), f"{package}.__all__ repeats a name"
    assert [n for n in names if not hasattr(module, n)] == []
