"""Numba backend: the prototypes of cuflash/proto/, on a GPU or on the CPU simulator.

On a GPU it takes and returns CuPy arrays, viewed by Numba without a copy through
__cuda_array_interface__ and launched on CuPy's current stream. Under NUMBA_ENABLE_CUDASIM=1 it takes
and returns NumPy arrays and runs each thread as a Python thread (tiny sizes only).

dtypes: float16, float32 and float64 arrays go to the kernels as they are (they convert to acc_t on
load and back on store). bfloat16 arrays (ml_dtypes.bfloat16, which Numba cannot type) are
converted to float32 before the launch and the results rounded back to bfloat16 after it; the
kernel's arithmetic is the same (bf16 -> fp32 is exact), only its loads are wider.

Config: cuflash.config.choose_forward / choose_backward, with the tiles shrunk where needed so that
a prototype's static shared memory fits in 48 KiB (Numba has no opt-in for more).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ..config import KernelConfig, choose_backward, choose_forward, dtype_name

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
        elif "dkdv" in cfg.kernel:
            thread_layout(cfg.block_n, cfg.head_dim, cfg.threads)
        elif "dq" in cfg.kernel:
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


def _forward(q, k, v, *, causal, softmax_scale, cfg=None, out=None, lse=None):
    """forward() with an optional KernelConfig override (tests use small tiles in the simulator)."""
    from ..proto.flash_fwd import make_flash_fwd

    xp = _xp(q)
    dt = dtype_name(q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    cfg = fit(choose_forward(dt, head_dim, causal)) if cfg is None else cfg
    launcher = _Launcher()
    o = _result(out, q.shape, np.float32 if dt == "bfloat16" else q.dtype, xp, launcher.sim)
    lse_buf = _result(lse, (batch, nheads, seqlen_q), _acc_dtype(dt), xp, launcher.sim)
    scale, scale_log2 = _scales(dt, softmax_scale)
    grid = (_ceil_div(seqlen_q, cfg.block_m), nheads, batch)
    launcher.launch(make_flash_fwd, cfg, grid, launcher.inp(q), launcher.inp(k), launcher.inp(v),
                    o, lse_buf, scale, scale_log2)
    return _finish(out, o, q.dtype), _finish(lse, lse_buf, lse_buf.dtype)


def _backward(do, q, k, v, o, lse, *, causal, softmax_scale, cfgs=None, dq=None, dk=None, dv=None, dsum=None):
    """backward() with an optional (preprocess, dkdv, dq) KernelConfig override."""
    from ..proto.flash_bwd import make_flash_bwd_dkdv, make_flash_bwd_dq, make_flash_bwd_preprocess

    xp = _xp(q)
    dt = dtype_name(q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if cfgs is None:
        cfgs = tuple(fit(c) for c in choose_backward(dt, head_dim, causal))
    cfg_pre, cfg_dkdv, cfg_dq = cfgs
    launcher = _Launcher()
    work = np.float32 if dt == "bfloat16" else q.dtype
    dq_buf, dk_buf, dv_buf = (_result(given, x.shape, work, xp, launcher.sim)
                              for given, x in ((dq, q), (dk, k), (dv, v)))
    if dsum is None:
        dsum = xp.empty((batch, nheads, seqlen_q), dtype=_acc_dtype(dt))
    scale, scale_log2 = _scales(dt, softmax_scale)
    q_, k_, v_, do_, o_, lse_ = (launcher.inp(x) for x in (q, k, v, do, o, lse))
    launcher.launch(make_flash_bwd_preprocess, cfg_pre, (_ceil_div(seqlen_q, cfg_pre.block_m), nheads, batch),
                    do_, o_, dsum)
    launcher.launch(make_flash_bwd_dkdv, cfg_dkdv, (_ceil_div(seqlen_k, cfg_dkdv.block_n), nheads_k, batch),
                    q_, k_, v_, do_, lse_, dsum, dk_buf, dv_buf, scale, scale_log2)
    launcher.launch(make_flash_bwd_dq, cfg_dq, (_ceil_div(seqlen_q, cfg_dq.block_m), nheads, batch),
                    q_, k_, v_, do_, lse_, dsum, dq_buf, scale, scale_log2)
    return tuple(_finish(given, buf, q.dtype) for given, buf in ((dq, dq_buf), (dk, dk_buf), (dv, dv_buf)))


def forward(q, k, v, *, causal, softmax_scale, out=None, lse=None):
    """(o, lse). out / lse, when given, are written in place (bshd views, any strides)."""
    return _forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse)


def backward(do, q, k, v, o, lse, *, causal, softmax_scale, deterministic=False, dq=None, dk=None, dv=None,
             dsum=None):
    """(dq, dk, dv); deterministic by construction (no atomics), whatever `deterministic` says.
    dsum, when given, is the workspace for D = rowsum(dO * O) (batch, heads, seqlen_q)."""
    return _backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, dq=dq, dk=dk, dv=dv,
                     dsum=dsum)
