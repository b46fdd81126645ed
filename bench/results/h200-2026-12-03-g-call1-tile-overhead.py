"""Per-tile overhead of flash_fwd_sm90 (non-persistent grid): the same FLOPs as N x N attention, cut into more or
fewer query tiles (seqlen_q * seqlen_k fixed). If each block pays a fixed prologue + epilogue C, time grows with the
block count: T = waves * (work + C). cuDNN (persistent) beside it on the same tensors. bf16, non-causal."""
import json, sys
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cuflash
from cuflash.backends import cuda as C

def ms_per_call(f, calls=20, repeats=5):
    for _ in range(3):
        f()
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            f()
        e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) / calls)
    ts.sort()
    return ts[len(ts) // 2]

rows = []
for b, h, d in ((2, 8, 128), (2, 16, 64)):
    for sq, sk in ((16384, 4096), (8192, 8192), (4096, 16384), (2048, 32768), (1024, 65536)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fl = 4 * b * h * sq * sk * d
        f_cf = lambda: cuflash.flash_attn_forward(q, k, v)
        def f_dnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt)
        o, _ = f_cf(); ref = f_dnn().transpose(1, 2)
        err = float((o.float() - ref.float()).abs().max())
        res = {"cuflash": [], "cudnn": []}
        for _ in range(3):
            res["cuflash"].append(ms_per_call(f_cf)); res["cudnn"].append(ms_per_call(f_dnn))
        row = {"b": b, "h": h, "d": d, "sq": sq, "sk": sk, "max_err": err}
        for n, ts in res.items():
            ms = sorted(ts)[1]
            row[n + "_ms"] = ms; row[n + "_rounds"] = ts; row[n + "_tflops"] = fl / ms / 1e9
        row["blocks"] = -(-sq // 128) * h * b
        print(json.dumps(row), flush=True); rows.append(row)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
