"""Tile candidates timed on the GPU (bf16 unless said, CUDA events around back-to-back calls, median of 5), one
JSON list on the path. Every candidate must compile without spills: check with _compile.ptxas_reports first.

  fwd: flash_fwd_sm90's candidates (config._TILES patched, _TILES_BY_KEYS emptied so each runs as given)
       through backends.cuda.forward_launches, in three rounds interleaved with torch SDPA's cuDNN forward on
       the same inputs, and each output's max error against cuDNN's (how _TILES_BY_KEYS was chosen).
  fwd-mma: the same for flash_fwd (the mma.sync family forced), against torch SDPA's flash backend
       (FlashAttention-2).
  bwd: flash_bwd's (config._TILES patched), atomic and deterministic, causal and not, through
       backends.cuda.backward (how _TILES["flash_bwd"] was chosen; its original warmed up with 1 call, this
       with 3).

    python3 bench/tile_sweep.py fwd|fwd-mma|bwd OUT.json
"""

import dataclasses
import json
import os
import sys

import cupy as cp
import numpy as np
from deterministic import inputs, ms_per_call, record  # bench/ (the script's directory) is on sys.path

import cuflash
from cuflash import _compile, config
from cuflash.backends import cuda

FWD_CANDIDATES = {"flash_fwd_sm90": {64: [(128, 128, 12), (128, 192, 12), (64, 128, 8), (64, 192, 8)],
                                     128: [(128, 128, 12), (128, 176, 12), (128, 192, 12)],
                                     256: [(128, 64, 12), (128, 80, 12)]},
                  "flash_fwd": {32: [(128, 64, 8), (128, 64, 4), (128, 128, 8)],
                                64: [(128, 64, 4), (128, 128, 8), (128, 64, 8)],
                                96: [(128, 32, 4), (128, 64, 4), (128, 64, 8)],
                                128: [(128, 32, 4), (128, 64, 4), (128, 64, 8)],
                                160: [(64, 32, 4), (64, 64, 4), (128, 64, 8)],
                                192: [(128, 64, 8), (64, 64, 4)],
                                256: [(128, 64, 8), (64, 64, 4), (128, 32, 8)]}}
FWD_SHAPES = {"flash_fwd_sm90": [(2, 8, n, 128, causal, "bf16") for n in (2048, 4096, 8192, 16384)
                                 for causal in (True, False)] + [
    (1, 8, 8192, 128, True, "bf16"), (2, 8, 8192, 128, True, "fp16"), (2, 8, 8192, 128, False, "fp16"),
    (1, 32, 8192, 32, True, "bf16"), (8, 16, 1024, 64, True, "bf16"), (8, 16, 1024, 64, False, "bf16"),
    (16, 16, 512, 64, True, "bf16"), (4, 16, 2048, 64, True, "bf16"), (4, 16, 2048, 64, False, "bf16"),
    (4, 16, 4096, 64, True, "bf16"), (4, 16, 4096, 64, False, "bf16"), (2, 16, 8192, 64, True, "fp16"),
    (2, 16, 8192, 64, False, "fp16"), (1, 4, 8192, 256, True, "bf16"), (2, 4, 8192, 256, False, "bf16"),
    (2, 4, 2048, 256, True, "bf16"), (2, 4, 2048, 256, False, "bf16")],  # B, H, N, d, causal, dtype
    "flash_fwd": [(2, 8, n, 128, causal, "bf16") for n in (1024, 4096, 16384) for causal in (True, False)] + [
    (1, 8, 8192, 128, True, "bf16"), (2, 8, 8192, 128, False, "fp16"), (1, 32, 8192, 32, True, "bf16"),
    (1, 32, 8192, 32, False, "bf16"), (1, 16, 8192, 64, True, "bf16"), (1, 16, 8192, 64, False, "bf16"),
    (4, 16, 2048, 64, True, "bf16"), (1, 10, 8192, 96, True, "bf16"), (1, 10, 8192, 96, False, "bf16"),
    (1, 6, 8192, 160, True, "bf16"), (1, 5, 8192, 192, True, "bf16"), (1, 4, 8192, 256, True, "bf16"),
    (1, 4, 8192, 256, False, "bf16"), (2, 4, 2048, 256, False, "bf16")]}
