"""NumPy structured dtypes that mirror kernels_cu/params.cuh byte for byte.

A kernel takes its params struct by value; CuPy passes a NumPy structured scalar as raw bytes, so
these dtypes must match the C++ layout exactly (align=True gives C's natural alignment).
tests/test_params.py checks the layout against the header's field list and sizes.
"""

from __future__ import annotations

import numpy as np

from . import _mask, _philox
from .config import BOUNDED_SOFTCAP, SEMAPHORE_ROWS, backward_workspace, ceil_div, compiled_head_dim, variant_bits

_i64, _f64, _i32, _f32, _ptr = np.int64, np.float64, np.int32, np.float32, np.uint64


def _strides(name: str, dims=("batch", "row", "head")) -> list[tuple[str, type]]:
    return [(f"{name}_{d}_stride", _i64) for d in dims]


FWD_PARAMS = np.dtype(
    [
        ("q", _ptr), ("k", _ptr), ("v", _ptr), ("o", _ptr), ("lse", _ptr),
        *_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"),
        *_strides("lse", ("batch", "head")),
        ("softmax_scale", _f64), ("scale_log2", _f64),
        ("batch", _i32), ("nheads", _i32), ("nheads_k", _i32),
        ("seqlen_q", _i32), ("seqlen_k", _i32), ("head_dim", _i32),
        ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr), ("alibi_slopes", _ptr), ("alibi_batch_stride", _i64),
        ("seed", np.uint64), ("dropout_scale", _f64), ("window_left", _i32), ("window_right", _i32),
        ("softcap", _f32), ("dropout_threshold", np.uint32), ("offset", np.uint32),
        ("seqused_k", _ptr), ("block_table", _ptr), ("block_table_batch_stride", _i64),
        ("page_size", _i32), ("num_pages", _i32),
    ],
    align=True,
)

BWD_PARAMS = np.dtype(
    [
        ("fwd", FWD_PARAMS),
        ("dout", _ptr), ("dq", _ptr), ("dk", _ptr), ("dv", _ptr), ("dsum", _ptr),
        *_strides("do"), *_strides("dq"), *_strides("dk"), *_strides("dv"),
        *_strides("dsum", ("batch", "head")),
        ("dq_accum_offset", _i64), ("dq_semaphore_offset", _i64),
        *_strides("dq_accum", ("batch", "head", "row")),
        *_strides("dq_semaphore", ("batch", "head")),
        ("dq_accum_swizzle", _i32),
    ],
    align=True,
)

# flash_decode's params (DecodeParams): FwdParams, the split partials and their count.
DECODE_PARAMS = np.dtype([("fwd", FWD_PARAMS), ("o_partial", _ptr), ("lse_partial", _ptr), ("num_splits", _i32)],
                         align=True)

# kvcache_append's params (AppendParams): the new rows, the caches, where each entry's rows start.
APPEND_PARAMS = np.dtype(
    [
        ("k_new", _ptr), ("v_new", _ptr), ("k", _ptr), ("v", _ptr),
        ("cache_seqlens", _ptr), ("block_table", _ptr), ("counts", _ptr), ("start", _i64),
        *_strides("k_new"), *_strides("v_new"), *_strides("k"), *_strides("v"),
        ("block_table_batch_stride", _i64), ("capacity", _i64),
        ("seqlen_new", _i32), ("nheads_k", _i32), ("head_dim", _i32), ("page_size", _i32), ("num_pages", _i32),
    ],
    align=True,
)

