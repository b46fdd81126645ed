"""cuflash.jax: the custom_vjp functions, eager and under jax.jit, against the float64 reference.

CPU tests run on JAX's CPU backend (the NumPy backend): values and jax.grad against
cuflash.reference, jit against eager (bitwise: the same backend runs), finite differences in float64,
the pure_callback fallback of a JAX without buffer_callback and the refusal of that fallback on a GPU,
cuflash's own messages for bad input. GPU tests (marked gpu) run on a JAX GPU device and are judged
by DESIGN.md's accuracy rule, as tests/test_gpu_variants.py judges the kernels; one checks that
under jit the kernels get XLA's device buffers and stream. JAX is optional: the module skips without it.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX not installed (optional)")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import reference as ref  # noqa: E402

from conftest import FP32_FORWARD_ATOL, RULE_ATOL, jax_gpu  # noqa: E402
from test_variants import varlen_inputs  # noqa: E402


@pytest.fixture
def x64():
    """float64 arrays in JAX for the test's duration (jax_enable_x64, restored after)."""
    old = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


def make(b, sq, sk, h, hk, d, dtype=np.float32, seed=0):
    """q, k, v and a loss weight w (the cotangent of o), NumPy."""
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def slopes(shape, seed=0):
    return np.random.default_rng(seed).uniform(0.05, 0.5, shape).astype(np.float32)


def oracle(q, k, v, w, causal=False, seed=0, offset=0, cu=None, **kw):
    """(o, dq, dk, dv) of the float64 reference; dropout's keep mask made from seed / offset."""
    q, k, v, w = (np.asarray(x, dtype=np.float64) for x in (q, k, v, w))
    if cu is not None:
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    if kw.get("dropout_p"):
        if cu is None:
            b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
        else:
            b, sq, h, sk = len(cu[0]) - 1, int(np.diff(cu[0]).max()), q.shape[1], int(np.diff(cu[1]).max())
        kw["dropout_mask"] = cuflash.dropout_mask(b, h, sq, sk, dropout_p=kw["dropout_p"], seed=seed, offset=offset)
    o, _ = ref.forward(q, k, v, causal=causal, **kw)
    return (o, *ref.backward(w, q, k, v, causal=causal, **kw))


def assert_close(got, want, rtol, names=("o", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        g = np.asarray(g, dtype=np.float64)
        assert not np.isnan(g).any(), name
        err = ref.max_abs_error(g, w)
        bound = rtol * max(1.0, float(np.abs(w).max()) if w.size else 0.0)
        assert err <= bound, f"{name}: max abs error {err:.3e} > {bound:.3e}"


def value_and_grads(f, q, k, v, w, jit=False):
    """o = f(q, k, v) and the gradients of sum(o * w) in q, k, v."""
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32 if w.dtype != jnp.float64 else w.dtype) * w)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    if jit:
        f, grad = jax.jit(f), jax.jit(grad)
    return (f(q, k, v), *grad(q, k, v))


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- eager -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_eager_matches_reference(causal, monkeypatch):
    """Eager calls, jax.grad included, run cuflash directly: no callback."""
    monkeypatch.setattr(cfj, "_callback", lambda *a: pytest.fail("an eager call went through a callback"))
    q, k, v, w = make(2, 37, 45, 4, 2, 16, seed=1)
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=causal)
    got = value_and_grads(f, *map(jnp.asarray, (q, k, v, w)))
    for x, like in zip(got, (q, q, k, v)):
        assert isinstance(x, jax.Array) and x.dtype == jnp.float32 and x.shape == like.shape
        assert x.devices() == {jax.devices("cpu")[0]}
    want = oracle(q, k, v, w, causal=causal)
    assert_close(got[:1], want[:1], 2e-6, ("o",))  # float32: test_variants.py's bounds for the NumPy backend
    assert_close(got[1:], want[1:], 5e-6, ("dq", "dk", "dv"))


def test_eager_is_cuflash_on_numpy():
    """Eager on the CPU runs cuflash's NumPy backend: the results of cuflash on NumPy arrays, bitwise."""
    q, k, v, w = make(1, 50, 50, 2, 2, 32, seed=2)
    o, dq, dk, dv = value_and_grads(lambda q, k, v: cfj.flash_attn(q, k, v, softmax_scale=0.3),
                                    *map(jnp.asarray, (q, k, v, w)))
    o_np, lse = cuflash.flash_attn_forward(q, k, v, softmax_scale=0.3, backend="numpy")
    grads = cuflash.flash_attn_backward(w, q, k, v, o_np, lse, softmax_scale=0.3, backend="numpy")
    for got, want in zip((o, dq, dk, dv), (o_np, *grads)):
        assert bits_equal(got, want)


