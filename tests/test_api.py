"""The public API on the CPU (NumPy backend): results, layouts, output kinds."""

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference


def rand(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_match_reference(causal):
    q, k, v = rand((2, 33, 4, 24), seed=1), rand((2, 47, 2, 24), seed=2), rand((2, 47, 2, 24), seed=3)
    do = rand(q.shape, seed=4)
    o, lse = cuflash.flash_attn(q, k, v, causal=causal, return_lse=True, backend="numpy")
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, rtol=0)
    grads = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="numpy")
    for g, r in zip(grads, reference.backward(do, q, k, v, causal=causal)):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=0)


def test_backward_takes_dout_by_the_name_its_errors_use():
    q = rand((1, 9, 2, 16), seed=1)
    o, lse = cuflash.flash_attn_forward(q, q, q, backend="numpy")
    do = rand(q.shape, seed=2)
    by_name = cuflash.flash_attn_backward(dout=do, q=q, k=q, v=q, o=o, lse=lse, backend="numpy")
    for a, b in zip(by_name, cuflash.flash_attn_backward(do, q, q, q, o, lse, backend="numpy")):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="dout: expected shape"):
        cuflash.flash_attn_backward(dout=do[:, :8], q=q, k=q, v=q, o=o, lse=lse, backend="numpy")


def test_jax_arrays_are_not_written_in_place():
    """out=, dq= (and dk=, dv=, checked alike) refuse JAX arrays, which JAX holds immutable."""
    jnp = pytest.importorskip("jax.numpy")
    q = rand((1, 9, 2, 16), np.float32, seed=1)
    o, lse = cuflash.flash_attn_forward(q, q, q, backend="numpy")
    out = jnp.zeros(q.shape, jnp.float32)
    with pytest.raises(TypeError, match="out: a JAX array cannot be written in place"):
        cuflash.flash_attn_forward(q, q, q, backend="numpy", out=out)
    with pytest.raises(TypeError, match="dq: a JAX array cannot be written in place"):
        cuflash.flash_attn_backward(o, q, q, q, o, lse, backend="numpy", dq=out)


def test_auto_backend_on_cpu_returns_numpy():
    q = rand((1, 8, 2, 16), np.float32)
    o = cuflash.flash_attn(q, q, q)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == q.shape


def test_bhsd_layout_is_a_view_of_bshd():
    q, k, v = (rand((2, 3, 20, 16), seed=s) for s in range(3))  # (b, h, s, d)
    o, lse = cuflash.flash_attn(q, k, v, layout="bhsd", causal=True, return_lse=True, backend="numpy")
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    o2, lse2 = cuflash.flash_attn(t(q), t(k), t(v), causal=True, return_lse=True, backend="numpy")
    assert o.shape == q.shape
    np.testing.assert_array_equal(o, t(o2))
    np.testing.assert_array_equal(lse, lse2)
    dq, dk, dv = cuflash.flash_attn_backward(o, q, k, v, o, lse, layout="bhsd", causal=True, backend="numpy")
    dq2, dk2, dv2 = cuflash.flash_attn_backward(t(o), t(q), t(k), t(v), t(o), lse, causal=True, backend="numpy")
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        np.testing.assert_array_equal(a, t(b))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_dtypes_keep_dtype(dtype):
    q = rand((1, 16, 2, 32), dtype)
    o, lse = cuflash.flash_attn_forward(q, q, q, backend="numpy")
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert np.isfinite(o.astype(np.float32)).all()


def test_float64_lse_is_float64():
    q = rand((1, 4, 1, 8))
    _, lse = cuflash.flash_attn_forward(q, q, q, backend="numpy")
    assert lse.dtype == np.float64


def test_numba_backend_refuses_clearly_without_gpu_or_simulator(monkeypatch):
    from cuflash._interop import gpu_status

    if gpu_status()[0]:
        pytest.skip("a GPU is visible")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    q = rand((1, 4, 1, 8))
    with pytest.raises(RuntimeError, match=r"backend='numba' cannot run here: "):
        cuflash.flash_attn(q, q, q, backend="numba")
