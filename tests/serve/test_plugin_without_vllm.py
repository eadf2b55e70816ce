"""The serving code that runs without vLLM (default suite; docs/serving.md): importing kvmeans, kvmeans.serve, the
plugin module and the `kvmeans serve` command leaves vllm out of sys.modules; the plugin's overrides for a plain
folder."""
import subprocess
import sys


def test_core_package_does_not_import_vllm():
    code = ("import sys, kvmeans, kvmeans.serve, kvmeans.serve.state_slots, kvmeans.serve.native_slots, "
            "kvmeans.serve.vllm_plugin, "
            "kvmeans.cli, kvmeans.cli.serve; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_overrides_for_the_automatic_setting_calibrate_on_the_weights(llama_dir, monkeypatch):
    """``kvmeans serve --kvm auto``: the overrides carry the split calibrated on the folder's own weights (as
    ``convert_hf(model)`` on the loaded model would store it, the model-wide ranking included); a plain spec
    converts on the meta device, unchanged. Both calibrations here score windows of 320 built-in tokens (the default
    1024 takes a minute on this tiny model; the split is still chosen among every candidate on the tokens past the
    260 kept keys)."""
    import functools

    import pytest
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from kvmeans.pretrained import calibrate
    from kvmeans.pretrained.convert import convert_hf
    from kvmeans.serve.vllm_plugin import kvm_hf_overrides
    monkeypatch.setattr(calibrate, "calibrate", functools.partial(calibrate.calibrate, length=320))
    got = kvm_hf_overrides(llama_dir, "auto")
    conv = got["kvm_conversion"]
    assert got["architectures"] == ["KVMeansLlamaForCausalLM"] and conv["exact_scope"] == "model"
    want = convert_hf(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval(),
                      calibrate=True, exact_heads="uniform").config.kvm_conversion      # not served yet
    assert conv["calibration"]["chosen"] == want["calibration"]["chosen"]
    assert conv["calibration"]["windows"] == want["calibration"]["windows"] == [2, 320]
    assert {k: v for k, v in conv.items() if k != "calibration"} == {k: v for k, v in want.items()
                                                                     if k != "calibration"}
    plain = kvm_hf_overrides(llama_dir, "budget=16,chunk_len=8,n_bswa_chunks=2,sink_len=2")["kvm_conversion"]
    assert plain["budget"] == 16 and "calibration" not in plain and plain["exact_scope"] == "model"


def test_a_spec_for_a_native_folder_is_refused(tmp_path):
    """`kvmeans serve --model NATIVE --kvm SPEC`: a native folder is served as it is, so a spec is an error."""
    import pytest
    pytest.importorskip("transformers")
    from kvmeans import KVMConfig, KVMForCausalLM
    from kvmeans.serve.vllm_plugin import kvm_hf_overrides
    KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="native KVM model .*drop the spec"):
        kvm_hf_overrides(tmp_path, "budget=32")


def test_serve_asks_a_native_folder_for_its_max_model_len(tmp_path):
    """`kvmeans serve --model NATIVE` without --max-model-len: a usage error before vLLM is looked for (a native
    config has no positional limit, and the slots are sized by it)."""
    import pytest
    pytest.importorskip("transformers")
    from kvmeans import KVMConfig, KVMForCausalLM
    from kvmeans.cli.serve import main
    from kvmeans.utils.args import UsageError
    KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="native KVM model.*--max-model-len"):
        main(["--model", str(tmp_path)])


def test_overrides_for_a_named_split_take_its_sizes_without_calibrating(llama_dir, monkeypatch):
    """``kvmeans serve --kvm auto:NAME,keys=N``: the overrides carry that calibration split's sizes at N kept keys,
    as the same settings written out do, and no calibration pass runs."""
    import pytest
    pytest.importorskip("transformers")
    import kvmeans.pretrained.calibrate as calibrate
    from kvmeans.pretrained.calibrate import split_named, split_settings
    from kvmeans.serve.vllm_plugin import kvm_hf_overrides
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("a named split must not calibrate"))
    got = kvm_hf_overrides(llama_dir, "auto:C32-w0.50-e0.25,keys=128")["kvm_conversion"]
    s = split_settings(split_named("C32-w0.50-e0.25"), 128)
    written = (f"budget=fixed:{s['budget'].n},chunk_len={s['chunk_len']},n_bswa_chunks={s['n_bswa_chunks']},"
               f"sink_len={s['sink_len']},exact_rows={s['exact_rows']}")
    assert got == kvm_hf_overrides(llama_dir, written)["kvm_conversion"]
    assert (got["budget"]["n"], got["chunk_len"], got["n_bswa_chunks"], got["exact_rows"]) == (64, 32, 2, 16)
