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
