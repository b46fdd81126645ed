"""Probes behind bench/RESULTS.md's decode figures (bf16, one query row, the decode suite's caches):

    python3 bench/decode_probe.py BxHxH_kvxLENxD cuflash|cudnn   # one call in a profiler range, after warm-up
    ncu --profile-from-start off --metrics ... python3 bench/decode_probe.py 8x32x8x32768x128 cuflash
    python3 bench/decode_probe.py read      # a plain read kernel's bandwidth over 1 GiB: the ceiling for a reader
    python3 bench/decode_probe.py layout    # flash_decode on bshd caches against head-major ones viewed as bshd
"""
import sys

import cupy as cp

import cuflash
from cuflash.benchmark import decode


def profiled_call(shape, which):
    """flash_attn_with_kvcache, or SDPA's cuDNN backend on the same values, three times, then once between
    cudaProfilerStart and Stop."""
    cell = decode.Cell(*(int(x) for x in shape.split("x")), "bfloat16")
    data = decode.Data(cell, seed=0)
    if which == "cuflash":
        fn = lambda: cuflash.flash_attn_with_kvcache(data.q, data.k, data.v, cache_seqlens=data.seqlens)
    else:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = data.torch_qkv()
        gqa = cell.nheads != cell.nheads_k

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    for _ in range(3):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.profilerStart()
    fn()
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.profilerStop()


# A grid-stride read of 16-byte words, its result kept only to stop the compiler dropping the loads
READ = cp.RawKernel(r'''
extern "C" __global__ void read_all(const uint4* __restrict__ x, long long n, unsigned* out) {
    unsigned acc = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        const uint4 v = x[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}''', "read_all")


def read_bw():
    """CUDA events around 20 back-to-back reads of 1 GiB (random values), at 4, 8 and 16 blocks of 256 per SM."""
    n = (1 << 30) // 16
    x = cp.random.randint(0, 2**31, size=4 * n, dtype=cp.int64).astype(cp.uint32)
    out = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for blocks_per_sm in (4, 8, 16):
        grid = sms * blocks_per_sm
        for _ in range(3):
            READ((grid,), (256,), (x, cp.int64(n), out))
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        for _ in range(20):
            READ((grid,), (256,), (x, cp.int64(n), out))
        e.record(); e.synchronize()
        ms = cp.cuda.get_elapsed_time(s, e) / 20
        print(f"read 1 GiB, {blocks_per_sm} blocks/SM x 256: {ms:.3f} ms, {(1 << 30) / ms / 1e9:.2f} TB/s")


def layout_timing():
    """flash_decode on bshd caches (the suite's) against head-major ones viewed as bshd, device ms per call."""
    for shape in ("8x32x8x32768x128", "64x32x8x4096x128", "1x32x8x131072x128"):
        cell = decode.Cell(*(int(x) for x in shape.split("x")), "bfloat16")
        data = decode.Data(cell, seed=0)
        hk, hv = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (data.k, data.v))
        for name, (k, v) in (("bshd", (data.k, data.v)), ("head-major", (hk, hv)), ("bshd", (data.k, data.v))):
            fn = lambda: cuflash.flash_attn_with_kvcache(data.q, k, v, cache_seqlens=data.seqlens)
            for _ in range(3):
                fn()
            times = []
            for _ in range(15):
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                for _ in range(10):
                    fn()
                e.record(); e.synchronize()
                times.append(cp.cuda.get_elapsed_time(s, e) / 10)
            ms = sorted(times)[len(times) // 2]
            print(f"{shape} {name}: {ms * 1e3:.1f} us, {cell.kv_bytes / ms / 1e9:.2f} TB/s", flush=True)
        del data, hk, hv
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    if sys.argv[1] == "layout":
        layout_timing()
    elif sys.argv[1] == "read":
        read_bw()
    else:
        profiled_call(sys.argv[1], sys.argv[2])
