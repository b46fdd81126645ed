#!/usr/bin/env bash
# (v) call 1, main 2796275 + bwd_probe's -softcap flag. (1) Why the Hopper backward at d = 256 runs faster with a
# softcap than without (H100, 2026-12-07 (u): 0.86-0.92 of the plain time): the two in turns at d = 256 and 128,
# then Nsight Compute on each at d = 256 causal. (2) The suites on this GPU: seqlen + headdim (sm90 family, bf16 and
# fp16, causal and not), variants, launch, decode. Between them, an A/B at d = 256 against _new (the candidate: the
# dQ warp hands sQ back once the engine has read its rows, before sdO's). Files packed into one archive after each
# stage.
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/v1.tgz -C $W .; }
left() { echo $((575 - SECONDS + T0)); }
{ date -u +%FT%TZ; git log -1 --format=%H 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt
timeout 150 python3 -m cuflash compile -j 16 --dtype bf16 > $W/compile.log 2>&1; mark "compile exit $?"
# the candidate's bf16 kernels in the background (the same cache: only its flash_bwd_sm90 configs are new)
(cd _new && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m cuflash compile -j 8 --dtype bf16 > $W/compile-new.log 2>&1) &
AB='import json, sys
sys.path.insert(0, "bench")
from deterministic import inputs, ms_in_turns
import cuflash
rows = []
for b, h, n, d in ((2, 4, 8192, 256), (2, 8, 8192, 128))[:int(sys.argv[2])]:
    q, k, v, do = inputs(b, h, n, d)
    for causal in (True, False):
        fs = []
        for kw in ({}, {"softcap": 30.0}):
            o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal, **kw)
            fs.append(lambda o=o, lse=lse, kw=kw: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, **kw))
        plain, soft = ms_in_turns(fs)
        rows.append({"shape": [b, h, n, d], "causal": causal, "plain_ms": round(plain, 4), "softcap_ms": round(soft, 4),
                     "softcap_over_plain": round(soft / plain, 4)})
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)'
timeout 90 python3 -c "$AB" $W/ab.json 2 > $W/ab.log 2>&1; mark "ab exit $?"
NCU="ncu --profile-from-start off -k regex:flash_bwd --section SpeedOfLight --section MemoryWorkloadAnalysis
  --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats
  --section Occupancy --section SourceCounters"
for w in sm90 sm90-softcap; do
  timeout 60 $NCU python3 bench/bwd_probe.py $w 8192 256 causal > $W/ncu-d256-causal-$w.txt 2>&1; mark "ncu $w exit $?"
done
wait; mark "compiled new"
for i in 1 2; do  # the candidate
  (cd _new && PYTHONPATH=/tmp/site:$PWD timeout 90 python3 -c "$AB" $W/ab-new-$i.json 1 > $W/ab-new-$i.log 2>&1)
  mark "ab new $i exit $?"
  timeout 60 python3 -c "$AB" $W/ab-old-$i.json 1 > $W/ab-old-$i.log 2>&1; mark "ab old $i exit $?"
done
bench() {  # dtype causal|no-causal
  timeout $(( $(left) < 75 ? $(left) : 75 )) python3 -m cuflash bench --family sm90 --suite seqlen,headdim --dtype $1 --$2 \
    --max-suite-seconds 35 --json $W/bench-sm90-$1-$2.json > $W/bench-sm90-$1-$2.log 2>&1; mark "bench $1 $2 exit $?"
}
bench bf16 causal; bench bf16 no-causal
timeout 45 python3 -m cuflash bench --suite variants --max-suite-seconds 40 --json $W/variants.json > $W/variants.log 2>&1
mark "variants exit $?"
timeout 40 python3 -m cuflash bench --suite decode --max-suite-seconds 35 --json $W/decode.json > $W/decode.log 2>&1
mark "decode exit $?"
timeout 45 python3 -m cuflash bench --suite launch --max-suite-seconds 40 --json $W/launch.json > $W/launch.log 2>&1
mark "launch exit $?"
for c in causal no-causal; do [ $(left) -gt 45 ] && bench fp16 $c; done
