"""Host time of cached calls, and where it goes: cProfile over repeated calls of a plan (CuPy, fp16, causal
2x8x4096x128 forward and backward; a decoding step over 8 x 4096 cached keys with one new row and an int
cache_seqlens, and without it from an int32 array). The median is of 200 calls with a sync between them.
`pieces`: the backward plan's parts at the launch suite's shapes (bhsd views, as the suite), each timed alone
over 60 calls behind a spin kernel (timing.time_host, as the suite times whole calls), median µs.

    python3 bench/host_profile.py > OUT.txt       # on a GPU machine
    python3 bench/host_profile.py pieces OUT.json
"""

import cProfile
import functools
import io
import json
import pstats
import sys
import time

import cupy as cp

import cuflash
from cuflash import _params, _plan
from cuflash.benchmark.timing import CupyClock, time_host


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


def host_us(*calls) -> float:
    """The median host µs of the calls, taken in turn, 60 in all (timing.time_host: behind a spin kernel, as the
    launch suite times whole calls)."""
    return round(time_host(calls, CupyClock(), warmup=1, runs=60)["host_ms_median"] * 1e3, 1)


def pieces(path) -> None:
    out = {}
    for b, h, n, d in ((1, 8, 128, 64), (2, 8, 4096, 128), (4, 16, 8192, 128)):  # the launch suite's
        rs = cp.random.RandomState(0)
        sets = []
        for _ in range(2):
            q, k, v, do = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16).transpose(0, 2, 1, 3)
                           for _ in range(4))
            sets.append((do, q, k, v, *cuflash.flash_attn_forward(q, k, v, causal=True)))
        for s in sets:
            cuflash.flash_attn_backward(*s, causal=True)  # the general path leaves the plan
        plan = [p for p in _plan.BACKWARD.values() if p.shapes[0] == tuple(sets[0][1].shape)][-1]
        L, stream, ptrs = plan.launches, plan.kind.stream(), [x.data.ptr for x in sets[0]]
        bwd = [functools.partial(cuflash.flash_attn_backward, *x, causal=True) for x in sets]
        kind = plan.kind
        row = {"call": host_us(bwd[0]), "call_2_sets": host_us(*bwd), "plan": host_us(lambda: plan(*sets[0])),
               "alloc_dq_dk_dv": host_us(lambda: [kind.like(x) for x in sets[0][1:4]]),
               "alloc_workspace": host_us(lambda: kind.same(sets[0][5], plan.workspace_shape))}
        # the launches alone write into gradients and a workspace held here (a plan call frees its own)
        held = [kind.like(x) for x in sets[0][1:4]] + [kind.same(sets[0][5], plan.workspace_shape)]
        L.patch(_params.BWD_POINTERS, ptrs[0], *(x.data.ptr for x in held))
        row.update(run_3_launches=host_us(lambda: L.run(stream)),
                   patch_same=host_us(lambda: L.patch(_params.FWD_POINTERS, *ptrs[1:])),
                   patch_2_sets=host_us(*(functools.partial(L.patch, _params.FWD_POINTERS, *(y.data.ptr for y in x[1:]))
                                          for x in sets)),
                   kernels=[k[1:] for k in L.kernels])  # (grid x, y, z, threads, shared memory)
        out[f"{b}x{h}x{n}x{d}"] = row
        print(f"{b}x{h}x{n}x{d}", json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    pieces(sys.argv[2]) if sys.argv[1:2] == ["pieces"] else main()
