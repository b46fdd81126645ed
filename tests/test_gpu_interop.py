"""The public API with the caller's own arrays: CuPy, NumPy (with a GPU present) and torch tensors.

Output kind is the caller's (CuPy in -> CuPy out, NumPy in -> NumPy out, torch in -> torch out on the
same device), device inputs and out= are used in place (no copies), and torch's current stream is
honoured. Results are checked with the same accuracy rule as tests/test_gpu_kernels.py. The torch
tests skip themselves where torch (or its CUDA) is missing.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _torch_inputs(torch, key, dtype, b, sq, sk, h, hk, d):
    g = torch.Generator(device="cuda")
    g.manual_seed(zlib.crc32(key.encode()))
    tdt = getattr(torch, dtype)
    gen = torch.float64 if dtype == "float64" else torch.float32

    def randn(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=gen).to(tdt)

    return randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d), randn(b, sq, h, d)


def _torch_bits_differ(torch, a, b) -> int:
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def _check_torch(gpu, ctx, dtype, causal, q, k, v, do, o, lse, dq, dk, dv):
    """Each torch tensor seen through cupy.from_dlpack (zero-copy), then the shared checks."""
    cp = gpu.cp
    gpu.check(ctx, dtype, causal, None, *(cp.from_dlpack(x) for x in (q, k, v, do, o, lse, dq, dk, dv)))


# ------------------------------------------------------------------------------------------------
# CuPy and NumPy
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,causal,hk", [("float16", False, 4), ("bfloat16", True, 2), ("float32", True, 1),
                                             ("float64", False, 2)])
def test_cupy_in_cupy_out(gpu, dtype, causal, hk):
    """CuPy arrays through the default backend ("auto"): CuPy arrays back, on q's device."""
    cp, cf = gpu.cp, gpu.cuflash
    b, sq, sk, h, d = 2, 150, 190, 4, 64
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="cupy auto")
    rs = gpu.rng(ctx)
    q, do = gpu.randn(rs, (b, sq, h, d), dtype), gpu.randn(rs, (b, sq, h, d), dtype)
    k, v = gpu.randn(rs, (b, sk, hk, d), dtype), gpu.randn(rs, (b, sk, hk, d), dtype)
    o_only = cf.flash_attn(q, k, v, causal=causal)
    assert isinstance(o_only, cp.ndarray), f"flash_attn without return_lse: expected one cupy array, got {type(o_only)}"
    o, lse = cf.flash_attn(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert isinstance(x, cp.ndarray), f"{name}: expected a cupy.ndarray, got {type(x)} [{ctx}]"
        assert x.device.id == q.device.id, f"{name}: on device {x.device.id}, q on {q.device.id} [{ctx}]"
    assert gpu.same_bits(o_only, o) == 0, f"flash_attn with and without return_lse differ [{ctx}]"
    gpu.check(ctx, dtype, causal, None, q, k, v, do, o, lse, dq, dk, dv)


@pytest.mark.parametrize("dtype,causal", [("float32", True), ("bfloat16", False), ("float64", True), ("float16", True)])
def test_numpy_in_numpy_out(gpu, dtype, causal, monkeypatch):
    """NumPy arrays with a GPU present: the CUDA backend runs, NumPy arrays come back (out= too)."""
    cp, cf = gpu.cp, gpu.cuflash
    from cuflash.backends import cuda as cuda_backend

    ran = []
    real_fwd, real_bwd = cuda_backend.forward, cuda_backend.backward
    monkeypatch.setattr(cuda_backend, "forward", lambda *a, **kw: (ran.append("fwd"), real_fwd(*a, **kw))[1])
    monkeypatch.setattr(cuda_backend, "backward", lambda *a, **kw: (ran.append("bwd"), real_bwd(*a, **kw))[1])
    b, sq, sk, h, hk, d = 2, 97, 130, 4, 2, 64
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="numpy auto")
    rng = np.random.default_rng(zlib.crc32(ctx.encode()))
    npdt = gpu.np_dtype(dtype)
    q, do = (rng.standard_normal((b, sq, h, d)).astype(npdt) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hk, d)).astype(npdt) for _ in range(2))
    out = np.full(q.shape, np.nan, dtype=npdt)
    o, lse = cf.flash_attn_forward(q, k, v, causal=causal, out=out)
    dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    assert ran == ["fwd", "bwd"], f"expected the CUDA backend to run forward and backward, saw {ran} [{ctx}]"
    assert o is out, f"numpy out=: expected the out array back, got {type(o)} [{ctx}]"
    for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert type(x) is np.ndarray, f"{name}: expected a numpy.ndarray, got {type(x)} [{ctx}]"
    assert o.dtype == npdt and dq.dtype == npdt, f"dtypes o {o.dtype}, dq {dq.dtype}, expected {npdt} [{ctx}]"
    gpu.check(ctx, dtype, causal, None, *(cp.asarray(x) for x in (q, k, v, do, o, lse, dq, dk, dv)))


