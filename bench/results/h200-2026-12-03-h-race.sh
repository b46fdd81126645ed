set -u
CASES=("bfloat16 128 0 0 300 517" "bfloat16 128 1 0 517 517" "bfloat16 64 0 0 300 517" "bfloat16 128 0 0.3 300 517" "bfloat16 128 0 0 300 300" "bfloat16 128 0 0 300 200" "bfloat16 256 0 0 300 517")
for c in "${CASES[@]}"; do timeout 60 python3 _probe/race.py $c; done > $OUT/race-plain.log 2>&1
for c in "${CASES[@]}"; do echo "== $c"; timeout 45 compute-sanitizer --tool racecheck --kernel-name kns=flash_fwd_sm90 python3 _probe/race.py $c 2>&1 | grep -v "^Original\|^Error in sys\|^$" | tail -4; done > $OUT/race-san.log 2>&1
