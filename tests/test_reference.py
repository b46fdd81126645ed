"""The float64 oracle itself: against a naive per-(batch, head, row) loop, finite differences, and the
rounding emulation of the same-precision references (CPU; one GPU test runs it on CuPy arrays)."""

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference as ref

# The oracle must never warn (no log(0), no inf - inf, no 0/0), masked rows included.
pytestmark = pytest.mark.filterwarnings("error")


def rand(rng, *shape):
    return rng.standard_normal(shape)


def make(b, sq, sk, h, hk, d, seed=0):
    rng = np.random.default_rng(seed)
    return rand(rng, b, sq, h, d), rand(rng, b, sk, hk, d), rand(rng, b, sk, hk, d), rand(rng, b, sq, h, d)


# --- an independent oracle for the oracle: one row at a time, softmax Jacobian written out -----------


def visible_cols(i, sq, sk, causal):
    return [j for j in range(sk) if not causal or j <= i + sk - sq]


def naive(q, k, v, do, causal, scale):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    o = np.zeros(q.shape)
    lse = np.full((b, h, sq), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for bi in range(b):
        for hi in range(h):
            kv = hi // group
            for i in range(sq):
                js = visible_cols(i, sq, sk, causal)
                if not js:
                    continue
                kk, vv = k[bi, js, kv], v[bi, js, kv]
                s = scale * (kk @ q[bi, i, hi])
                m = s.max()
                e = np.exp(s - m)
                p = e / e.sum()
                o[bi, i, hi] = p @ vv
                lse[bi, hi, i] = m + math.log(e.sum())
                # d(sum(o * do)) through softmax: ds = (diag(p) - p p^T) dp, dp = vv do
                dp = vv @ do[bi, i, hi]
                ds = (np.diag(p) - np.outer(p, p)) @ dp
                dv[bi, js, kv] += np.outer(p, do[bi, i, hi])
                dq[bi, i, hi] += scale * (ds @ kk)
                dk[bi, js, kv] += scale * np.outer(ds, q[bi, i, hi])
    return o, lse, dq, dk, dv


NAIVE_CASES = [
    # (b, sq, sk, h, hk, d, causal)
    (2, 7, 11, 4, 2, 8, False),
    (2, 7, 11, 4, 2, 8, True),
    (1, 11, 7, 4, 1, 16, True),  # seqlen_q > seqlen_k: the first 4 rows see no key
    (1, 11, 7, 3, 3, 16, False),
    (1, 1, 1, 2, 1, 8, True),
    (2, 9, 9, 2, 2, 40, True),
]


@pytest.mark.parametrize("case", NAIVE_CASES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_naive(case, scale):
    b, sq, sk, h, hk, d, causal = case
    q, k, v, do = make(b, sq, sk, h, hk, d, seed=sq * 31 + sk)
    want = naive(q, k, v, do, causal, 1 / math.sqrt(d) if scale is None else scale)
    o, lse = ref.forward(q, k, v, causal=causal, softmax_scale=scale)
    grads = ref.backward(do, q, k, v, causal=causal, softmax_scale=scale)
    for got, exp in zip((o, lse, *grads), want):
        assert got.dtype == np.float64 and got.shape == exp.shape
        assert ref.max_abs_error(got, exp) < 1e-13


@pytest.mark.parametrize("causal,sq,sk,h,hk", [(False, 3, 4, 2, 1), (True, 3, 4, 2, 2), (True, 4, 2, 2, 1)])
def test_backward_finite_differences(causal, sq, sk, h, hk):
    """The analytic gradient is the gradient of sum(o * do): central differences, float64."""
    q, k, v, do = make(1, sq, sk, h, hk, 8, seed=7)

    def loss(q, k, v):
        return float(np.sum(ref.forward(q, k, v, causal=causal)[0] * do))

    grads = ref.backward(do, q, k, v, causal=causal)
    eps = 1e-6
    for which, x in enumerate((q, k, v)):
        fd = np.zeros(x.shape)
        for idx in np.ndindex(x.shape):
            args = [q, k, v]
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args[which] = plus
            lp = loss(*args)
            args[which] = minus
            fd[idx] = (lp - loss(*args)) / (2 * eps)
        assert ref.max_abs_error(grads[which], fd) < 1e-8


@pytest.mark.parametrize("precision", [None, "float32", "float16", "bfloat16"])
def test_rows_without_key(precision):
    q, k, v, do = make(2, 9, 4, 4, 2, 16, seed=3)
    o, lse = ref.forward(q, k, v, causal=True, precision=precision)
    dq, dk, dv = ref.backward(do, q, k, v, causal=True, precision=precision)
    for x in (o, dq, dk, dv):
        assert not np.isnan(x).any()
    assert np.all(o[:, :5] == 0) and np.all(dq[:, :5] == 0)
    assert np.all(lse[:, :, :5] == -np.inf) and np.isfinite(lse[:, :, 5:]).all()

    empty = np.zeros((2, 0, 2, 16))
    o, lse = ref.forward(q, empty, empty, precision=precision)
    dq, dk, dv = ref.backward(do, q, empty, empty, precision=precision)
    assert np.all(o == 0) and np.all(lse == -np.inf) and np.all(dq == 0)
    assert dk.shape == dv.shape == (2, 0, 2, 16)


# --- same-precision emulation -----------------------------------------------------------------------


def test_round_bf16_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * np.exp2(rng.integers(-140, 126, 20000))).astype(np.float32)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway: ties to even
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, 1e-45, -3e-39, 1.0 + 2**-8],
                       dtype=np.float32)
    x = np.concatenate([x, bits.view(np.float32), ties.view(np.float32), special])
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = ref._round_bf16(x, np)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isnan(ref._round_bf16(np.array([np.nan, -np.nan], np.float32), np)).all()


