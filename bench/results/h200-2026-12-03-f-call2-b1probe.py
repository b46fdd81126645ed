"""Why the decode suite's B=1 'cuflash' cell (device cache_seqlens) runs ~15 us slower than 'cuflash-append'."""
import functools, json, sys
import cupy as cp
import cuflash
from cuflash.benchmark import decode
from cuflash.benchmark.timing import clock, time_device

out = []
def t(name, fn, rnd):
    st = time_device([fn], clock("cupy"), warmup=3, repeats=20, budget_s=1.0)
    r = {"name": name, "round": rnd, "med_us": st["ms_median"] * 1e3, "min_us": st["ms_min"] * 1e3, "max_us": st["ms_max"] * 1e3}
    print(json.dumps(r), flush=True); out.append(r)

# as the suite: B=8 first, then free, then B=1
c8 = decode.Cell(8, 32, 8, 32768, 128, "bfloat16")
d8 = decode.Data(c8, 0)
t("b8-cuflash", decode.CuflashDecode().calls(c8, d8)[0][0], 0)
del d8; cp.get_default_memory_pool().free_all_blocks()
cell = decode.Cell(1, 32, 8, 131072, 128, "bfloat16")
data = decode.Data(cell, 0)
fa = decode.CuflashDecode().calls(cell, data)[0][0]
fb = decode.CuflashDecode(append=True).calls(cell, data)[0][0]
seq2 = data.seqlens.copy()
fc = functools.partial(cuflash.flash_attn_with_kvcache, data.q, data.k, data.v, cache_seqlens=seq2,
                       softmax_scale=cell.case.scale)
fd = functools.partial(cuflash.flash_attn_with_kvcache, data.q, data.k, data.v, cache_seqlens=cell.seqlen_k,
                       softmax_scale=cell.case.scale)
fe = functools.partial(cuflash.flash_attn_with_kvcache, data.q, data.k, data.v, cache_seqlens=data.seqlens)
if len(sys.argv) > 2:  # under ncu: each variant 3 times in a profiler range, after warm-up
    for fn in (fa, fb, fc, fd, fe):
        fn(); fn()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    for fn in (fa, fa, fa, fb, fb, fb, fd, fd, fd):
        fn()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    sys.exit(0)
for rnd in range(3):
    for name, fn in (("a-device-seqlens", fa), ("b-append", fb), ("c-seqlens-copy", fc), ("d-int-no-rows", fd),
                     ("e-no-scale", fe)):
        t(name, fn, rnd)
json.dump(out, open(sys.argv[1], "w"), indent=1)
