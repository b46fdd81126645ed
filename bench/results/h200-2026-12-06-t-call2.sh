#!/usr/bin/env bash
# (t) call 2, on the same warm machine (kernel caches and /tmp/site kept): what call 1 wrote but could not bring
# back (8 files at most), packed into one archive after each stage: det old, the GPU tests, the variants suite old
# and new, the sanitizer; then the headdim suite on the new tree against cuDNN.
set -x
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS; export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0; ROOT=$PWD
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/t.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt
in_tree() {  # tree command...: in the tree's folder with its own kernel cache
  local tree=$1 dir=$ROOT; shift; [ "$tree" = old ] && dir=$ROOT/_old
  (cd "$dir" && PYTHONPATH=$dir:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-$tree "$@")
}
for tree in old new; do
  in_tree $tree timeout 50 python3 -c "import sys; sys.path.insert(0, 'bench'); import deterministic
deterministic.SHAPES = ((2, 16, 8192, 64), (4, 16, 4096, 64))
deterministic.main('$W/det-$tree.json', 'sm90')" > $W/det-$tree.log 2>&1; mark "det $tree exit $?"
done
export PYTHONPATH=$ROOT:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-new
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
timeout 100 python3 -m cuflash bench --suite headdim --backends cuflash,torch-cudnn --max-suite-seconds 80 \
  --json $W/headdim-new.json > $W/headdim-new.log 2>&1; mark "headdim exit $?"
