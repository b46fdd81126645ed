#!/usr/bin/env bash
# (u) call: main 5855eed (this checkout, "old") against _new (f78bf09 copied in: the dead kDqOwnKeys path removed,
# and the Hopper backward keeps the softcap's 1 - t^2 from [5] to [7] as fp16 pairs instead of recovering it from P
# by a log2; not with dropout). In priority order: the backward with and without a softcap, in turns (their ratio),
# old then new, twice, with the new tree's GPU tests between the rounds; the variants suite at d = 64, old then
# new; the sanitizer over the Hopper family (quick). Files packed into one archive after each stage (the device
# tool returns 8 files a call).
set -x
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
W=/tmp/w; rm -rf $W; mkdir -p $W; T0=$SECONDS; export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0; ROOT=$PWD
mark() { echo "$1 at $((SECONDS - T0)) s" >> $W/times.txt; tar czf $OUT/u.tgz -C $W .; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; } > $W/gpu.txt
in_tree() {  # tree command...: in the tree's folder with its own kernel cache
  local tree=$1 dir=$ROOT; shift; [ "$tree" = new ] && dir=$ROOT/_new
  (cd "$dir" && PYTHONPATH=$dir:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-$tree "$@")
}
for tree in old new; do  # both trees' kernels, up front (each process then finds them cached)
  (in_tree $tree timeout 150 python3 -m cuflash compile -j 8 > $W/compile-$tree.log 2>&1; echo "exit $?" >> $W/compile-$tree.log) &
done
wait; mark compiled
AB='import json, sys
sys.path.insert(0, "bench")
from deterministic import inputs, ms_in_turns
import cuflash
rows = []
for b, h, n, d in ((2, 16, 8192, 64), (2, 8, 8192, 128), (2, 4, 8192, 256)):
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
for tree in old new; do
  in_tree $tree timeout 100 python3 -c "$AB" $W/ab-$tree-1.json > $W/ab-$tree-1.log 2>&1
  mark "ab $tree 1 exit $?"
done
(
cd $ROOT/_new; export PYTHONPATH=$ROOT/_new:/tmp/site CUFLASH_CACHE_DIR=/tmp/cuflash-new
t() { timeout 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=80 "$@"; }
t tests/test_gpu_sm90.py -k "backward or bwd or determinis" > $W/pytest-sm90-bwd.log 2>&1 &
t tests/test_gpu_sm90.py -k "not (backward or bwd or determinis)" > $W/pytest-sm90-rest.log 2>&1 &
t tests/test_gpu_variants.py > $W/pytest-variants.log 2>&1 &
wait; mark tests
)
for tree in old new; do
  in_tree $tree timeout 100 python3 -c "$AB" $W/ab-$tree-2.json > $W/ab-$tree-2.log 2>&1
  mark "ab $tree 2 exit $?"
done
for shape in "--head-dim 64 --heads 16"; do
  for tree in old new; do
    tag=$tree-d$(echo $shape | cut -d' ' -f2)
    in_tree $tree timeout 50 python3 -m cuflash bench --suite variants --backends cuflash $shape --seqlens 8192 \
      --max-suite-seconds 35 --json $W/variants-$tag.json > $W/variants-$tag.log 2>&1
    mark "variants $tag exit $?"
  done
done
SANITIZE_ARGS="--family sm90 --quick" SANITIZE_TIMEOUT=30 in_tree new timeout 60 bash bench/sanitize.sh $W/sanitizer.log
mark "sanitizer exit $?"
