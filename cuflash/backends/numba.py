"""Numba backend: the prototypes of cuflash/proto/, on a GPU or on the CPU simulator.

On a GPU it takes and returns CuPy arrays, viewed by Numba without a copy through
__cuda_array_interface__ and launched on CuPy's current stream. Under NUMBA_ENABLE_CUDASIM=1 it takes
and returns NumPy arrays and runs each thread as a Python thread (tiny sizes only).

dtypes: float16, float32 and float64 arrays go to the kernels as they are (they convert to acc_t on
load and back on store). bfloat16 arrays (ml_dtypes.bfloat16, which Numba cannot type) are
converted to float32 before the launch and the results rounded back to bfloat16 after it; the
kernel's arithmetic is the same (bf16 -> fp32 is exact), only its loads are wider.

Variants: forward / backward take the CUDA backend's keywords (window, softcap, alibi_slopes,
dropout_p, seed, offset) and varlen_forward / varlen_backward its packed arrays; the values become the
prototypes' arguments as cuflash/_params.py fills FwdParams (-1 window bounds as UNBOUNDED), and
cfg.variant (the kVariant bits) selects what the kernels apply.

Config: cuflash.config.choose_forward / choose_backward, with the tiles shrunk where needed so that
a prototype's static shared memory fits in 48 KiB (Numba has no opt-in for more). The backward runs
flash_bwd.cu's three kernels (preprocess, flash_bwd, postprocess) for every dtype, fp32 / fp64 with the
tensor-core tiles (the prototype has no SIMT variant); deterministic=True sets DETERMINISTIC.

KV cache: kvcache_forward runs flash_decode.cu's prototype (and its combine when split) where
config.choose_decode serves the call, for every dtype: fp16 / bf16 as the CUDA backend decides, float32 /
float64 with the same decision and tiles (the CUDA backend runs flash_fwd_simt for them; the prototype computes
in acc_t either way). num_splits=0 is decode_splits over DECODE_NOTIONAL_SMS SMs (the same choice on
every machine), and every count is clamped to [1, the cache's key blocks] as the CUDA backend clamps it.
Elsewhere (ALiBi, more than DECODE_MAX_ROWS packed rows without num_splits > 1, or on a GPU no decode tile within
48 KiB) flash_fwd's prototype serves it, unsplit.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from .. import _mask, _params, _philox
from .._params import UNBOUNDED
from ..config import (DETERMINISTIC, SEMAPHORE_ROWS, KernelConfig, backward_grid, choose_backward, choose_forward,
                      dtype_name)

STATIC_SMEM_LIMIT = 48 * 1024


def _simulator() -> bool:
    """Is (or will) Numba's CUDA simulator be in use in this process?"""
    try:
        from numba.cuda.core import config

        return bool(config.ENABLE_CUDASIM)
    except Exception:
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


# Read by cuflash.api: device (CuPy) arrays on a GPU, host (NumPy) arrays under the simulator.
ON_DEVICE = not _simulator()


def available() -> tuple[bool, str]:
    try:
        from numba import cuda
    except Exception as e:
        return False, f"numba-cuda is not importable ({type(e).__name__}: {e}); install cuflash[numba]"
    if _simulator():
        return True, ""
    try:
        if not cuda.is_available():
            return False, "no CUDA GPU visible to Numba (NUMBA_ENABLE_CUDASIM=1 runs the prototypes on the CPU)"
        import cupy  # noqa: F401  (device arrays in and out)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


# ------------------------------------------------------------------------------------------------
# Configs


def _layout_ok(cfg: KernelConfig) -> bool:
    from ..proto.flash_fwd import thread_layout

    try:
        if cfg.kernel.startswith("flash_fwd"):
            thread_layout(cfg.block_m, cfg.block_n, cfg.threads)
            thread_layout(cfg.block_m, cfg.head_dim, cfg.threads)
        elif cfg.kernel == "flash_bwd":  # dK / dV tile and dQ's share
            thread_layout(cfg.block_n, cfg.head_dim, cfg.threads)
            thread_layout(cfg.block_m, cfg.head_dim, cfg.threads)
    except ValueError:
        return False
    return True


def proto_smem_bytes(cfg: KernelConfig) -> int:
    from ..proto import flash_bwd, flash_fwd

    return flash_fwd.smem_bytes(cfg) if cfg.kernel.startswith("flash_fwd") else flash_bwd.smem_bytes(cfg)


