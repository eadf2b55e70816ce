"""``kvmeans bench longctx`` (kvmeans/bench/longctx.py): the command end to end on a tiny Llama (every run in its
own process with ``-m slow``; by default the workers run in this process, and ``--generate`` starts real ones), cache
bytes flat for the bounded arms and linear for full attention, failed runs reported as a status, peak RSS that sees
an allocation, random weights from a config, and one-line usage errors."""
import contextlib
import csv
import io
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from kvmeans.bench import longctx  # noqa: E402
from kvmeans.cli import main as cli  # noqa: E402
from tests.cli.test_usage_errors import fails  # noqa: E402

KVM = "kvm:budget=fixed:16,chunk_len=8,n_bswa_chunks=2,sink_len=2,exact_rows=4"
ARMS = ["full", "streaming:2+30", KVM]
FAST = ["--segment", "32", "--decode-tokens", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (vocab 512, 2 layers, GQA 4/2, head dim 16) saved without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    d = tmp_path_factory.mktemp("longctx") / "llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    return d


def read(out):
    with open(out / "longctx.csv") as f:
        table = list(csv.DictReader(f))
    return table, json.loads((out / "longctx.json").read_text())


def by(rows, arm, length):
    return next(r for r in rows if r["arm"] == arm and r["length"] == length)


def three_arms_end_to_end(tiny_dir, out, capsys):
    """``kvmeans bench longctx`` with three arms at two lengths, and what its outputs must say."""
    assert cli(["bench", "longctx", "--model", str(tiny_dir), "--out", str(out), "--lengths", "128", "64",
                "--arms", *ARMS, *FAST]) == 0
    printed = capsys.readouterr().out
    assert "peak RSS above model MB" in printed and "decode ms/tok" in printed and KVM in printed
    table, doc = read(out)
    assert [(r["arm"], r["length"]) for r in table] == [(a, n) for n in ("64", "128") for a in ARMS]  # interleaved
    assert all(r["status"] == "ok" for r in table), table
    rows = doc["rows"]
    assert doc["settings"]["lengths"] == [64, 128] and doc["env"]["torch"] == torch.__version__
    # full attention's cache grows with the prompt, exactly; StreamingLLM's and KVM's do not
    assert by(rows, "full", 128)["cache_bytes"] == 2 * by(rows, "full", 64)["cache_bytes"]
    assert by(rows, "full", 64)["cache_bytes"] == 2 * 2 * 2 * 64 * 16 * 4         # K+V, layers, Hkv, T, D, fp32
    assert by(rows, "streaming:2+30", 64)["cache_bytes"] == by(rows, "streaming:2+30", 128)["cache_bytes"] \
        == 2 * 2 * 2 * (2 + 30 - 1) * 16 * 4                                     # sinks + the last W - 1 tokens
    assert by(rows, KVM, 64)["cache_bytes"] == by(rows, KVM, 128)["cache_bytes"] < by(rows, "full", 128)["cache_bytes"]
    assert by(rows, KVM, 128)["cache_kv_bytes"] == 0 and by(rows, KVM, 128)["cache_rows_bytes"] > 0
    for r in rows:
        assert r["ttft_s"] > 0 and r["decode_ms_per_tok"] > 0 and r["peak_rss_above_model_mb"] is not None
        assert r["rss_loaded_mb"] > 0 and r["prefill_tok_s"] == pytest.approx(r["length"] / r["ttft_s"])
    runs = doc["runs"]
    assert len(runs) == 6 and all(len(r["decode_step_s"]) == 3 and r["threads"] == 1 for r in runs)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "longctx.png").stat().st_size > 1000


def worker_in_process(settings, timeout):
    """``run_worker`` without the fresh interpreter: :func:`longctx.worker_main` here, its result line read back."""
    threads, buf, t0 = torch.get_num_threads(), io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            assert longctx.worker_main(json.dumps(settings)) == 0
    finally:
        torch.set_num_threads(threads)                  # the worker sets its --threads
    line = [ln for ln in buf.getvalue().splitlines() if ln.startswith(longctx.RESULT_TAG)][-1]
    return {**json.loads(line[len(longctx.RESULT_TAG):]), "wall_s": time.perf_counter() - t0}


