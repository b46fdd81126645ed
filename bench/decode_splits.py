"""flash_decode's time per split count, beside num_splits=0's choice: what the split heuristic
(config.decode_splits) is judged by. The decode suite's dense shapes, and page pools of the first two (B = 8:
pages of 16, 64, 256 keys; B = 1: 16, 64), bf16, one query row; device time as the suite measures it (timing.time_device: events around
back-to-back calls behind a spin kernel, median).

    python3 bench/decode_splits.py OUT.json
"""

import functools
import json
import sys

import cupy as cp

import cuflash
from cuflash.backends import cuda
from cuflash.benchmark import decode
from cuflash.benchmark.timing import clock, time_device

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
PAGES = {decode.SHAPES[0]: (16, 64, 256), decode.SHAPES[1]: (16, 64)}


def main(path):
    rows = []
    cells = [(shape, page) for shape in decode.SHAPES for page in (None, *PAGES.get(shape, ()))]
    for shape, page in cells:
        cell = decode.Cell(*shape, "bfloat16", page_size=page)
        data = decode.Data(cell, seed=0)
        k, v, table = data.paged(page) if page else (data.k, data.v, None)
        chosen = decode.CuflashDecode.kernel_of(cell)["num_splits"]
        row = {"shape": list(shape), "page_size": page, "kv_bytes": cell.kv_bytes, "chosen": chosen, "ms": {}}
        for n in (0, *SPLITS):
            fn = functools.partial(cuflash.flash_attn_with_kvcache, data.q, k, v, cache_seqlens=data.seqlens,
                                   block_table=table, num_splits=n)
            row["ms"][n] = time_device([fn], clock("cupy"), warmup=3, repeats=20, budget_s=1.0)["ms_median"]
        best = min(SPLITS, key=lambda n: row["ms"][n])
        row.update(best=best, chosen_over_best=row["ms"][0] / row["ms"][best],
                   tb_per_s={n: cell.kv_bytes / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
        del data, k, v, table
        cp.get_default_memory_pool().free_all_blocks()
    with open(path, "w") as f:
        json.dump({"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sms": cuda._multiprocessors(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
