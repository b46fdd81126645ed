#!/usr/bin/env bash
# One call on the lent GPU machine: compile every kernel config once (in parallel), then the stages
# asked for, in order, each capped in time and logging under $OUT (what finished comes back even if
# the call runs out). Usage, from the repository root, after installing the carried wheels:
#   bash bench/device_run.sh [test] [targets] [bench] [sanitize] [memory]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -m cuflash info; } > "$OUT/gpu.txt" 2>&1
( time python3 -m cuflash compile -j "$(nproc)" ) >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# The GPU suite, as concurrent pytest processes over disjoint groups of files: its tests are mostly host-bound
# (float64 references, compiles of the Numba mirrors), so five processes share the one GPU and end in a third of
# the time of one (2026-12-04: 496 tests in 95 s, against 275 s in one process). The last group is every file
# the others do not name, new ones included. It stops at the first test that hangs: a kernel that never
# returns (a barrier waited on forever) cannot be recovered in-process, and waiting on spends the rest of the
# stage's time. pytest's faulthandler dumps every stack into the log once a test has run HANG_SECONDS; then
# every group is stopped. One log, pytest_gpu.log, holds the groups' logs in turn.
GPU_GROUPS=(tests/test_gpu_kernels.py "tests/test_gpu_sm90.py tests/test_gpu_variants.py"
            "tests/test_gpu_kvcache.py tests/test_gpu_callpath.py" tests/test_proto.py)
gpu_suite() {
  local log=$OUT/pytest_gpu.log logs; logs=$(mktemp -d)
  local -a rest=(tests) pids=() args=()
  local i s status=0 hung=
  for i in ${GPU_GROUPS[*]}; do rest+=("--ignore=$i"); done
  for i in "${!GPU_GROUPS[@]}" rest; do
    if [ "$i" = rest ]; then args=("${rest[@]}"); else read -ra args <<< "${GPU_GROUPS[$i]}"; fi
    echo "pytest -m gpu ${args[*]}" > "$logs/$i.args"
    timeout "${TEST_SECONDS:-420}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=5 \
      -o faulthandler_timeout="${HANG_SECONDS:-90}" "${args[@]}" > "$logs/$i.log" 2>&1 &
    pids+=($!)
  done
  while kill -0 "${pids[@]}" 2>/dev/null; do  # while any group runs
    if grep -q "Timeout ([0-9:]*)!" "$logs"/*.log; then
      sleep 1; kill "${pids[@]}" 2>/dev/null; hung=1; break
    fi
    sleep 1
  done
  for i in "${pids[@]}"; do wait "$i"; s=$?; [ "$status" -ne 0 ] || status=$s; done
  : > "$log"
  for i in "${!GPU_GROUPS[@]}" rest; do
    { echo "== $(cat "$logs/$i.args")"; cat "$logs/$i.log"; } >> "$log"
    echo "$(cat "$logs/$i.args"): $(tail -n 1 "$logs/$i.log")"
  done
  [ -z "$hung" ] || echo "device_run.sh: a test hung (stacks above); suite stopped" >> "$log"
  rm -rf "$logs"
  return "$status"
}
# The issues' target cells: each family's seqlen suite and head-dim sweep against its baselines (the Hopper family
# against cuDNN and FlashAttention-2, the mma.sync family against FlashAttention-2), bf16 and fp16, causal and not,
# then each family's deterministic ratio (bench/deterministic.py): bench-FAMILY-DTYPE-MASK.json and det-FAMILY.json,
# each with its log, under $OUT.
targets() {
  local family dtype mask backends status=0
  for family in sm90 mma; do
    backends=cuflash,torch-flash; [ "$family" = sm90 ] && backends+=,torch-cudnn
    for dtype in bf16 fp16; do for mask in causal no-causal; do
      local name=$OUT/bench-$family-$dtype-$mask
      timeout 60 python3 -m cuflash bench --family "$family" --suite seqlen,headdim --dtype "$dtype" "--$mask" \
        --max-suite-seconds 45 --backends "$backends" --json "$name.json" > "$name.log" 2>&1 || status=$?
    done; done
    timeout 40 python3 bench/deterministic.py "$OUT/det-$family.json" "$family" > "$OUT/det-$family.log" 2>&1 \
      || status=$?
  done
  return "$status"
}
rc=0
for stage in "$@"; do
  t0=$SECONDS
  case "$stage" in
    test) gpu_suite ;;
    targets) targets ;;
    bench) timeout "${BENCH_SECONDS:-200}" python3 -m cuflash bench --suite all --max-seconds "${BENCH_CAP:-170}" \
            --max-suite-seconds 60 --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1 ;;
    sanitize) SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-60} timeout 150 bash bench/sanitize.sh "$OUT/sanitizer.log" ;;
    memory) timeout 60 python3 bench/memory_check.py > "$OUT/memory.json" 2>&1 ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  s=$?; rc=$((rc | s))
  echo "stage $stage: exit $s in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
done
tail -n 5 "$OUT/sanitizer.log" 2>/dev/null
exit $rc
