"""The decode suite: one query row per sequence over a long KV cache (flash_attn_with_kvcache, no append),
its KV read bandwidth against torch SDPA's flash and cuDNN backends on the same values, and against a
device-to-device copy measured in the same run.

The pure parts (cells, byte counts, bandwidth, copy fractions) import nothing heavy: they run on the CPU
in the tests. `Data` and the implementations import CuPy and torch when they run.
"""

from __future__ import annotations

import dataclasses
import functools

from ..config import numpy_dtype
from .baselines import Case, Impl, TorchSDPA, Unavailable, refusals_as_unavailable

# (batch, nheads, nheads_k, cache length, head_dim); the paged caches use the first shape
SHAPES = ((8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128), (64, 32, 8, 4096, 128), (8, 16, 16, 16384, 64))
PAGE_SIZES = (16, 64, 256)
QUICK_PAGE_SIZES = (64,)
COPY = "copy"
APPEND = "cuflash-append"  # a decoding step: one new row per entry written into the cache, then attended over
IMPLS = ("cuflash", APPEND, "torch-flash", "torch-cudnn", COPY)  # the order of a cell's rows, and of the table
ON_CPU = "it times flash_attn_with_kvcache over KV caches of 0.5-1 GiB on a CUDA GPU; this run is on the CPU"
ROUNDS = 3  # a cell's implementations timed in this many interleaved rounds (--quick: 1)
METHOD = ("device ms: CUDA events around each call, the calls back to back behind a spin kernel after warm-up, "
          "median of >= 10; a cell's implementations timed one after the other in `rounds` rounds, each row the "
          "round with the median device time (every timed round's in round_ms): the GPU's rate drops by 10-15 % "
          "for some milliseconds, for every implementation alike, so one round would turn a drift into a "
          "difference between implementations; host us: median time.perf_counter() around each call, back to back "
          "behind a spin kernel (timing.time_call); one input set, not rotated: every K + V cache is 0.5-1 GiB, far "
          "above the L2. KV TB/s: bytes of K and V (2 B len H_kv d itemsize) / time; the copy's TB/s counts what "
          "it reads and writes (2 x those bytes: the DRAM traffic of a cudaMemcpyAsync of a buffer of the K + V "
          "size); of copy = TB/s / copy's TB/s. cuflash: flash_attn_with_kvcache, k = v = None, cache_seqlens an "
          "int32 device array (every entry the full length), the paged block_table a random permutation of the "
          "pool's pages; cuflash-append: the same with k, v one new row per entry and cache_seqlens the int len - 1 "
          "(each call rewrites the last row); torch SDPA: the same values as dense (B, H, 1, d) / (B, H_kv, len, d) tensors, paged "
          "cells too (SDPA has no paged cache)")


@dataclasses.dataclass(frozen=True)
class Cell:
    batch: int
    nheads: int
    nheads_k: int
    seqlen_k: int
    head_dim: int
    dtype: str
    page_size: int | None = None  # None: a dense cache

    @property
    def case(self) -> Case:
        """The attention shape of a row: one query row, non-causal."""
        return Case(self.batch, self.nheads, 1, self.seqlen_k, self.head_dim, self.dtype, False)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the call reads: 2 B len H_kv d itemsize."""
        return 2 * self.batch * self.seqlen_k * self.nheads_k * self.head_dim * numpy_dtype(self.dtype).itemsize

    @property
    def num_pages(self) -> int:
        """Pages in the pool: exactly the cache's (every entry full)."""
        return self.batch * self.seqlen_k // self.page_size if self.page_size else 0

    @property
    def cache(self) -> str:
        return f"paged {self.page_size}" if self.page_size else "dense"

    @property
    def dense(self) -> "Cell":
        """The dense cell of the same shape: the one whose values this cell's inputs share."""
        return dataclasses.replace(self, page_size=None)

    @property
    def label(self) -> str:
        return (f"B={self.batch} H={self.nheads} Hkv={self.nheads_k} L={self.seqlen_k} d={self.head_dim} "
                f"{self.cache}")

    def extra(self) -> dict:
        """The keys every row of this cell carries beside make_row's."""
        return {"nheads_k": self.nheads_k, "page_size": self.page_size, "cache": self.cache,
                "kv_bytes": self.kv_bytes}


