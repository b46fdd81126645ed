"""Quick GPU correctness table: every dtype x a few head dims x causal, forward and backward,
against the float64 reference on the GPU. Prints max errors and the accuracy-rule bound; exits
non-zero on any failure. Usage: python3 bench/smoke.py [--quick]"""

import sys
import time

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash import reference
from cuflash._interop import to_working

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
ATOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-6, "float64": 1e-12}


def rand(shape, dtype, rng):
    return to_working("x", rng.standard_normal(shape).astype(dtype), True)


def to64(x):
    """A device array as float64 (bf16 through its bits: CuPy has no bf16 arithmetic)."""
    if x.dtype == ml_dtypes.bfloat16:
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return x.astype(cp.float64)


def check(dtype, d, causal, sq=300, sk=257, b=2, h=4, hk=2, seed=0):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q, k, v, do = rand((b, sq, h, d), dt, rng), rand((b, sk, hk, d), dt, rng), rand((b, sk, hk, d), dt, rng), rand((b, sq, h, d), dt, rng)
    out = cp.empty_like(q)
    bits = {2: cp.uint16, 4: cp.uint32, 8: cp.uint64}[q.itemsize]
    out.view(bits).fill(np.iinfo(bits).max)  # all-ones bits: NaN in every float type
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal, out=out)
    dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    q64, k64, v64, do64 = (to64(x) for x in (q, k, v, do))
    o_ref, lse_ref = reference.forward(q64, k64, v64, causal=causal)
    g_ref = reference.backward(do64, q64, k64, v64, causal=causal)
    prec = None if dtype == "float64" else dtype
    o_sp, _ = reference.forward(q64, k64, v64, causal=causal, precision=prec) if prec else (o_ref, None)
    g_sp = reference.backward(do64, q64, k64, v64, causal=causal, precision=prec) if prec else g_ref
    rows = []
    for name, ours, ref, sp in (("o", o, o_ref, o_sp), ("dq", dq, g_ref[0], g_sp[0]), ("dk", dk, g_ref[1], g_sp[1]), ("dv", dv, g_ref[2], g_sp[2])):
        err, bound = reference.accuracy_bound(to64(ours), ref, sp, ATOL[dtype])
        rows.append((name, float(err), float(bound)))
    lerr = float(cp.nanmax(cp.abs(cp.where(cp.isinf(lse_ref), 0, lse.astype(cp.float64) - lse_ref)))) if lse.size else 0.0
    lse_ok = bool(cp.all(cp.isinf(lse_ref) == cp.isinf(lse))) and not bool(cp.isnan(lse).any())
    rows.append(("lse", lerr, 1e-3 if dtype in ("float16", "bfloat16") else 1e-6))
    ok = lse_ok and all(e <= bnd for _, e, bnd in rows)
    return ok, rows


def main():
    quick = "--quick" in sys.argv
    heads = (64, 128) if quick else (40, 64, 128, 256)
    fails = 0
    t0 = time.perf_counter()
    for dtype in DTYPES:
        for d in heads:
            for causal in (False, True):
                try:
                    ok, rows = check(dtype, d, causal)
                    detail = " ".join(f"{n}={e:.2e}/{b:.2e}" for n, e, b in rows)
                except Exception as e:  # report and go on: one table shows every failure
                    ok, detail = False, f"{type(e).__name__}: {str(e)[:300]}"
                fails += not ok
                print(f"{'ok ' if ok else 'BAD'} {dtype:9s} d={d:3d} causal={causal!s:5s} {detail}", flush=True)
    print(f"smoke: {fails} failures in {time.perf_counter() - t0:.1f} s")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
