"""flash_bwd tile candidates timed on the GPU (bf16, CUDA events around 10 back-to-back calls, median of 5;
the sweep's original warmed up with 1 call, this one with 3),
atomic and deterministic, causal and not, through backends.cuda.backward with config._TILES patched (every
candidate compiles without spills: check with _compile.ptxas_reports first). One JSON list on the path.

    python3 bench/tile_sweep.py OUT.json
"""

import json
import sys

import cupy as cp
from deterministic import inputs, ms_per_call, record  # bench/ (the script's directory) is on sys.path

from cuflash import config
from cuflash.backends import cuda

CANDIDATES = {32: [(64, 64, 4), (64, 128, 8), (128, 128, 8), (128, 64, 4)],
              64: [(64, 64, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8), (128, 64, 8)],
              128: [(64, 64, 4), (64, 128, 8), (128, 64, 8), (64, 64, 8)],
              256: [(64, 64, 8), (64, 32, 4)]}


def main(path):
    rows = []
    for d, tiles in CANDIDATES.items():
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
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
