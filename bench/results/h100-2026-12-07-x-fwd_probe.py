"""One Hopper forward (bf16, B=2, H=1024/D, N, D; causal if the 3rd arg is 'causal') in a profiler range."""
import sys
import cupy as cp
import cuflash
n, d = int(sys.argv[1]), int(sys.argv[2])
causal = sys.argv[3:] == ["causal"]
q, k, v = (cp.random.standard_normal((2, n, 1024 // d, d), dtype=cp.float32).astype(cp.dtype("bfloat16") if hasattr(cp, "bfloat16") else cp.float16) for _ in range(3))
with cuflash.kernel_family("sm90"):
    for _ in range(3):
        cuflash.flash_attn_forward(q, k, v, causal=causal)
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStart()
    for _ in range(5):
        cuflash.flash_attn_forward(q, k, v, causal=causal)
    cp.cuda.Device().synchronize()
    cp.cuda.runtime.profilerStop()
