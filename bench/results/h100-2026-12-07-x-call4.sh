#!/usr/bin/env bash
# (x) call 4. Trees: . = main 2badd37 + D (flash_bwd_sm90 at d = 128: dK's dS^T from sdS, the next pair's S^T and
# dP^T issued while dK runs); _old = main. (1) compile; (2) GPU tests of the Hopper backward (sm90, variants,
# call path); (3) ncu kernel durations, old / new; (4) the in-turns driver, old / new, three rounds; (5) memcheck.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w4; rm -rf $W; mkdir -p $W; T0=$SECONDS; R=$PWD
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/x4.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt 2>&1
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m cuflash compile -j 4 --dtype bf16 > $W/compile_old.log 2>&1) &
timeout 90 python3 -m cuflash compile -j 12 > $W/compile.log 2>&1; mark "compile exit $?"
wait; mark "old compiled"
P="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60"
timeout 150 $P tests/test_gpu_variants.py > $W/pytest-variants.log 2>&1 &
timeout 150 $P tests/test_gpu_callpath.py -k "backward or determin or grad" > $W/pytest-callpath.log 2>&1 &
timeout 150 $P tests/test_gpu_sm90.py > $W/pytest-sm90.log 2>&1; mark "pytest sm90: $(tail -n 1 $W/pytest-sm90.log)"
wait; mark "variants: $(tail -n 1 $W/pytest-variants.log); callpath: $(tail -n 1 $W/pytest-callpath.log)"
M="--profile-from-start off --metrics gpu__time_duration.sum"
for a in "8192 128" "8192 128 causal" "2048 128"; do
  for t in _old .; do
    (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 30 ncu $M python3 $R/bench/bwd_probe.py sm90 $a \
      > "$W/ncu-${a// /-}$t.txt" 2>&1)
  done
done
mark "ncu done"
for r in 1 2 3; do
  for t in _old .; do
    (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 40 python3 $R/_call/ab.py $W/ab$t-$r.json > $W/ab$t-$r.log 2>&1)
    mark "ab $t $r exit $?"
  done
done
SANITIZE_TOOLS=memcheck SANITIZE_ARGS=--quick timeout 100 bash bench/sanitize.sh $W/sanitize.log > $W/sanitize.out 2>&1
mark "memcheck exit $?"