def test_end_to_end_three_arms_in_process(tiny_dir, tmp_path, capsys, monkeypatch):
    """The command end to end with each run's worker in this process: the six fresh interpreters (torch and
    transformers imported six times) are ``test_end_to_end_three_arms`` under ``-m slow``;
    ``test_generate_mode_reads_the_prompt_with_the_same_cache`` starts a real worker process in the default suite."""
    monkeypatch.setattr(longctx, "run_worker", worker_in_process)
    three_arms_end_to_end(tiny_dir, tmp_path / "out", capsys)


@pytest.mark.slow
def test_end_to_end_three_arms(tiny_dir, tmp_path, capsys):
    """The same, every run in its own process (as the command runs them)."""
    three_arms_end_to_end(tiny_dir, tmp_path / "out", capsys)


def test_interleave_times_every_arm_in_one_process(tiny_dir, tmp_path, capsys):
    """--interleave: decode steps of the arms taken in turn in one process, medians and ratios to the first arm."""
    out = tmp_path / "inter"
    assert cli(["bench", "longctx", "--model", str(tiny_dir), "--out", str(out), "--lengths", "96", "48",
                "--interleave", "--arms", *ARMS, *FAST]) == 0
    assert "decode.csv" in capsys.readouterr().out
    rows = json.loads((out / "decode.json").read_text())["rows"]
    assert [(r["arm"], r["length"]) for r in rows] == [(a, n) for n in (48, 96) for a in ARMS]
    for r in rows:
        assert len(r["decode_step_s"]) == 3 and r["decode_ms_per_tok"] > 0
        first = next(x for x in rows if x["length"] == r["length"] and x["arm"] == "full")
        assert r["ratio_to_first"] == pytest.approx(r["decode_ms_per_tok"] / first["decode_ms_per_tok"])
        own = next(x for x in rows if x["length"] == 48 and x["arm"] == r["arm"])
        assert r["ratio_to_shortest"] == pytest.approx(r["decode_ms_per_tok"] / own["decode_ms_per_tok"])
    with open(out / "decode.csv") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_generate_mode_reads_the_prompt_with_the_same_cache(tiny_dir, tmp_path, monkeypatch):
    """--generate: model.generate with nothing set; a KVM prompt past the segment keeps the bounded cache. The KVM
    run's worker is a fresh process, as the command starts it; full attention's runs in this one."""
    real_worker, spawned = longctx.run_worker, []

    def kvm_in_a_process(settings, timeout):
        if settings["arm"]["kind"] != "kvm":
            return worker_in_process(settings, timeout)
        spawned.append(settings["arm"]["label"])
        return real_worker(settings, timeout)
    monkeypatch.setattr(longctx, "run_worker", kvm_in_a_process)
    out = tmp_path / "gen"
    assert cli(["bench", "longctx", "--model", str(tiny_dir), "--out", str(out), "--lengths", "96", "--generate",
                "--arms", "full", KVM, *FAST]) == 0
    _, doc = read(out)
    runs = {r["arm"]: r for r in doc["runs"]}
    assert {r["via"] for r in runs.values()} == {"generate"} and all(r["status"] == "ok" for r in runs.values())
    assert runs[KVM]["cache_bytes"] < runs["full"]["cache_bytes"] and runs[KVM]["cache_bytes_by_kind"]["kv"] == 0
    assert len(runs["full"]["decode_step_s"]) == 3 and runs["full"]["ttft_s"] > 0
    if Path("/proc/self/status").exists():          # anonymous memory's peak, as in the forward mode
        assert all(r["peak_anon_above_model_bytes"] is not None and r["anon_loaded_bytes"] > 0 for r in runs.values())
    assert spawned == [KVM]
    assert cli(["bench", "longctx", "--model", str(tiny_dir), "--out", str(out), "--generate", "--batch", "2"]) == 2


