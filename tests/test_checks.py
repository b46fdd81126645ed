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
    with pytest.raises(TypeError, match=r"out: dtype must be float32 \(q's\), got float64"):
        fwd(q, k, v, out=np.empty(q.shape, np.float64))
    with pytest.raises(TypeError, match=r"out: dtype must be float32 \(q's\), got int32"):
        fwd(q, k, v, out=np.empty(q.shape, np.int32))


@pytest.mark.parametrize("alias", ["q", "v"])
def test_out_aliasing_input(alias):
    q, k, v = qkv(sk=5)
    target = {"q": q, "v": v}[alias]
    with pytest.raises(ValueError, match=rf"out: must not share memory with {alias}"):
        fwd(q, k, v, out=target)


@pytest.mark.parametrize("how", ["read-only", "broadcast"])
def test_out_must_be_writable(how):
    """A destination that cannot take the result is refused before anything is computed or written."""
    q, k, v = qkv()
    if how == "read-only":
        out = np.empty_like(q)
        out.flags.writeable = False
    else:
        out = np.broadcast_to(np.empty(q.shape[-1], q.dtype), q.shape)
    with pytest.raises(ValueError, match=r"out: the array is read-only"):
        fwd(q, k, v, out=out)


def test_backward_outputs_checked_before_any_is_written():
    q, k, v = qkv()
    o, lse = fwd(q, k, v)
    dq, dk = np.full_like(q, np.nan), np.full_like(k, np.nan)
    dv = np.empty_like(v)
    dv.flags.writeable = False
    with pytest.raises(ValueError, match=r"dv: the array is read-only"):
        cuflash.flash_attn_backward(o, q, k, v, o, lse, dq=dq, dk=dk, dv=dv, backend="numpy")
    assert np.isnan(dq).all() and np.isnan(dk).all()


def test_zero_stride_destination_is_refused():
    """Elements at one address (a zero stride) cannot each take a result; NumPy marks its broadcasts read-only,
    so the rule is checked directly on the strides."""
    from cuflash import _checks

    x = np.lib.stride_tricks.as_strided(np.empty(16, np.float32), (2, 5, 4, 16), (0, 0, 0, 4))
    assert x.flags.writeable
    with pytest.raises(ValueError, match=r"out: elements must not share memory \(a zero stride"):
        _checks.check_writable("out", x)


def test_empty_out_is_accepted():
    """An out= without elements has no strides to keep (NumPy 2 may report 0): the call returns it."""
    q, k, v = qkv(b=0)
    out = np.empty(q.shape, q.dtype)
    o, lse = fwd(q, k, v, out=out)
    assert o is out and lse.shape == (0, 4, 5)


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


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, 0, -2, np.float32("nan"),
                                   np.float64("-inf"), np.int64(0), 10**400])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softmax_scale: expected a finite positive number, got"):
        fwd(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [1e-46, 1e-39, 1e39, 1e300])
def test_softmax_scale_outside_float32(scale):
    """The kernels scale in float32: a factor that would be 0, a denormal or inf there is refused (it made the
    float32 softmax NaN), for float64 inputs too (one rule)."""
    q, k, v = qkv()
    for x in (q, q.astype(np.float64)):
        with pytest.raises(ValueError, match=r"softmax_scale: expected a number within float32's normal range"):
            fwd(x, k.astype(x.dtype), v.astype(x.dtype), softmax_scale=scale)


def test_softmax_scale_at_float32_bounds():
    q, k, v = qkv()
    tiny = float(np.finfo(np.float32).tiny)
    o, lse = fwd(q, k, v, softmax_scale=tiny)  # scores ~0: every key weighs the same
    np.testing.assert_allclose(o, np.broadcast_to(v.mean(axis=1, keepdims=True), o.shape), rtol=1e-5, atol=1e-6)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("scale", ["x", "0.5", True, np.bool_(True), 0.5 + 0j, np.complex64(0.5), [0.5],
                                   np.array(0.5), np.array([0.5])],
                         ids=["str", "numeric-str", "bool", "np.bool_", "complex", "np.complex64", "list",
                              "0-d-array", "1-d-array"])
def test_softmax_scale_wrong_type(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"softmax_scale: expected None or a real number \(int, float, NumPy integer "
                                        r"or floating scalar\), got .+ of type"):
        fwd(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [1, np.int32(1), np.float16(0.25), np.float32(0.25), np.float64(0.25), 0.25])
