#!/usr/bin/env bash
# (y) call 3: the deterministic Hopper backward's dQ warps prefetch the next dQ tile into L2 (candidate) against
# main 603dce5 (_old): bench/deterministic.py in both trees, flash_bwd_sm90 under Nsight Compute (one launch, locked
# clock) old and new in turns; then the GPU tests of the Hopper kernels on the new tree.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w3; rm -rf $W; mkdir -p $W; R=$PWD; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s $(date -u +%T)" >> $W/times.txt; tar czf $OUT/y3.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $W/gpu.txt 2>&1
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m cuflash compile -j 8 --dtype bf16 > $W/compile_old.log 2>&1) &
timeout 100 python3 -m cuflash compile -j 8 --dtype bf16 > $W/compile.log 2>&1; wait; mark compiled
for round in 1 2; do for t in _old .; do
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 $R/bench/deterministic.py $W/det$t-$round.json sm90 \
    > $W/det$t-$round.log 2>&1)
  mark "det $t $round exit $?"
done; done
while read -r args; do
  for t in _old .; do
    echo "== $t $args" >> $W/ncu.txt
    (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 40 ncu --profile-from-start off --metrics gpu__time_duration.sum \
      python3 $R/bench/bwd_probe.py $args 2>&1 | grep -E "flash_bwd|gpu__time_duration" >> $W/ncu.txt)
  done
  mark "$args"
done <<'P'
sm90-det 8192 64
sm90-det 8192 64 causal
sm90-det 4096 64
sm90-det 16384 128
sm90-det 8192 256
sm90-det-dropout 8192 128
sm90 8192 64
P
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sm90.py tests/test_gpu_variants.py \
  > $W/pytest_sm90.log 2>&1 &
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py > $W/pytest_kernels.log 2>&1
wait; mark tests
cat $W/times.txt; tail -n 2 $W/pytest_*.log; grep -h det_over /tmp/w3/det*.json | head -0
