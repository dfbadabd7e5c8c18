#!/usr/bin/env bash
# The bench set-up (docs/benchmarks.md): the chart's matplotlib and TorchFT for B2. A full
# `python -m bench` fails without TorchFT (B2 runs in every full run). torchft-nightly is
# installed with --no-deps so that it can never pull another torch, plus the three small
# OpenTelemetry packages it imports; the version installed is recorded in latest.json
# (machine.torchft, b2.torchft_version). Extra arguments go to pip (e.g. a --target or --user).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -e '.[bench]' "$@"
"$PY" -m pip install -q --no-deps torchft-nightly "$@"
"$PY" -m pip install -q opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "$@"
"$PY" -c "from bench.common import torchft_version; from bench.torchft_bench import available; why = available(); print('torchft', torchft_version(), 'imports' if why is None else f'does NOT import: {why}')"