def fit(cfg: KernelConfig) -> KernelConfig:
    """cfg, or the largest tiles below it whose prototype fits in static shared memory."""
    if _simulator() or (proto_smem_bytes(cfg) <= STATIC_SMEM_LIMIT and _layout_ok(cfg)):
        return cfg
    best = None
    for warps in range(cfg.warps, 0, -1):
        for bm in (cfg.block_m >> s for s in range(4)):
            for bn in (cfg.block_n >> s for s in range(4)):
                c = dataclasses.replace(cfg, block_m=bm, block_n=bn, warps=warps)
                if bm >= 4 and bn >= 4 and _layout_ok(c) and proto_smem_bytes(c) <= STATIC_SMEM_LIMIT:
                    key = (bm * bn, warps, bm)
                    if best is None or key > best[0]:
                        best = (key, c)
    if best is None:
        raise ValueError(f"no prototype tile of {cfg} fits in {STATIC_SMEM_LIMIT} bytes of shared memory")
    return best[1]


# ------------------------------------------------------------------------------------------------
# Arrays


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def _bf16_to_f32(x):
    """bfloat16 -> float32 (exact) on the bit pattern: works for NumPy and CuPy alike."""
    xp = _xp(x)
    return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def _f32_to_bf16(x, dtype):
    """float32 -> bfloat16, round to nearest even, on the bit pattern; NaN stays NaN."""
    xp = _xp(x)
    u = xp.ascontiguousarray(x).view(xp.uint32)
    r = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    r = xp.where(xp.isnan(x), xp.uint32(0x7FC0), r)
    return r.astype(xp.uint16).view(dtype)


def _cast(x, dtype):
    if x.dtype == dtype:
        return x
    if np.dtype(dtype).name == "bfloat16":
        return _f32_to_bf16(x, dtype)
    return x.astype(dtype)


def _acc_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


class _Launcher:
    """Kernel arguments and launch: NumPy arrays under the simulator; on a GPU, Numba views of
    CuPy arrays and CuPy's current stream."""

    def __init__(self):
        self.sim = _simulator()
        if not self.sim:
            import cupy
            from numba import cuda

            ptr = cupy.cuda.get_current_stream().ptr
            self.stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()

    def inp(self, x):
        """An input as the kernel reads it: bfloat16 (which Numba cannot type) as a float32 copy; under
        the simulator a contiguous array (it copies every argument and cannot copy a strided one)."""
        if x.dtype.name == "bfloat16":
            x = _bf16_to_f32(x)
        if self.sim:
            x = np.ascontiguousarray(x)
        return x

    def arg(self, x):
        if self.sim or not hasattr(x, "__cuda_array_interface__"):
            return x
        from numba import cuda

        # Same stream as the launch: no need for Numba to synchronize on the exporter's stream.
        return cuda.as_cuda_array(x, sync=False)

    def launch(self, make, cfg, grid, *args):
        kernel = make(_kernel_cfg(cfg))
        if 0 in grid:
            return
        args = tuple(self.arg(a) for a in args)
        if self.sim:
            kernel[grid, (cfg.threads,)](*args)
        else:
            kernel[grid, (cfg.threads,), self.stream](*args)


def _kernel_cfg(cfg: KernelConfig) -> KernelConfig:
    """The config the kernel is built for: bfloat16 runs the float32 kernel (see the module doc)."""
    return dataclasses.replace(cfg, dtype="float32") if cfg.dtype == "bfloat16" else cfg


def _scales(dtype: str, softmax_scale: float):
    acc = _acc_dtype(dtype)
    return acc(softmax_scale), acc(softmax_scale * math.log2(math.e))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _result(given, shape, dtype, xp, sim):
    """Where a kernel writes a result: `given` itself, or a new array (none given, a bfloat16 result
    computed in float32, or under the simulator a strided `given`, which it cannot write through)."""
    if given is not None and given.dtype == dtype and not (sim and not given.flags.c_contiguous):
        return given
    return xp.empty(shape, dtype=dtype)


def _finish(given, buf, dtype):
    """The result array: buf, or `given` with buf copied into it; in the input dtype."""
    if given is None:
        return _cast(buf, dtype)
    if buf is not given:
        given[...] = _cast(buf, dtype)
    return given


