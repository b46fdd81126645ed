"""Backward kernel time with deterministic=True against the atomic dQ adds (bf16, CUDA events around 20
back-to-back flash_attn_backward calls, median of 5), one JSON list on the given path; FAMILY (mma or sm90)
forces that kernel family (cuflash.kernel_family), else each call takes the fastest.

    python3 bench/deterministic.py OUT.json [FAMILY]
"""

import json
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash

SHAPES = ((2, 8, 4096, 128), (2, 8, 16384, 128), (4, 16, 8192, 64), (1, 8, 8192, 256))  # B, H, N, d


def ms_per_call(f, calls=20, repeats=5) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(calls):
            f()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / calls)
    return float(np.median(times))


def inputs(b, h, n, d):
    """q, k, v, dout: bf16 (b, n, h, d), standard normal, seed 0."""
    rs = cp.random.RandomState(0)
    return [rs.standard_normal((b, n, h, d), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(4)]


def record(rows, row):
    print(json.dumps(row), flush=True)
    rows.append(row)


def main(path, family=None):
    rows = []
    with cuflash.kernel_family(family):
        measure(rows, family)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def measure(rows, family):
    for b, h, n, d in SHAPES:
        q, k, v, do = inputs(b, h, n, d)
        for causal in (True, False):
            o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
            row = {"shape": [b, h, n, d], "causal": causal, "family": family}
            for det in (False, True):
                row["det" if det else "atomic"] = ms_per_call(
                    lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=det))
            row["det_over_atomic_speed"] = row["atomic"] / row["det"]
            record(rows, row)


if __name__ == "__main__":
    main(*sys.argv[1:3])
