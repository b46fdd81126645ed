#!/usr/bin/env bash
# (y) call 1: main as it stands, on the lent GPU: the sm90 family's seqlen suite and head-dim sweep against torch's
# flash and cuDNN backends (bf16, fp16; causal and not), the launch, variants and decode suites, the deterministic
# ratio, then the GPU suite. Everything under $W, tarred to $OUT after each stage.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w1; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s $(date -u +%T)" >> $W/times.txt; tar czf $OUT/y1.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv; } > $W/gpu0.txt 2>&1
cat $W/gpu0.txt
timeout 120 python3 -m cuflash compile -j 16 > $W/compile.log 2>&1; mark "compiled exit $?"
for dt in bf16 fp16; do for c in causal no-causal; do
  timeout 60 python3 -m cuflash bench --family sm90 --suite seqlen,headdim --dtype $dt --$c --max-suite-seconds 50 \
    --backends cuflash,torch-flash,torch-cudnn --json $W/bench-sm90-$dt-$c.json > $W/bench-sm90-$dt-$c.log 2>&1
  mark "sm90 $dt $c exit $?"
done; done
for s in launch variants decode; do
  timeout 60 python3 -m cuflash bench --suite $s --json $W/$s.json > $W/$s.log 2>&1; mark "$s exit $?"
done
timeout 40 python3 bench/deterministic.py $W/det-sm90.json sm90 > $W/det-sm90.log 2>&1; mark "det exit $?"
OUT=$W TEST_SECONDS=150 bash bench/device_run.sh test > $W/device_run.log 2>&1; mark "tests exit $?"
cat $W/times.txt; tail -n 6 $W/device_run.log
