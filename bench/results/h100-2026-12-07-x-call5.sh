#!/usr/bin/env bash
# (x) call 5 (call 4's machine): D without the causal mask only; ncu and the in-turns driver, old / new.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/w5; rm -rf $W; mkdir -p $W; R=$PWD
timeout 60 python3 -m cuflash compile -j 16 --dtype bf16 > $W/compile.log 2>&1
M="--profile-from-start off --metrics gpu__time_duration.sum"
for a in "8192 128" "8192 128 causal"; do
  for t in _old .; do
    (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 30 ncu $M python3 $R/bench/bwd_probe.py sm90 $a > "$W/ncu-${a// /-}$t.txt" 2>&1)
  done
done
for r in 1 2; do for t in _old .; do
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 40 python3 $R/_call/ab.py $W/ab$t-$r.json > $W/ab$t-$r.log 2>&1)
done; done
tar czf $OUT/x5.tgz -C $W .
for f in $W/ncu-*; do echo "== $(basename $f)"; grep -o "flash_bwd_sm90<[^>]*>\|duration.sum *[mu]s *[0-9.]*" $f | sed -n 3,4p; done
python3 -c "
import json
for r in (1,2):
  o=json.load(open('$W/ab_old-%d.json'%r)); n=json.load(open('$W/ab.-%d.json'%r))
  for a,b in zip(o,n):
    if a['mode']=='bwd' and a['shape'][2]>=2048: print(r,a['shape'],a['causal'],a['ms'],b['ms'],round(a['ms']/b['ms'],3))
"
