# q call 3: the final d=256 tree (consumers also arrive on q_empty): the sanitizer, the GPU suite, the head-dim sweep
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
W=/tmp/w; mkdir -p $W
export CUFLASH_CACHE_DIR=/tmp/cuflash-new
python3 -m cuflash compile -j "$(nproc)" > $W/compile.log 2>&1; echo "compile $? at $SECONDS s"
SANITIZE_TIMEOUT=60 SANITIZE_TOOLS="racecheck synccheck memcheck" SANITIZE_ARGS="--family sm90 --quick" \
  timeout 120 bash bench/sanitize.sh $W/sanitize.log > /dev/null 2>&1; echo "sanitize $? at $SECONDS s"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|exit|cases passed" $W/sanitize.log
tar -czf $OUT/t.tgz -C $W .
OUT=$W/suite TEST_SECONDS=150 bash bench/device_run.sh test memory > $W/device_run.log 2>&1; tail -9 $W/device_run.log
echo "suite at $SECONDS s"; tar -czf $OUT/t.tgz -C $W .
for c in --causal --no-causal; do
  [ $SECONDS -gt 190 ] && break
  timeout $((235 - SECONDS)) python3 -m cuflash bench --family sm90 --suite headdim --dtype bf16 $c \
    --backends cuflash,torch-cudnn --json $W/headdim-bf16$c.json > $W/headdim-bf16$c.log 2>&1
  echo "headdim bf16 $c $? at $SECONDS s"; tar -czf $OUT/t.tgz -C $W .
done