def params(s) -> dict:
    """The decode suite's sweep (pure). Fixed shapes; --dtype applies; --quick keeps the first shape, dense
    and paged with 64-key pages."""
    dtype = s.dtype or "bfloat16"
    shapes = SHAPES[:1] if s.quick else SHAPES
    pages = QUICK_PAGE_SIZES if s.quick else PAGE_SIZES
    cells = [(*shape, None) for shape in shapes[:1]] + [(*shapes[0], p) for p in pages]
    cells += [(*shape, None) for shape in shapes[1:]]
    keys = ("batch", "nheads", "nheads_k", "seqlen_k", "head_dim", "page_size")
    return {"dtype": dtype, "causal": False, "seqlen_q": 1, "modes": ["fwd"], "rounds": 1 if s.quick else ROUNDS,
            "cells": [dict(zip(keys, c)) for c in cells],
            "implementations": [i for i in IMPLS if i == COPY or i.replace("-append", "") in s.backends],
            "method": METHOD}


def cells(p: dict) -> list[Cell]:
    return [Cell(c["batch"], c["nheads"], c["nheads_k"], c["seqlen_k"], c["head_dim"], p["dtype"], c["page_size"])
            for c in p["cells"]]


def variant_bits(cell: Cell) -> int:
    """The forward kernel's kVariant of the cell's call (non-causal, per-entry key counts, paged or not)."""
    from .. import _params

    return _params.variant(False, None, kvcache=(True, True if cell.page_size else None))


def kernels(cell: Cell, compute_capability: int = 0, family: str | None = None) -> list:
    """The cuflash kernel configs of the cell's call (pure): flash_decode and its combine where
    config.choose_decode serves it, else the forward's."""
    from .. import config

    bits = variant_bits(cell)
    pair = config.choose_decode(cell.dtype, cell.head_dim, bits, packed_rows=cell.nheads // cell.nheads_k,
                                family=family, smem_limit=config.SMEM_LIMIT.get(compute_capability))
    return list(pair) if pair else [config.choose_forward(cell.dtype, cell.head_dim, bits,
                                                          compute_capability=compute_capability, family=family)]


def bandwidth(cell: Cell, implementation: str, ms: float | None) -> dict:
    """bytes_per_call (K and V read; the copy: read and written) and tb_per_s = bytes / time."""
    n = 2 * cell.kv_bytes if implementation == COPY else cell.kv_bytes
    return {"bytes_per_call": n, "tb_per_s": n / (ms * 1e-3) / 1e12 if ms and ms > 0 else None}


