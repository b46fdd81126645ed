"""Forward kernel time of each cuflash kernel family on one GPU, beside torch SDPA's flash and cuDNN backends
(bf16, the same tensors, CUDA events around 20 back-to-back calls, median of 5), one JSON list on the given
path. The instrument behind bench/RESULTS.md's Hopper-forward stages; `cuflash bench` holds the targets.

    python3 bench/forward_families.py OUT.json
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


def main(path):
    rows = []
    torch.manual_seed(0)
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (b, h, n, d) views of the same memory
        for causal in (True, False):
            row = {"shape": [b, h, n, d], "causal": causal}
            for family in ("sm90", "mma"):
                with cuflash.kernel_family(family):
                    row[family] = ms_per_call(lambda: cuflash.flash_attn_forward(qc, kc, vc, causal=causal))
            for name, backend in SDPA.items():
                with sdpa_kernel(backend):
                    row[name] = ms_per_call(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            row["tflops"] = {k: round(flops / row[k] / 1e9) for k in ("sm90", "mma", *SDPA)}
            record(rows, row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
