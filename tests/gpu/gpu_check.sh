#!/usr/bin/env bash
# The one-GPU check (issue 12): bash tests/gpu/gpu_check.sh [OUT_DIR]; results in OUT_DIR/gpu_check.json.
# Needs the CUDA build of torch 2.13 (the machine's own); installs this package without touching torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
"$PY" -m pip install -q --no-deps -e . 2>/dev/null || true
export PYTHONUNBUFFERED=1
exec "$PY" tests/gpu/gpu_check.py "${1:-bench/results}" "${@:2}"