@pytest.mark.parametrize("precision,dtype", [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_precision_values_are_representable(precision, dtype):
    q, k, v, do = make(2, 33, 45, 4, 2, 32, seed=5)
    outs = (*ref.forward(q, k, v, causal=True, precision=precision)[:1],
            *ref.backward(do, q, k, v, causal=True, precision=precision))
    for x in outs:
        assert np.array_equal(x.astype(dtype).astype(np.float64), x)


def test_precision_error_ordering():
    """Less storage precision, more error; float32 emulation within a few ulps of float64."""
    q, k, v, do = make(2, 64, 96, 4, 2, 64, seed=9)
    want = (*ref.forward(q, k, v, causal=True), *ref.backward(do, q, k, v, causal=True))
    errs = {}
    for precision in ("float32", "float16", "bfloat16"):
        got = (*ref.forward(q, k, v, causal=True, precision=precision),
               *ref.backward(do, q, k, v, causal=True, precision=precision))
        errs[precision] = [ref.max_abs_error(g, w) for g, w in zip(got, want)]
    assert max(errs["float32"]) < 2e-5
    for e32, e16, ebf in zip(errs["float32"], errs["float16"], errs["bfloat16"]):
        assert e32 < e16 < ebf


def test_accepts_low_precision_inputs():
    q, k, v, _ = make(1, 5, 6, 2, 2, 8)
    o64, _ = ref.forward(q, k, v)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        o, lse = ref.forward(*(x.astype(dtype) for x in (q, k, v)))
        assert o.dtype == lse.dtype == np.float64
        assert ref.max_abs_error(o, o64) < 0.05


def test_invalid_arguments():
    q, k, v, _ = make(1, 5, 6, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of nheads_k"):
        ref.forward(q, k, v)
    q, k, v, _ = make(1, 5, 6, 2, 2, 8)
    with pytest.raises(ValueError, match="precision"):
        ref.forward(q, k, v, precision="int8")
    with pytest.raises(ValueError, match="mode"):
        ref.flops(1, 1, 1, 1, 8, False, mode="both")


# --- flops and the accuracy rule ----------------------------------------------------------------------


def test_flops():
    assert ref.flops(2, 3, 5, 7, 64, False) == 4 * 2 * 3 * 5 * 7 * 64
    assert ref.flops(2, 3, 5, 7, 64, True) == 2 * 2 * 3 * 5 * 7 * 64
    assert ref.flops(2, 3, 5, 7, 64, False, mode="bwd") == 10 * 2 * 3 * 5 * 7 * 64
    assert ref.flops(2, 3, 5, 7, 64, True, mode="fwd_bwd") == 7 * 2 * 3 * 5 * 7 * 64
    assert isinstance(ref.flops(1, 1, 1, 1, 8, True, mode="bwd"), int)


def test_max_abs_error():
    a = np.array([1.0, -np.inf, np.inf, 2.0])
    assert ref.max_abs_error(a, a) == 0.0
    assert ref.max_abs_error(a, np.array([1.0, -np.inf, np.inf, 2.5])) == 0.5
    assert ref.max_abs_error(a, np.array([1.0, 0.0, np.inf, 2.0])) == np.inf
    assert math.isnan(ref.max_abs_error(np.array([np.nan, 1.0]), np.array([0.0, 1.0])))
    assert ref.max_abs_error(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    assert ref.max_abs_error(np.ones(3, np.float16), np.ones(3)) == 0.0
    with pytest.raises(ValueError, match="shape"):
        ref.max_abs_error(np.zeros(3), np.zeros(4))


def test_accuracy_bound():
    r64 = np.array([1.0, 2.0, -np.inf])
    same = np.array([1.01, 2.0, -np.inf])
    err, bound = ref.accuracy_bound(np.array([1.015, 2.0, -np.inf]), r64, same, 1e-3)
    assert err == pytest.approx(0.015) and bound == pytest.approx(0.021) and err <= bound
    err, bound = ref.accuracy_bound(np.array([1.03, 2.0, -np.inf]), r64, same, 1e-3)
    assert err > bound
    # A NaN anywhere fails, whichever way the comparison is written.
    nan = np.array([np.nan, 2.0, -np.inf])
    for ours, r, s in ((nan, r64, same), (r64, nan, same), (r64, r64, nan)):
        err, bound = ref.accuracy_bound(ours, r, s, 1.0)
        assert not err <= bound and err > bound


# --- CuPy arrays (the GPU tests hand the oracle CuPy arrays) --------------------------------------------


def _gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("precision", [None, "float32", "float16", "bfloat16"])
def test_cupy_arrays(precision):
    import cupy

    q, k, v, do = make(2, 13, 9, 4, 2, 16, seed=11)
    want = (*ref.forward(q, k, v, causal=True, precision=precision),
            *ref.backward(do, q, k, v, causal=True, precision=precision))
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    got = (*ref.forward(*dev[:3], causal=True, precision=precision),
           *ref.backward(dev[3], *dev[:3], causal=True, precision=precision))
    for g, w in zip(got, want):
        assert isinstance(g, cupy.ndarray) and g.dtype == cupy.float64
        # float32 GEMMs may sum in another order on the GPU: one storage ulp may differ.
        tol = 1e-12 if precision is None else 1e-2
        assert ref.max_abs_error(g, cupy.asarray(w)) < tol
