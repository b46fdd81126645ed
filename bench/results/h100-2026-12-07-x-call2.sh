#!/usr/bin/env bash
# (x) call 2 (the warm machine of call 1): Nsight Compute kernel durations, old / ab / abc trees.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/w2; rm -rf $W; mkdir -p $W; R=$PWD
M="--profile-from-start off --metrics gpu__time_duration.sum"
for t in _old _a _ab .; do
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 30 ncu $M python3 $R/bench/bwd_probe.py sm90 512 128 > $W/ncu-bwd512$t.txt 2>&1)
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 30 ncu $M python3 $R/_call/fwd_probe.py 1024 128 > $W/ncu-fwd1024$t.txt 2>&1)
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 30 ncu $M python3 $R/bench/bwd_probe.py sm90 8192 128 > $W/ncu-bwd8192$t.txt 2>&1)
  tar czf $OUT/x2.tgz -C $W .
done
