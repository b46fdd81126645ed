"""The CUDA backend: kernels_cu/ compiled through CuPy RawModule, launched on CuPy's current stream."""

from __future__ import annotations

from .. import _compile, _params
from .._checks import check_batch
from .._interop import gpu_status
from ..config import choose_backward, choose_forward, ceil_div

ON_DEVICE = True
MIN_COMPUTE_CAPABILITY = 80  # mma.sync m16n8k16 with bf16 and cp.async need sm_80


def available() -> tuple[bool, str]:
    ok, why = gpu_status()
    if not ok:
        return False, why
    import cupy

    cc = int(cupy.cuda.Device().compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        return False, f"compute capability {cc / 10:.1f} < 8.0 (the kernels need sm_80 or newer)"
    return True, ""


def _aligned(x) -> bool:
    """16-byte vector loads need a 16-byte aligned base and 16-byte multiples for every stride."""
    return x.data.ptr % 16 == 0 and all(s % 16 == 0 for s in x.strides[:-1])


def _ready(x):
    """A kernel-ready view: `x` itself when aligned, else a contiguous copy."""
    import cupy

    return x if _aligned(x) else cupy.ascontiguousarray(x)


def _launch(cfg, grid, params) -> None:
    if 0 in grid:
        return
    _compile.kernel(cfg)(grid, (cfg.threads,), (params,), shared_mem=cfg.smem_bytes)


def _result_buffer(out):
    """Where a kernel writes a result: `out` itself when aligned, else a temporary copied back."""
    import cupy

    return out if _aligned(out) else cupy.empty(out.shape, out.dtype)


def forward(q, k, v, *, causal, softmax_scale, out, lse):
    b, sq, h, d = q.shape
    check_batch(b)
    q, k, v = _ready(q), _ready(k), _ready(v)
    o = _result_buffer(out)
    cfg = choose_forward(q.dtype, d, causal)
    p = _params.fwd_params(q, k, v, o, lse, softmax_scale)
    _launch(cfg, (ceil_div(sq, cfg.block_m), h, b), p[()])
    if o is not out:
        out[...] = o
    return out, lse


def backward(do, q, k, v, o, lse, *, causal, softmax_scale, deterministic, dq, dk, dv):
    import cupy

    del deterministic  # always: no atomics, fixed reduction order
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    check_batch(b)
    do, q, k, v, o = (_ready(x) for x in (do, q, k, v, o))
    bufs = [_result_buffer(x) for x in (dq, dk, dv)]
    dsum = cupy.empty((b, h, sq), dtype=lse.dtype)
    pre, dkdv, dqk = choose_backward(q.dtype, d, causal)
    p = _params.bwd_params(do, q, k, v, o, lse, *bufs, dsum, softmax_scale)[()]
    _launch(pre, (ceil_div(sq, pre.block_m), h, b), p)
    _launch(dkdv, (ceil_div(sk, dkdv.block_n), hk, b), p)
    _launch(dqk, (ceil_div(sq, dqk.block_m), h, b), p)
    for buf, dst in zip(bufs, (dq, dk, dv)):
        if buf is not dst:
            dst[...] = buf
    return dq, dk, dv