def test_softmax_scale_real_numbers(scale):
    """Every accepted kind of number gives the result of the same value as a Python float."""
    q, k, v = qkv()
    o, lse = fwd(q, k, v, softmax_scale=scale)
    o_ref, lse_ref = fwd(q, k, v, softmax_scale=float(scale))
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    o_default, _ = fwd(q, k, v)  # 1 / sqrt(16) = 0.25: the default is used only for None
    if float(scale) != 0.25:
        assert not np.array_equal(o, o_default)


def test_bad_layout_and_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"layout: expected one of \('bshd', 'bhsd'\), got 'sbhd'"):
        fwd(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'cuda', 'numba', 'numpy'\), got 'triton'"):
        cuflash.flash_attn(q, k, v, backend="triton")
    with pytest.raises(ValueError, match=r"layout: expected one of \('bshd', 'bhsd'\), got 'xyz'"):
        cuflash.flash_attn_backward(q, q, k, v, q, np.zeros((2, 4, 5), np.float32), layout="xyz", backend="numpy")


@pytest.mark.parametrize("layout", [3, None, b"bshd", ("bshd",)])
def test_layout_wrong_type(layout):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"layout: expected a str, one of \('bshd', 'bhsd'\), got .+ of type"):
        fwd(q, k, v, layout=layout)


@pytest.mark.parametrize("backend", [None, 3, b"numpy"])
def test_backend_wrong_type(backend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"backend: expected a str, one of \('auto', 'cuda', 'numba', 'numpy'\), got "):
        cuflash.flash_attn(q, k, v, backend=backend)


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


def test_backward_without_query_heads_gives_zero_key_gradients():
    """nheads = 0 with nheads_k > 0: no query reads the keys, so dk = dv = 0 (were left unwritten)."""
    q, k, v = qkv(h=0, hk=2)
    o, lse = fwd(q, k, v)
    dk, dv = np.full_like(k, np.nan), np.full_like(v, np.nan)
    dq, dk_out, dv_out = cuflash.flash_attn_backward(o, q, k, v, o, lse, dk=dk, dv=dv, backend="numpy")
    assert dq.shape == q.shape and dk_out is dk and dv_out is dv
    assert np.all(dk == 0) and np.all(dv == 0)
    _, dk, dv = cuflash.flash_attn_backward(o, q, k, v, o, lse, backend="numpy")
    assert np.all(dk == 0) and np.all(dv == 0)