# ------------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,causal,hk", [("float16", False, 4), ("bfloat16", True, 2), ("float32", True, 1)])
def test_torch_in_torch_out(gpu, dtype, causal, hk):
    """torch tensors in: torch tensors out, on q's device, q's dtype (bf16 included), correct."""
    torch = _torch()
    cf = gpu.cuflash
    b, sq, sk, h, d = 2, 150, 190, 4, 128
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="torch")
    q, k, v, do = _torch_inputs(torch, ctx, dtype, b, sq, sk, h, hk, d)
    o, lse = cf.flash_attn(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    want_lse = torch.float32
    for name, x, like in (("o", o, q), ("lse", lse, None), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert isinstance(x, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(x)} [{ctx}]"
        assert x.device == q.device, f"{name}: on {x.device}, q on {q.device} [{ctx}]"
        dt = want_lse if like is None else like.dtype
        assert x.dtype == dt, f"{name}: dtype {x.dtype}, expected {dt} [{ctx}]"
        if like is not None:
            assert tuple(x.shape) == tuple(like.shape), f"{name}: shape {tuple(x.shape)} [{ctx}]"
    _check_torch(gpu, ctx, dtype, causal, q, k, v, do, o, lse, dq, dk, dv)


def test_torch_out_is_written_in_place(gpu):
    """out= a torch tensor: the same tensor comes back, written in place (no copy on the way out),
    and bitwise equal to the result without out=. Results wrap the memory the kernels wrote."""
    torch = _torch()
    cp, cf = gpu.cp, gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "bfloat16", 2, 200, 256, 4, 2, 64, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="torch out=")
    q, k, v, _ = _torch_inputs(torch, ctx, dtype, b, sq, sk, h, hk, d)
    o_ref, _ = cf.flash_attn(q, k, v, causal=causal, return_lse=True)
    out = torch.full_like(q, math.nan)
    ptr = out.data_ptr()
    o, lse = cf.flash_attn_forward(q, k, v, causal=causal, out=out)
    torch.cuda.synchronize()
    assert o.data_ptr() == ptr, f"out=: result at {o.data_ptr():#x}, out at {ptr:#x} [{ctx}]"
    assert not torch.isnan(out).any(), f"out=: NaN left in the caller's tensor (not written in place) [{ctx}]"
    assert _torch_bits_differ(torch, out, o_ref) == 0, f"out= result differs from the result without out= [{ctx}]"
    for name, x in (("o", o_ref), ("lse", lse)):
        assert cp.from_dlpack(x).data.ptr == x.data_ptr(), f"{name}: DLPack view is not the tensor's memory [{ctx}]"


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_device_outs_with_a_host_backend(gpu, kind):
    """backend="numpy" on device arrays with out= / dq= dk= dv=: the host results are copied into the
    caller's device arrays (the same objects come back), equal to what the CUDA backend gives."""
    cp, cf = gpu.cp, gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "float32", 1, 40, 56, 2, 1, 32, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra=f"{kind} outs, numpy backend")
    rs = gpu.rng(ctx)
    xs = [gpu.randn(rs, s, dtype) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))]
    if kind == "torch":
        torch = _torch()
        xs = [torch.from_dlpack(x) for x in xs]
        fresh = lambda x: torch.full_like(x, math.nan)  # noqa: E731
    else:
        fresh = gpu.nan_like
    q, k, v, do = xs
    o_cuda, lse_cuda = cf.flash_attn_forward(q, k, v, causal=causal, backend="cuda")
    g_cuda = cf.flash_attn_backward(do, q, k, v, o_cuda, lse_cuda, causal=causal, backend="cuda")
    out = fresh(q)
    o, lse = cf.flash_attn_forward(q, k, v, causal=causal, backend="numpy", out=out)
    grads = [fresh(x) for x in (q, k, v)]
    got = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="numpy", dq=grads[0], dk=grads[1],
                                 dv=grads[2])
    assert o is out and all(a is b for a, b in zip(got, grads)), f"the given arrays must come back [{ctx}]"
    for name, x, y in zip(("o", "dq", "dk", "dv"), (o, *got), (o_cuda, *g_cuda)):
        err = float(cp.max(cp.abs(cp.from_dlpack(x) - cp.from_dlpack(y))))
        assert err < 1e-5, f"{name}: max |numpy - cuda| = {err} (NaN: not written back) [{ctx}]"


