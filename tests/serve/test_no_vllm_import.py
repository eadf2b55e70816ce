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