def _variant_args(launcher, xp, dt: str, nheads: int, causal: bool, varlen=None, window=_mask.NO_WINDOW,
                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0, offset=0) -> tuple:
    """The kernels' variant arguments (proto/flash_fwd.py), FwdParams' variant fields as
    cuflash/_params.py fills them: cu_seqlens (a 1-element dummy when dense), the window with -1 as
    UNBOUNDED, softcap, the slopes (flattened, acc_t) and their batch stride, the Philox key words,
    offset and threshold, and 1 / (1 - dropout_p)."""
    acc = _acc_dtype(dt)
    if varlen is not None:
        cu_q, cu_k = (launcher.inp(c) for c in varlen[:2])
    else:
        cu_q = cu_k = xp.zeros(1, dtype=np.int32)
    left, right = (UNBOUNDED if w < 0 else int(w) for w in _mask.effective_window(causal, window))
    if alibi_slopes is not None:
        slopes = xp.ascontiguousarray(alibi_slopes, dtype=acc).reshape(-1)
        slope_stride = nheads if alibi_slopes.ndim == 2 else 0
    else:
        slopes, slope_stride = xp.zeros(1, dtype=acc), 0
    seed = int(seed)
    return (cu_q, cu_k, left, right, acc(softcap or 0.0), slopes, slope_stride,
            np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32), np.uint64(int(offset) & 0xFFFFFFFF),
            np.uint64(_philox.threshold(dropout_p or 0.0)), acc(1.0 / (1.0 - float(dropout_p or 0.0))))


def _grid_sizes(q, k, varlen):
    """(batch, seqlen_q, seqlen_k) that size the grids: the arrays' extents, or with varlen the number
    of sequences and the longest lengths."""
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1]
    cu_q, _, max_q, max_k = varlen
    return int(cu_q.shape[0]) - 1, int(max_q), int(max_k)


def _forward(q, k, v, *, causal, softmax_scale, cfg=None, out=None, lse=None, varlen=None, kvcache=None,
             **variants):
    """forward() with an optional KernelConfig override (tests use small tiles in the simulator).
    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) with q, k, v (and out) the packed
    arrays as (1, total, heads, head_dim) views and lse (1, heads, total_q). kvcache: (seqused_k,
    block_table or None) with k, v the cache, as for the CUDA backend (cuflash/_params.py)."""
    from ..proto.flash_fwd import make_flash_fwd

    xp = _xp(q)
    dt = dtype_name(q.dtype)
    _, seqlen_q, nheads, head_dim = q.shape
    batch, grid_sq, _ = _grid_sizes(q, k, varlen)
    if cfg is None:
        cfg = fit(choose_forward(dt, head_dim, _params.variant(causal, varlen, kvcache=kvcache, **variants)))
    launcher = _Launcher()
    o = _result(out, q.shape, np.float32 if dt == "bfloat16" else q.dtype, xp, launcher.sim)
    lse_buf = _result(lse, (q.shape[0], nheads, seqlen_q), _acc_dtype(dt), xp, launcher.sim)
    scale, scale_log2 = _scales(dt, softmax_scale)
    grid = (_ceil_div(grid_sq, cfg.block_m), nheads, batch)
    seqused_k, block_table = kvcache if kvcache is not None else (None, None)
    if seqused_k is None:
        seqused_k = xp.zeros(1, dtype=np.int32)
    block_table = xp.zeros((1, 1), dtype=np.int32) if block_table is None else launcher.inp(block_table)
    launcher.launch(make_flash_fwd, cfg, grid, launcher.inp(q), launcher.inp(k), launcher.inp(v),
                    o, lse_buf, scale, scale_log2,
                    *_variant_args(launcher, xp, dt, nheads, causal, varlen, **variants),
                    launcher.inp(seqused_k), block_table)
    return _finish(out, o, q.dtype), _finish(lse, lse_buf, lse_buf.dtype)


def _backward_configs(dt: str, head_dim: int, variant: int) -> tuple:
    """(preprocess, flash_bwd, postprocess) configs, fitted. The prototype mirrors flash_bwd.cu for every
    dtype (it has no SIMT variant, where choose_backward gives fp32 / fp64 flash_bwd_simt.cu's kernels):
    the tensor-core choice, which depends on head_dim and variant only, with the call's dtype."""
    cfgs = choose_backward("float16", head_dim, variant)
    return tuple(fit(dataclasses.replace(c, dtype=dt)) for c in cfgs)


