"""Every validation rule of the public API: exception type and message (CPU, NumPy backend)."""

import re

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _interop
from cuflash.backends import numpy as numpy_backend


def qkv(b=2, sq=5, sk=7, h=4, hk=4, d=16, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return q, k, v


def fwd(q, k, v, **kw):
    return cuflash.flash_attn_forward(q, k, v, backend="numpy", **kw)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_])
def test_unsupported_dtype(dtype):
    q, k, v = (x.astype(dtype) for x in qkv())
    with pytest.raises(TypeError, match=r"q: dtype must be one of float16, bfloat16, float32, float64, got"):
        fwd(q, k, v)


def test_mismatched_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k: dtype must match q \(float32\), got float64"):
        fwd(q, k.astype(np.float64), v)
    with pytest.raises(TypeError, match=r"v: dtype must match q \(float32\), got bfloat16"):
        fwd(q, k, v.astype(ml_dtypes.bfloat16))


def test_wrong_ndim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q: expected a 4-D array \(batch, seqlen, nheads, head_dim\), got 3-D with shape \(5, 4, 16\)"):
        fwd(q[0], k, v)
    with pytest.raises(ValueError, match=r"v: expected a 4-D array \(batch, nheads, seqlen, head_dim\), got 5-D"):
        fwd(q, k, v[None], layout="bhsd")


def test_k_v_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v: shapes must be equal, got k \(2, 7, 4, 16\) and v \(2, 6, 4, 16\)"):
        fwd(q, k, v[:, :6])


def test_batch_and_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k: batch must equal q's \(2\), got 1"):
        fwd(q, k[:1], v[:1])
    q2, _, _ = qkv(d=24)
    with pytest.raises(ValueError, match=r"k: head_dim must equal q's \(24\), got 16"):
        fwd(q2, k, v)


def test_nheads_not_divisible():
    q, k, v = qkv(h=4, hk=3)
    with pytest.raises(ValueError, match=r"k: nheads_k must divide q's nheads \(4\), got nheads_k=3"):
        fwd(q, k, v)


def test_head_dim_too_large():
    q, k, v = qkv(d=264, sq=2, sk=2)
    with pytest.raises(ValueError, match=r"head_dim must be <= 256, got 264"):
        fwd(q, k, v)


@pytest.mark.parametrize("d", [12, 4])
def test_head_dim_not_multiple_of_8(d):
    q, k, v = qkv(d=d)
    with pytest.raises(ValueError, match=rf"head_dim must be a positive multiple of 8 \(pad q, k, v to one\), got {d}"):
        fwd(q, k, v)


def test_strided_last_dim_input_is_copied():
    q, k, v = qkv(d=16)
    wide = np.repeat(q, 2, axis=-1)  # q[..., ::2] of this is q, with a last-dim stride of 2 elements
    o_ref, lse_ref = fwd(q, k, v)
    o, lse = fwd(wide[..., ::2], k, v)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)


def test_out_strided_last_dim():
    q, k, v = qkv()
    out = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float32)[..., ::2]
    with pytest.raises(ValueError, match=r"out: the last dimension must be contiguous \(stride 4 bytes\), got 8"):
        fwd(q, k, v, out=out)


def test_out_wrong_shape_and_dtype():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5, 4, 16\), got \(2, 5, 4, 8\)"):
        fwd(q, k, v, out=np.empty((2, 5, 4, 8), np.float32))
    with pytest.raises(ValueError, match=r"out: dtype must be float32 \(q's\), got float64"):
        fwd(q, k, v, out=np.empty(q.shape, np.float64))


@pytest.mark.parametrize("alias", ["q", "v"])
def test_out_aliasing_input(alias):
    q, k, v = qkv(sk=5)
    target = {"q": q, "v": v}[alias]
    with pytest.raises(ValueError, match=rf"out: must not share memory with {alias}"):
        fwd(q, k, v, out=target)


def test_out_is_written_and_returned():
    q, k, v = qkv()
    out = np.full(q.shape, np.nan, np.float32)
    o, _ = fwd(q, k, v, out=out)
    assert o is out
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, fwd(q, k, v)[0])


def test_different_devices():
    class FakeCuda:
        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(ValueError, match=r"arrays are on different devices: q on host, k on cuda:0"):
        _interop.check_devices(q=np.zeros(1), k=FakeCuda())


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, "x"])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softmax_scale: expected a finite positive number, got"):
        fwd(q, k, v, softmax_scale=scale)


def test_bad_layout_and_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"layout: expected one of \('bshd', 'bhsd'\), got 'sbhd'"):
        fwd(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'cuda', 'numba', 'numpy'\), got 'triton'"):
        cuflash.flash_attn(q, k, v, backend="triton")


def test_forced_backend_that_cannot_run_says_why():
    if _interop.gpu_status()[0]:
        pytest.skip("a GPU is visible: the cuda backend can run")
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"backend='cuda' cannot run here: .+"):
        cuflash.flash_attn(q, k, v, backend="cuda")


@pytest.mark.parametrize("b,sq", [(0, 5), (2, 0)])
def test_empty_batch_or_queries_no_launch(monkeypatch, b, sq):
    q, k, v = qkv(b=max(b, 1), sq=max(sq, 1))
    q = q[:b, :sq] if b == 0 else q[:, :sq]
    k, v = (k[:b], v[:b]) if b == 0 else (k, v)

    def boom(*a, **kw):
        raise AssertionError("a kernel ran for an empty problem")

    monkeypatch.setattr(numpy_backend, "forward", boom)
    monkeypatch.setattr(numpy_backend, "backward", boom)
    o, lse = fwd(q, k, v)
    assert o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    dq, dk, dv = cuflash.flash_attn_backward(o, q, k, v, o, lse, backend="numpy") if b == 0 else (None,) * 3
    if b == 0:
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_seqlen_k_zero_gives_zeros_and_neg_inf():
    q, k, v = qkv(sk=0)
    with np.errstate(all="raise"):
        o, lse = fwd(q, k, v)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = cuflash.flash_attn_backward(np.ones_like(o), q, k, v, o, lse, backend="numpy")
    assert np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


def test_fully_masked_rows_no_nan():
    q, k, v = qkv(sq=9, sk=4)  # causal, bottom-right: the first 5 query rows see no key
    o, lse = fwd(q, k, v, causal=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:]))
    dq, dk, dv = cuflash.flash_attn_backward(np.ones_like(o), q, k, v, o, lse, causal=True, backend="numpy")
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    assert np.all(dq[:, :5] == 0)


def test_backward_argument_checks():
    q, k, v = qkv()
    o, lse = fwd(q, k, v)
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 5, 4, 16\), got \(2, 4, 4, 16\)"):
        cuflash.flash_attn_backward(o[:, :4], q, k, v, o, lse, backend="numpy")
    with pytest.raises(TypeError, match=r"o: dtype must be float32, got float64"):
        cuflash.flash_attn_backward(o, q, k, v, o.astype(np.float64), lse, backend="numpy")
    with pytest.raises(ValueError, match=re.escape("lse: expected shape (2, 4, 5) (batch, nheads, seqlen_q), got (2, 5, 4)")):
        cuflash.flash_attn_backward(o, q, k, v, o, lse.transpose(0, 2, 1), backend="numpy")
    with pytest.raises(TypeError, match=r"lse: dtype must be float32, got float64"):
        cuflash.flash_attn_backward(o, q, k, v, o, lse.astype(np.float64), backend="numpy")
