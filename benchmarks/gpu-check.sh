#!/usr/bin/env bash
# `make gpu-check`: the GPU test tier (tests/gpu), then the GPU benchmarks (benchmarks/gpu.py),
# from this working tree with a given interpreter and no install: PYTHON=python3 on the GPU
# machine (its own torch, no venv, no nbval), the venv's here. At most 8 minutes on one GPU: the
# tier gets TIER_SECONDS, the benchmarks BENCH_SECONDS (each part writes its files as it ends,
# so a run cut short keeps the parts done). Both run even when the other fails; the status is
# non-zero when either did. Without CUDA: the tier is collected and skipped, and the benchmarks
# say in one line that they measured nothing; the status is 0.
#
#     PYTHON=python3 benchmarks/gpu-check.sh
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TIER_SECONDS=${TIER_SECONDS:-150}
BENCH_SECONDS=${BENCH_SECONDS:-330}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
# The project's addopts name nbval's options, and nbval is not on the GPU machine: replaced.
timeout -k 10 "$TIER_SECONDS" "$PYTHON" -m pytest -o addopts="-ra --strict-markers" \
    -p no:cacheprovider -m gpu tests/gpu || status=$?
timeout -k 10 "$BENCH_SECONDS" "$PYTHON" benchmarks/gpu.py || status=$?
exit "$status"
