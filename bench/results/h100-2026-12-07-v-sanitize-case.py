# (v) calls 3 and 6: the case run under compute-sanitizer --tool memcheck|racecheck|synccheck (written to /tmp/s.py
# on the device and run from the candidate tree): the Hopper backward at d = 256, bf16, causal and not,
# deterministic and not.
import cupy as cp, cuflash, ml_dtypes
rs = cp.random.RandomState(0)
for causal in (True, False):
    for det in (False, True):
        q, k, v, do = (rs.standard_normal((1, 320, 2, 256), dtype=cp.float32).astype(ml_dtypes.bfloat16)
                       for _ in range(4))
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=det)
        cp.cuda.Device().synchronize(); print(causal, det, float(abs(dq.astype(cp.float32)).sum()), flush=True)
