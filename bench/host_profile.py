"""Host time of cached calls, and where it goes: cProfile over repeated calls of a plan (CuPy, fp16, causal
2x8x4096x128 forward and backward; a decoding step over 8 x 4096 cached keys with one new row and an int
cache_seqlens, and without it from an int32 array). The median is of 200 calls with a sync between them.

    python3 bench/host_profile.py > OUT.txt       # on a GPU machine
"""

import cProfile
import io
import pstats
import time

import cupy as cp

import cuflash


def calls() -> dict:
    rs = cp.random.RandomState(0)

    def randn(*shape):
        return rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16)

    q, k, v = randn(2, 4096, 8, 128), randn(2, 4096, 8, 128), randn(2, 4096, 8, 128)
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=True)
    do = randn(*o.shape)
    k_cache, v_cache = randn(8, 4096, 8, 128), randn(8, 4096, 8, 128)
    q1, k_new, v_new = randn(8, 1, 32, 128), randn(8, 1, 8, 128), randn(8, 1, 8, 128)
    seqlens = cp.full((8,), 4000, cp.int32)
    return {"fwd": lambda: cuflash.flash_attn_forward(q, k, v, causal=True),
            "bwd": lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True),
            "kv-append-int": lambda: cuflash.flash_attn_with_kvcache(q1, k_cache, v_cache, k_new, v_new,
                                                                     cache_seqlens=4000),
            "kv-array": lambda: cuflash.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens)}


def main() -> None:
    for name, f in calls().items():
        for _ in range(2):  # the general path, then the plan it left
            f()
        cp.cuda.runtime.deviceSynchronize()
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
            cp.cuda.runtime.deviceSynchronize()
        times.sort()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            f()
            cp.cuda.runtime.deviceSynchronize()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(f"== {name}: host us median {times[100] * 1e6:.1f} min {times[0] * 1e6:.1f} (sync between calls)")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:3500])


if __name__ == "__main__":
    main()
