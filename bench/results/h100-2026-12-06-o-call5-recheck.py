import sys, json
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
import cupy as cp, cuflash
from deterministic import ms_per_call, inputs
assert cuflash.__file__.startswith(sys.argv[1]), cuflash.__file__
out = {}
for (b, h, n, d) in ((4, 16, 8192, 128), (2, 8, 16384, 128)):
    q, k, v, do = inputs(b, h, n, d)
    for causal in (False, True):
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        out[f"{b}x{h}x{n}x{d} causal={causal}"] = ms_per_call(lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal))
print(sys.argv[2], json.dumps(out), flush=True)