def test_a_run_past_the_timeout_is_a_status_and_longer_lengths_are_skipped(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(["bench", "longctx", "--model", str(tiny_dir), "--out", str(out), "--lengths", "64", "128",
                "--arms", "full", KVM, "--timeout", "0.001"]) == 0
    table, doc = read(out)
    assert [(r["arm"], r["length"], r["status"]) for r in table] == [
        ("full", "64", "timeout"), (KVM, "64", "timeout"), ("full", "128", "skipped"), (KVM, "128", "skipped")]
    assert by(doc["rows"], "full", 128)["error"] == "timeout at length 64"
    assert "timeout" in capsys.readouterr().out


def test_a_killed_worker_is_oom_and_a_crashed_one_an_error(monkeypatch):
    """The parent's reading of a worker that leaves no result: SIGKILL (the OOM killer) -> oom, else error."""
    monkeypatch.setattr(longctx, "_WORKER", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    r = longctx.run_worker({}, timeout=60)
    assert r["status"] == "oom" and "SIGKILL" in r["error"]
    monkeypatch.setattr(longctx, "_WORKER", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    r = longctx.run_worker({}, timeout=60)
    assert r["status"] == "error" and r["error"] == "exit 3: boom"


@pytest.mark.parametrize("action, status", [("memory", "oom"), ("error", "error")])
def test_the_worker_reports_its_own_failure(monkeypatch, capsys, action, status):
    monkeypatch.setenv(longctx.INJECT_ENV, f"full@64={action}")
    settings = {"arm": {"label": "full", "kind": "full"}, "length": 64}
    assert longctx.worker_main(json.dumps(settings)) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(longctx.RESULT_TAG)
    r = json.loads(line[len(longctx.RESULT_TAG):])
    assert r["status"] == status and "injected" in r["error"] and "Traceback" in r["traceback"]


def test_random_weights_from_a_config(tiny_dir, tmp_path, monkeypatch):
    """config:DIR (a folder with only a config.json) and config:NAME (a fetched model's folder); measured here in
    process, batch 2, StreamingLLM: the cache holds sinks + W - 1 tokens of both prompts."""
    only = tmp_path / "only_config"
    only.mkdir()
    shutil.copy(tiny_dir / "config.json", only / "config.json")
    assert longctx.resolve_model(f"config:{only}") == (str(only), True)
    monkeypatch.setenv("KVMEANS_CACHE", str(tmp_path / "cache"))
    shutil.copytree(only, tmp_path / "cache" / "models" / "tiny")
    assert longctx.resolve_model("config:tiny") == (str(tmp_path / "cache" / "models" / "tiny"), True)
    assert longctx.resolve_model(str(tiny_dir)) == (str(tiny_dir), False)
    arm = longctx.parse_arm("streaming:2+14")
    s = {"model": str(only), "random": True, "arm": vars(arm), "length": 40, "batch": 2, "decode_tokens": 2,
         "dtype": "float32", "device": "cpu", "threads": None, "segment": 16, "seed": 0}
    r = longctx.measure(s)
    assert r["status"] == "ok" and r["random_weights"] and r["batch"] == 2
    assert r["cache_bytes"] == r["cache_bytes_end"] == 2 * 2 * 2 * 2 * (2 + 14 - 1) * 16 * 4
    assert r["prefill_tok_s"] == pytest.approx(2 * 40 / r["ttft_s"])


@torch.no_grad()
def test_streaming_arm_equals_one_masked_call_and_decodes_on(tiny_dir):
    """Segments of 24 tokens with eviction == one call under StreamingLLM's mask over everything (no eviction);
    with a window longer than the prompt == full attention; decode steps continue alike."""
    from transformers import AutoModelForCausalLM

    from kvmeans.pretrained.bench import streaming_mask
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.randint(0, 512, (2, 101), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(101)
    for sinks, window in [(2, 30), (0, 17), (4, 1000)]:
        run = longctx._runner(model, {"kind": "streaming", "sinks": sinks, "window": window})
        got = run.prefill(ids[:, :100], 24)
        got_next = run(ids[:, 100:])
        mask = streaming_mask(pos, pos, sinks, window, torch.float32)
        want = model(ids, attention_mask=mask, position_ids=pos[None].expand(2, -1)).logits
        torch.testing.assert_close(got, want[:, 99], rtol=0, atol=1e-5)
        torch.testing.assert_close(got_next, want[:, 100], rtol=0, atol=1e-5)
        assert run.cache.get_seq_length() == min(101, sinks + window - 1)
    torch.testing.assert_close(got_next, model(ids).logits[:, 100], rtol=0, atol=1e-5)


def test_peak_rss_sees_an_allocation():
    before = longctx.rss_bytes()
    if before is None:
        pytest.skip("no /proc/self/status")
    with longctx.PeakRSS() as probe:
        x = torch.ones(64 * 2 ** 20 // 4)        # 64 MiB, written
        del x
    assert probe.peak - before > 48 * 2 ** 20, (probe.peak, before, probe.hwm, probe.sampled)


def test_peak_anon_counts_allocations_and_not_mapped_file_pages(tmp_path):
    """``anon`` rises with a tensor the process allocates, not with the pages of a file it maps and reads (as
    memory-mapped weights are), which ``peak`` (all resident memory) does count."""
    import mmap
    if longctx.anon_bytes() is None:
        pytest.skip("no RssAnon in /proc/self/status")
    size = 64 * 2 ** 20
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * size)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        anon0, rss0 = longctx.anon_bytes(), longctx.rss_bytes()
        with longctx.PeakRSS() as probe:
            assert sum(mapped[i] for i in range(0, size, 4096)) == size // 4096     # every page read
            time.sleep(0.05)
        assert probe.peak - rss0 > 48 * 2 ** 20 and probe.anon - anon0 < 16 * 2 ** 20, (probe.peak, probe.anon)
    with longctx.PeakRSS() as probe:
        x = torch.ones(size // 4)
        time.sleep(0.05)                    # the sampler reads RssAnon every 5 ms
        del x
    assert probe.anon - anon0 > 48 * 2 ** 20, (probe.anon, anon0)


def test_parse_arm():
    assert longctx.parse_arm("full") == longctx.ArmSpec("full", "full")
    assert longctx.parse_arm("streaming:4+256") == longctx.ArmSpec("streaming:4+256", "streaming", 4, 256)
    spec = "budget=fixed:132,chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32"
    assert longctx.parse_arm(f"kvm:{spec}") == longctx.ArmSpec(f"kvm:{spec}", "kvm", spec=spec)
    assert longctx.parse_arm("kvm").spec == ""
    assert [a.kind for a in longctx.parse_arms(longctx.DEFAULT_ARMS)] == ["full", "streaming", "kvm"]


@pytest.fixture
def files(tmp_path, tiny_dir):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "converted").mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "converted" / "config.json").write_text(json.dumps({**cfg, "kvm_conversion": {"layers": [0]}}))
    (tmp_path / "gpt_bigcode").mkdir()
    (tmp_path / "gpt_bigcode" / "config.json").write_text(json.dumps({"model_type": "gpt_bigcode"}))
    return tmp_path


@pytest.mark.parametrize("args, needles", [
    (["--arms", "full,streaming:4+256"], ["--arms 'full,streaming:4+256': unknown arm", "separate arguments"]),
    (["--arms", "nope"], ["--arms 'nope': unknown arm", "streaming:S+W"]),
    (["--arms", "streaming:4"], ["--arms streaming:4: streaming takes S+W"]),
    (["--arms", "streaming:4+0"], ["--arms streaming:4+0: streaming takes S+W"]),
    (["--arms", "kvm:budget=bogus"], ["--arms kvm:budget=bogus:"]),
    (["--arms", "kvm:chunk_len=8,sink_len=9"], ["--arms kvm:chunk_len=8,sink_len=9: sink_len must be in"]),
    (["--arms", "kvm:colour=red"], ["--arms kvm:colour=red: item 'colour=red'"]),
    (["--arms", "full", "full"], ["--arms full: given twice"]),
    (["--lengths", "64", "0"], ["--lengths must be >= 1, got 0"]),
    (["--batch", "0"], ["--batch must be >= 1, got 0"]),
    (["--decode-tokens", "0"], ["--decode-tokens must be >= 1, got 0"]),
    (["--segment", "0"], ["--segment must be >= 1, got 0"]),
    (["--timeout", "0"], ["--timeout must be a positive number of seconds, got 0"]),
    (["--device", "nope"], ["--device 'nope' is not a device"]),
    (["--out", "{tmp}/a_file"], ["a_file is a file"]),
    (["--model", "{tmp}/missing"], ["--model {tmp}/missing: not a directory"]),
    (["--model", "config:{tmp}/missing"], ["--model config:{tmp}/missing: no config.json", "kvmeans models fetch"]),
    (["--model", "config:"], ["--model config:: give a folder"]),
    (["--model", "{tmp}/converted"], ["a KVM model already"]),
    (["--model", "config:{tmp}/gpt_bigcode"], ["--arms kvm: convert_hf supports model_type in"]),
])
def test_usage_errors(files, tiny_dir, capsys, args, needles):
    args = [a.format(tmp=files) for a in args]
    base = {"--model": str(tiny_dir), "--out": str(files / "out")}
    for flag, value in base.items():
        if flag not in args:
            args = [flag, value] + args
    fails(["bench", "longctx"] + args, capsys, *[n.format(tmp=files) for n in needles])
    assert not (files / "out").exists()
