#!/usr/bin/env bash
# One command for a session that has a CUDA GPU: check the compiled Triton kernels against the torch
# paths, then time KVM against flash SDPA at the paper's shape (B=8, H=32, D=128, bf16) with the Triton
# kernels and with the torch paths, writing CSV/PNG/env under benchmarks/results/<gpu>-<date>/.
#   bash benchmarks/gpu_session.sh            # everything (~10-20 min on an H100)
#   QUICK=1 bash benchmarks/gpu_session.sh    # the tests and a short benchmark only
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_session.sh: no CUDA device visible to torch; run it on a GPU machine")
PY
pip install -q -e ".[dev,triton]"
gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out="benchmarks/results/${gpu}-$(date +%Y%m%d)"
mkdir -p "$out"

# 1. compiled kernels vs the torch path (gpu-marked tests), then the Triton test file compiled on CUDA
python -m pytest -q -m gpu tests/ 2>&1 | tee "$out/pytest-gpu.txt"
python -m pytest -q tests/test_triton.py 2>&1 | tee "$out/pytest-triton.txt"

# 2. the operator benchmark: Triton arm, then the torch paths, same shapes, SDPA (flash) in each run
lengths="1024 2048 4096 8192 16384 32768"
[ "${QUICK:-0}" = 1 ] && lengths="4096 32768"
kvmeans bench ops --device cuda --paper-shape --kvm-impl triton --lengths $lengths --out "$out/triton"
kvmeans bench ops --device cuda --paper-shape --kvm-impl torch --lengths $lengths --out "$out/torch"
echo "results in $out (commit $(git rev-parse --short HEAD)); put the ratio table in README.md"
