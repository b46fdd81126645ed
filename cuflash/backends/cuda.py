"""The CUDA backend: kernels_cu/ compiled through CuPy RawModule, launched on a raw stream handle.

A call becomes a `Launches`: the params struct as raw bytes, and the kernels that read it. The
general path builds one per call from CuPy views of the arrays; the plan cache (cuflash/_plan.py)
keeps one per call signature and patches only the array pointers into its bytes before launching.
"""

from __future__ import annotations

import functools
import struct
import threading

import numpy as np

from .. import _compile, _params, _tma
from .._checks import check_batch, check_grid_heads
from .._interop import gpu_status
from ..config import (DQ_SWIZZLE_SM90, PAGED, backward_grid, ceil_div, choose_append, choose_backward, choose_decode,
                      choose_forward, decode_splits, forced_family, kv_box_rows)

ON_DEVICE = True
MIN_COMPUTE_CAPABILITY = 80  # mma.sync m16n8k16 with bf16 and cp.async need sm_80
ALIGNMENT = 16  # bytes: the kernels load and store q, k, v, o, dout and the gradients 16 bytes at a time
CUDA_ERROR_INVALID_CONTEXT = 201


def available() -> tuple[bool, str]:
    ok, why = gpu_status()
    if not ok:
        return False, why
    import cupy

    cc = int(cupy.cuda.Device().compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        return False, f"compute capability {cc / 10:.1f} < 8.0 (the kernels need sm_80 or newer)"
    return True, ""


def aligned(x) -> bool:
    """16-byte vector accesses need a 16-byte aligned base and 16-byte multiples for every stride."""
    return x.data.ptr % ALIGNMENT == 0 and all(s % ALIGNMENT == 0 for s in x.strides[:-1])


def _ready(x):
    """A kernel-ready view: `x` itself when aligned, else a fresh (aligned, contiguous) copy.
    Not cupy.ascontiguousarray: it returns a contiguous array as it is, misaligned base included."""
    return x if aligned(x) else x.copy()


def _result_buffer(out):
    """Where a kernel writes a result: `out` itself when aligned, else a temporary copied back."""
    import cupy

    return out if aligned(out) else cupy.empty(out.shape, out.dtype)


_POINTERS = {n: struct.Struct(f"<{n}Q").pack_into for n in range(1, 9)}


class Launches:
    """The kernel launches of one call and the params struct they share, as raw bytes.

    `patch(offset, *pointers)` rewrites consecutive pointer fields (or other 64-bit unsigned ones) in place;
    `run(stream)` launches every kernel on a raw CUDA stream handle. The driver copies the params at launch, so
    the bytes may be patched again as soon as `run` returns; `lock` serializes patch-and-run across threads.
    `partial`: (bytes, offset of the LSE partials) of the split-KV scratch flash_decode's launches need
    (PARTIAL_POINTERS, patched by whoever runs them), or None.
    """

    partial = None

    def __init__(self, params: np.ndarray, kernels: list[tuple]):
        from cupy.cuda import driver

        self.launch_kernel, self.driver_error = driver.launchKernel, driver.CUDADriverError
        self.raw = np.frombuffer(params.tobytes(), dtype=np.uint8).copy()
        self._argv = np.array([self.raw.ctypes.data], dtype=np.uint64)  # void** to the one kernel arg
        self.argv = int(self._argv.ctypes.data)
        # (function handle, grid x, y, z, threads, dynamic shared memory); empty grids launch nothing
        self.kernels = [(int(_compile.kernel(cfg).kernel.ptr), *grid, cfg.threads, cfg.smem_bytes)
                        for cfg, grid in kernels if 0 not in grid]
        self.lock = threading.Lock()

    def patch(self, offset: int, *pointers: int) -> None:
        _POINTERS[len(pointers)](self.raw, offset, *pointers)

    def run(self, stream: int) -> None:
        launch = self.launch_kernel
        for fn, gx, gy, gz, threads, smem in self.kernels:
            try:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, self.argv, 0)
            except self.driver_error as e:
                if e.status != CUDA_ERROR_INVALID_CONTEXT:
                    raise
                from cupy.cuda import runtime

                runtime.setDevice(runtime.getDevice())  # a thread that never used CUDA: bind the context
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, self.argv, 0)


