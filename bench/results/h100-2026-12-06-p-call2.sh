# The targets of issues 11 and 12 at this tree (bf16), the deterministic ratio, the variants; all into $OUT/t.tgz
W=/tmp/w; mkdir -p $W
pack() { tar -czf $OUT/t.tgz -C $W .; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
(time python3 -m cuflash compile -j $(nproc)) > $W/compile.log 2>&1; echo "compile at $SECONDS s"
for c in causal no-causal; do
  timeout 120 python3 -m cuflash bench --family sm90 --suite seqlen,headdim --dtype bf16 --$c \
    --backends cuflash,torch-flash,torch-cudnn --json $W/bench-sm90-bf16-$c.json > $W/bench-sm90-bf16-$c.log 2>&1
  echo "bench $c: $? at $SECONDS s"; pack
done
timeout 45 python3 bench/deterministic.py $W/det-sm90.json sm90 > $W/det-sm90.log 2>&1; echo "det $? at $SECONDS s"
timeout 70 python3 -m cuflash bench --suite variants --backends cuflash,torch-flash,torch-cudnn --json $W/variants.json \
  > $W/variants.log 2>&1; echo "variants $? at $SECONDS s"; pack