def test_torch_outputs_autograd_would_not_see_are_refused():
    """A write through DLPack bypasses autograd: an output that requires grad is refused (as torch refuses out=
    there), and so is an inference tensor outside inference mode; a tensor seen through another kind of array
    (an nn.Parameter's .data, a NumPy view) still counts as shared memory."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(ValueError, match=r"out: a tensor that requires grad cannot be written in place"):
        cuflash.flash_attn(q, k, v, out=torch.zeros_like(q, requires_grad=True))
    o, lse = cuflash.flash_attn_forward(q, k, v)
    with pytest.raises(ValueError, match=r"dk: a tensor that requires grad"):
        cuflash.flash_attn_backward(o, q, k, v, o, lse, dk=torch.zeros_like(k, requires_grad=True))
    with torch.inference_mode():
        inference = torch.empty_like(q)
    with pytest.raises(ValueError, match=r"out: an inference tensor can be written in place only under "
                                         r"torch.inference_mode\(\)"):
        cuflash.flash_attn(q, k, v, out=inference)
    with torch.inference_mode():
        assert cuflash.flash_attn(q, k, v, out=inference) is inference
    param = torch.nn.Parameter(q.clone())
    with pytest.raises(ValueError, match=r"out: must not share memory with q"):
        cuflash.flash_attn(param, k, v, out=param.data)
    with pytest.raises(ValueError, match=r"out: must not share memory with q"):
        cuflash.flash_attn(q, k, v, out=q.numpy())


def test_meta_tensors_are_refused_by_name():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match=r"k: its memory cannot be handed over by DLPack"):
        cuflash.flash_attn(q, k.to("meta"), v)
    with pytest.raises(TypeError, match=r"out: its memory cannot be handed over by DLPack"):
        cuflash.flash_attn(q, k, v, out=torch.empty_like(q, device="meta"))


def test_traced_jax_values_are_refused_by_name():
    """Inside jax.jit the core functions get tracers, which hold no data: a TypeError naming the argument and
    cuflash.jax (an AttributeError from the DLPack hand-off before)."""
    jax = pytest.importorskip("jax")
    q, k, v = (jax.numpy.asarray(x) for x in qkv())
    with pytest.raises(TypeError, match=r"q: a traced JAX value \(inside jax.jit, grad or vmap\) has no data to "
                                        r"read; use cuflash.jax"):
        jax.jit(lambda a: cuflash.flash_attn(a, k, v))(q)
    o, lse = cuflash.flash_attn_forward(q, k, v)
    with pytest.raises(TypeError, match=r"dout: a traced JAX value"):
        jax.jit(lambda d: cuflash.flash_attn_backward(d, q, k, v, o, lse)[0])(o)
    with pytest.raises(TypeError, match=r"merge: a traced JAX value"):
        jax.jit(lambda a: cuflash.merge_states(a, lse, o, lse)[0])(o)


def test_dropout_mask_without_elements_allocates_nothing():
    """An empty mask comes back at once, however large its other sizes (it built their index ranges before)."""
    m = cuflash.dropout_mask(1, 1, 2**45, 0, dropout_p=0.5, seed=1)
    assert m.shape == (1, 1, 2**45, 0) and m.dtype == bool
    assert cuflash.dropout_mask(2**40, 2**20, 0, 5, dropout_p=0.5, seed=1).shape == (2**40, 2**20, 0, 5)


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


# --- the exception rule: TypeError for a wrong type or dtype, ValueError for a wrong value -----------

_ARRAY_MSG = r"expected a NumPy or CuPy array or a DLPack producer \(torch, JAX\.\.\.\), got "


_NOT_ARRAYS = {"list": lambda x: x.tolist(), "None": lambda x: None, "float": lambda x: 1.5, "str": lambda x: "q"}


@pytest.mark.parametrize("which,bad", [(w, b) for w in ("q", "k", "v", "out") for b in _NOT_ARRAYS
                                       if (w, b) != ("out", "None")])  # out=None is the default
def test_forward_non_array_argument(which, bad):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v, "out": np.empty_like(q)}
    args[which] = _NOT_ARRAYS[bad](args[which])
    kind = type(args[which]).__name__
    with pytest.raises(TypeError, match=rf"^{which}: {_ARRAY_MSG}{kind}$"):
        cuflash.flash_attn_forward(**args, backend="numpy")
    with pytest.raises(TypeError, match=rf"^{which}: {_ARRAY_MSG}{kind}$"):
        cuflash.flash_attn(**args, backend="numpy")


@pytest.mark.parametrize("which", ["dout", "q", "k", "v", "o", "lse"])
def test_backward_non_array_argument(which):
    q, k, v = qkv()
    o, lse = fwd(q, k, v)
    args = {"dout": o, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=rf"^{which}: {_ARRAY_MSG}list$"):
        cuflash.flash_attn_backward(*args.values(), backend="numpy")


def test_non_array_checked_before_other_arguments():
    """A list q is reported as such even when other arguments are wrong too (nothing reads q.ndim first)."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"^q: {_ARRAY_MSG}list$"):
        cuflash.flash_attn(q.tolist(), k, v, causal="yes", layout="xyz", backend="numpy")


@pytest.mark.parametrize("value", ["False", "True", 1, 0, None, 1.0, np.int64(1), np.array(True), [True]],
                         ids=["str-False", "str-True", "int-1", "int-0", "None", "float", "np.int64", "0-d-array",
                              "list"])
def test_flags_must_be_bools(value):
    q, k, v = qkv()
    o, lse = fwd(q, k, v)
    msg = r": expected a bool \(True or False\), got .* of type "
    with pytest.raises(TypeError, match=r"^causal" + msg):
        fwd(q, k, v, causal=value)
    with pytest.raises(TypeError, match=r"^causal" + msg):
        cuflash.flash_attn(q, k, v, causal=value, backend="numpy")
    with pytest.raises(TypeError, match=r"^return_lse" + msg):
        cuflash.flash_attn(q, k, v, return_lse=value, backend="numpy")
    with pytest.raises(TypeError, match=r"^causal" + msg):
        cuflash.flash_attn_backward(o, q, k, v, o, lse, causal=value, backend="numpy")
    with pytest.raises(TypeError, match=r"^deterministic" + msg):
        cuflash.flash_attn_backward(o, q, k, v, o, lse, deterministic=value, backend="numpy")


@pytest.mark.parametrize("flag", [False, True])
def test_numpy_bool_flags_are_accepted(flag):
    """numpy.bool_ (what comparisons on arrays give) means the same as the Python bool."""
    q, k, v = qkv(sq=7, sk=7)
    o, lse = cuflash.flash_attn(q, k, v, causal=np.bool_(flag), return_lse=np.bool_(True), backend="numpy")
    o_ref, lse_ref = cuflash.flash_attn(q, k, v, causal=flag, return_lse=True, backend="numpy")
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    assert isinstance(cuflash.flash_attn(q, k, v, return_lse=np.bool_(False), backend="numpy"), np.ndarray)
    grads = cuflash.flash_attn_backward(o, q, k, v, o, lse, causal=np.bool_(flag), deterministic=np.bool_(flag),
                                        backend="numpy")
    for g, r in zip(grads, cuflash.flash_attn_backward(o, q, k, v, o, lse, causal=flag, backend="numpy")):
        np.testing.assert_array_equal(g, r)


