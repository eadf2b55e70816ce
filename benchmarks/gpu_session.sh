#!/usr/bin/env bash
# One command for a session that has a CUDA GPU: check the compiled Triton kernels against the torch
# paths, then time KVM against flash SDPA at the paper's shape (B=8, H=32, D=128, bf16) with the Triton
# kernels and with the torch paths, writing CSV/PNG/env under benchmarks/results/<gpu>-<date>/
# (or under $OUT when set, e.g. on the device tool's machine, whose files come back from there).
#   bash benchmarks/gpu_session.sh                 # all steps (~10-20 min on an H100)
#   bash benchmarks/gpu_session.sh tests           # one step: tests | triton | torch (each < 10 min)
#   QUICK=1 bash benchmarks/gpu_session.sh         # T = 4096 and 32768 only
# Works offline: a machine that already has torch + triton (+ pytest, matplotlib) needs no download;
# kvmeans itself is installed without dependencies, or used from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_session.sh: no CUDA device visible to torch; run it on a GPU machine")
PY
if ! python3 -c "import kvmeans" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
        || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out="${OUT:-benchmarks/results/${gpu}-$(date +%Y%m%d)}"
mkdir -p "$out"
steps="${1:-tests triton torch}"
lengths="1024 2048 4096 8192 16384 32768"
[ "${QUICK:-0}" = 1 ] && lengths="4096 32768"
export PYTHONUNBUFFERED=1

for step in $steps; do
    case "$step" in
    tests)   # compiled kernels vs the torch path (gpu-marked tests), then the whole Triton test file on CUDA
        python3 -m pytest -q -m gpu tests/test_triton.py 2>&1 | tee "$out/pytest-gpu.txt" || true
        python3 -m pytest -q tests/test_triton.py 2>&1 | tee "$out/pytest-triton.txt" || true ;;
    triton|torch)   # the operator benchmark, same shapes, SDPA (flash) timed in the same run
        python3 -m kvmeans.bench.ops --device cuda --paper-shape --kvm-impl "$step" --lengths $lengths \
            --out "$out/$step" 2>&1 | tee "$out/bench-$step.txt" ;;
    *) echo "unknown step $step (tests | triton | torch)" >&2; exit 2 ;;
    esac
done
echo "results in $out (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)); put the ratio table in README.md"
