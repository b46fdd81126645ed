set -u
S="compute-sanitizer --tool racecheck"
run() { echo "== $*"; timeout 60 "$@" 2>&1 | grep -v "^Original\|^Error in sys\|^$" | tail -5; }
run python3 _probe/race_varlen.py fwdbwd
run $S --kernel-name kns=flash_fwd_sm90 python3 _probe/race_varlen.py fwd
run $S --kernel-name kns=flash_fwd_sm90 python3 _probe/race_varlen.py fwd nodropout
run $S --kernel-name kns=flash_fwd_sm90 python3 _probe/race_varlen.py fwdbwd
run $S python3 _probe/race_varlen.py fwdbwd
