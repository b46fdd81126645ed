"""Kernel time of each cuflash kernel family on one GPU, beside torch SDPA's flash and cuDNN backends (bf16,
the same tensors, CUDA events around 20 back-to-back calls, median of 5): the forward (fwd), or the
backward alone (bwd: dq, dk, dv from one saved forward), one JSON list on the given path; kvcache: query
chunks over a KV cache (flash_attn_with_kvcache, dense and paged, cuflash's families alone: SDPA has no
cache). The instrument behind bench/RESULTS.md's Hopper stages; `cuflash bench` holds the targets.

    python3 bench/families.py fwd|bwd|kvcache OUT.json
"""

import json
import sys

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F
from deterministic import ms_per_call, record  # bench/ (the script's directory) is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

SHAPES = ((2, 8, 4096, 128), (2, 8, 8192, 128), (2, 8, 16384, 128), (4, 16, 8192, 128), (2, 16, 8192, 64),
          (2, 4, 8192, 256))  # B, H, N, d
SDPA = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
FLOPS_PER_FORWARD = {"fwd": 1.0, "bwd": 2.5}  # the backward's five tile GEMMs against the forward's two
# kvcache: B, H, H_kv, query chunk, cache length (every entry full), d; pages of None (dense), 64, 256 keys
KV_SHAPES = ((2, 32, 8, 2048, 16384, 128), (1, 32, 8, 4096, 65536, 128), (4, 16, 16, 1024, 8192, 64))
PAGE_SIZES = (None, 64, 256)


def cuflash_call(mode, q, k, v, do, causal):
    if mode == "fwd":
        return lambda: cuflash.flash_attn_forward(q, k, v, causal=causal)
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
    return lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)


def sdpa_call(mode, q, k, v, do, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (b, h, n, d) views of the same memory
    if mode == "fwd":
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # the backend is chosen here
    return lambda: torch.autograd.grad(out, (q, k, v), do.transpose(1, 2), retain_graph=True)


def kvcache(path):
    rows = []
    rng = cp.random.default_rng(0)
    for b, h, hk, sq, sk, d in KV_SHAPES:
        q = rng.standard_normal((b, sq, h, d), dtype=cp.float32).astype(cp.float16)
        k, v = (rng.standard_normal((b, sk, hk, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
        lens = cp.full(b, sk, dtype=cp.int32)
        for page in PAGE_SIZES:
            kw = {}
            kc, vc = k, v
            if page:  # the same values in pages, the table a random permutation of the pool
                perm = cp.asarray(np.random.default_rng(page).permutation(b * sk // page).astype(np.int32))
                kc, vc = (cp.empty_like(x.reshape(-1, page, hk, d)) for x in (k, v))
                kc[perm], vc[perm] = k.reshape(-1, page, hk, d), v.reshape(-1, page, hk, d)
                kw["block_table"] = perm.reshape(b, -1)
            for causal in (True, False):
                row = {"mode": "kvcache", "shape": [b, h, hk, sq, sk, d], "page_size": page, "causal": causal}
                for family in ("sm90", "mma"):
                    with cuflash.kernel_family(family):
                        row[family] = ms_per_call(lambda: cuflash.flash_attn_with_kvcache(
                            q, kc, vc, cache_seqlens=lens, causal=causal, **kw))
                flops = 4 * b * h * sq * d * (sk - (sq - 1) / 2 if causal else sk)
                row["tflops"] = {f: round(flops / row[f] / 1e9) for f in ("sm90", "mma")}
                row["sm90_over_mma_speed"] = round(row["mma"] / row["sm90"], 3)
                record(rows, row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def main(mode, path):
    if mode == "kvcache":
        return kvcache(path)
    rows = []
    torch.manual_seed(0)
    for b, h, n, d in SHAPES:
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                       for i in range(4))
        qc, kc, vc, doc = (cp.from_dlpack(x.detach()) for x in (q, k, v, do))
        for causal in (True, False):
            row = {"mode": mode, "shape": [b, h, n, d], "causal": causal}
            for family in ("sm90", "mma"):
                with cuflash.kernel_family(family):
                    try:
                        row[family] = ms_per_call(cuflash_call(mode, qc, kc, vc, doc, causal))
                    except ValueError:  # a call this family does not serve
                        row[family] = None
            for name, backend in SDPA.items():
                with sdpa_kernel(backend):
                    row[name] = ms_per_call(sdpa_call(mode, q, k, v, do, causal))
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * FLOPS_PER_FORWARD[mode]
            row["tflops"] = {k: round(flops / row[k] / 1e9) for k in ("sm90", "mma", *SDPA) if row[k]}
            record(rows, row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
