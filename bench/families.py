"""Kernel time of each cuflash kernel family on one GPU, beside torch SDPA's flash and cuDNN backends (bf16,
the same tensors, CUDA events around 20 back-to-back calls, median of 5): the forward (fwd), or the
backward alone (bwd: dq, dk, dv from one saved forward), one JSON list on the given path. The instrument
behind bench/RESULTS.md's Hopper stages; `cuflash bench` holds the targets.

    python3 bench/families.py fwd|bwd OUT.json
"""

import json
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from deterministic import ms_per_call, record  # bench/ (the script's directory) is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

SHAPES = ((2, 8, 4096, 128), (2, 8, 8192, 128), (2, 8, 16384, 128), (4, 16, 8192, 128), (2, 16, 8192, 64),
          (2, 4, 8192, 256))  # B, H, N, d
SDPA = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
FLOPS_PER_FORWARD = {"fwd": 1.0, "bwd": 2.5}  # the backward's five tile GEMMs against the forward's two


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


def main(mode, path):
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
                    except ValueError:  # a call this family does not serve (the sm90 backward at d = 256)
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
