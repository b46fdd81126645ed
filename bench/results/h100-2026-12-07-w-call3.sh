#!/usr/bin/env bash
# (w) call 3b (what the device time left allows of call 3). The tree: main 94b0aae + the backward's preprocess
# and postprocess with their loads in flight together (2509245); _old = main. (1) compile all; (2) the backward's
# GPU tests: tests/test_gpu_kernels.py (mma.sync and SIMT, every dtype) and test_gpu_sm90.py's backward tests,
# at once; (3) Nsight Compute's kernel durations, sm90 B2 H8 N512 d128; (4) the backward in turns, old then new.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/w3.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt 2>&1
timeout 70 python3 -m cuflash compile -j 16 > $W/compile.log 2>&1; mark "compile exit $?"
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m cuflash compile -j 4 --dtype bf16 > $W/compile-old.log 2>&1) &
P="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60"
timeout 80 $P tests/test_gpu_kernels.py > $W/pytest-kernels.log 2>&1 &
timeout 80 $P tests/test_gpu_sm90.py -k "backward" > $W/pytest-sm90-bwd.log 2>&1; mark "pytest sm90 exit $?"
wait; mark "pytest kernels: $(tail -n 1 $W/pytest-kernels.log)"
timeout 25 ncu --profile-from-start off --metrics gpu__time_duration.sum,launch__grid_size \
  python3 bench/bwd_probe.py sm90 512 128 none > $W/ncu-sm90-512-none.txt 2>&1; mark "ncu exit $?"
(cd _old && PYTHONPATH=/tmp/site:$PWD timeout 20 python3 ../_call/ab.py $W/ab-old-6.json bwd > $W/ab-old-6.log 2>&1)
mark "ab old exit $?"
timeout 20 python3 _call/ab.py $W/ab-new-6.json bwd > $W/ab-new-6.log 2>&1; mark "ab new exit $?"
