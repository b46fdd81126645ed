"""The probe behind bench/RESULTS.md's Nsight Compute figures for the backward (2026-12-04 (k)): one backward
call (bf16, B=2, N keys and queries, head dim D (default 128) and 1024 / D heads, random normal inputs; non-causal
unless `causal` follows) in a profiler range, after three warm-up calls, by cuflash's mma.sync or Hopper family
(`-det`: deterministic=True; `-softcap`: softcap=30; `-dropout`: dropout_p=0.1) or by torch SDPA's
FlashAttention-2 or cuDNN backend:

    python3 bench/bwd_probe.py mma|sm90[-det][-softcap][-dropout]|flash|cudnn N [D [causal]]
    ncu --profile-from-start off -k 'regex:^flash_bwd$|seqk_parallel' \\
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum' \\
        python3 bench/bwd_probe.py mma 4096
"""
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash


def profiled_call(which: str, n: int, d: int = 128, causal: bool = False):
    b, h = 2, max(1, 1024 // d)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    family, *flags = which.split("-")
    if family in ("mma", "sm90"):
        kw = {"causal": causal, "softcap": 30.0 if "softcap" in flags else 0.0,
              "dropout_p": 0.1 if "dropout" in flags else 0.0, "seed": 1}
        with cuflash.kernel_family(family):
            o, lse = cuflash.flash_attn_forward(q, k, v, **kw)
            run(lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, deterministic="det" in flags, **kw))
        return
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[which]
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dot = do.transpose(1, 2)
    run(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))


def run(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    cp.cuda.runtime.profilerStart()
    fn()
    torch.cuda.synchronize()
    cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    profiled_call(sys.argv[1], *map(int, sys.argv[2:4]), causal=sys.argv[4:5] == ["causal"])