def test_causal_string_false_no_longer_runs_causal():
    """The bug this rule fixes: "False" is a truthy string, and used to run a causal attention."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^causal: expected a bool \(True or False\), got 'False' of type str$"):
        fwd(q, k, v, causal="False")


def test_check_helpers_directly():
    from cuflash import _checks

    assert _checks.check_flag("x", True) is True and _checks.check_flag("x", np.bool_(False)) is False
    _checks.check_array("q", np.zeros((1, 1, 1, 8)))
    _checks.check_array("out", None, optional=True)
    with pytest.raises(TypeError, match=rf"^out: {_ARRAY_MSG}NoneType$"):
        _checks.check_array("out", None)
    with pytest.raises(TypeError, match=rf"^q: {_ARRAY_MSG}tuple$"):
        _checks.check_array("q", (1, 2))
    assert _checks.check_softmax_scale(None, 64) == 0.125
    assert _checks.check_softmax_scale(np.float32(0.5), 64) == 0.5
    assert type(_checks.check_softmax_scale(np.int8(2), 64)) is float


@pytest.mark.parametrize("call,exc", [
    # wrong types and dtypes
    pytest.param(lambda q, k, v: fwd(q.tolist(), k, v), TypeError, id="list-q"),
    pytest.param(lambda q, k, v: fwd(q, k, v.astype(np.int16)), TypeError, id="int-dtype"),
    pytest.param(lambda q, k, v: fwd(q, k.astype(np.float64), v), TypeError, id="mixed-dtype"),
    pytest.param(lambda q, k, v: fwd(q, k, v, out=np.empty(q.shape, np.float16)), TypeError, id="out-dtype"),
    pytest.param(lambda q, k, v: fwd(q, k, v, causal="False"), TypeError, id="causal-str"),
    pytest.param(lambda q, k, v: fwd(q, k, v, softmax_scale="0.5"), TypeError, id="scale-str"),
    pytest.param(lambda q, k, v: fwd(q, k, v, layout=3), TypeError, id="layout-int"),
    pytest.param(lambda q, k, v: cuflash.flash_attn(q, k, v, backend=None), TypeError, id="backend-None"),
    # wrong values
    pytest.param(lambda q, k, v: fwd(q[0], k, v), ValueError, id="ndim"),
    pytest.param(lambda q, k, v: fwd(q, k[:, :3], v), ValueError, id="k-v-shapes"),
    pytest.param(lambda q, k, v: fwd(q, k, v, out=np.empty((1,) + q.shape[1:], np.float32)), ValueError, id="out-shape"),
    pytest.param(lambda q, k, v: fwd(q, k, v, out=q), ValueError, id="out-aliases-q"),
    pytest.param(lambda q, k, v: fwd(q, k, v, softmax_scale=-0.5), ValueError, id="scale-negative"),
    pytest.param(lambda q, k, v: fwd(q, k, v, layout="xyz"), ValueError, id="layout-name"),
    pytest.param(lambda q, k, v: cuflash.flash_attn(q, k, v, backend="xyz"), ValueError, id="backend-name"),
])
def test_exception_rule(call, exc):
    """One rule for every argument: TypeError for a wrong type or dtype, ValueError for a wrong value
    (and never the other one, nor an AttributeError from inside)."""
    q, k, v = qkv()
    with pytest.raises(Exception) as info:
        call(q, k, v)
    assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"


def test_shares_elements_tells_interleaved_from_overlapping():
    """Exact, from pointers and strides: halves of one buffer interleaved by row share an address range but no
    element; views a row apart, one array twice, or a transposed view of it do share."""
    from cuflash._checks import shares_elements

    buf = np.zeros((2, 16, 2, 4, 8), dtype=np.float16)
    k, v = buf[:, :, 0], buf[:, :, 1]
    assert not shares_elements(k, v)
    assert shares_elements(k, k) and shares_elements(k, k.transpose(0, 2, 1, 3))
    rows = np.zeros((2, 17, 4, 8), dtype=np.float16)
    assert shares_elements(rows[:, :-1], rows[:, 1:])
    assert not shares_elements(rows[:, :8], rows[:, 8:])  # adjacent, apart
    assert not shares_elements(k[:, :0], k)  # empty
    assert shares_elements(buf[:, :, 0, :, 1:], buf[:, :, 0, :, :-1][..., ::-1])  # negative stride
