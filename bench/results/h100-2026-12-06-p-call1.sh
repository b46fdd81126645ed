# rows-early against HEAD (A/B), then on rows-early: the GPU suite, memory, the sanitizer (sm90, quick)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
OLD=_old CAP=150 OUT=$OUT/x bash bench/ab.sh bwd det-sm90
export CUFLASH_CACHE_DIR=/tmp/cuflash-new
W=/tmp/w; mkdir -p $W
OUT=$W TEST_SECONDS=150 bash bench/device_run.sh test memory > $W/device_run.log 2>&1; tail -9 $W/device_run.log
echo "at $SECONDS s"
SANITIZE_TIMEOUT=60 SANITIZE_TOOLS="racecheck synccheck memcheck" SANITIZE_ARGS="--family sm90 --quick" \
  timeout 200 bash bench/sanitize.sh $W/sanitize.log > /dev/null 2>&1; echo "sanitize $? at $SECONDS s"
tail -4 $W/sanitize.log
tar -czf $OUT/t.tgz -C $W .
# Where the deterministic causal backward waits: B2 H8 N16384 d128, atomic and deterministic (rows-early tree)
M='gpu__time_duration.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for w in sm90 sm90-det; do
  timeout $((585 - SECONDS)) ncu --profile-from-start off -k 'regex:^flash_bwd_sm90$' --metrics "$M" \
    python3 bench/bwd_probe.py $w 16384 128 causal > $W/ncu-$w-causal.txt 2>&1; echo "ncu $w $? at $SECONDS s"
done
tar -czf $OUT/t.tgz -C $W .
timeout $((590 - SECONDS)) ncu --profile-from-start off -k 'regex:^flash_bwd_sm90$' --page source --csv --print-source sass \
  --section SourceCounters --section WarpStateStats python3 bench/bwd_probe.py sm90-det 16384 128 causal 2>&1 \
  | gzip > $W/ncu-sm90-det-causal-sass.csv.gz; echo "ncu sass $? at $SECONDS s"
tar -czf $OUT/t.tgz -C $W .
