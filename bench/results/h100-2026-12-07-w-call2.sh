#!/usr/bin/env bash
# (w) call 2. The tree: main 94b0aae + flash_bwd_sm90's warp 1 loading LSE and D before its wait; _old = main.
# (1) the backward in turns, old / new processes alternating three times; (2) Nsight Compute's duration of every
# kernel of one backward, cuflash (sm90) and cuDNN, B2 H8 d128 N = 512 and 1024, causal and not; (3) the seqlen
# suite causal (bf16) with time for N = 8192 and 16384.
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/w2.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; which nsys; } > $W/gpu.txt 2>&1
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m cuflash compile -j 6 --dtype bf16 > $W/compile-old.log 2>&1) &
timeout 150 python3 -m cuflash compile -j 10 --dtype bf16 > $W/compile.log 2>&1; mark "compile exit $?"
wait; mark "compiled old"
for i in 3 4 5; do
  (cd _old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 ../_call/ab.py $W/ab-old-$i.json bwd > $W/ab-old-$i.log 2>&1)
  mark "ab old $i exit $?"
  timeout 60 python3 _call/ab.py $W/ab-new-$i.json bwd > $W/ab-new-$i.log 2>&1; mark "ab new $i exit $?"
done
for n in 512 1024; do for c in none causal; do for w in sm90 cudnn; do
  timeout 40 ncu --profile-from-start off --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size \
    python3 bench/bwd_probe.py $w $n 128 $c > $W/ncu-$w-$n-$c.txt 2>&1; mark "ncu $w $n $c exit $?"
done; done; done
timeout 130 python3 -m cuflash bench --family sm90 --suite seqlen --dtype bf16 --causal --max-suite-seconds 110 \
  --json $W/bench-sm90-bf16-causal-seqlen.json > $W/bench-sm90-bf16-causal-seqlen.log 2>&1; mark "bench exit $?"
mark end