class TmaLaunches(Launches):
    """Launches of a Hopper kernel (flash_fwd_sm90, or flash_bwd_sm90 and its pre- and postprocess), whose
    params also hold tensor maps (cuflash/_tma.py): patching the pointers points the maps at the new arrays
    too."""

    def __init__(self, params: _tma.SM90Params, kernels: list[tuple]):
        super().__init__(params.raw, kernels)
        self.params, self.raw = params, params.raw  # the maps stay where they were encoded (64-byte aligned)
        self._argv[0] = self.raw.ctypes.data

    def patch(self, offset: int, *pointers: int) -> None:
        super().patch(offset, *pointers)
        self.params.follow(offset, pointers)


def forward_launches(q, k, v, o, lse, *, causal: bool, softmax_scale: float, varlen=None, **variants) -> Launches:
    """The forward of CuPy (batch, seqlen, heads, head_dim) views, kernel-ready (see `aligned`);
    varlen and variants as for _params.fwd_params."""
    d, h = q.shape[3], q.shape[2]
    p = _params.fwd_params(q, k, v, o, lse, softmax_scale, causal, varlen, **variants)
    cfg = choose_forward(q.dtype, d, _params.variant(causal, varlen, **variants), seqlen_k=int(p["seqlen_k"]),
                         compute_capability=compute_capability(), family=forced_family())
    b, sq = int(p["batch"]), int(p["seqlen_q"])
    check_batch(b)
    if cfg.family == "sm90":
        try:
            boxes = {"q": cfg.block_m, "k": cfg.block_n, "v": cfg.block_n}
            extents = None
            if varlen is not None:  # the packed arrays, one entry each
                extents = {n: (a.shape[1], 1) for n, a in (("q", q), ("k", k), ("v", v))}
            if cfg.variant & PAGED:  # the page pools, a box per kv_box_rows rows of a page
                boxes["k"] = boxes["v"] = kv_box_rows(cfg, k.shape[1])
                extents = {n: (k.shape[1], k.shape[0]) for n in ("k", "v")}
            return TmaLaunches(_tma.SM90Params(_params.FWD_SM90_PARAMS, p, cfg.dtype, boxes, extents),
                               [(cfg, (ceil_div(sq, cfg.block_m), h, b))])
        except _tma.Unencodable:  # strides TMA cannot take (e.g. 0 for a broadcast head): the mma.sync kernel
            if forced_family() == "sm90":
                raise
            cfg = choose_forward(q.dtype, d, cfg.variant, family="mma")
    return Launches(p, [(cfg, (ceil_div(sq, cfg.block_m), h, b))])


def backward_launches(do, q, k, v, o, lse, dq, dk, dv, workspace, *, causal: bool, softmax_scale: float,
                      varlen=None, deterministic=False, **variants) -> Launches:
    """The backward's three launches (config.choose_backward); workspace: a device array of at least
    _params.workspace_layout(q, varlen, deterministic).nbytes."""
    d, h, hk = q.shape[3], q.shape[2], k.shape[2]
    p = _params.bwd_params(do, q, k, v, o, lse, dq, dk, dv, workspace, softmax_scale, causal, varlen, deterministic,
                           **variants)
    b, sq, sk = int(p["fwd"]["batch"]), int(p["fwd"]["seqlen_q"]), int(p["fwd"]["seqlen_k"])
    check_batch(b)
    variant = _params.variant(causal, varlen, deterministic=deterministic, **variants)
    choose = functools.partial(choose_backward, q.dtype, d, variant, key_slabs=b * hk, seqlen_k=sk,
                               sms=_multiprocessors())
    cfgs = choose(compute_capability=compute_capability(), family=forced_family())

    def grid(cfg):
        if cfg.kernel in ("flash_bwd", "flash_bwd_sm90"):
            return backward_grid(cfg, hk, sk, b)
        if cfg.kernel == "flash_bwd_dkdv_simt":
            return ceil_div(sk, cfg.block_n), hk, b
        return ceil_div(sq, cfg.block_m), h, b

    main = cfgs[1]
    if main.family == "sm90":
        try:
            p["dq_accum_swizzle"] = DQ_SWIZZLE_SM90
            boxes = {"q": main.block_m, "k": main.block_n, "v": main.block_n, "do": main.block_m}
            extents = None if varlen is None else {n: (a.shape[1], 1) for n, a in (("q", q), ("k", k), ("v", v),
                                                                                  ("do", do))}
            return TmaLaunches(_tma.SM90Params(_params.BWD_SM90_PARAMS, p, main.dtype, boxes, extents),
                               [(cfg, grid(cfg)) for cfg in cfgs])
        except _tma.Unencodable:  # as in forward_launches
            if forced_family() == "sm90":
                raise
            cfgs = choose(compute_capability=compute_capability(), family="mma")
            p["dq_accum_swizzle"] = 0
    return Launches(p, [(cfg, grid(cfg)) for cfg in cfgs])