def _backward(do, q, k, v, o, lse, *, causal, softmax_scale, cfgs=None, deterministic=False, dq=None, dk=None,
              dv=None, workspace=None, varlen=None, **variants):
    """backward() with an optional (preprocess, flash_bwd, postprocess) KernelConfig override; varlen as
    for _forward. deterministic sets DETERMINISTIC on flash_bwd's config (given or chosen)."""
    from ..proto.flash_bwd import make_flash_bwd, make_flash_bwd_postprocess, make_flash_bwd_preprocess

    xp = _xp(q)
    dt = dtype_name(q.dtype)
    slabs, rows, nheads, head_dim = q.shape
    nheads_k = k.shape[2]
    batch, grid_sq, grid_sk = _grid_sizes(q, k, varlen)
    if cfgs is None:
        cfgs = _backward_configs(dt, head_dim, _params.variant(causal, varlen, **variants))
    cfg_pre, cfg_bwd, cfg_post = cfgs
    if deterministic:
        cfg_bwd = dataclasses.replace(cfg_bwd, variant=cfg_bwd.variant | DETERMINISTIC)
    launcher = _Launcher()
    work = np.float32 if dt == "bfloat16" else q.dtype
    dq_buf, dk_buf, dv_buf = (_result(given, x.shape, work, xp, launcher.sim)
                              for given, x in ((dq, q), (dk, k), (dv, v)))
    acc = _acc_dtype(dt)
    if workspace is not None:
        # D at the front of the API's workspace (config.BackwardWorkspace: offset 0, [slab, head, row])
        nbytes = slabs * nheads * rows * np.dtype(acc).itemsize
        dsum = workspace.view(np.uint8)[:nbytes].view(acc).reshape(slabs, nheads, rows)
    else:
        dsum = xp.empty((slabs, nheads, rows), dtype=acc)
    # The accumulator and the semaphores are the backend's own (the preprocess zeroes them): the prototype
    # indexes dq_accum by the call's head_dim, not the compiled one of the workspace. One semaphore per
    # query block of flash_bwd, at least as many as flash_bwd.cu's one per SEMAPHORE_ROWS rows (fit may
    # shrink block_m below it).
    dq_accum = xp.empty((slabs, nheads, rows, head_dim), dtype=acc)
    semaphore = xp.empty((batch, nheads, _ceil_div(grid_sq, min(SEMAPHORE_ROWS, cfg_bwd.block_m))), dtype=np.int32)
    scale, scale_log2 = _scales(dt, softmax_scale)
    var = _variant_args(launcher, xp, dt, nheads, causal, varlen, **variants)
    q_, k_, v_, do_, o_, lse_ = (launcher.inp(x) for x in (q, k, v, do, o, lse))
    launcher.launch(make_flash_bwd_preprocess, cfg_pre, (_ceil_div(grid_sq, cfg_pre.block_m), nheads, batch),
                    do_, o_, dsum, dq_accum, semaphore, var[0], var[1])
    launcher.launch(make_flash_bwd, cfg_bwd, backward_grid(cfg_bwd, nheads_k, grid_sk, batch),
                    q_, k_, v_, do_, lse_, dsum, dk_buf, dv_buf, dq_accum, semaphore, scale, scale_log2, *var)
    launcher.launch(make_flash_bwd_postprocess, cfg_post, (_ceil_div(grid_sq, cfg_post.block_m), nheads, batch),
                    dq_accum, dq_buf, scale, var[0], var[1])
    return tuple(_finish(given, buf, q.dtype) for given, buf in ((dq, dq_buf), (dk, dk_buf), (dv, dv_buf)))


def forward(q, k, v, *, causal, softmax_scale, out=None, lse=None, varlen=None, kvcache=None, **variants):
    """(o, lse). out / lse, when given, are written in place (bshd views, any strides). variants: the
    CUDA backend's (window, softcap, alibi_slopes, dropout_p, seed, offset); varlen and kvcache as for
    _forward."""
    return _forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse, varlen=varlen,
                    kvcache=kvcache, **variants)


