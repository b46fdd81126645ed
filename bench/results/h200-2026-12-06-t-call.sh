#!/usr/bin/env bash
# (t) call: main c9c5be3 (_old) against this tree (d = 64's Hopper backward at 128 x 128, a consumer's queries in
# two halves; deterministic too, the small block in the alignment slack), in priority order. Kernel time, old then
# new: the backward at d = 64 (and d = 128, 256 as controls) beside cuDNN and FA2 (families.py), deterministic
# against atomic at d = 64 (deterministic.py, sm90 forced); the new tree's GPU tests (4 processes); the variants
# suite at d = 64, old then new; the sanitizer over the Hopper family.
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
W=$OUT; T0=$SECONDS; export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0; ROOT=$PWD
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt
# the new tree's kernels compile in the background (CPU) while the backward is timed
(CUFLASH_CACHE_DIR=/tmp/cuflash-new timeout 240 python3 -m cuflash compile -j 8 > $W/compile-new.log 2>&1
 echo "compile exit $?" >> $W/compile-new.log) &
in_tree() {  # tree command...: in the tree's folder with its own kernel cache
  local tree=$1 dir=$ROOT; shift; [ "$tree" = old ] && dir=$ROOT/_old
  (cd "$dir" && PYTHONPATH=$dir:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-$tree "$@")
}
for tree in old new; do
  in_tree $tree timeout 100 python3 -c "import sys; sys.path.insert(0, 'bench'); import families
families.SHAPES = ((2, 16, 8192, 64), (4, 16, 4096, 64), (1, 16, 16384, 64), (2, 8, 8192, 128), (2, 4, 8192, 256))
families.main('bwd', '$W/bwd-$tree.json')" > $W/bwd-$tree.log 2>&1; mark "bwd $tree exit $?"
done
for tree in old new; do
  in_tree $tree timeout 50 python3 -c "import sys; sys.path.insert(0, 'bench'); import deterministic
deterministic.SHAPES = ((2, 16, 8192, 64), (4, 16, 4096, 64))
deterministic.main('$W/det-$tree.json', 'sm90')" > $W/det-$tree.log 2>&1; mark "det $tree exit $?"
done
export PYTHONPATH=$ROOT:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-new
wait; mark compiled
t() { timeout 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=80 "$@"; }
t tests/test_gpu_sm90.py -k "backward or bwd or determinis" > $W/pytest-sm90-bwd.log 2>&1 &
t tests/test_gpu_sm90.py -k "not (backward or bwd or determinis)" > $W/pytest-sm90-rest.log 2>&1 &
t tests/test_gpu_variants.py > $W/pytest-variants.log 2>&1 &
t tests/test_gpu_kernels.py > $W/pytest-kernels.log 2>&1 &
wait; mark tests
for tree in old new; do
  in_tree $tree timeout 60 python3 -m cuflash bench --suite variants --backends cuflash --head-dim 64 --heads 16 \
    --seqlens 8192 --max-suite-seconds 45 --json $W/variants-$tree.json > $W/variants-$tree.log 2>&1
  mark "variants $tree exit $?"
done
SANITIZE_ARGS="--family sm90 --quick" SANITIZE_TIMEOUT=60 timeout 150 bash bench/sanitize.sh $W/sanitizer.log
mark "sanitizer exit $?"
