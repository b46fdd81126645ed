#!/usr/bin/env bash
# (r) lean call: HEAD (_old) against this tree (families.py bwd): d = 64 128 x 128 in two query halves, d = 256 dQ
# under dK; then the sm90 GPU tests until 215 s
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
W=/tmp/w; mkdir -p $W; T0=$SECONDS; export CUFLASH_CACHE_DIR=/tmp/cuflash-new
pack() { echo "$1 at $((SECONDS-T0))" >> $W/times.txt; tar czf $OUT/t.tgz -C $W .; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/gpu.txt
OLD=_old CAP=90 OUT=$W/ab bash bench/ab.sh bwd > $W/ab.out 2>&1; pack ab
timeout $((215 - (SECONDS - T0))) python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_sm90.py \
  > $W/pytest-sm90.log 2>&1; pack "pytest exit $?"
