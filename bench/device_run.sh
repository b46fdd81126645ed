#!/usr/bin/env bash
# One call on the lent GPU machine: compile every kernel config once (in parallel), then the stages
# asked for, in order, each capped in time and logging under $OUT (what finished comes back even if
# the call runs out). Usage, from the repository root, after installing the carried wheels:
#   bash bench/device_run.sh [test] [bench] [sanitize] [memory]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -m cuflash info; } > "$OUT/gpu.txt" 2>&1
( time python3 -m cuflash compile -j "$(nproc)" ) >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# The GPU suite, stopped at the first test that hangs: a kernel that never returns (a barrier waited on
# forever) cannot be recovered in-process, and waiting on spends the rest of the stage's time. pytest's
# faulthandler dumps every stack into the log once a test has run HANG_SECONDS; then the suite is stopped.
gpu_suite() {
  local log=$OUT/pytest_gpu.log
  timeout "${TEST_SECONDS:-420}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=10 \
    -o faulthandler_timeout="${HANG_SECONDS:-90}" > "$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if grep -q "Timeout ([0-9:]*)!" "$log"; then
      sleep 1; kill "$pid"; echo "device_run.sh: a test hung (stacks above); suite stopped" >> "$log"; break
    fi
    sleep 1
  done
  wait "$pid"
}
rc=0
for stage in "$@"; do
  t0=$SECONDS
  case "$stage" in
    test) gpu_suite ;;
    bench) timeout "${BENCH_SECONDS:-200}" python3 -m cuflash bench --suite all --max-seconds "${BENCH_CAP:-170}" \
            --max-suite-seconds 60 --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1 ;;
    sanitize) SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-60} timeout 150 bash bench/sanitize.sh "$OUT/sanitizer.log" ;;
    memory) timeout 60 python3 bench/memory_check.py > "$OUT/memory.json" 2>&1 ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  s=$?; rc=$((rc | s))
  echo "stage $stage: exit $s in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
done
tail -n 25 "$OUT/pytest_gpu.log" 2>/dev/null; tail -n 5 "$OUT/sanitizer.log" 2>/dev/null
exit $rc