def median_rounds(rows: list[dict]) -> list[dict]:
    """One row per (cell, implementation) from the rounds' rows (pure): the ok round with the median device time
    (the lower middle of an even count), with every ok round's median time in round_ms. A round that failed
    (error, OOM, unavailable) gives the row instead; rounds the time budget skipped are left out, unless none ran.
    Rows keep their first round's order."""
    groups: dict = {}
    for r in rows:
        key = (tuple(r["shape"].values()), r["dtype"], r.get("page_size"), r["implementation"])
        groups.setdefault(key, []).append(r)
    out = []
    for group in groups.values():
        failed = [r for r in group if r["status"] not in ("ok", "skipped")]
        ok = [r for r in group if r["status"] == "ok"]
        if failed or not ok:
            out.append((failed or group)[0])
            continue
        chosen = sorted(ok, key=lambda r: r["ms_median"])[(len(ok) - 1) // 2]
        out.append({**chosen, "round_ms": [r["ms_median"] for r in ok]})
    return out


def add_copy_fractions(rows: list[dict]) -> None:
    """Every ok row with tb_per_s gets copy_fraction = its TB/s over the copy's in the same cell."""
    def key(r):
        return tuple(r["shape"].values()), r["dtype"], r.get("nheads_k"), r.get("page_size")

    copy = {key(r): r["tb_per_s"] for r in rows if r["implementation"] == COPY and r["status"] == "ok"
            and r.get("tb_per_s")}
    for r in rows:
        ref = copy.get(key(r))
        if r["status"] == "ok" and r.get("tb_per_s") and ref:
            r["copy_fraction"] = r["tb_per_s"] / ref


# ------------------------------------------------------------------------------------------------
# GPU: inputs and the implementations
# ------------------------------------------------------------------------------------------------


def _bits(x):
    """The same memory as unsigned integers of the same size (for indexing copies of any dtype)."""
    return x.view(f"u{x.dtype.itemsize}")


def page_pool(x, perm, page: int):
    """The values of a dense (B, len, H_kv, d) cache (NumPy or CuPy) as a pool of B len / page pages: chunk i of
    the cache (entry i // (len / page), keys from (i % (len / page)) page on) is page perm[i]; with
    block_table = perm.reshape(B, len / page), key j of entry b is row j % page of page block_table[b, j // page]."""
    from ..reference import _namespace

    n = x.shape[0] * x.shape[1] // page
    pool = _namespace(x).empty((n, page, *x.shape[2:]), dtype=x.dtype)
    _bits(pool)[perm] = _bits(x).reshape(n, page, *x.shape[2:])
    return pool


class Data:
    """The inputs of the cells of one dense shape, each made at first use: q and the dense caches in bshd
    (cuflash), a page pool and block table per page size, the same values as bhsd torch tensors, torch's
    K / V expanded to every query head (only where enable_gqa is refused), and the copy's two buffers."""

    def __init__(self, cell: Cell, seed: int):
        import cupy

        from .baselines import cast

        self.cell, self.seed = cell.dense, seed
        b, h, hk, n, d = cell.batch, cell.nheads, cell.nheads_k, cell.seqlen_k, cell.head_dim
        rs = cupy.random.RandomState(seed)
        self.q, self.k, self.v = (cast(rs.standard_normal(s, dtype=cupy.float32), cell.dtype)
                                  for s in ((b, 1, h, d), (b, n, hk, d), (b, n, hk, d)))
        self.seqlens = cupy.full((b,), n, dtype=cupy.int32)
        self._cache: dict = {}

    def _once(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def paged(self, page: int):
        """(k pool, v pool, block_table): logical key j of entry b at row j % page of page block_table[b, j // page]."""
        def make():
            import cupy

            c = self.cell
            perm = cupy.random.RandomState(self.seed + page).permutation(c.batch * c.seqlen_k // page)
            perm = perm.astype(cupy.int32)
            return page_pool(self.k, perm, page), page_pool(self.v, perm, page), perm.reshape(c.batch, -1)

        return self._once(("paged", page), make)

    def new_rows(self):
        """k, v (B, 1, H_kv, d): the last key row of each entry, the append's new row (the cache keeps its values)."""
        return self._once("new", lambda: (self.k[:, -1:].copy(), self.v[:, -1:].copy()))

    def torch_qkv(self):
        """q (B, H, 1, d), k, v (B, H_kv, len, d): contiguous torch tensors of the same values."""
        def make():
            import cupy

            from .baselines import to_torch

            return tuple(to_torch(cupy.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (self.q, self.k, self.v))

        return self._once("torch", make)

    def torch_expanded(self):
        """k, v with every kv head repeated H / H_kv times: (B, H, len, d)."""
        def make():
            _, k, v = self.torch_qkv()
            g = self.cell.nheads // self.cell.nheads_k
            return tuple(x.repeat_interleave(g, dim=1) for x in (k, v))

        return self._once("expanded", make)

    def copy_buffers(self):
        def make():
            import cupy

            return tuple(cupy.empty((self.cell.kv_bytes,), dtype=cupy.uint8) for _ in range(2))

        return self._once("copy", make)


class CuflashDecode(Impl):
    """flash_attn_with_kvcache over the cell's cache; append=True: a decoding step (APPEND)."""

    def __init__(self, append: bool = False):
        self.append = append
        self.name = APPEND if append else "cuflash"

    def available(self):
        from .baselines import Cuflash

        return Cuflash().available()

    def calls(self, cell: Cell, data: Data) -> tuple[list, dict]:
        from ..api import flash_attn_with_kvcache

        if cell.page_size:
            k, v, bt = data.paged(cell.page_size)
            layout = f"page pools ({cell.num_pages}, {cell.page_size}, H_kv, d), block_table ({cell.batch}, " \
                     f"{cell.seqlen_k // cell.page_size})"
        else:
            k, v, bt = data.k, data.v, None
            layout = "dense caches (B, len, H_kv, d)"
        kw = dict(block_table=bt, softmax_scale=cell.case.scale)
        if self.append:
            k_new, v_new = data.new_rows()
            fn = functools.partial(flash_attn_with_kvcache, data.q, k, v, k_new, v_new, cache_seqlens=cell.seqlen_k - 1,
                                   **kw)
        else:
            fn = functools.partial(flash_attn_with_kvcache, data.q, k, v, cache_seqlens=data.seqlens, **kw)
        return [fn], {"layout": layout, **self.kernel_of(cell)}

    @staticmethod
    def kernel_of(cell: Cell) -> dict:
        """The row's kernel, and with flash_decode the splits it runs (num_splits=0's choice on this GPU)."""
        from ..backends import cuda
        from ..config import ceil_div, forced_family

        main = kernels(cell, cuda.compute_capability(), forced_family())[0]
        out = {"kernel": main.kernel}
        if main.kernel == "flash_decode":
            tiles = cell.batch * cell.nheads_k * ceil_div(cell.nheads // cell.nheads_k, main.block_m)
            out["num_splits"] = cuda.split_count(main, tiles, cell.seqlen_k, 0, cell.page_size or 0)
        return out


class TorchDecode(TorchSDPA):
    """F.scaled_dot_product_attention with one backend forced, over the dense bhsd values; GQA through
    enable_gqa where the backend takes it, else K / V expanded to every query head (and the row says so)."""

    def calls(self, cell: Cell, data: Data) -> tuple[list, dict]:
        import torch.nn.functional as F

        q, k, v = data.torch_qkv()
        kw = {"scale": cell.case.scale}
        layout = "dense (B, H_kv, len, d)"
        if cell.nheads == cell.nheads_k:
            return [self._checked(functools.partial(F.scaled_dot_product_attention, q, k, v, **kw))], {
                "gqa": "none (H_kv = H)", "layout": layout}
        try:
            fn = self._checked(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True, **kw))
            return [fn], {"gqa": "enable_gqa", "layout": layout}
        except Unavailable as e:
            refused = str(e)
        k2, v2 = data.torch_expanded()
        try:
            fn = self._checked(functools.partial(F.scaled_dot_product_attention, q, k2, v2, **kw))
        except Unavailable as e:
            raise Unavailable(f"enable_gqa: {refused[:240]}; K/V heads expanded: {str(e)[:240]}") from e
        return [fn], {"gqa": f"expanded K/V heads to {cell.nheads} (enable_gqa refused: {refused[:200]})",
                      "layout": "dense (B, H, len, d), K/V heads repeated"}

    @staticmethod
    def _checked(fn):
        """fn, after one call: a backend that cannot run the case raises Unavailable with torch's reasons."""
        with refusals_as_unavailable():
            fn()
        return fn


class DeviceCopy(Impl):
    """cudaMemcpyAsync, device to device, of a buffer of the K + V size: the bandwidth reference."""

    name = COPY

    def calls(self, cell: Cell, data: Data) -> tuple[list, dict]:
        src, dst = data.copy_buffers()
        return [functools.partial(dst.data.copy_from_device_async, src.data, cell.kv_bytes)], {
            "layout": f"{cell.kv_bytes} bytes, one cudaMemcpyAsync"}


def implementations(names) -> list[Impl]:
    make = {"cuflash": CuflashDecode, APPEND: lambda: CuflashDecode(append=True), "torch-flash": lambda: TorchDecode("torch-flash"),
            "torch-cudnn": lambda: TorchDecode("torch-cudnn"), COPY: DeviceCopy}
    return [make[n]() for n in names]
