"""flash_fwd_sm90 walking tiles (a grid of the blocks the SMs hold) against a block per tile, the same kernel;
beside cuDNN. bf16, non-causal; 3 interleaved rounds of (walk, per-tile, cudnn), events around 20 back-to-back
calls, median of 5; a 300 ms rest (spin-free sleep) before each timing so every implementation starts rested."""
import json, sys, time
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cuflash
from cuflash import _plan
from cuflash.backends import cuda as C

def ms_per_call(f, calls=20, repeats=5):
    for _ in range(3):
        f()
    torch.cuda.synchronize(); time.sleep(0.3)
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            f()
        e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) / calls)
    return sorted(ts)[len(ts) // 2]

walk_grid = C.sm90_forward_grid
per_tile = lambda cfg, tiles, sms: tiles
rows = []
SHAPES = [(2, 8, 4096, 4096, 128), (2, 8, 16384, 4096, 128), (2, 16, 8192, 8192, 64), (1, 32, 8192, 8192, 32)]
for b, h, sq, sk, d in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fl = 4 * b * h * sq * sk * d
    def dnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)
    ref = dnn().transpose(1, 2).float()
    res = {"walk": [], "per_tile": [], "cudnn": []}
    err = {}
    for _ in range(3):
        for name, grid in (("walk", walk_grid), ("per_tile", per_tile)):
            C.sm90_forward_grid = grid; _plan.FORWARD.clear()
            f = lambda: cuflash.flash_attn_forward(q, k, v)
            o, _ = f()
            err[name] = float((o.float() - ref).abs().max())
            res[name].append(ms_per_call(f))
        res["cudnn"].append(ms_per_call(dnn))
    C.sm90_forward_grid = walk_grid; _plan.FORWARD.clear()
    row = {"b": b, "h": h, "sq": sq, "sk": sk, "d": d, "err": err, "rounds_ms": res}
    row["ms"] = {n: sorted(x)[1] for n, x in res.items()}
    row["tflops"] = {n: fl / ms / 1e9 for n, ms in row["ms"].items()}
    row["walk_over_per_tile"] = row["ms"]["per_tile"] / row["ms"]["walk"]
    row["over_cudnn"] = {n: row["ms"]["cudnn"] / row["ms"][n] for n in ("walk", "per_tile")}
    print(json.dumps({k2: row[k2] for k2 in ("b", "h", "sq", "sk", "d", "err", "ms", "walk_over_per_tile",
                                              "over_cudnn")}), flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
