#!/usr/bin/env bash
# One call on the lent GPU machine: compile every kernel once (in parallel), then the stages asked
# for, each logging under $OUT. Usage: bash bench/device_run.sh [test] [sanitize] [bench] [proto]
# Run from the repository root, after installing the carried wheels (see README, "Developing").
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 -m cuflash info | tee -a "$OUT/gpu.txt"
python3 -m cuflash compile -j "$(nproc)" 2>&1 | tail -30 | tee -a "$OUT/gpu.txt"
rc=0
for stage in "$@"; do
  case "$stage" in
    test) python3 -m pytest -m gpu -q -rfE --durations=15 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
          rc=$((rc | ${PIPESTATUS[0]})) ;;
    proto) NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 python3 -m pytest -q tests/test_proto.py -rfE 2>&1 | tee "$OUT/pytest_proto.log"
          rc=$((rc | ${PIPESTATUS[0]})) ;;
    sanitize) bash bench/sanitize.sh "$OUT/sanitizer.log"; rc=$((rc | $?)) ;;
    bench) python3 -m cuflash bench --suite all --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
          rc=$((rc | ${PIPESTATUS[0]})) ;;
    *) echo "unknown stage $stage"; rc=1 ;;
  esac
done
exit $rc
