#!/usr/bin/env bash
# A/B on the lent GPU machine: each stage asked for runs on the OLD tree, then on this one (NEW), in one
# call, each tree with its own kernel cache; after every stage all outputs are packed into $OUT/ab.tgz (the
# device tool brings back at most 8 files). OLD is a folder holding a `git archive` of the commit to compare
# against, made here and carried with the working tree (an untracked folder travels):
#   git archive REV cuflash kernels_cu bench pyproject.toml | (mkdir -p _old && tar -x -C _old)
#   OLD=_old bash bench/ab.sh causal full det bwd fwd      # on the device, after installing the wheels
# Stages: causal / full (`cuflash bench --suite seqlen` against cuDNN, with or without --no-causal), headdim
# (`cuflash bench --suite headdim` against cuDNN), variants (`cuflash bench --suite variants`, cuflash alone),
# decode (`cuflash bench --suite decode`, cuflash and cuDNN), det (bench/deterministic.py; det-mma, det-sm90
# with the family forced), bwd / fwd (bench/families.py). BENCH_ARGS go after each `cuflash bench` stage's own
# (a later option wins): BENCH_ARGS="--family mma --backends cuflash,torch-flash" times the mma.sync kernels
# against FlashAttention-2. Output: $OUT/ab.tgz holding <stage>-<tree>.json and .log, and ab.txt (each run's
# exit status and the seconds since the start).
set -uo pipefail
BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-/tmp/out}; ROOT=$PWD; OLD=$(cd "${OLD:?OLD: the folder of the tree to compare against}" && pwd)
WORK=$(mktemp -d); mkdir -p "$OUT"
run() {  # tree stage command...: in the tree's folder, its own kernel cache, capped at CAP seconds
  local tree=$1 stage=$2 dir=$ROOT; shift 2
  [ "$tree" = old ] && dir=$OLD
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" CUFLASH_CACHE_DIR=/tmp/cuflash-$tree \
     timeout "${CAP:-120}" "$@") > "$WORK/$stage-$tree.log" 2>&1
  echo "$stage $tree: exit $? at $SECONDS s" | tee -a "$WORK/ab.txt"
}
pack() { tar -czf "$OUT/ab.tgz" -C "$WORK" .; }
for tree in old new; do run "$tree" compile python3 -m cuflash compile -j "$(nproc)"; done
pack
for stage in "$@"; do
  for tree in old new; do
    json=$WORK/$stage-$tree.json
    case "$stage" in
      causal) run "$tree" "$stage" python3 -m cuflash bench --suite seqlen --backends cuflash,torch-cudnn \
                --json "$json" $BENCH_ARGS ;;
      full) run "$tree" "$stage" python3 -m cuflash bench --suite seqlen --no-causal --backends cuflash,torch-cudnn \
              --json "$json" $BENCH_ARGS ;;
      headdim) run "$tree" "$stage" python3 -m cuflash bench --suite headdim --backends cuflash,torch-cudnn \
                 --json "$json" $BENCH_ARGS ;;
      variants) run "$tree" "$stage" python3 -m cuflash bench --suite variants --backends cuflash \
                  --json "$json" $BENCH_ARGS ;;
      decode) run "$tree" "$stage" python3 -m cuflash bench --suite decode --backends cuflash,torch-cudnn \
                --json "$json" $BENCH_ARGS ;;
      det | det-mma | det-sm90) family=${stage#det}
        run "$tree" "$stage" python3 bench/deterministic.py "$json" ${family#-} ;;
      bwd | fwd) run "$tree" "$stage" python3 bench/families.py "$stage" "$json" ;;
      *) echo "unknown stage $stage" | tee -a "$WORK/ab.txt" ;;
    esac
  done
  pack
done
