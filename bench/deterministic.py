"""Backward kernel time with deterministic=True against the atomic dQ adds (bf16, CUDA events around 20
back-to-back flash_attn_backward calls, median of 6, the two modes timed in turns), one JSON list on the given
path; FAMILY (mma or sm90) forces that kernel family (cuflash.kernel_family), else each call takes the fastest.

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
    return ms_in_turns([f], calls, repeats)[0]


def ms_in_turns(fs, calls=20, repeats=6) -> list[float]:
    """ms per call of each of fs, timed in turns, the order reversed every round: one timed after another for
    seconds would run on a hotter GPU (under sustained load the H200's clock falls to its power cap within
    50-150 ms, bench/RESULTS.md 2026-12-03 (g)); the median of each."""
    for f in fs:
        for _ in range(3):
            f()
    times = [[] for _ in fs]
    for r in range(repeats):
        for i in range(len(fs)) if r % 2 == 0 else reversed(range(len(fs))):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(calls):
                fs[i]()
            e1.record()
            e1.synchronize()
            times[i].append(cp.cuda.get_elapsed_time(e0, e1) / calls)
    return [float(np.median(t)) for t in times]


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
            row["atomic"], row["det"] = ms_in_turns([
                lambda det=det: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=det)
                for det in (False, True)])
            row["det_over_atomic_speed"] = row["atomic"] / row["det"]
            record(rows, row)


if __name__ == "__main__":
    main(*sys.argv[1:3])