def test_numpy_inputs_give_jax_arrays():
    q, k, v, _ = make(1, 8, 8, 2, 1, 16)
    o = cfj.flash_attn(q, k, v)
    assert isinstance(o, jax.Array) and bits_equal(o, cuflash.flash_attn(q, k, v, backend="numpy"))


def test_auto_runs_where_the_data_is(monkeypatch):
    """backend='auto' on host arrays is the NumPy backend even where cuflash would pick the GPU."""
    from cuflash import _interop

    monkeypatch.setattr(_interop, "gpu_status", lambda: (True, ""))
    q, k, v, w = map(jnp.asarray, make(1, 20, 20, 2, 2, 16, seed=3))
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=True)
    eager, jitted = value_and_grads(f, q, k, v, w), value_and_grads(f, q, k, v, w, jit=True)
    assert all(bits_equal(a, b) for a, b in zip(eager, jitted))


# --- under jax.jit -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_jit_equals_eager(causal):
    q, k, v, w = map(jnp.asarray, make(2, 70, 33, 4, 1, 32, seed=4))
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=causal)
    eager, jitted = value_and_grads(f, q, k, v, w), value_and_grads(f, q, k, v, w, jit=True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), eager, jitted):
        assert bits_equal(a, b), name


def test_jit_uses_buffer_callback():
    q, k, v, _ = map(jnp.asarray, make(1, 8, 8, 2, 2, 16))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: cfj.flash_attn(q, k, v).sum()))(q))
    assert jaxpr.count("buffer_callback[") == 2 and "pure_callback" not in jaxpr


def test_bfloat16_keeps_dtype_jit_equals_eager():
    q, k, v, w = (jnp.asarray(x.astype(ml_dtypes.bfloat16)) for x in make(1, 40, 48, 2, 2, 32, seed=5))
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=True)
    eager, jitted = value_and_grads(f, q, k, v, w), value_and_grads(f, q, k, v, w, jit=True)
    for a, b in zip(eager, jitted):
        assert a.dtype == jnp.bfloat16 and bits_equal(a, b)
    want = oracle(*(np.asarray(x).astype(np.float64) for x in (q, k, v, w)), causal=True)
    assert_close(eager, want, 2e-2)  # bf16 storage: the order of its rounding (accuracy rule on the GPU below)


def test_vmap():
    q, k, v, _ = make(3, 20, 24, 2, 2, 16, seed=6)
    f = lambda q, k, v: cfj.flash_attn(q[None], k[None], v[None], causal=True)[0]
    got = jax.jit(jax.vmap(f))(*map(jnp.asarray, (q, k, v)))
    assert bits_equal(got, cuflash.flash_attn(q, k, v, causal=True, backend="numpy"))


# --- variants and varlen (float64) -------------------------------------------------------------------------


VARIANTS = {
    "causal_window_softcap_alibi": dict(causal=True, window=(12, 3), softcap=1.3, alibi_slopes="bh"),
    "window_alibi_h": dict(window=(-1, 5), alibi_slopes="h"),
    "dropout_causal": dict(causal=True, dropout_p=0.25, seed=2**40 + 3, offset=2),
}


def _alibi(kw, batch, h):
    kw = dict(kw)
    if kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = slopes((batch, h))
    elif kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = slopes((h,))
    return kw


@pytest.mark.parametrize("case", list(VARIANTS))
@pytest.mark.parametrize("jit", [False, True])
def test_variants_match_reference(x64, case, jit):
    q, k, v, w = make(2, 41, 53, 4, 2, 16, dtype=np.float64, seed=7)
    kw = _alibi(VARIANTS[case], 2, 4)
    alibi = kw.pop("alibi_slopes", None)
    f = lambda q, k, v: cfj.flash_attn(q, k, v, alibi_slopes=None if alibi is None else jnp.asarray(alibi), **kw)
    got = value_and_grads(f, *map(jnp.asarray, (q, k, v, w)), jit=jit)
    assert all(x.dtype == jnp.float64 for x in got)
    assert_close(got, oracle(q, k, v, w, alibi_slopes=alibi, **kw), 1e-12)


