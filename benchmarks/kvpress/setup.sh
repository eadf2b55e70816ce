#!/usr/bin/env bash
# Build kvpress 0.5.5 in its own venv (it pins transformers<5.3 and pandas<3, which kvmeans' env must not get).
#   benchmarks/kvpress/setup.sh [VENV]      (default ~/.cache/kvmeans/venvs/kvpress)
# Then: VENV/bin/python benchmarks/kvpress/run_kvpress.py --samples samples.jsonl --model DIR --out DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$HOME/.cache/kvmeans/venvs/kvpress}"
constraints="$here/../../constraints-cpu.txt"     # torch==2.13.0+cpu: never the multi-GB CUDA build
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q -c "$constraints" "torch==2.13.0+cpu" "kvpress==0.5.5" "transformers<5.3" \
    "pandas<3" tqdm
"$venv/bin/python" -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$venv/bin/python"
