"""Tensor maps: how the Hopper kernels' bulk tensor copies (TMA) see q, k, v (and the backward's dout).

A CUtensorMap is 128 opaque bytes that the CUDA driver encodes (cuTensorMapEncodeTiled) from a global
address, the extent and byte stride of each dimension, and the box one copy brings into shared memory.
The kernel reads it from its parameters (kernels_cu/params.cuh, FwdSm90Params and BwdSm90Params). A plan
reuses its params bytes from call to call, so only the address changes: cuTensorMapReplaceAddress rewrites it.
Called through ctypes on the driver library CuPy has loaded: no other dependency.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from ._params import TENSOR_MAP_BYTES

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
_DATA_TYPE = {"float16": 6, "bfloat16": 9}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
SLAB = 64  # columns per box: one 128-byte swizzled row of 16-bit elements (kernels_cu/sm90.cuh)

# The arrays each map describes: (pointer, seqlen, heads, row / head / batch strides), FwdParams fields but
# for dout's pointer and strides (BwdParams)
ARRAYS = {
    "q": ("q", "seqlen_q", "nheads", "q_row_stride", "q_head_stride", "q_batch_stride"),
    "k": ("k", "seqlen_k", "nheads_k", "k_row_stride", "k_head_stride", "k_batch_stride"),
    "v": ("v", "seqlen_k", "nheads_k", "v_row_stride", "v_head_stride", "v_batch_stride"),
    "do": ("dout", "seqlen_q", "nheads", "do_row_stride", "do_head_stride", "do_batch_stride"),
}


def _holder(p, field: str):
    """The record holding `field`: a BwdParams record `p` keeps the forward's fields in p["fwd"]."""
    return p if field in p.dtype.names else p["fwd"]


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                                           u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuTensorMapReplaceAddress.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def geometry(p, name: str, rows: int, extent: tuple[int, int] | None = None, itemsize: int = 2):
    """(dims, byte strides, box) of one array's map, innermost first: (head_dim, seqlen, heads, batch),
    boxes of SLAB columns x `rows` rows. p: a FWD_PARAMS or BWD_PARAMS record. extent: (rows, entries) of an
    array that p's seqlen and batch do not describe: a varlen call's packed one (total rows, 1 entry: the
    kernel adds each sequence's first row), a paged cache's pool (page_size, num_pages). A dimension of
    extent 1 is never stepped, so its stride only needs to be valid (TMA takes positive multiples of 16
    bytes); an empty one (seqlen_k = 0) is never read, and is described as one row."""
    _, seqlen, heads, *strides = ARRAYS[name]
    fwd = _holder(p, "head_dim")
    dims = tuple(max(1, int(fwd[f])) for f in ("head_dim", seqlen, heads, "batch"))
    if extent:
        dims = (dims[0], extent[0], dims[2], extent[1])
    held = _holder(p, strides[0])
    byte_strides = tuple(int(held[s]) * itemsize if n > 1 else 16 for s, n in zip(strides, dims[1:]))
    return dims, byte_strides, (SLAB, rows, 1, 1)


def encode(out: np.ndarray, dtype: str, address: int, dims, byte_strides, box) -> None:
    """cuTensorMapEncodeTiled into `out` (TENSOR_MAP_BYTES bytes, 64-byte aligned): 128-byte swizzle,
    out-of-bounds elements read as zeros."""
    c_dims = (ctypes.c_uint64 * 4)(*dims)
    c_strides = (ctypes.c_uint64 * 3)(*byte_strides)
    c_box = (ctypes.c_uint32 * 4)(*box)
    c_elem = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    err = _driver().cuTensorMapEncodeTiled(out.ctypes.data, _DATA_TYPE[dtype], 4, address, c_dims, c_strides, c_box,
                                           c_elem, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if err:
        raise Unencodable(f"cuTensorMapEncodeTiled failed (CUresult {err}) for dims {dims}, byte strides "
                           f"{byte_strides}, box {box}")


class Unencodable(RuntimeError):
    """The driver refused a tensor map: a layout TMA cannot describe (the call runs on the mma kernel)."""


class SM90Params:
    """A Hopper kernel's params struct (_params.FWD_SM90_PARAMS or BWD_SM90_PARAMS: `layout`) in a 64-byte
    aligned buffer: `raw` (uint8), the FwdParams or BwdParams record `p` at offset 0 and a map of each array in
    `boxes` ({name: box rows}) after it; extents: {name: geometry's extent} where p does not describe one.
    `follow(offset, pointers)` points the maps at the arrays whose pointers a plan has just written into `raw`
    from byte `offset` on: same geometry, new addresses.

    A plan is built from its first call's arrays, whose pointers may be misaligned (the plan sends such calls
    to the general path, which copies them): TMA takes 16-byte aligned addresses only, so the maps are encoded
    at the address rounded down, and the plan re-addresses them before each run. A direct run's arrays are
    aligned already (backends/cuda.py)."""

    def __init__(self, layout: np.dtype, p, dtype: str, boxes: dict[str, int],
                 extents: dict[str, tuple[int, int]] | None = None):
        buf = np.zeros(layout.itemsize + 64, dtype=np.uint8)
        start = -buf.ctypes.data % 64
        self.raw = buf[start:start + layout.itemsize]
        self.raw[:p.dtype.itemsize] = np.frombuffer(p.tobytes(), dtype=np.uint8)
        self._follow = []  # (map address, byte offset in raw of the pointer it follows, the address it holds)
        for name, rows in boxes.items():
            off = layout.fields[f"tma_{name}"][1]
            tensor_map = self.raw[off:off + TENSOR_MAP_BYTES]
            pointer = ARRAYS[name][0]
            address = int(_holder(p, pointer)[pointer]) & ~15
            encode(tensor_map, dtype, address, *geometry(p, name, rows, (extents or {}).get(name)))
            self._follow.append((tensor_map.ctypes.data, _offset(p.dtype, pointer), address))
        self._replace = _driver().cuTensorMapReplaceAddress

    def follow(self, offset: int, pointers: tuple[int, ...]) -> None:
        # the pointers themselves, not raw's bytes read back: this runs on every cached call
        for i, (tensor_map, off, address) in enumerate(self._follow):
            k = (off - offset) >> 3
            if 0 <= k < len(pointers) and off == offset + 8 * k and pointers[k] != address:
                err = self._replace(tensor_map, pointers[k])
                if err:
                    raise RuntimeError(f"cuTensorMapReplaceAddress failed (CUresult {err})")
                self._follow[i] = (tensor_map, off, pointers[k])


def _offset(dtype: np.dtype, field: str) -> int:
    """Byte offset of a pointer field in a FwdParams or BwdParams record (BwdParams: the forward's in "fwd")."""
    if field in dtype.names:
        return dtype.fields[field][1]
    fwd, base = dtype.fields["fwd"]
    return base + fwd.fields[field][1]