def test_alibi_slopes_get_zero_gradient(x64):
    q, k, v, _ = map(jnp.asarray, make(1, 9, 9, 2, 2, 16, dtype=np.float64))
    s = jnp.asarray(slopes((2,)))
    g = jax.grad(lambda s: cfj.flash_attn(q, k, v, alibi_slopes=s).sum())(s)
    assert g.shape == s.shape and not np.asarray(g).any()


@pytest.mark.parametrize("case", ["plain", "causal_window_softcap_alibi", "dropout_causal"])
@pytest.mark.parametrize("jit", [False, True])
def test_varlen_matches_reference(x64, case, jit):
    lens_q, lens_k = [30, 0, 45, 7], [38, 12, 40, 0]
    q, k, v, w, cu_q, cu_k = varlen_inputs(lens_q, lens_k, seed=len(case))
    kw = _alibi(VARIANTS.get(case, {}), 4, 4)
    alibi = kw.pop("alibi_slopes", None)
    cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
    f = lambda q, k, v: cfj.flash_attn_varlen(q, k, v, cq, ck, 45, 40, alibi_slopes=alibi, **kw)
    got = value_and_grads(f, *map(jnp.asarray, (q, k, v, w)), jit=jit)
    assert_close(got, oracle(q, k, v, w, cu=(cu_q, cu_k), alibi_slopes=alibi, **kw), 1e-12)


def test_varlen_cu_seqlens_get_no_gradient(x64):
    q, k, v, w, cu_q, cu_k = varlen_inputs([5, 3], [4, 6], seed=1)
    f = lambda q, cq: jnp.sum(cfj.flash_attn_varlen(q, k, v, cq, jnp.asarray(cu_k), 5, 6) * w)
    g = jax.jit(jax.grad(f))(jnp.asarray(q), jnp.asarray(cu_q))
    assert g.shape == q.shape


@pytest.mark.parametrize("jit", [False, True])
def test_check_grads_float64(x64, jit):
    """JAX's own finite-difference check of the VJP (reverse mode), float64."""
    from jax.test_util import check_grads

    q, k, v, _ = make(1, 5, 7, 2, 1, 8, dtype=np.float64, seed=8)
    a = jnp.asarray(slopes((2,)))
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=True, softcap=0.9, alibi_slopes=a)
    check_grads(jax.jit(f) if jit else f, tuple(map(jnp.asarray, (q, k, v))), order=1, modes=["rev"],
                atol=1e-7, rtol=1e-7)


# --- JAX without buffer_callback -----------------------------------------------------------------------------


def test_without_buffer_callback_cpu_uses_pure_callback(monkeypatch):
    monkeypatch.setattr(cfj, "_buffer_callback", lambda: None)
    calls = []
    real = jax.pure_callback

    @functools.wraps(real)  # keeps the signature cuflash.jax inspects for vmap_method
    def spy(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(jax, "pure_callback", spy)
    q, k, v, w = map(jnp.asarray, make(2, 33, 40, 4, 2, 16, seed=9))
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=True, window=(9, 2))
    eager, jitted = value_and_grads(f, q, k, v, w), value_and_grads(f, q, k, v, w, jit=True)
    assert len(calls) == 3  # the forward alone, then forward + backward of the gradient
    assert all(bits_equal(a, b) for a, b in zip(eager, jitted))
    # varlen and vmap through the fallback too
    qv, kv, vv, _, cu_q, cu_k = varlen_inputs([10, 4], [6, 9], dtype=np.float32)
    fv = lambda q: cfj.flash_attn_varlen(q, kv, vv, jnp.asarray(cu_q), jnp.asarray(cu_k), 10, 9)
    assert bits_equal(jax.jit(fv)(jnp.asarray(qv)), fv(jnp.asarray(qv)))
    fb = lambda q: cfj.flash_attn(q[None], k[:1], v[:1])[0]
    assert bits_equal(jax.jit(jax.vmap(fb))(q[:1]), fb(q[0])[None])


def test_without_buffer_callback_gpu_refuses(monkeypatch):
    monkeypatch.setattr(cfj, "_buffer_callback", lambda: None)
    monkeypatch.setattr(cfj, "_platform", lambda: "gpu")
    monkeypatch.setattr(jax, "pure_callback", lambda *a, **kw: pytest.fail("a GPU array routed through the host"))
    q, k, v, _ = map(jnp.asarray, make(1, 8, 8, 2, 2, 16))
    msg = r"needs jax\.experimental\.buffer_callback, which JAX .* lacks: cuflash\.jax never routes device arrays"
    with pytest.raises(RuntimeError, match=msg + " through the host"):
        jax.jit(lambda q, k, v: cfj.flash_attn(q, k, v))(q, k, v)
    assert cfj.flash_attn(q, k, v).shape == q.shape  # eager calls need no callback


