"""lm-eval `kvm` model: local toy tasks end to end (multiple choice + generate_until), results that do
not depend on the batch size, log-likelihoods / generations equal to direct model calls, the authors'
layout through the wrapper, and the `kvmeans eval lm-eval` command. No download: the tasks read
tests/data/lmeval_toy/*.jsonl, the model and a byte-level tokenizer are built here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")      # lm-eval's HFLM imports it
tk = pytest.importorskip("tokenizers")

import kvmeans.eval.harness as H  # noqa: E402
from kvmeans.cli import main as kvmeans_cli  # noqa: E402
from kvmeans.cli.eval_lm_eval import translate_args  # noqa: E402
from kvmeans.models import KVMLanguageModel, KVMModelConfig  # noqa: E402
from kvmeans.models.hf import KVMForCausalLM  # noqa: E402
from kvmeans.models.reference_checkpoint import build_tiny_reference_checkpoint  # noqa: E402
from kvmeans.train.tokenizers import EOT, save_tokenizer  # noqa: E402
from kvmeans.utils.testing import perturb_identity_init  # noqa: E402

TOY = Path(__file__).parents[1] / "data" / "lmeval_toy"
TASKS = ["kvm_toy_mc", "kvm_toy_gen"]
VOCAB = 264                       # 257 byte-level ids (+ unused rows)


def byte_tokenizer():
    """Byte-level tokenizer with no merges: id 0 = <|endoftext|>, ids 1..256 = the bytes."""
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    tok = tk.Tokenizer(tk.models.BPE(vocab={EOT: 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}},
                                     merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def tiny_model(seed=0) -> KVMForCausalLM:
    torch.manual_seed(seed)
    cfg = KVMModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         chunk_len=8, n_bswa_chunks=2, budget={"kind": "fixed", "n": 8})
    lm = KVMLanguageModel(cfg)
    perturb_identity_init(lm)   # the paper init makes blocks the identity
    return KVMForCausalLM.from_language_model(lm, eos_token_id=0, pad_token_id=0).eval()


@pytest.fixture(scope="module", autouse=True)
def offline_one_thread():
    """No network; one intra-op thread (tiny matmuls on a shared 2-core machine are far faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvm_model")
    tiny_model().save_pretrained(d)
    save_tokenizer(byte_tokenizer(), d)
    return d


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=str(TOY), include_defaults=False)


def evaluate(lm, task_manager, tasks=TASKS):
    from lm_eval import simple_evaluate
    return simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def runs(model_dir, task_manager):
    """The toy tasks at batch sizes 1 and 3 (the same model directory)."""
    return {bs: evaluate(H.KVMLM(pretrained=str(model_dir), batch_size=bs, device="cpu"), task_manager)
            for bs in (1, 3)}


def _resps(run, task):
    return [(s["doc_id"], s["resps"]) for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])]


# ---- registration -------------------------------------------------------------------------------
def test_kvm_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM
    assert get_model("kvm") is H.KVMLM and issubclass(H.KVMLM, HFLM)
    import importlib
    importlib.reload(H)          # a second import of the module is harmless (registration is idempotent)


# ---- toy tasks end to end -----------------------------------------------------------------------
def test_toy_tasks_run_end_to_end(runs):
    r = runs[1]["results"]
    assert r["kvm_toy_mc"]["sample_len"] == 8 and r["kvm_toy_gen"]["sample_len"] == 6
    assert 0.0 <= r["kvm_toy_mc"]["acc,none"] <= 1.0 and 0.0 <= r["kvm_toy_mc"]["acc_norm,none"] <= 1.0
    assert 0.0 <= float(r["kvm_toy_gen"]["exact_match,none"]) <= 1.0
    mc = runs[1]["samples"]["kvm_toy_mc"]
    assert all(len(s["resps"]) == 3 for s in mc)                 # one log-likelihood per choice
    # acc is the fraction of documents whose highest-scoring choice is the gold one
    acc = sum(max(range(3), key=lambda j: s["resps"][j][0][0]) == s["target"] for s in mc) / len(mc)
    assert r["kvm_toy_mc"]["acc,none"] == pytest.approx(acc)


@pytest.mark.parametrize("task", TASKS)
def test_results_do_not_depend_on_batch_size(runs, task):
    a, b = runs[1], runs[3]
    assert a["results"][task] == b["results"][task]
    ra, rb = _resps(a, task), _resps(b, task)
    assert [d for d, _ in ra] == [d for d, _ in rb]
    if task == "kvm_toy_gen":
        assert ra == rb                                             # identical generated strings
    else:
        for (_, x), (_, y) in zip(ra, rb):
            for (llx, gx), (lly, gy) in zip([c[0] for c in x], [c[0] for c in y]):
                assert llx == pytest.approx(lly, abs=1e-5) and gx == gy


