"""Peak GPU memory of one forward + backward, against the memory the outputs alone need.

    python3 bench/memory_check.py [--batch 1 --nheads 8 --seqlen 8192 --head-dim 128 --dtype bfloat16]

Prints one JSON object on stdout. Every allocation goes through a fresh CuPy memory pool wrapped by
a tracking allocator, which records the pool's live bytes after each malloc (live bytes only grow at
a malloc, so that is the exact peak, to the pool's 512-byte rounding). The inputs (q, k, v, dout)
are allocated first and are the baseline; what the calls add on top is compared with the
unavoidable: o, lse, dq, dk, dv and the backward's workspace (config.BackwardWorkspace: D = rowsum(dO * O),
and for fp16 / bf16 the fp32 dQ accumulator [batch, nheads, seqlen, head dim] and the deterministic
mode's semaphores; the breakdown reports each). No N x N matrix may appear, and no input may be copied.
tests/test_gpu_kernels.py runs `measure` and asserts on it.
"""

from __future__ import annotations

import argparse
import json
import sys


class TrackingAllocator:
    """Wraps a cupy.cuda.MemoryPool: malloc passes through, recording live and peak bytes."""

    def __init__(self, pool):
        self.pool = pool
        self.peak = 0
        self.mallocs = 0

    def malloc(self, nbytes: int):
        mem = self.pool.malloc(nbytes)
        self.mallocs += 1
        self.peak = max(self.peak, self.pool.used_bytes())
        return mem

    def live(self) -> int:
        return self.pool.used_bytes()

    def reset_peak(self) -> None:
        self.peak = self.pool.used_bytes()


def measure(batch: int = 1, nheads: int = 8, seqlen: int = 8192, head_dim: int = 128, dtype: str = "bfloat16",
            causal: bool = False, seed: int = 0) -> dict:
    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash.config import backward_workspace

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    lse_itemsize = 8 if dtype == "float64" else 4
    pool = cupy.cuda.MemoryPool()
    tracker = TrackingAllocator(pool)
    shape = (batch, seqlen, nheads, head_dim)
    with cupy.cuda.using_allocator(tracker.malloc):
        rs = cupy.random.RandomState(seed)
        gen = cupy.float64 if dtype == "float64" else cupy.float32
        q, k, v, do = (rs.standard_normal(shape, dtype=gen).astype(np_dtype) for _ in range(4))
        cupy.cuda.get_current_stream().synchronize()
        baseline = tracker.live()  # the inputs (generation temporaries are freed by now)
        tracker.reset_peak()
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal, backend="cuda")
        cupy.cuda.get_current_stream().synchronize()
        peak_fwd = tracker.peak
        dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="cuda",
                                                 deterministic=True)
        cupy.cuda.get_current_stream().synchronize()
        peak = tracker.peak
        live_after = tracker.live()
        nan = any(bool(cupy.isnan(x).any()) for x in (o, dq, dk, dv))
        outputs = {"o": o.nbytes, "lse": lse.nbytes, "dq": dq.nbytes, "dk": dk.nbytes, "dv": dv.nbytes}
        del q, k, v, do, o, lse, dq, dk, dv
    pool.free_all_blocks()

    layout = backward_workspace(dtype, head_dim, nheads, batch, seqlen, batch, seqlen, True)
    workspace = {"dsum": batch * nheads * seqlen * lse_itemsize}  # D, then the fp32 dQ accumulator, the semaphores
    if layout.dq_accum_offset >= 0:
        workspace["dq_accum"] = layout.dq_semaphore_offset - layout.dq_accum_offset
        workspace["dq_semaphores"] = layout.nbytes - layout.dq_semaphore_offset
    unavoidable = sum(outputs.values()) + layout.nbytes
    extra = peak - baseline
    try:
        gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        gpu = gpu.decode() if isinstance(gpu, bytes) else gpu
    except Exception:  # noqa: BLE001  (informational only)
        gpu = "unknown"
    return {
        "what": "peak GPU bytes of flash_attn_forward + flash_attn_backward above the inputs",
        "gpu": gpu,
        "cupy": cupy.__version__,
        "batch": batch, "nheads": nheads, "seqlen": seqlen, "head_dim": head_dim, "dtype": dtype,
        "causal": causal,
        "inputs_bytes": baseline,
        "peak_bytes": peak,
        "peak_forward_extra_bytes": peak_fwd - baseline,
        "peak_extra_bytes": extra,
        "live_after_extra_bytes": live_after - baseline,
        "unavoidable_bytes": unavoidable,
        "unavoidable_breakdown": {**outputs, **workspace},
        "outputs_bytes": sum(outputs.values()),
        "ratio": extra / unavoidable,
        "within_10_percent": extra <= 1.10 * unavoidable,
        "nan_in_outputs": nan,
        "mallocs": tracker.mallocs,
        "nxn_matrix_bytes_fp32": batch * nheads * seqlen * seqlen * 4,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32", "float64"])
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.batch, a.nheads, a.seqlen, a.head_dim, a.dtype, a.causal)
    json.dump(r, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if r["within_10_percent"] and not r["nan_in_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