def kvcache_launches(q, k_cache, v_cache, o, lse, *, kvcache, num_splits: int, causal: bool, softmax_scale: float,
                     **variants) -> Launches:
    """The KV-cache forward: flash_decode's launches where it serves the call (decode_launches), else the
    forward's. kvcache: (seqused_k, block_table or None), int32 device arrays."""
    launches = decode_launches(q, k_cache, v_cache, o, lse, kvcache=kvcache, num_splits=num_splits, causal=causal,
                               softmax_scale=softmax_scale, **variants)
    if launches is None:
        launches = forward_launches(q, k_cache, v_cache, o, lse, causal=causal, softmax_scale=softmax_scale,
                                    kvcache=kvcache, **variants)
    return launches


def decode_launches(q, k_cache, v_cache, o, lse, *, kvcache, num_splits: int, causal: bool,
                    softmax_scale: float, **variants) -> Launches | None:
    """The KV-cache forward through flash_decode (and flash_decode_combine when split), or None where
    config.choose_decode leaves the call to flash_fwd. num_splits: 0 picks (decode_splits). Split, the
    launches' `partial` says how much scratch they need."""
    b, sq, h, d = q.shape
    group = h // k_cache.shape[2]
    variant = _params.variant(causal, kvcache=kvcache, **variants)
    pair = choose_decode(q.dtype, d, variant, packed_rows=sq * group, num_splits=num_splits, family=forced_family(),
                         smem_limit=smem_limit())
    if pair is None:
        return None
    main, combine = pair
    p = _params.fwd_params(q, k_cache, v_cache, o, lse, softmax_scale, causal, kvcache=kvcache, **variants)
    check_batch(b)
    check_grid_heads("k_cache", k_cache.shape[2])
    hk, m_blocks = k_cache.shape[2], ceil_div(sq * group, main.block_m)
    num_splits = split_count(main, b * hk * m_blocks, int(p["seqlen_k"]), num_splits, int(p["page_size"]))
    dp = np.zeros((), dtype=_params.DECODE_PARAMS)
    dp["fwd"], dp["num_splits"] = p, num_splits
    kernels = [(main, (m_blocks * num_splits, hk, b))]
    if num_splits > 1:
        kernels.append((combine, (ceil_div(b * h * sq, combine.warps), 1, 1)))
    launches = Launches(dp, kernels)
    if num_splits > 1:
        rows = b * h * sq
        launches.partial = (num_splits * rows * (main.head_dim + 1) * 4, num_splits * rows * main.head_dim * 4)
    return launches


def append_launches(k_cache, v_cache, k, v, cache_seqlens, block_table, counts, *, seqlen_new: int, batch: int,
                    capacity: int) -> Launches:
    """kvcache_append: k, v (None: no rows to write) written into the caches at each entry's rows
    cache_seqlens[b] .. (cache_seqlens: an int32 device array, or an int for every entry), rows outside the cache
    dropped; and with counts (an int32 (batch,) device array) each entry's keys after seqlen_new new rows."""
    p = _params.append_params(k_cache, v_cache, k, v, cache_seqlens, block_table, counts, seqlen_new, capacity)
    check_batch(batch)
    return Launches(p, [(choose_append(k_cache.dtype), (1 if k is None else seqlen_new, batch, 1))])


def split_count(cfg, tiles: int, capacity: int, num_splits: int, page_size: int = 0) -> int:
    """The splits flash_decode (cfg) runs: num_splits, or for 0 config.decode_splits on this GPU; at most one
    per key block of the capacity. tiles: batch * nheads_k * packed query blocks; page_size: the pool's (0: a
    dense cache)."""
    key_blocks = max(1, ceil_div(capacity, cfg.block_n))
    if num_splits == 0:
        num_splits = decode_splits(tiles, key_blocks, _multiprocessors(), page_size)
    return max(1, min(num_splits, key_blocks))


def smem_limit() -> int:
    """Shared memory one block of the current device may opt in to."""
    from cupy.cuda import runtime

    return _device_smem_limit(runtime.getDevice())