def test_platform_is_the_default_device():
    assert cfj._platform() == "cpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert cfj._platform() == "cpu"


# --- the GPU branch's wiring, without a GPU ----------------------------------------------------------------


def test_device_buffers_wiring(monkeypatch):
    """The callback's GPU branch with stand-ins for XLA's buffers and CuPy: it enters the buffers'
    device, then XLA's stream (ctx.stream through the CUDA stream protocol), and only then imports
    each buffer (None stays None); the run is told it is on the device."""
    import contextlib
    import sys
    import types

    events = []

    class Buffer:
        def __init__(self, a):
            self.a = a

        def __dlpack_device__(self):
            return 2, 1  # kDLCUDA, device 1

    class Stream:
        @classmethod
        def from_external(cls, obj):
            events.append(("stream", obj.__cuda_stream__()))
            return contextlib.nullcontext()

    def device(i):
        events.append(("device", i))
        return contextlib.nullcontext()

    def from_dlpack(buf):
        events.append("import")
        return buf.a

    cuda = types.SimpleNamespace(Device=device, Stream=Stream)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, from_dlpack=from_dlpack))
    got = {}

    def run(outs, *arrays, on_device):
        got.update(outs=outs, arrays=arrays, on_device=on_device)

    outs = (Buffer(np.zeros(2)), Buffer(np.zeros(3)))
    arg = Buffer(np.ones(1))
    cfj._run_on_buffers(run, types.SimpleNamespace(stream=0xABC0), outs, arg, None)
    assert events == [("device", 1), ("stream", (0, 0xABC0)), "import", "import", "import"]
    assert got["on_device"] is True and got["arrays"] == (arg.a, None)
    assert got["outs"][0] is outs[0].a and got["outs"][1] is outs[1].a


def test_host_backend_on_device_buffers_copies_results():
    """backend='numpy' forced on device buffers: cuflash writes no device out=, so the results are
    copied into the output buffers (NumPy arrays stand in for them here)."""
    q, k, v, w = make(1, 30, 30, 2, 2, 16, seed=10)
    opts = cfj._options(16, True, None, (-1, -1), 0.0, 0.0, 0, 0, "numpy", False)
    o, lse = np.full_like(q, np.nan), np.full((1, 2, 30), np.nan, np.float32)
    cfj._forward_into(opts, [o, lse], q, k, v, None, None, None, on_device=True)
    o_np, lse_np = cuflash.flash_attn_forward(q, k, v, causal=True, backend="numpy")
    assert bits_equal(o, o_np) and bits_equal(lse, lse_np)
    grads = [np.full_like(x, np.nan) for x in (q, k, v)]
    cfj._backward_into(opts, grads, w, q, k, v, o, lse, None, None, None, on_device=True)
    want = cuflash.flash_attn_backward(w, q, k, v, o_np, lse_np, causal=True, backend="numpy")
    assert all(bits_equal(g, x) for g, x in zip(grads, want))


# --- bad input: cuflash's own messages, before any callback --------------------------------------------------