BWD_CANDIDATES = {32: [(64, 64, 4), (64, 128, 8), (128, 128, 8), (128, 64, 4)],
                  64: [(64, 64, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8), (128, 64, 8)],
                  128: [(64, 64, 4), (64, 128, 8), (128, 64, 8), (64, 64, 8)],
                  256: [(64, 64, 8), (64, 32, 4)]}


def fwd(rows, kernel="flash_fwd_sm90"):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config._TILES_BY_KEYS.clear()
    family, candidates = ("sm90" if kernel.endswith("_sm90") else "mma"), FWD_CANDIDATES[kernel]
    baseline, backend = {"sm90": ("torch-cudnn", SDPBackend.CUDNN_ATTENTION),
                         "mma": ("torch-flash", SDPBackend.FLASH_ATTENTION)}[family]
    dtypes = {"bf16": "bfloat16", "fp16": "float16"}
    _compile.precompile([dataclasses.replace(config.choose_forward(dtypes[dt], d, config.LOCAL if causal else 0,
                                                                   compute_capability=90, family=family),
                                             block_m=bm, block_n=bn, warps=w)
                         for _, _, _, d, causal, dt in FWD_SHAPES[kernel]
                         for bm, bn, w in candidates[config.compiled_head_dim(d, sorted(candidates))]],
                        jobs=os.cpu_count())
    stream = cp.cuda.get_current_stream().ptr
    for b, h, n, d, causal, dtype in FWD_SHAPES[kernel]:
        compiled = config.compiled_head_dim(d, sorted(candidates))
        tiles = candidates[compiled]
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        qt, kt, vt = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(3))
        q, k, v = (cp.from_dlpack(x) for x in (qt, kt, vt))
        sdpa = lambda: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qt, kt, vt)),  # noqa: E731
                                                      is_causal=causal)
        with sdpa_kernel(backend):
            ref = cp.from_dlpack(sdpa().transpose(1, 2).float().contiguous())
        launches, errors = {}, {}
        for tile in tiles:
            config._TILES[kernel][compiled] = tile
            o, lse = cp.full(q.shape, cp.nan, q.dtype), cp.empty((b, h, n), cp.float32)
            with cuflash.kernel_family(family):
                launches[tile] = cuda.forward_launches(q, k, v, o, lse, causal=causal, softmax_scale=d ** -0.5)
            launches[tile].run(stream)
            errors[tile] = float(cp.abs(o.astype(cp.float32) - ref).max())
        times = {t: [] for t in [*tiles, baseline]}
        for r in range(3):  # each round starts one further along the list
            for t in list(times)[r:] + list(times)[:r]:
                if t == baseline:
                    with sdpa_kernel(backend):
                        times[t].append(ms_per_call(sdpa))
                else:
                    times[t].append(ms_per_call(lambda: launches[t].run(stream)))  # noqa: B023
        ms = {t: float(np.median(v)) for t, v in times.items()}
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        record(rows, {"kernel": kernel, "shape": [b, h, n, d], "causal": causal, "dtype": dtype, "baseline": baseline,
                      "baseline_ms": ms[baseline], "tiles": {
            str(t): {"ms": ms[t], "tflops": round(flops / ms[t] / 1e9, 1),
                     "over_baseline": round(ms[baseline] / ms[t], 3), "over_first": round(ms[tiles[0]] / ms[t], 3),
                     "max_err": errors[t], "rounds": times[t]}
            for t in tiles}})


def bwd(rows):
    for d, tiles in BWD_CANDIDATES.items():
        b, h, n = (2, 8, 8192) if d == 128 else (1, 1024 // d, 8192)
        q, k, v, do = inputs(b, h, n, d)
        for causal in (True, False):
            o, lse = cp.empty_like(q), cp.empty((b, h, n), cp.float32)
            cuda.forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out=o, lse=lse)
            for det in (False, True):
                for tile in tiles:
                    config._TILES["flash_bwd"][d] = tile
                    grads = [cp.empty_like(x) for x in (q, k, v)]
                    f = lambda: cuda.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=d ** -0.5,  # noqa: E731
                                              deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2])
                    ms = ms_per_call(f, calls=10)
                    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                    record(rows, {"d": d, "shape": [b, h, n, d], "tile": tile, "causal": causal, "det": det, "ms": ms,
                                  "tflops": flops / ms / 1e9})


def main(mode, path):
    rows = []
    {"fwd": fwd, "fwd-mma": lambda r: fwd(r, "flash_fwd"), "bwd": bwd}[mode](rows)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