@functools.lru_cache(maxsize=None)
def _device_smem_limit(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.lru_cache(maxsize=None)
def _device_multiprocessors(device: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _device_compute_capability(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def compute_capability() -> int:
    """Compute capability of the current device, as an int (90 for an H100 or H200)."""
    from cupy.cuda import runtime

    return _device_compute_capability(runtime.getDevice())


def _multiprocessors() -> int:
    """SMs of the current device (what a grid has to fill)."""
    from cupy.cuda import runtime

    return _device_multiprocessors(runtime.getDevice())


def _current_stream() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def forward(q, k, v, *, causal, softmax_scale, out, lse, varlen=None, num_splits=0, **variants):
    """The forward's launches: kvcache_launches' for a KV cache (variants' kvcache), with num_splits splits where
    flash_decode serves it, else forward_launches'."""
    import cupy

    q, k, v = _ready(q), _ready(k), _ready(v)
    o = _result_buffer(out)
    if variants.get("kvcache") is not None:
        launches = kvcache_launches(q, k, v, o, lse, num_splits=num_splits, causal=causal,
                                    softmax_scale=softmax_scale, **variants)
    else:
        launches = forward_launches(q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, varlen=varlen,
                                    **variants)
    if launches.partial:  # dropped once enqueued: the pool reuses it in stream order
        nbytes, lse_offset = launches.partial
        scratch = cupy.empty(nbytes, dtype=cupy.uint8)
        launches.patch(_params.PARTIAL_POINTERS, scratch.data.ptr, scratch.data.ptr + lse_offset)
    launches.run(_current_stream())
    if o is not out:
        out[...] = o
    return out, lse


def backward(do, q, k, v, o, lse, *, causal, softmax_scale, deterministic, dq, dk, dv, workspace=None, varlen=None,
             **variants):
    """workspace: a device array of at least _params.workspace_layout(...).nbytes (D, the fp32 dQ
    accumulator, the deterministic mode's semaphores), from the caller's allocator when given."""
    import cupy

    if workspace is None:
        workspace = cupy.empty(_params.workspace_layout(q, varlen, deterministic).nbytes, dtype=cupy.uint8)
    do, q, k, v, o = (_ready(x) for x in (do, q, k, v, o))
    bufs = [_result_buffer(x) for x in (dq, dk, dv)]
    backward_launches(do, q, k, v, o, lse, *bufs, workspace, causal=causal, softmax_scale=softmax_scale,
                      varlen=varlen, deterministic=deterministic, **variants).run(_current_stream())
    for buf, dst in zip(bufs, (dq, dk, dv)):
        if buf is not dst:
            dst[...] = buf
    return dq, dk, dv


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    import cupy

    cu = [cupy.ascontiguousarray(c) for c in (cu_seqlens_q, cu_seqlens_k)]
    return (*cu, int(max_seqlen_q), int(max_seqlen_k))


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, out, lse, **kwargs):
    """Packed (total, heads, head_dim) q, k, v, o; lse (heads, total_q). The kernels read each
    sequence's rows from cu_seqlens (int32, on the device)."""
    varlen = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    forward(q[None], k[None], v[None], out=out[None], lse=lse[None], varlen=varlen, **kwargs)
    return out, lse


def kvcache_forward(q, k_cache, v_cache, seqlens_k, block_table=None, *, out, lse, num_splits=0, **kwargs):
    """Attention of q over a KV cache, read in place: dense (batch, capacity, heads_k, head_dim), or page
    pools (num_pages, page_size, heads_k, head_dim) with block_table int32 (batch, max_pages). seqlens_k
    int32 (batch,) on the device: each entry's key count, which the kernels clamp to the capacity (no
    value reads outside the cache; a page outside the pool reads as zeros). flash_decode serves it where
    it can (decode_launches), with num_splits splits of the keys (0: chosen here); flash_fwd elsewhere."""
    import cupy

    bt = None if block_table is None else cupy.ascontiguousarray(block_table)
    kvcache = (cupy.ascontiguousarray(seqlens_k), bt)
    return forward(q, k_cache, v_cache, out=out, lse=lse, kvcache=kvcache, num_splits=num_splits, **kwargs)


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, dq, dk, dv,
                    **kwargs):
    varlen = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    backward(do[None], q[None], k[None], v[None], o[None], lse[None], dq=dq[None], dk=dk[None], dv=dv[None],
             varlen=varlen, **kwargs)
    return dq, dk, dv
