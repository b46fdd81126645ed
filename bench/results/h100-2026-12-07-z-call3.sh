#!/usr/bin/env bash
# NVRTC 13.5 (what `pip install cuflash[all]` resolves to without torch) against this machine's NVRTC 13.0: one
# tree (_n135, a git archive of HEAD), built by each. "n135": _n135/nvidia -> the 13.5 wheel's libraries, found
# first on sys.path by cuda-pathfinder; "n130": the same tree without that link. Each its own kernel caches.
set -u
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/nv135 && tar xJf .whl/nvrtc135.tar.xz -C /tmp/nv135
cp -r _n135 /tmp/n130 && ln -sfn /tmp/nv135/nvidia _n135/nvidia
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
run() {  # tree stage command...
  local tree=$1 stage=$2 dir=$PWD/_n135; shift 2
  local pre= lib=
  [ "$tree" = n130 ] && dir=/tmp/n130
  [ "$tree" = n135 ] && lib=/tmp/nv135/nvidia/cu13/lib && pre=$lib/libnvrtc.so.13
  (cd "$dir" && LD_PRELOAD=$pre LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$dir:/tmp/site \
     CUFLASH_CACHE_DIR=/tmp/cf-$tree CUPY_CACHE_DIR=/tmp/cc-$tree \
     timeout 200 "$@") > "$OUT/$stage-$tree-r2.log" 2>&1
  echo "$stage $tree: exit $? at $SECONDS s" | tee -a "$OUT/times.txt"
}
for tree in n130 n135; do
  run $tree versions python3 -c "
import cupy, cuda.pathfinder as pf
from cuflash import _compile
print('cupy nvrtc', cupy.cuda.nvrtc.getVersion(), 'cuda-bindings nvrtc', _compile.nvrtc_version())
print(pf.load_nvidia_dynamic_lib('nvrtc'))"
  cat "$OUT/versions-$tree.log"
  run $tree compile python3 -m cuflash compile -j 16 --dtype bf16
done
for stage in causal full headdim; do
  for tree in n130 n135; do
    flag="--suite seqlen --causal"; [ $stage = full ] && flag="--suite seqlen --no-causal"
    [ $stage = headdim ] && flag="--suite headdim --causal"
    run $tree $stage python3 -m cuflash bench $flag --backends cuflash,torch-cudnn \
      --json "$OUT/$stage-$tree-r2.json"
  done
done
tar czf $OUT/call.tgz -C $OUT --exclude call.tgz --exclude call1.log . 
