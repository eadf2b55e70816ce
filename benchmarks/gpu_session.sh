#!/usr/bin/env bash
# One command for a session that has a CUDA GPU. Steps, in priority order, each under its own time limit
# (the whole run ends inside DEADLINE seconds, default 1800):
#   tests    the gpu-marked tests (the compiled Triton kernels against the naive spec and the torch paths, bf16
#            included) and the Triton test files compiled on CUDA (12 pytest workers when xdist is there)
#   triton   bench ops at the paper's shape (B=8, H=32, D=128, bf16), KVM through the Triton kernels, SDPA (flash)
#   profile  benchmarks/gpu_profile.py at 32K: per arm and mode, wall vs kernel time and launches (what bounds it)
#   longctx  bench longctx on a random-weight model of Qwen2.5-Coder-1.5B's config (bf16): full vs converted KVM,
#            peak GPU memory, time to first token, decode ms/token at 8K-128K
#   torch    bench ops again with KVM through the torch paths
# Output: CSV/PNG/JSON/env and logs under benchmarks/results/<gpu>-<date>/ (or $OUT when set, e.g. on the device
# tool's machine, where everything is also packed into results.tgz, since only a few files come back from there).
#   bash benchmarks/gpu_session.sh                      # all steps, lengths 4K and 32K
#   LENGTHS="1024 2048 4096 8192 16384 32768" bash benchmarks/gpu_session.sh triton
#   DEADLINE=400 bash benchmarks/gpu_session.sh tests triton profile longctx
# Works offline: the machine needs torch + triton (+ pytest, matplotlib, transformers >= 5.18 for longctx; wheels
# in ./.whl are installed first when present). Qwen's config comes from ./.gpu/qwen2.5-coder-1.5b/config.json
# (copy it there from `kvmeans models fetch qwen2.5-coder-1.5b`'s folder) or the fetched folder itself.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
deadline=${DEADLINE:-1800}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_session.sh: no CUDA device visible')" \
    || exit 1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out="benchmarks/results/${gpu}-$(date +%Y%m%d)"
[ -n "${OUT:-}" ] && out=/tmp/gpu-session   # the device machine returns at most 8 files: logs + results.tgz
mkdir -p "$out"
lengths="${LENGTHS:-4096 32768}"
qwen=.gpu/qwen2.5-coder-1.5b
[ -f "$qwen/config.json" ] || qwen="${HOME}/.cache/kvmeans/models/qwen2.5-coder-1.5b"
kvm="kvm:budget=fixed:132,chunk_len=32,n_bswa_chunks=4,sink_len=4,exact_rows=32"
{ nvidia-smi; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"; \
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; date -u; } >"$out/env.txt" 2>&1

left() { echo $(( deadline - ($(date +%s) - start) - 10 )); }
limit() { local l; l=$(left); (( l < $1 )) && echo "$l" || echo "$1"; }   # a step's limit: its own or what is left
pack() { [ -n "${OUT:-}" ] && cp "$out"/*.txt "$OUT"/ && tar czf "$OUT/results.tgz.tmp" -C "$out" . \
    && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; return 0; }

for step in ${*:-tests triton profile longctx torch}; do
    t=$(left); if (( t < 30 )); then echo "== $step: skipped ($t s left)"; continue; fi
    echo "== $step ($(date -u +%T), $t s left)"
    case "$step" in
    tests)   # one run, all cores: each test's verdict printed as it lands, a hung test stopped with its stack
        opts=(); python3 -c "import xdist" 2>/dev/null && opts=(-n 12)
        python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout 120)
        timeout "$(limit 240)" python3 -m pytest -v -p no:cacheprovider -p no:benchmark "${opts[@]}" \
            --tb=short -rfE --durations 15 -m "gpu or not slow" tests/ops/test_triton.py tests/ops/test_triton_rows.py \
            tests/ops/test_growth_triton.py tests/ops/test_kvm_inputs.py 2>&1 | tee "$out/pytest-triton.txt"
        rc=${PIPESTATUS[0]} ;;
    triton|torch)
        timeout "$(limit 150)" python3 -m kvmeans bench ops --device cuda --paper-shape --kvm-impl "$step" \
            --lengths $lengths --out "$out/ops-$step" 2>&1 | tee "$out/bench-ops-$step.txt"
        rc=${PIPESTATUS[0]} ;;
    profile)
        KVMEANS_TRITON_AUTOTUNE=${PROFILE_AUTOTUNE:-1} timeout "$(limit 60)" python3 benchmarks/gpu_profile.py --device cuda --paper-shape --kvm-impl triton \
            --lengths ${PROFILE_LENGTHS:-32768} --top 10 \
            --arms ${PROFILE_ARMS:-sdpa,kvm-fixed256,kvm-sqrt16} --modes ${PROFILE_MODES:-prefill backward decode} 2>&1 | grep --line-buffered -v '^USDT' | tee "$out/profile.txt"
        rc=${PIPESTATUS[0]} ;;
    longctx)
        timeout "$(limit 170)" python3 -m kvmeans bench longctx --model "config:$qwen" --device cuda --dtype bfloat16 \
            --lengths ${LONGCTX_LENGTHS:-8192 32768 131072} --arms full "$kvm" --decode-tokens 16 \
            --timeout ${LONGCTX_TIMEOUT:-80} --out "$out/longctx" 2>&1 | tee "$out/bench-longctx.txt"
        rc=${PIPESTATUS[0]} ;;
    *) echo "unknown step $step (tests | triton | profile | longctx | torch)" >&2; exit 2 ;;
    esac
    echo "== $step: exit $rc"
    pack
done
echo "results in $out"
