# q call 2: d=256 dQ by bulk reduces over the stage (new) against main (_old); tests, sanitizer, ncu
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
W=/tmp/w; mkdir -p $W
OLD=_old CAP=150 OUT=$W/ab bash bench/ab.sh bwd det-sm90
export CUFLASH_CACHE_DIR=/tmp/cuflash-new
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_sm90.py -k "256 or 200" > $W/pytest-d256.log 2>&1
echo "pytest $? at $SECONDS s"; tail -3 $W/pytest-d256.log
tar -czf $OUT/t.tgz -C $W .
SANITIZE_TIMEOUT=60 SANITIZE_TOOLS="racecheck synccheck memcheck" SANITIZE_ARGS="--family sm90 --quick" \
  timeout 200 bash bench/sanitize.sh $W/sanitize.log > /dev/null 2>&1; echo "sanitize $? at $SECONDS s"
tail -4 $W/sanitize.log
tar -czf $OUT/t.tgz -C $W .
M='gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,lts__t_sectors_op_red.sum,lts__t_sectors.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for w in sm90-256 cudnn-256 cudnn-64 sm90-64; do
  [ $SECONDS -gt 540 ] && break
  timeout $((580 - SECONDS)) ncu --profile-from-start off --section SpeedOfLight --section LaunchStats \
    --section Occupancy --metrics "$M" python3 bench/bwd_probe.py ${w%-*} 8192 ${w#*-} > $W/ncu-$w.txt 2>&1
  echo "ncu $w $? at $SECONDS s"; tar -czf $OUT/t.tgz -C $W .
done
