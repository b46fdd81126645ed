"""cuflash.merge_states: attention over disjoint key sets, merged by LSE, equals attention over all."""

import numpy as np
import pytest

import cuflash
from cuflash import merge_states, merge_states_list

TOL = {"float64": 1e-12, "float32": 2e-6}


def _inputs(rng, dtype, b=2, sq=37, sk=53, h=4, hk=2, d=16):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return q, k, v


def _fwd(q, k, v, causal=False):
    return cuflash.flash_attn_forward(q, k, v, causal=causal, backend="numpy")


def _assert_close(o, lse, o_ref, lse_ref, dtype):
    tol = TOL[dtype]
    assert o.dtype == o_ref.dtype and lse.dtype == lse_ref.dtype
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, atol=tol, rtol=0)
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all()
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("cuts", [[20], [10, 30], [1, 52]])
def test_split_keys_non_causal(dtype, cuts):
    rng = np.random.default_rng(len(cuts) * 7 + cuts[0])
    q, k, v = _inputs(rng, dtype)
    o_ref, lse_ref = _fwd(q, k, v)
    bounds = [0, *cuts, k.shape[1]]
    parts = [_fwd(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    if len(parts) == 2:
        o, lse = merge_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    else:
        o, lse = merge_states_list([p[0] for p in parts], [p[1] for p in parts])
    _assert_close(o, lse, o_ref, lse_ref, dtype)
    # stacked arrays and a different order give the same result
    o2, lse2 = merge_states_list(np.stack([p[0] for p in parts[::-1]]), np.stack([p[1] for p in parts[::-1]]))
    _assert_close(o2, lse2, o_ref, lse_ref, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sq,sk,cuts", [(40, 40, [13]), (40, 40, [7, 25]), (50, 30, [10, 20]), (20, 45, [30])])
def test_split_keys_causal(dtype, sq, sk, cuts):
    """Causal, bottom-right: a query row i sees key j <= i + sk - sq. Each part attends its keys with
    the mask of their global positions; rows that see nothing of a part give lse = -inf there."""
    rng = np.random.default_rng(sq + sk + len(cuts))
    q, k, v = _inputs(rng, dtype, sq=sq, sk=sk)
    o_ref, lse_ref = _fwd(q, k, v, causal=True)
    bounds = [0, *cuts, sk]
    os, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        # row i sees keys [a, min(b, i + sk - sq + 1)) of this part: attend them row by row
        o = np.zeros_like(q)
        lse = np.full((q.shape[0], q.shape[2], sq), -np.inf, dtype=lse_ref.dtype)
        for i in range(sq):
            hi = min(b, i + sk - sq + 1)
            if hi <= a:
                continue
            oi, li = _fwd(q[:, i:i + 1], k[:, a:hi], v[:, a:hi])
            o[:, i:i + 1], lse[:, :, i:i + 1] = oi, li
        os.append(o)
        lses.append(lse)
    assert any(np.isneginf(l).any() for l in lses)  # some rows see nothing in some part
    o, lse = merge_states_list(os, lses)
    _assert_close(o, lse, o_ref, lse_ref, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_causal_diagonal_blocks(dtype):
    """The ring's pattern: keys cut into chunks; a query chunk attends earlier chunks fully and its own
    chunk causally (sq == sk per chunk), later chunks not at all."""
    rng = np.random.default_rng(3)
    c, n = 16, 4
    q, k, v = _inputs(rng, dtype, sq=c * n, sk=c * n)
    o_ref, lse_ref = _fwd(q, k, v, causal=True)
    for qi in range(n):
        qs = slice(qi * c, (qi + 1) * c)
        parts = [_fwd(q[:, qs], k[:, ki * c:(ki + 1) * c], v[:, ki * c:(ki + 1) * c], causal=ki == qi)
                 for ki in range(qi + 1)]
        o, lse = merge_states_list([p[0] for p in parts], [p[1] for p in parts])
        _assert_close(o, lse, o_ref[:, qs], lse_ref[:, :, qs], dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_neg_inf(dtype):
    from cuflash.config import numpy_dtype

    dt = numpy_dtype(dtype)
    ldt = np.float64 if dtype == "float64" else np.float32
    rng = np.random.default_rng(0)
    b, s, h, d = 1, 3, 2, 4
    o_a = rng.standard_normal((b, s, h, d)).astype(dt)
    lse_a = rng.standard_normal((b, h, s)).astype(ldt)
    o_b = np.full((b, s, h, d), np.nan, dtype=dt)  # an empty side's o is ignored, even NaN
    lse_b = np.full((b, h, s), -np.inf, dtype=ldt)
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dt and lse.dtype == ldt
    np.testing.assert_array_equal(o.astype(np.float64), o_a.astype(np.float64))
    np.testing.assert_array_equal(lse, lse_a)
    o, lse = merge_states(o_b, lse_b, o_a, lse_a)
    np.testing.assert_array_equal(o.astype(np.float64), o_a.astype(np.float64))
    # both empty: o = 0, lse = -inf, no NaN
    o, lse = merge_states(o_b, lse_b, np.zeros_like(o_a), lse_b.copy())
    assert (o.astype(np.float64) == 0).all() and np.isneginf(lse).all()
    # a mix per row: row 0 empty in both, row 1 empty in b only
    lse_a2 = lse_a.copy()
    lse_a2[:, :, 0] = -np.inf
    o_a2 = o_a.copy()
    o_a2[:, 0] = 0
    o, lse = merge_states(o_a2, lse_a2, o_b, lse_b)
    assert not np.isnan(o.astype(np.float64)).any()
    assert (o[:, 0].astype(np.float64) == 0).all() and np.isneginf(lse[:, :, 0]).all()
    np.testing.assert_array_equal(o[:, 1:].astype(np.float64), o_a[:, 1:].astype(np.float64))


def test_equal_lse_halves():
    o_a = np.ones((1, 2, 1, 2))
    o_b = 3 * np.ones((1, 2, 1, 2))
    l = np.zeros((1, 1, 2))
    o, lse = merge_states(o_a, l, o_b, l)
    np.testing.assert_allclose(o, 2.0)
    np.testing.assert_allclose(lse, np.log(2.0))


def test_16bit_accumulates_in_float32():
    from cuflash.config import numpy_dtype

    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, "float32")
    o_ref, lse_ref = _fwd(q, k, v)
    parts = [_fwd(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 20), (20, 53))]
    for name in ("float16", "bfloat16"):
        dt = numpy_dtype(name)
        o, lse = merge_states_list([p[0].astype(dt) for p in parts], [p[1] for p in parts])
        assert o.dtype == dt and lse.dtype == np.float32
        tol = 2e-3 if name == "float16" else 1.6e-2
        np.testing.assert_allclose(o.astype(np.float32), o_ref, atol=tol * 2)
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad,want_lse", [(np.nan, np.nan), (np.inf, np.inf)])
def test_nan_or_inf_lse_is_carried(bad, want_lse):
    """A part whose lse is NaN or +inf (it met NaN, or overflowed) makes the row NaN, never a finite o under a
    lse that says no key was seen (what the weights' `> 0` test gave before)."""
    o = np.ones((1, 2, 1, 2), np.float32)
    lse_a = np.array([[[bad, 1.0]]], np.float32)
    lse_b = np.full((1, 1, 2), 5.0, np.float32)
    for merge in (lambda: merge_states(o, lse_a, 2 * o, lse_b), lambda: merge_states_list([2 * o, o], [lse_b, lse_a])):
        got, lse = merge()
        np.testing.assert_array_equal(lse[0, 0, 0], np.float32(want_lse))
        assert np.isnan(got[0, 0]).all()
        assert np.isfinite(got[0, 1]).all() and np.isfinite(lse[0, 0, 1])  # the other row as before
    empty = np.full((1, 1, 2), -np.inf, np.float32)
    got, lse = merge_states(o, empty, 2 * o, empty)
    assert np.all(got == 0) and np.all(np.isneginf(lse))


def test_errors():
    o = np.zeros((1, 2, 3, 4), np.float32)
    l = np.zeros((1, 3, 2), np.float32)
    with pytest.raises(TypeError):
        merge_states(o, l, o.astype(np.float64), l)
    with pytest.raises(TypeError):
        merge_states(o, l.astype(np.float64), o, l)
    with pytest.raises(TypeError):
        merge_states(o.astype(np.int32), l, o.astype(np.int32), l)
    with pytest.raises(TypeError):
        merge_states([[1.0]], l, o, l)
    with pytest.raises(ValueError):
        merge_states(o, l, np.zeros((1, 3, 3, 4), np.float32), l)
    with pytest.raises(ValueError):
        merge_states(o, l, o, np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError):
        merge_states(o[0], l, o[0], l)
    with pytest.raises(ValueError):
        merge_states_list([], [])
    with pytest.raises(ValueError):
        merge_states_list([o, o], [l])
    with pytest.raises(TypeError, match="merge: os must be a sequence of arrays or one stacked array, got NoneType"):
        merge_states_list(None, None)


def test_exported():
    assert "merge_states" in cuflash.__all__ and cuflash.merge_states is merge_states
