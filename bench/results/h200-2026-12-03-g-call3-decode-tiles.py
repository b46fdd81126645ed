"""flash_decode's tile at d = 128 (block_n, warps): blocks per SM and waves. The decode suite's dense shapes and B = 8
in pages of 64; num_splits=0 (the rule); 3 rounds interleaved with SDPA cuDNN; device time as the suite's."""
import json, sys
import cupy as cp
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cuflash
from cuflash import config, _plan
from cuflash.benchmark import decode
from cuflash.benchmark.timing import clock, time_device

CANDS = [(16, 64, 4), (16, 32, 2), (16, 64, 2), (16, 128, 8)]
cells = [(s, None) for s in decode.SHAPES] + [(decode.SHAPES[0], 64)]
rows = []
for shape, page in cells:
    cell = decode.Cell(*shape, "bfloat16", page_size=page)
    data = decode.Data(cell, seed=0)
    k, v, table = data.paged(page) if page else (data.k, data.v, None)
    qt, kt, vt = data.torch_qkv()
    gqa = cell.nheads != cell.nheads_k
    def dnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    row = {"shape": list(shape), "page": page, "gb": cell.kv_bytes / 1e9, "ms": {}, "err": {}}
    ref = None
    for rnd in range(3):
        for cand in CANDS:
            if shape[-1] != 128 and cand != CANDS[0]:
                continue
            config._TILES["flash_decode"][128] = cand
            _plan.KVCACHE.clear()
            fn = lambda: cuflash.flash_attn_with_kvcache(data.q, k, v, cache_seqlens=data.seqlens, block_table=table)
            o = fn()
            if ref is None:
                ref = o.copy()
            row["err"][str(cand)] = float(cp.abs(o.astype(cp.float32) - ref.astype(cp.float32)).max())
            ms = time_device([fn], clock("cupy"), warmup=3, repeats=20, budget_s=1.0)["ms_median"]
            row["ms"].setdefault(str(cand), []).append(ms)
        ms = time_device([dnn], clock("torch"), warmup=3, repeats=20, budget_s=1.0)["ms_median"]
        row["ms"].setdefault("cudnn", []).append(ms)
    row["median_us"] = {c: sorted(x)[1] * 1e3 for c, x in row["ms"].items()}
    row["over_cudnn"] = {c: row["median_us"]["cudnn"] / u for c, u in row["median_us"].items()}
    print(json.dumps({k2: row[k2] for k2 in ("shape", "page", "median_us", "over_cudnn", "err")}), flush=True)
    rows.append(row)
    config._TILES["flash_decode"][128] = CANDS[0]
    del data, k, v, table, qt, kt, vt, ref
    cp.get_default_memory_pool().free_all_blocks(); torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