BAD = [
    (dict(q=np.zeros((1, 8, 2, 12), np.float32), k=np.zeros((1, 8, 2, 12), np.float32),
          v=np.zeros((1, 8, 2, 12), np.float32)), ValueError, "head_dim must be a positive multiple of 8"),
    (dict(k=np.zeros((1, 8, 3, 16), np.float32)), ValueError, r"k and v: shapes must be equal"),
    (dict(k=np.zeros((1, 8, 2, 16), np.float16)), TypeError, r"k: dtype must match q \(float32\)"),
    (dict(q=[[1.0]]), TypeError, "q: expected a NumPy or CuPy array or a DLPack producer"),
    (dict(q=np.zeros((8, 2, 16), np.float32)), ValueError, "q: expected a 4-D array"),
    (dict(window=(1.0, 2)), TypeError, "window: expected a pair of ints"),
    (dict(softcap=-1.0), ValueError, r"softcap: expected 0 \(off\) or a finite positive number"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a number in \[0, 1\)"),
    (dict(seed=-1), ValueError, r"seed: expected 0 <= seed < 2\*\*64"),
    (dict(causal="yes"), TypeError, r"causal: expected a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite positive number"),
    (dict(backend="tpu"), ValueError, r"backend: expected one of"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes: dtype must be float32"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes: expected shape \(2,\) or \(1, 2\)"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD)
@pytest.mark.parametrize("jit", [False, True])
def test_bad_input(kw, exc, msg, jit):
    q, k, v, _ = make(1, 8, 8, 2, 2, 16)
    args = {"q": q, "k": k, "v": v, **kw}
    arrays = {n: args.pop(n) for n in ("q", "k", "v")}
    if jit and not isinstance(arrays["q"], list):
        arrays = {n: jnp.asarray(x) for n, x in arrays.items()}
        with pytest.raises(exc, match=msg):
            jax.jit(lambda q, k, v: cfj.flash_attn(q, k, v, **args))(**arrays)
    else:
        with pytest.raises(exc, match=msg):
            cfj.flash_attn(**arrays, **args)


def test_bad_varlen_input():
    q, k, v, _, cu_q, cu_k = varlen_inputs([5, 3], [4, 6], dtype=np.float32)
    f = cfj.flash_attn_varlen
    with pytest.raises(ValueError, match="cu_seqlens_q: must start at 0"):
        f(q, k, v, np.array([1, 5, 8], np.int32), cu_k, 5, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: the last value must equal k's length"):
        f(q, k, v, cu_q, jnp.asarray(np.array([0, 4, 9], np.int32)), 5, 6)  # a concrete host jax array is checked
    with pytest.raises(ValueError, match=r"max_seqlen_q: must be >= the longest sequence \(5\)"):
        f(q, k, v, cu_q, cu_k, 4, 6)
    with pytest.raises(TypeError, match="cu_seqlens_q: dtype must be int32"):
        f(q, k, v, cu_q.astype(np.int64), cu_k, 5, 6)
    with pytest.raises(ValueError, match="q: expected a 3-D packed array"):
        f(q[None], k, v, cu_q, cu_k, 5, 6)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int"):
        jax.jit(lambda q: f(q, k, v, cu_q, cu_k, 5, 6.0))(jnp.asarray(q))
    with pytest.raises(TypeError, match="deterministic"):
        f(q, k, v, cu_q, cu_k, 5, 6, deterministic=1)


def test_forced_cuda_backend_without_gpu():
    from cuflash import _interop

    if _interop.gpu_status()[0]:
        pytest.skip("a GPU is usable here")
    q, k, v, _ = make(1, 8, 8, 2, 2, 16)
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run here"):
        cfj.flash_attn(q, k, v, backend="cuda")


# --- on a GPU ---------------------------------------------------------------------------------------------


def _gpu_inputs(dev, dtype, shapes, seed):
    rng = np.random.default_rng(seed)
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return [jax.device_put(rng.standard_normal(s).astype(np.float32).astype(np_dt), dev) for s in shapes]


def _rule(gpu, ctx, dtype, got, r64, sp):
    """DESIGN.md's accuracy rule on o, dq, dk, dv (CuPy arrays), as tests/test_gpu_variants.py applies it."""
    cp = gpu.cp
    fails = []
    for name, ours, want, same in zip(("o", "dq", "dk", "dv"), got, r64, sp):
        ours = ours.astype(cp.float64)
        err = float(cp.max(cp.abs(ours - want)))
        err = math.inf if math.isnan(err) else err
        mag = float(cp.max(cp.abs(want)))
        if dtype == "float32" and name == "o":
            bound = FP32_FORWARD_ATOL["cuda"] * max(1.0, mag)
        else:
            bound = 2.0 * float(cp.max(cp.abs(same - want))) + RULE_ATOL[dtype] * max(1.0, mag)
        if not err <= bound:
            fails.append(f"{name}: error {err:.3e} > bound {bound:.3e} (max|ref| {mag:.3e})")
    if fails:
        raise AssertionError(f"[{ctx}]\n  " + "\n  ".join(fails))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_eager_and_jit(gpu, dtype, causal):
    _, dev = jax_gpu()
    cp = gpu.cp
    q, k, v, w = _gpu_inputs(dev, dtype, [(2, 200, 4, 64), (2, 230, 2, 64), (2, 230, 2, 64), (2, 200, 4, 64)], 11)
    f = lambda q, k, v: cfj.flash_attn(q, k, v, causal=causal, deterministic=True)  # dq compared bitwise
    grad = jax.grad(lambda q, k, v, w: jnp.sum(f(q, k, v).astype(jnp.float32) * w.astype(jnp.float32)),
                    argnums=(0, 1, 2))
    eager = (f(q, k, v), *grad(q, k, v, w))
    jitted = (jax.jit(f)(q, k, v), *jax.jit(grad)(q, k, v, w))
    for name, a, b in zip(("o", "dq", "dk", "dv"), eager, jitted):
        assert a.devices() == {dev} and b.devices() == {dev}, name
        assert str(a.dtype) == dtype and str(b.dtype) == dtype, name
        assert gpu.same_bits(cp.from_dlpack(a), cp.from_dlpack(b)) == 0, f"{name}: jit differs from eager"
    c = [cp.from_dlpack(x) for x in (q, k, v, w)]
    r64, sp = gpu.references(dtype, causal, None, *c)
    names = ("o", "dq", "dk", "dv")
    _rule(gpu, f"jax {dtype} causal={causal}", dtype, [cp.from_dlpack(x) for x in jitted],
          [r64[n] for n in names], [sp[n] for n in names])


@pytest.mark.gpu
def test_gpu_jit_runs_on_xla_buffers_and_stream(gpu, monkeypatch):
    """Under jit the kernels read and write XLA's device buffers on XLA's stream: every buffer is
    CUDA memory (it has __cuda_array_interface__), none is read on the host."""
    _, dev = jax_gpu()
    cp = gpu.cp
    seen = {"device": 0, "host": 0, "streams": [], "current": []}
    real_device, real_run = cfj._device_array, cfj._run_on_buffers

    def device_array(buf):
        if buf is not None:
            assert buf.__dlpack_device__()[0] == 2 and buf.__cuda_array_interface__["data"][0]
            seen["device"] += 1
            seen["current"].append(cp.cuda.get_current_stream().ptr)
        return real_device(buf)

    def host_array(buf):
        if buf is not None:
            seen["host"] += 1
        return None if buf is None else np.asarray(buf)

    def run_on_buffers(run, ctx, outs, *bufs):
        seen["streams"].append(ctx.stream)
        return real_run(run, ctx, outs, *bufs)

    monkeypatch.setattr(cfj, "_device_array", device_array)
    monkeypatch.setattr(cfj, "_host_array", host_array)
    monkeypatch.setattr(cfj, "_run_on_buffers", run_on_buffers)
    # float16: a bfloat16 buffer may have no __cuda_array_interface__ typestr (cuflash imports through DLPack)
    q, k, v = _gpu_inputs(dev, "float16", [(1, 128, 2, 64), (1, 128, 2, 64), (1, 128, 2, 64)], 12)
    dq = jax.jit(jax.grad(lambda q: cfj.flash_attn(q, k, v, causal=True).astype(jnp.float32).sum()))(q)
    dq.block_until_ready()
    assert len(seen["streams"]) == 2 and seen["host"] == 0 and seen["device"] == 5 + 9  # fwd 2 + 3, bwd 3 + 6
    assert set(seen["current"]) <= set(seen["streams"]) and all(seen["streams"]), seen


@pytest.mark.gpu
def test_gpu_varlen_variants_jit_equals_cuflash(gpu):
    """Varlen with every deterministic variant, fp16, jit: bitwise the results of cuflash on CuPy."""
    _, dev = jax_gpu()
    cp = gpu.cp
    lens_q, lens_k = [150, 0, 97], [130, 40, 160]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v, w = _gpu_inputs(dev, "float16", [(cu_q[-1], 4, 128), (cu_k[-1], 2, 128), (cu_k[-1], 2, 128),
                                              (cu_q[-1], 4, 128)], 13)
    a = jax.device_put(slopes((3, 4)), dev)
    cq, ck = jax.device_put(cu_q, dev), jax.device_put(cu_k, dev)
    kw = dict(causal=True, window=(60, 2), softcap=2.0)
    f = lambda q, k, v: cfj.flash_attn_varlen(q, k, v, cq, ck, 150, 160, alibi_slopes=a, deterministic=True, **kw)
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w.astype(jnp.float32)), argnums=(0, 1, 2))
    got = (jax.jit(f)(q, k, v), *jax.jit(grad)(q, k, v))
    c = [cp.from_dlpack(x) for x in (q, k, v, w, cq, ck, a)]
    o, lse = cuflash.flash_attn_varlen_forward(*c[:3], c[4], c[5], 150, 160, alibi_slopes=c[6], **kw)
    want = (o, *cuflash.flash_attn_varlen_backward(c[3], *c[:3], o, lse, c[4], c[5], 150, 160, alibi_slopes=c[6],
                                                   deterministic=True, **kw))
    for name, g, x in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.devices() == {dev}
        assert gpu.same_bits(cp.from_dlpack(g), x) == 0, name