# flash_fwd_sm90's params: FwdParams, then one CUtensorMap (128 bytes, 64-byte aligned) for each of q, k, v,
# written by cuflash/_tma.py.
TENSOR_MAP_BYTES = 128
_TMA0 = -(-FWD_PARAMS.itemsize // 64) * 64
FWD_SM90_PARAMS = np.dtype({
    "names": ["fwd", "tma_q", "tma_k", "tma_v"],
    "formats": [FWD_PARAMS, *[(np.uint8, TENSOR_MAP_BYTES)] * 3],
    "offsets": [0, *(_TMA0 + TENSOR_MAP_BYTES * i for i in range(3))],
    "itemsize": _TMA0 + 3 * TENSOR_MAP_BYTES,
})

# flash_bwd_sm90's params: BwdParams, then the maps of q, k, v and dout.
_TMA0_BWD = -(-BWD_PARAMS.itemsize // 64) * 64
BWD_SM90_PARAMS = np.dtype({
    "names": ["bwd", "tma_q", "tma_k", "tma_v", "tma_do"],
    "formats": [BWD_PARAMS, *[(np.uint8, TENSOR_MAP_BYTES)] * 4],
    "offsets": [0, *(_TMA0_BWD + TENSOR_MAP_BYTES * i for i in range(4))],
    "itemsize": _TMA0_BWD + 4 * TENSOR_MAP_BYTES,
})

LOG2E = 1.4426950408889634
UNBOUNDED = 1 << 30  # a window bound of -1 (kUnbounded in kernels_cu/mask.cuh)

# Byte offsets of the pointer runs that change from call to call (the plan cache patches them):
# q, k, v, o, lse in FwdParams (and in BwdParams.fwd, DecodeParams.fwd, at offset 0); dout, dq, dk, dv, dsum in
# BwdParams; seqused_k, block_table in FwdParams (a KV cache); o_partial, lse_partial in DecodeParams; k_new ..
# counts, then start, in AppendParams.
FWD_POINTERS = FWD_PARAMS.fields["q"][1]
BWD_POINTERS = BWD_PARAMS.fields["dout"][1]
KVCACHE_POINTERS = FWD_PARAMS.fields["seqused_k"][1]
PARTIAL_POINTERS = DECODE_PARAMS.fields["o_partial"][1]
APPEND_POINTERS = APPEND_PARAMS.fields["k_new"][1]
for _dt, _names in ((FWD_PARAMS, ("q", "k", "v", "o", "lse")), (BWD_PARAMS, ("dout", "dq", "dk", "dv", "dsum")),
                    (FWD_PARAMS, ("seqused_k", "block_table")), (DECODE_PARAMS, ("o_partial", "lse_partial")),
                    (APPEND_PARAMS, ("k_new", "v_new", "k", "v", "cache_seqlens", "block_table", "counts", "start"))):
    _first = _dt.fields[_names[0]][1]
    assert [_dt.fields[n][1] for n in _names] == [_first + 8 * i for i in range(len(_names))], _names


def _ptr_of(a) -> int:
    return int(a.data.ptr) if a is not None and a.size else 0


def _elem_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def _set_bshd(p, name: str, a) -> None:
    sb, sr, sh, _ = _elem_strides(a)
    p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = sb, sr, sh


def _set_bhs(p, name: str, a) -> None:
    sb, sh, _ = _elem_strides(a)
    p[f"{name}_batch_stride"], p[f"{name}_head_stride"] = sb, sh


def variant(causal: bool, varlen=None, window=_mask.NO_WINDOW, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
            kvcache=None, deterministic=False, **_) -> int:
    """The kVariant bits a call needs (config.LOCAL, SOFTCAP, ALIBI, DROPOUT, VARLEN, WINDOW, SEQUSED, PAGED,
    DETERMINISTIC, BOUNDED): LOCAL alone for causal, LOCAL | WINDOW for any other window; kvcache: (seqused_k,
    block_table or None); deterministic: the backward's dQ adds in key-block order; BOUNDED for a softcap of at
    most config.BOUNDED_SOFTCAP without ALiBi (choose_forward keeps it where a kernel takes it)."""
    left, right = _mask.effective_window(causal, window)
    return variant_bits(local=not _mask.is_plain(left, right), window=(left, right) not in ((-1, -1), (-1, 0)),
                        softcap=bool(softcap), alibi=alibi_slopes is not None, dropout=bool(dropout_p),
                        bounded=0 < softcap <= BOUNDED_SOFTCAP and alibi_slopes is None,
                        varlen=varlen is not None, seqused=kvcache is not None,
                        paged=kvcache is not None and kvcache[1] is not None, deterministic=deterministic)


def fwd_params(q, k, v, o, lse, softmax_scale: float, causal: bool, varlen=None, **variants):
    """Pack a forward call. q/k/v/o are CuPy (batch, seqlen, heads, head_dim) views, lse (b, h, s);
    variants: the api's window, softcap, alibi_slopes, dropout_p, seed, offset.

    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) with q/k/v/o the packed arrays
    as (1, total, heads, head_dim) views and lse (1, heads, total_q): batch strides become 0 and the
    kernels take each sequence's rows from cu_seqlens.

    kvcache: (seqused_k, block_table) with k, v the cache: dense (batch, capacity, heads_k, head_dim)
    with block_table None, or page pools (num_pages, page_size, heads_k, head_dim) with block_table int32
    (batch, max_pages); seqused_k int32 (batch,), the key count of each entry (the kernels clamp it to
    the capacity: capacity, or max_pages * page_size)."""
    p = np.zeros((), dtype=FWD_PARAMS)
    _fill_fwd(p, q, k, v, o, lse, softmax_scale, causal, varlen, **variants)
    return p


def _fill_fwd(p, q, k, v, o, lse, softmax_scale: float, causal: bool, varlen=None, window=_mask.NO_WINDOW,
              softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0, offset=0, kvcache=None) -> None:
    p["q"], p["k"], p["v"], p["o"], p["lse"] = (_ptr_of(a) for a in (q, k, v, o, lse))
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        _set_bshd(p, name, a)
    _set_bhs(p, "lse", lse)
    p["softmax_scale"] = softmax_scale
    p["scale_log2"] = softmax_scale * LOG2E
    b, sq, h, d = q.shape
    p["batch"], p["nheads"], p["nheads_k"] = b, h, k.shape[2]
    p["seqlen_q"], p["seqlen_k"], p["head_dim"] = sq, k.shape[1], d
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        p["cu_seqlens_q"], p["cu_seqlens_k"] = _ptr_of(cu_q), _ptr_of(cu_k)
        p["batch"], p["seqlen_q"], p["seqlen_k"] = cu_q.shape[0] - 1, max_q, max_k
        for name in ("q", "k", "v", "o", "lse"):
            p[f"{name}_batch_stride"] = 0
    p["window_left"], p["window_right"] = (UNBOUNDED if w < 0 else w for w in _mask.effective_window(causal, window))
    p["softcap"] = softcap
    if alibi_slopes is not None:
        p["alibi_slopes"] = _ptr_of(alibi_slopes)
        p["alibi_batch_stride"] = alibi_slopes.strides[0] // alibi_slopes.itemsize if alibi_slopes.ndim == 2 else 0
    p["seed"], p["offset"] = seed, offset
    p["dropout_threshold"], p["dropout_scale"] = _philox.threshold(dropout_p), 1.0 / (1.0 - dropout_p)
    if kvcache is not None:
        seqused_k, block_table = kvcache
        p["seqused_k"] = _ptr_of(seqused_k)
        if block_table is not None:
            p["block_table"] = _ptr_of(block_table)
            p["block_table_batch_stride"] = block_table.strides[0] // block_table.itemsize
            p["num_pages"], p["page_size"] = k.shape[0], k.shape[1]
            p["seqlen_k"] = block_table.shape[1] * k.shape[1]  # the capacity of an entry


def append_params(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, counts, seqlen_new: int, capacity: int):
    """Pack a kvcache_append call. k_cache, v_cache: CuPy caches, dense (batch, capacity, heads_k, head_dim) or
    page pools with block_table int32 (batch, max_pages); k_new, v_new (batch, seqlen_new, heads_k, head_dim), or
    None for no rows to write (counts only); cache_seqlens: an int32 (batch,) device array, or an int (every
    entry's); counts: an int32 (batch,) device array for the key counts after the append, or None."""
    p = np.zeros((), dtype=APPEND_PARAMS)
    p["k"], p["v"] = _ptr_of(k_cache), _ptr_of(v_cache)
    for name, a in (("k", k_cache), ("v", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if a is not None:
            _set_bshd(p, name, a)
    if k_new is not None:
        p["k_new"], p["v_new"] = _ptr_of(k_new), _ptr_of(v_new)
    p["seqlen_new"] = seqlen_new
    if isinstance(cache_seqlens, int):
        p["start"] = cache_seqlens
    else:
        p["cache_seqlens"] = _ptr_of(cache_seqlens)
    if block_table is not None:
        p["block_table"] = _ptr_of(block_table)
        p["block_table_batch_stride"] = block_table.strides[0] // block_table.itemsize
        p["num_pages"], p["page_size"] = k_cache.shape[0], k_cache.shape[1]
    p["counts"] = _ptr_of(counts)
    p["capacity"], p["nheads_k"], p["head_dim"] = capacity, k_cache.shape[2], k_cache.shape[3]
    return p


def workspace_layout(q, varlen=None, deterministic=False):
    """config.backward_workspace of a call on (batch, seqlen, heads, head_dim) q (varlen: packed as for
    fwd_params)."""
    slabs, rows, nheads, head_dim = q.shape
    entries, max_q = (slabs, rows) if varlen is None else (varlen[0].shape[0] - 1, varlen[2])
    return backward_workspace(q.dtype, head_dim, nheads, slabs, rows, entries, max_q, deterministic)


def bwd_params(do, q, k, v, o, lse, dq, dk, dv, workspace, softmax_scale: float, causal: bool, varlen=None,
               deterministic=False, **variants):
    """Pack a backward call. workspace: a device array of workspace_layout(...).nbytes or more, laid out
    as config.BackwardWorkspace says (dsum points at it). varlen and variants as for fwd_params (do, dq,
    dk, dv packed like q, k, v)."""
    p = np.zeros((), dtype=BWD_PARAMS)
    _fill_fwd(p["fwd"], q, k, v, o, lse, softmax_scale, causal, varlen, **variants)
    p["dout"], p["dq"], p["dk"], p["dv"], p["dsum"] = (_ptr_of(a) for a in (do, dq, dk, dv, workspace))
    for name, a in (("do", do), ("dq", dq), ("dk", dk), ("dv", dv)):
        _set_bshd(p, name, a)
    slabs, rows, nheads, head_dim = q.shape
    p["dsum_batch_stride"], p["dsum_head_stride"] = nheads * rows, rows  # D: [slab, head, row]
    layout = workspace_layout(q, varlen, deterministic)
    p["dq_accum_offset"], p["dq_semaphore_offset"] = layout.dq_accum_offset, layout.dq_semaphore_offset
    width = compiled_head_dim(head_dim)
    p["dq_accum_batch_stride"], p["dq_accum_head_stride"], p["dq_accum_row_stride"] = nheads * rows * width, rows * width, width
    blocks = ceil_div(int(p["fwd"]["seqlen_q"]), SEMAPHORE_ROWS)
    p["dq_semaphore_batch_stride"], p["dq_semaphore_head_stride"] = nheads * blocks, blocks
    if varlen is not None:
        for name in ("do", "dq", "dk", "dv", "dsum", "dq_accum"):
            p[f"{name}_batch_stride"] = 0
    return p