def test_loglikelihoods_equal_direct_model_scores(runs, model_dir):
    """Each (context, continuation) log-likelihood equals the sum of log-softmax of one unpadded
    forward over context + continuation (right padding in the batch changed nothing)."""
    model = KVMForCausalLM.from_pretrained(model_dir).eval()
    tok = H.load_tokenizer_for(str(model_dir))
    for s in runs[3]["samples"]["kvm_toy_mc"]:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            c, k = tok.encode(ctx, add_special_tokens=False), tok.encode(cont, add_special_tokens=False)
            ids = torch.tensor([c + k])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
            want = sum(logp[len(c) - 1 + j, t].item() for j, t in enumerate(k))
            assert resp[0][0] == pytest.approx(want, abs=1e-4)


def test_generations_equal_single_prompt_greedy_generate(runs, model_dir):
    model = KVMForCausalLM.from_pretrained(model_dir).eval()
    tok = H.load_tokenizer_for(str(model_dir))
    for s in runs[3]["samples"]["kvm_toy_gen"]:
        ids = torch.tensor([tok.encode(s["arguments"][0][0], add_special_tokens=False)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=0)
        text = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True).split("\n")[0]
        assert s["resps"][0][0] == text


# ---- loading ------------------------------------------------------------------------------------
def test_model_instance_and_authors_layout_through_the_wrapper(tmp_path, model_dir, task_manager, runs):
    ref = tmp_path / "authors"
    build_tiny_reference_checkpoint(ref, vocab_size=VOCAB)
    save_tokenizer(byte_tokenizer(), ref)                  # the tiny stand-in ships no vocabulary
    lm = H.KVMLM(pretrained=str(ref), dtype="float32", batch_size=2, device="cpu")
    assert isinstance(lm.model, KVMForCausalLM) and lm.model.dtype == torch.float32
    assert lm.max_length == 2 ** 30                         # no truncation
    res = evaluate(lm, task_manager, tasks=["kvm_toy_mc"])
    assert res["results"]["kvm_toy_mc"]["sample_len"] == 8
    # an instance (tokenizer from its directory) scores exactly like the directory
    inst = H.KVMLM(pretrained=KVMForCausalLM.from_pretrained(model_dir).eval(), batch_size=3)
    again = evaluate(inst, task_manager, tasks=["kvm_toy_mc"])
    assert _resps(again, "kvm_toy_mc") == _resps(runs[3], "kvm_toy_mc")


def test_bad_arguments_name_the_fix(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="pretrained="):
        H.KVMLM(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_length"):
        H.KVMLM(pretrained=str(model_dir), batch_size="auto")
    bare = tmp_path / "bare"
    tiny_model().save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="tokenizer=PATH"):
        H.KVMLM(pretrained=str(bare))


# ---- command line -------------------------------------------------------------------------------
def test_translate_args():
    d = str(TOY)                                            # any existing directory
    assert translate_args(["--model", d, "--tasks", "x"]) == \
        ["run", "--model", "kvm", "--model_args", f"pretrained={d}", "--tasks", "x"]
    assert translate_args(["--tasks", "x"]) == ["run", "--model", "kvm", "--tasks", "x"]
    assert translate_args(["run", "--model", "hf", "--tasks", "x"]) == ["run", "--model", "hf", "--tasks", "x"]
    assert translate_args(["ls", "tasks"]) == ["ls", "tasks"]


def test_kvmeans_eval_lm_eval_command(tmp_path, model_dir, monkeypatch, capsys):
    """`kvmeans eval lm-eval --model DIR ...` runs lm-eval's own CLI with the kvm model and writes
    its results file (the built-in task index is skipped here only to keep the test fast)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    class LocalOnly(TaskManager):
        def __init__(self, *a, **kw):
            kw["include_defaults"] = False
            super().__init__(*a, **kw)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)       # what the CLI imports
    out = tmp_path / "out"
    rc = kvmeans_cli(["eval", "lm-eval", "--model", str(model_dir), "--model_args", "dtype=float32", "--device", "cpu",
                      "--tasks", "kvm_toy_mc", "--include_path", str(TOY), "--batch_size", "4",
                      "--output_path", str(out)])
    assert rc == 0
    assert "kvm_toy_mc" in capsys.readouterr().out
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert res["config"]["model"] == "kvm" and res["results"]["kvm_toy_mc"]["sample_len"] == 8


def test_lm_eval_help_mentions_the_plain_command_caveat(capsys):
    from kvmeans.cli.eval_lm_eval import main as lm_eval_main
    assert lm_eval_main(["--help"]) == 0
    assert "does not work" in capsys.readouterr().out


@pytest.mark.slow
def test_python_m_harness_subprocess(tmp_path, model_dir):
    """`python -m kvmeans eval lm-eval` (a fresh interpreter: registration at import, full task index)."""
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "kvmeans", "eval", "lm-eval", "--model", "kvm", "--model_args",
                        f"pretrained={model_dir},dtype=float32", "--device", "cpu", "--tasks", "kvm_toy_gen",
                        "--include_path", str(TOY), "--limit", "2", "--output_path", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "kvm_toy_gen" in p.stdout and list(out.rglob("results_*.json"))