def backward(do, q, k, v, o, lse, *, causal, softmax_scale, deterministic=False, dq=None, dk=None, dv=None,
             workspace=None, varlen=None, **variants):
    """(dq, dk, dv). deterministic: the adds into each dQ tile in key-block order (DETERMINISTIC), so
    that repeated calls are bitwise identical; else atomic adds as they come. workspace, when given, is
    the API's 1-D device workspace (cuflash/_params.py workspace_layout): D is written at its front; the
    dQ accumulator and semaphores are allocated here."""
    return _backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                     dq=dq, dk=dk, dv=dv, workspace=workspace, varlen=varlen, **variants)


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k)


def _none_or(x, f):
    return None if x is None else f(x)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, out=None, lse=None,
                   **kwargs):
    """Packed (total, heads, head_dim) q, k, v, o; lse (heads, total_q). The kernels take each
    sequence's rows from cu_seqlens (int32), as the CUDA backend's do."""
    varlen = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse_out = forward(q[None], k[None], v[None], out=_none_or(out, lambda x: x[None]),
                         lse=_none_or(lse, lambda x: x[None]), varlen=varlen, **kwargs)
    return o[0], lse_out[0]


def kvcache_forward(q, k_cache, v_cache, seqlens_k, block_table=None, *, out=None, lse=None, num_splits=0, **kwargs):
    """Attention of q over a KV cache read in place (dense, or page pools with block_table), each entry
    over its seqlens_k[b] keys, clamped as the CUDA backend's kernels clamp them. flash_decode's prototype
    serves it where config.choose_decode does (any dtype here, see _decode_configs), with num_splits splits
    of the keys (0: decode_num_splits), flash_fwd's elsewhere."""
    kvcache = (seqlens_k, block_table)
    got = _decode(q, k_cache, v_cache, kvcache=kvcache, num_splits=num_splits, out=out, lse=lse, **kwargs)
    if got is not None:
        return got
    return forward(q, k_cache, v_cache, out=out, lse=lse, kvcache=kvcache, **kwargs)


# ------------------------------------------------------------------------------------------------
# Decoding: flash_decode.cu's prototype (cuflash/proto/flash_decode.py)

# num_splits=0 on this backend: config.decode_splits (the CUDA backend's rule) for a notional GPU of
# DECODE_NOTIONAL_SMS multiprocessors, whatever runs the prototype (the simulator has no
# SMs, and the prototype's occupancy is not the kernel's): a deterministic choice, the same on every machine.
DECODE_NOTIONAL_SMS = 108


def _decode_configs(dt: str, head_dim: int, variant: int, packed_rows: int, num_splits: int):
    """(flash_decode, flash_decode_combine, stages) configs of a KV-cache call, fitted, or None where flash_fwd's
    prototype serves it. config.choose_decode decides for fp16 / bf16 as for the CUDA backend; float32 and
    float64 calls, which the CUDA backend leaves to flash_fwd_simt, take the same decision and tiles here (as
    the backward's prototype runs flash_bwd.cu's tiles for every dtype): the prototype computes in acc_t
    whatever the dtype, and so serves the float64 tests at float64 accuracy. None also where no tile of the
    prototype fits in static shared memory (a GPU, large head dims)."""
    from ..config import TENSOR_CORE_DTYPES, choose_decode

    pair = choose_decode(dt if dt in TENSOR_CORE_DTYPES else "float16", head_dim, variant, packed_rows=packed_rows,
                         num_splits=num_splits)
    if pair is None:
        return None
    main, combine = (dataclasses.replace(c, dtype=dt) for c in pair)
    fitted = fit_decode(main)
    if fitted is None:
        return None
    main, stages = fitted
    return main, combine, stages


def fit_decode(cfg: KernelConfig):
    """(cfg, 0) (0: decode_stages' ring), or on a GPU the largest (warps, block_n) with a ring of 3 or 2 stages
    whose flash_decode prototype fits in static shared memory; None if none does (flash_fwd then serves)."""
    from ..config import decode_stages
    from ..proto import flash_decode as fd

    if _simulator() or (fd.layout_ok(cfg) and fd.smem_bytes(cfg) <= STATIC_SMEM_LIMIT):
        return cfg, 0
    best = None
    for warps in range(cfg.warps, 0, -1):
        for bn in (cfg.block_n >> s for s in range(5)):
            c = dataclasses.replace(cfg, block_n=bn, warps=warps)
            if not fd.layout_ok(c):
                continue
            for stages in (decode_stages(c), 2):
                if fd.smem_bytes(c, stages) <= STATIC_SMEM_LIMIT:
                    key = (bn, warps, stages)
                    if best is None or key > best[0]:
                        best = (key, (c, stages))
                    break
    return None if best is None else best[1]


