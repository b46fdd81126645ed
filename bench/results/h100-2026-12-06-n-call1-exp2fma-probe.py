"""Forward kernel time of the rows exp2_fma may change, on the tree on PYTHONPATH: one JSON line per row."""
import json, os, sys
import cupy as cp, ml_dtypes, numpy as np
import cuflash

def ms_per_call(f, calls=20, repeats=7):
    for _ in range(3): f()
    ts = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(calls): f()
        e1.record(); e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / calls)
    return float(np.median(ts))

tree = sys.argv[1]
ROWS = [  # family, dtype, B, H, N, d, causal, softcap
    ("sm90", "bf16", 2, 8, 8192, 128, True, 30.0), ("sm90", "fp16", 2, 8, 8192, 128, True, 30.0),
    ("sm90", "bf16", 2, 8, 8192, 128, False, 30.0), ("sm90", "bf16", 2, 8, 2048, 128, True, 30.0),
    ("sm90", "bf16", 2, 8, 8192, 128, True, 0.0),
    ("sm90", "bf16", 2, 16, 2048, 64, True, 0.0), ("sm90", "bf16", 2, 16, 2048, 64, False, 0.0),
    ("sm90", "bf16", 2, 16, 8192, 64, True, 0.0), ("sm90", "bf16", 2, 16, 8192, 64, False, 0.0),
    ("mma", "bf16", 2, 8, 8192, 128, True, 30.0), ("mma", "bf16", 2, 8, 8192, 128, True, 0.0),
]
for fam, dt, b, h, n, d, causal, cap in ROWS:
    rs = cp.random.RandomState(0)
    t = ml_dtypes.bfloat16 if dt == "bf16" else np.float16
    q, k, v = (rs.standard_normal((b, n, h, d), dtype=cp.float32).astype(t) for _ in range(3))
    with cuflash.kernel_family(fam):
        f = lambda: cuflash.flash_attn_forward(q, k, v, causal=causal, softcap=cap)
        if os.environ.get("PROBE_WARM"):
            f(); cp.cuda.Device().synchronize(); continue
        ms = ms_per_call(f)
    print(json.dumps({"tree": tree, "family": fam, "dtype": dt, "shape": [b, h, n, d], "causal": causal,
                      "softcap": cap, "ms": ms}), flush=True)
