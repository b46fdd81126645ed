#!/usr/bin/env bash
# (w) call 1. The tree: main 94b0aae + the candidate (flash_bwd_sm90's warp 1 loads LSE and D before waiting for the
# stage); _old = main. (1) compile all; (2) the whole GPU suite on the tree; (3) the backward in turns, old / new
# processes alternating twice; (4) the sm90 bench suites (seqlen, headdim; bf16, causal and not) on the tree.
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/w1.tgz -C $W .; }
left() { echo $((580 - SECONDS + T0)); }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt
timeout 150 python3 -m cuflash compile -j 16 > $W/compile.log 2>&1; mark "compile exit $?"
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m cuflash compile -j 6 --dtype bf16 > $W/compile-old.log 2>&1) &
TEST_SECONDS=170 OUT=$W bash bench/device_run.sh test > $W/suite.txt 2>&1; mark "suite exit $?"
wait; mark "compiled old"
for i in 1 2; do
  (cd _old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 ../_call/ab.py $W/ab-old-$i.json > $W/ab-old-$i.log 2>&1)
  mark "ab old $i exit $?"
  timeout 60 python3 _call/ab.py $W/ab-new-$i.json > $W/ab-new-$i.log 2>&1; mark "ab new $i exit $?"
done
bench() {  # dtype causal|no-causal
  timeout $(( $(left) < 75 ? $(left) : 75 )) python3 -m cuflash bench --family sm90 --suite seqlen,headdim --dtype $1 --$2 \
    --max-suite-seconds 35 --json $W/bench-sm90-$1-$2.json > $W/bench-sm90-$1-$2.log 2>&1; mark "bench $1 $2 exit $?"
}
for c in causal no-causal; do [ $(left) -gt 50 ] && bench bf16 $c; done
mark end
