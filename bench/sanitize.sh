#!/usr/bin/env bash
# The CUDA kernels under compute-sanitizer: memcheck (out-of-bounds and misaligned accesses, device
# faults) and racecheck (shared-memory hazards), over the tiny sweep of bench/sanitize_cases.py.
#
#   bash bench/sanitize.sh [LOGFILE]        # log to LOGFILE (appended), else to stdout
#
# Environment: PYTHON (default python3), COMPUTE_SANITIZER (default: on PATH, else
# /usr/local/cuda/bin/compute-sanitizer), SANITIZE_TOOLS (default "memcheck racecheck"; initcheck
# and synccheck work too), SANITIZE_ARGS (arguments to sanitize_cases.py for every tool; unset:
# the full sweep, except racecheck, the slowest tool, which gets --quick, every third case),
# SANITIZE_TIMEOUT (seconds per tool, default 300; running out counts as a failure).
# Exit status: 0 only if the plain run and every tool report no error.
#
# First the sweep runs once without the sanitizer: it fills CuPy's kernel cache (NVRTC compiles
# outside the slow instrumented runs) and checks the results against the reference. The sanitizer
# then checks only cuflash's kernels (--kernel-name kns=cuflash), not CuPy's own.
set -uo pipefail
cd "$(dirname "$0")/.."

LOG=${1:-}
PY=${PYTHON:-python3}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
ARGS_SET=${SANITIZE_ARGS+set}
ARGS=${SANITIZE_ARGS:-}
LIMIT=${SANITIZE_TIMEOUT:-300}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}

say() { if [ -n "$LOG" ]; then echo "$@" | tee -a "$LOG"; else echo "$@"; fi; }
run() {  # run a command, its output to the log (or stdout); returns its exit status
  if [ -n "$LOG" ]; then "$@" >>"$LOG" 2>&1; else "$@" 2>&1; fi
}

if [ -n "$LOG" ]; then mkdir -p "$(dirname "$LOG")"; : >"$LOG"; fi
if [ ! -x "$SAN" ]; then
  say "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)"
  exit 2
fi
say "sanitize: $("$SAN" --version | tail -n 1)"

# Restrict instrumentation to our kernels where this compute-sanitizer knows the option.
FILTER=()
if "$SAN" --help 2>/dev/null | grep -q -- "--kernel-name"; then
  FILTER=(--kernel-name kns=cuflash)
fi

rc=0
t0=$SECONDS
say "== plain run (compiles kernels, checks results)"
run "$PY" bench/sanitize_cases.py $ARGS
status=$?
say "plain: exit $status ($((SECONDS - t0)) s)"
[ $status -eq 0 ] || rc=1

for tool in $TOOLS; do
  t0=$SECONDS
  extra=()
  args=$ARGS
  if [ "$tool" = racecheck ]; then
    extra=(--racecheck-report all)
    [ -z "$ARGS_SET" ] && args=--quick
  fi
  say "== $tool $args"
  run timeout "$LIMIT" "$SAN" --tool "$tool" --error-exitcode 1 --print-limit 100 "${FILTER[@]}" "${extra[@]}" \
    "$PY" bench/sanitize_cases.py $args
  status=$?
  [ $status -eq 124 ] && say "$tool: timed out after $LIMIT s"
  say "$tool: exit $status ($((SECONDS - t0)) s)"
  [ $status -eq 0 ] || rc=1
done

if [ $rc -eq 0 ]; then say "sanitize: clean"; else say "sanitize: ERRORS (see above)"; fi
exit $rc