def decode_num_splits(num_splits: int, tiles: int, key_blocks: int, page_size: int = 0) -> int:
    """The splits a call runs: num_splits, or for 0 config.decode_splits over DECODE_NOTIONAL_SMS blocks (page_size:
    the pool's, 0 for a dense cache); at most the cache's key blocks and at least 1 (as the CUDA backend's
    decode_launches clamps)."""
    from ..config import decode_splits

    if num_splits == 0:
        num_splits = decode_splits(tiles, key_blocks, DECODE_NOTIONAL_SMS, page_size)
    return max(1, min(num_splits, key_blocks))


def _decode(q, k, v, *, kvcache, causal, softmax_scale, num_splits=0, cfgs=None, out=None, lse=None, **variants):
    """The KV-cache forward through flash_decode's prototype (and flash_decode_combine when split): (o, lse), or
    None where _decode_configs leaves the call to flash_fwd. cfgs: a (flash_decode, flash_decode_combine, stages)
    override (tests use small tiles in the simulator; stages 0: decode_stages), which serves any call."""
    from ..proto.flash_decode import make_flash_decode, make_flash_decode_combine

    xp = _xp(q)
    dt = dtype_name(q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k.shape[2]
    group = nheads // nheads_k
    if cfgs is None:
        cfgs = _decode_configs(dt, head_dim, _params.variant(causal, kvcache=kvcache, **variants), seqlen_q * group,
                               num_splits)
        if cfgs is None:
            return None
    main, combine, stages = cfgs
    seqused_k, block_table = kvcache
    capacity = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[1]
    m_blocks = _ceil_div(seqlen_q * group, main.block_m)
    splits = decode_num_splits(num_splits, batch * nheads_k * m_blocks, max(1, _ceil_div(capacity, main.block_n)),
                               k.shape[1] if block_table is not None else 0)
    launcher = _Launcher()
    o = _result(out, q.shape, np.float32 if dt == "bfloat16" else q.dtype, xp, launcher.sim)
    acc = _acc_dtype(dt)
    lse_buf = _result(lse, (batch, nheads, seqlen_q), acc, xp, launcher.sim)
    scale, scale_log2 = _scales(dt, softmax_scale)
    var = _variant_args(launcher, xp, dt, nheads, causal, **variants)
    left, right, softcap = var[2], var[3], var[4]
    block_table = xp.zeros((1, 1), dtype=np.int32) if block_table is None else launcher.inp(block_table)
    rows = batch * nheads * seqlen_q
    if splits > 1:  # [split, batch, head, row, kHeadDim] and [split, batch, head, row], flat (DecodeParams)
        o_partial = xp.empty(splits * rows * main.head_dim, dtype=acc)
        lse_partial = xp.empty(splits * rows, dtype=acc)
    else:
        o_partial = lse_partial = xp.zeros(1, dtype=acc)
    launcher.launch(lambda c: make_flash_decode(c, stages), main, (m_blocks * splits, nheads_k, batch),
                    launcher.inp(q), launcher.inp(k), launcher.inp(v), o, lse_buf, o_partial, lse_partial,
                    np.int32(splits), scale, scale_log2, left, right, softcap, launcher.inp(seqused_k), block_table)
    if splits > 1:
        launcher.launch(make_flash_decode_combine, combine, (_ceil_div(rows, combine.warps), 1, 1),
                        o_partial, lse_partial, o, lse_buf, np.int32(splits))
    return _finish(out, o, q.dtype), _finish(lse, lse_buf, lse_buf.dtype)


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, dq=None,
                    dk=None, dv=None, **kwargs):
    """Gradients of varlen_forward; lse (heads, total_q)."""
    kwargs.pop("workspace", None)
    varlen = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    grads = backward(do[None], q[None], k[None], v[None], o[None], lse[None],
                     dq=_none_or(dq, lambda x: x[None]), dk=_none_or(dk, lambda x: x[None]),
                     dv=_none_or(dv, lambda x: x[None]), varlen=varlen, **kwargs)
    return tuple(g[0] for g in grads)
