"""keep_ring.py's case 1 (bf16 d128, varlen lq (300, 130), lk (517, 390), 2 heads, dropout 0.3) in parts:
python3 _probe/race_varlen.py fwd|fwdbwd [nodropout]"""
import sys

import cupy as cp
import numpy as np

import cuflash

part = sys.argv[1]
kw = {} if "nodropout" in sys.argv else dict(dropout_p=0.3, seed=41)
rng = np.random.default_rng(1)
cu_q = cp.asarray([0, 300, 430], dtype=cp.int32)
cu_k = cp.asarray([0, 517, 907], dtype=cp.int32)
import ml_dtypes  # noqa: E402
bf = ml_dtypes.bfloat16
q, do = (cp.asarray(rng.standard_normal((430, 2, 128)).astype(bf)) for _ in range(2))
k, v = (cp.asarray(rng.standard_normal((907, 2, 128)).astype(bf)) for _ in range(2))
lens = (cu_q, cu_k, 300, 517)
o, lse = cuflash.flash_attn_varlen_forward(q, k, v, *lens, backend="cuda", **kw)
cp.cuda.runtime.deviceSynchronize()
print("forward done", float(cp.abs(o.astype(cp.float32)).max()))
if part == "fwdbwd":
    grads = cuflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *lens, backend="cuda", **kw)
    cp.cuda.runtime.deviceSynchronize()
    print("backward done", [float(cp.abs(g.astype(cp.float32)).max()) for g in grads])
