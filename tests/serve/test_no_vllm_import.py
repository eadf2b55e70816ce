"""The core package never imports vLLM (default suite; docs/serving.md): importing kvmeans, kvmeans.serve, the
plugin module and the `kvmeans serve` command leaves vllm out of sys.modules."""
import subprocess
import sys


def test_core_package_does_not_import_vllm():
    code = ("import sys, kvmeans, kvmeans.serve, kvmeans.serve.state_slots, kvmeans.serve.vllm_plugin, "
            "kvmeans.cli, kvmeans.cli.serve; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_native_folders_are_refused_with_what_serves_them(tmp_path):
    """The plugin's config hook refuses a native KVMForCausalLM folder (ours or the authors') before vLLM reads it,
    naming what serves it; other folders and non-folder names pass through to vLLM."""
    import json

    import pytest

    from kvmeans.serve.vllm_plugin import refuse_native
    for model_type in ("kvmeans", "rwkv7backbone"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(ValueError, match=rf"native KVM model \(model_type '{model_type}'.*kvmeans generate"):
            refuse_native(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "kvm_conversion": {}}))
    refuse_native(tmp_path)
    refuse_native("HuggingFaceTB/SmolLM2-135M")
    (tmp_path / "config.json").write_text("[1, 2]")
    refuse_native(tmp_path)


def test_overrides_for_the_automatic_setting_calibrate_on_the_weights(llama_dir):
    """``kvmeans serve --kvm auto``: the overrides carry the split calibrated on the folder's own weights (as
    ``convert_hf(model)`` on the loaded model would store it) with the per-layer ranking vLLM serves; a plain spec
    converts on the meta device, unchanged."""
    import pytest
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from kvmeans.pretrained.convert import convert_hf
    from kvmeans.serve.vllm_plugin import kvm_hf_overrides
    got = kvm_hf_overrides(llama_dir, "auto")
    conv = got["kvm_conversion"]
    assert got["architectures"] == ["KVMeansLlamaForCausalLM"] and conv["exact_scope"] == "layer"
    want = convert_hf(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval(),
                      calibrate=True, exact_scope="layer").config.kvm_conversion
    assert conv["calibration"]["chosen"] == want["calibration"]["chosen"]
    assert {k: v for k, v in conv.items() if k != "calibration"} == {k: v for k, v in want.items()
                                                                     if k != "calibration"}
    plain = kvm_hf_overrides(llama_dir, "budget=16,chunk_len=8,n_bswa_chunks=2,sink_len=2")["kvm_conversion"]
    assert plain["budget"] == 16 and "calibration" not in plain and plain["exact_scope"] == "model"