def test_torch_strided_inputs(gpu):
    """Non-contiguous torch views (row stride > head_dim, a transposed k) give correct results."""
    torch = _torch()
    cf = gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "float16", 2, 130, 170, 4, 2, 64, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="torch strided")
    q0, k0, v0, do0 = _torch_inputs(torch, ctx, dtype, b, sq, sk, h, hk, d + 16)
    q, v, do = q0[..., :d], v0[..., :d], do0[..., :d]
    k = k0[..., :d].transpose(1, 2).contiguous().transpose(1, 2)  # (b, sk, hk, d) with head stride sk * d
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    o, lse = cf.flash_attn(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    _check_torch(gpu, ctx, dtype, causal, q, k, v, do, o, lse, dq, dk, dv)


def test_torch_non_default_stream(gpu):
    """Inside `with torch.cuda.stream(s)`: inputs written on s behind a long busy kernel, results
    consumed on s right away, still bitwise equal to the default-stream results (which are checked
    against the reference)."""
    torch = _torch()
    cf = gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "bfloat16", 2, 300, 411, 4, 2, 128, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="torch stream")
    q, k, v, do = _torch_inputs(torch, ctx, dtype, b, sq, sk, h, hk, d)
    o0, lse0 = cf.flash_attn(q, k, v, causal=causal, return_lse=True)
    g0 = cf.flash_attn_backward(do, q, k, v, o0, lse0, causal=causal, deterministic=True)  # compared bitwise
    torch.cuda.synchronize()
    _check_torch(gpu, ctx, dtype, causal, q, k, v, do, o0, lse0, *g0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(50_000_000)  # tens of ms of spinning queued ahead on s
        else:
            busy = torch.ones(4096, 4096, device="cuda")
            for _ in range(4):
                busy = busy @ busy / 4096
        q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
        o2, lse2 = cf.flash_attn(q2, k2, v2, causal=causal, return_lse=True)
        g2 = cf.flash_attn_backward(do2, q2, k2, v2, o2, lse2, causal=causal, deterministic=True)
        taken = [x.clone() for x in (o2, lse2, *g2)]
    s.synchronize()
    fails = []
    for name, x, x0 in zip(("o", "lse", "dq", "dk", "dv"), taken, (o0, lse0, *g0)):
        n = _torch_bits_differ(torch, x, x0)
        if n:
            fails.append(f"{name}: {n} of {x.numel()} elements differ from the default-stream result")
    assert not fails, f"[{ctx}]\n  " + "\n  ".join(fails)
