"""One dense forward through backend="cuda" (flash_fwd_sm90 on sm_90), checked loosely against the reference:
python3 _probe/race.py DTYPE D CAUSAL(0/1) DROPOUT_P SEQLEN_Q SEQLEN_K"""
import sys

import cupy as cp
import numpy as np

import cuflash
from cuflash import reference

dtype, d, causal, p, sq, sk = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), float(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
rng = np.random.default_rng(0)
npdt = np.float16 if dtype == "float16" else None
import ml_dtypes  # noqa: E402
npdt = npdt or ml_dtypes.bfloat16
q, k, v = (rng.standard_normal((1, n, 2, d)).astype(npdt) for n in (sq, sk, sk))
kw = dict(dropout_p=p, seed=5) if p else {}
o = cuflash.flash_attn(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal, backend="cuda", **kw)
cp.cuda.runtime.deviceSynchronize()
rk = {}
if p:
    rk = dict(dropout_p=p, dropout_mask=cuflash.dropout_mask(1, 2, sq, sk, dropout_p=p, seed=5))
ref, _ = reference.forward(*(x.astype(np.float64) for x in (q, k, v)), causal=causal, **rk)
err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ref)))
print(f"race.py {sys.argv[1:]}: max error {err:.3g}", "ok" if err < 5e-2 else "WRONG")
