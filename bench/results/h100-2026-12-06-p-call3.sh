# relaxed turn polls (wait_acquire) against main: deterministic.py sm90, old / new / old / new; then on the new tree
# the determinism tests and racecheck + synccheck (sm90, quick); all into $OUT/t.tgz
W=/tmp/w3; mkdir -p $W
pack() { tar -czf $OUT/t.tgz -C $W .; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
for r in 1 2; do for tree in old new; do
  dir=$PWD; [ $tree = old ] && dir=$PWD/_old
  (cd $dir && PYTHONPATH=$dir:$PYTHONPATH CUFLASH_CACHE_DIR=/tmp/cf-$tree timeout 90 python3 bench/deterministic.py \
     $W/det-sm90-r$r-$tree.json sm90) > $W/det-sm90-r$r-$tree.log 2>&1; echo "det r$r $tree $? at $SECONDS s"
done; done; pack
export CUFLASH_CACHE_DIR=/tmp/cf-new
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_sm90.py tests/test_gpu_kernels.py \
  tests/test_gpu_variants.py -k "determinis or bitwise" > $W/pytest-det.log 2>&1; echo "pytest $? at $SECONDS s"
tail -2 $W/pytest-det.log; pack
SANITIZE_TIMEOUT=60 SANITIZE_TOOLS="racecheck synccheck" SANITIZE_ARGS="--family sm90 --quick" \
  timeout $((560 - SECONDS)) bash bench/sanitize.sh $W/sanitize.log > /dev/null 2>&1; echo "sanitize $? at $SECONDS s"
tail -3 $W/sanitize.log; pack
