set -u
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/w; W=$OUT/w
t() { tar -czf $OUT/call4.tgz -C $W . ; }
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks_event_reasons.active,power.draw --format=csv -lms 500 > $W/smi.csv 2>&1 &
SMI=$!
echo "start $(date -u +%T)" > $W/times.txt
OUT=$W/ab CAP=200 OLD=_old bash bench/ab.sh decode > $W/ab.log 2>&1; echo "ab $(date -u +%T)" >> $W/times.txt; t
CUFLASH_CACHE_DIR=/tmp/cuflash-new timeout 100 python3 bench/decode_splits.py $W/splits.json > $W/splits.log 2>&1; echo "splits $? $(date -u +%T)" >> $W/times.txt; t
CUFLASH_CACHE_DIR=/tmp/cuflash-new timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kvcache.py -p no:cacheprovider > $W/pytest-kvcache.log 2>&1; echo "pytest $? $(date -u +%T)" >> $W/times.txt; t
CUFLASH_CACHE_DIR=/tmp/cuflash-new SANITIZE_TIMEOUT=70 timeout 180 bash bench/sanitize.sh $W/sanitize.log > $W/sanitize.out 2>&1; echo "sanitize $? $(date -u +%T)" >> $W/times.txt; t
CUFLASH_CACHE_DIR=/tmp/cuflash-new timeout 60 python3 -m cuflash bench --suite decode --backends cuflash --json $W/decode-cuflash-alone.json > $W/decode-cuflash-alone.log 2>&1; echo "alone $? $(date -u +%T)" >> $W/times.txt
kill $SMI; gzip $W/smi.csv; t
