#!/usr/bin/env bash
# (x) call 6: D (non-causal d = 128): the deterministic and atomic backwards, old / new (bench/deterministic.py, sm90),
# then the non-causal seqlen suite on the new tree against cuDNN.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w6; rm -rf $W; mkdir -p $W; R=$PWD; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/x6.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $W/gpu.txt 2>&1
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -m cuflash compile -j 6 --dtype bf16 > $W/compile_old.log 2>&1) &
timeout 90 python3 -m cuflash compile -j 10 --dtype bf16 > $W/compile.log 2>&1; wait; mark compiled
for t in _old .; do
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 $R/bench/deterministic.py $W/det$t.json sm90 > $W/det$t.log 2>&1)
  mark "det $t exit $?"
done
timeout 80 python3 -m cuflash bench --family sm90 --suite seqlen --dtype bf16 --no-causal --max-suite-seconds 50 \
  --backends cuflash,torch-flash,torch-cudnn --json $W/bench-nc.json > $W/bench-nc.log 2>&1; mark "bench exit $?"
cat $W/times.txt; tail -n 12 $W/det_old.log $W/det..log; grep "│" $W/bench-nc.log | awk -F'│' '{print $2,$3,$6}'
