#!/usr/bin/env bash
# (x) call 1. Trees: . = main a863e08 + A (pre/postprocess 16 warps) + B (tensor-map prefetch) + C (3 Q/dO stages
# in the Hopper backward at d = 128); _old = main, _a = main + A, _ab = main + A + B (git archives).
# (1) compile; (2) the whole GPU suite on .; (3) ab.py in turns, old, a, ab, abc, two rounds; (4) memcheck quick;
# (5) the seqlen suite non-causal, sm90 bf16; (6) the launch suite.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/x1.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt 2>&1
for t in _old _a _ab; do
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m cuflash compile -j 3 --dtype bf16 > $W/compile$t.log 2>&1) &
done
timeout 90 python3 -m cuflash compile -j 8 > $W/compile.log 2>&1; mark "compile exit $?"
wait; mark "old trees compiled"
TEST_SECONDS=170 OUT=$W timeout 200 bash bench/device_run.sh test > $W/suite.txt 2>&1; mark "suite exit $?"
for r in 1 2; do
  for t in _old _a _ab .; do
    (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 40 python3 $OLDPWD/_call/ab.py $W/ab$t-$r.json > $W/ab$t-$r.log 2>&1)
    mark "ab $t $r exit $?"
  done
done
SANITIZE_TOOLS=memcheck SANITIZE_ARGS=--quick timeout 100 bash bench/sanitize.sh $W/sanitize.log > $W/sanitize.out 2>&1
mark "memcheck exit $?"
timeout 70 python3 -m cuflash bench --family sm90 --suite seqlen --dtype bf16 --no-causal --max-suite-seconds 45 \
  --json $W/bench-seqlen-nc.json > $W/bench-seqlen-nc.log 2>&1; mark "bench exit $?"
timeout 50 python3 -m cuflash bench --suite launch --json $W/launch.json > $W/launch.log 2>&1; mark "launch exit $?"
