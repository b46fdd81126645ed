"""The tiled NumPy backend (the kernels' algorithm on the CPU) against the materialized reference."""

import math
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import reference as ref
from cuflash.backends import numpy as nb

# No RuntimeWarning anywhere (exp2 of inf, log(0), 0/0 on rows without keys would show up here).
pytestmark = pytest.mark.filterwarnings("error")


def make(b, sq, sk, h, hk, d, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def run(q, k, v, do, causal, scale=None, **blocks):
    o, lse = nb.forward(q, k, v, causal=causal, softmax_scale=scale, **blocks)
    grads = nb.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, **blocks)
    return (o, lse, *grads)


def oracle(q, k, v, do, causal, scale=None, precision=None):
    return (*ref.forward(q, k, v, causal=causal, softmax_scale=scale, precision=precision),
            *ref.backward(do, q, k, v, causal=causal, softmax_scale=scale, precision=precision))


NAMES = ("o", "lse", "dq", "dk", "dv")


def assert_close(got, want, rtol):
    for name, g, w in zip(NAMES, got, want):
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name
        finite = np.isfinite(w)
        scale = max(1.0, float(np.abs(w[finite]).max())) if finite.any() else 1.0
        err = ref.max_abs_error(g, w)
        assert err <= rtol * scale, f"{name}: max abs error {err:.3e} > {rtol * scale:.3e}"


# --- float64: the same function as the reference, to rounding ----------------------------------------

RAGGED = [(1, 1), (1, 239), (113, 203), (127, 64), (65, 33), (200, 100), (64, 64), (128, 128), (33, 65)]
BLOCKS = [{}, {"block_m": 32, "block_n": 16}, {"block_m": 16, "block_n": 48}]


@pytest.mark.parametrize("sq,sk", RAGGED)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", BLOCKS, ids=["64x64", "32x16", "16x48"])
def test_float64_ragged(sq, sk, causal, blocks):
    q, k, v, do = make(2, sq, sk, 4, 2, 40, seed=sq * 1000 + sk)
    assert_close(run(q, k, v, do, causal, **blocks), oracle(q, k, v, do, causal), 1e-12)


@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("d", [8, 40, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_heads(h, hk, d, causal):
    q, k, v, do = make(2, 77, 91, h, hk, d, seed=d + 10 * hk)
    assert_close(run(q, k, v, do, causal, block_m=32, block_n=32), oracle(q, k, v, do, causal), 1e-12)


def test_float64_softmax_scale():
    q, k, v, do = make(1, 50, 70, 2, 1, 16, seed=4)
    assert_close(run(q, k, v, do, True, scale=0.05), oracle(q, k, v, do, True, scale=0.05), 1e-12)
    assert_close(run(q, k, v, do, False, scale=1.7), oracle(q, k, v, do, False, scale=1.7), 1e-12)


# --- float32 and the tensor-core dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("sq,sk,causal", [(113, 203, True), (200, 100, True), (256, 256, False), (1, 239, False)])
def test_float32(sq, sk, causal):
    q, k, v, do = make(2, sq, sk, 4, 2, 64, dtype=np.float32, seed=sq + sk)
    got = run(q, k, v, do, causal)
    assert [x.dtype for x in got] == [np.float32] * 5
    want = oracle(q, k, v, do, causal)  # float64 on the same (float32) inputs
    assert_close(got[:2], want[:2], 2e-6)
    assert_close(got[2:], want[2:], 5e-6)


@pytest.mark.parametrize("dtype,atol", [(np.float16, 1e-4), (ml_dtypes.bfloat16, 1e-3)])
@pytest.mark.parametrize("sq,sk,causal", [(113, 203, True), (200, 100, True), (128, 128, False), (1, 1, True)])
def test_low_precision_accuracy_rule(dtype, atol, sq, sk, causal):
    q, k, v, do = make(2, sq, sk, 4, 2, 64, dtype=dtype, seed=sq + 3 * sk)
    got = run(q, k, v, do, causal)
    assert [x.dtype for x in got] == [dtype, np.float32, dtype, dtype, dtype]
    ref64 = oracle(q, k, v, do, causal)
    same = oracle(q, k, v, do, causal, precision=np.dtype(dtype).name)
    for name, g, r, s in zip(NAMES, got, ref64, same):
        err, bound = ref.accuracy_bound(g, r, s, atol)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


# --- rows without keys, empty sequences ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_rows_without_key(dtype):
    # causal with seqlen_q > seqlen_k: the first 70 rows see no key, spanning two 64-row blocks
    q, k, v, do = make(2, 100, 30, 4, 2, 32, dtype=dtype, seed=1)
    o, lse, dq, dk, dv = got = run(q, k, v, do, True)
    for x in got:
        assert not np.isnan(x.astype(np.float64)).any()
    assert np.all(o[:, :70].astype(np.float64) == 0) and np.all(dq[:, :70].astype(np.float64) == 0)
    assert np.all(lse[:, :, :70] == -np.inf) and np.isfinite(lse[:, :, 70:]).all()
    if dtype == np.float64:
        assert_close(got, oracle(q, k, v, do, True), 1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16])
def test_empty_sequences(causal, dtype):
    q, k, v, do = make(2, 9, 0, 4, 2, 16, dtype=dtype, seed=2)
    o, lse, dq, dk, dv = run(q, k, v, do, causal)
    assert o.shape == q.shape and np.all(o.astype(np.float64) == 0) and np.all(lse == -np.inf)
    assert dq.shape == q.shape and np.all(dq.astype(np.float64) == 0)
    assert dk.shape == dv.shape == (2, 0, 2, 16)
    q, k, v, do = make(2, 0, 9, 4, 2, 16, dtype=dtype, seed=2)
    o, lse, dq, dk, dv = run(q, k, v, do, causal)
    assert o.shape == dq.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    assert np.all(dk.astype(np.float64) == 0) and np.all(dv.astype(np.float64) == 0)


# --- layout, outputs, determinism ---------------------------------------------------------------------


def test_non_contiguous_inputs():
    rng = np.random.default_rng(6)
    # bhsd storage seen as bshd, and a strided sequence axis
    q, do = (rng.standard_normal((2, 4, 70, 32)).transpose(0, 2, 1, 3) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 90, 32)).transpose(0, 2, 1, 3)[:, ::2] for _ in range(2))
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    got = run(q, k, v, do, True)
    want = run(*(np.ascontiguousarray(x) for x in (q, k, v, do)), True)
    for g, w in zip(got, want):
        assert g.flags.c_contiguous and np.array_equal(g, w)


def test_outputs_and_determinism():
    q, k, v, do = make(2, 70, 50, 4, 1, 24, dtype=np.float32, seed=8)
    first = run(q, k, v, do, True)
    o, lse, dq, dk, dv = first
    assert o.shape == dq.shape == q.shape and dk.shape == dv.shape == k.shape and lse.shape == (2, 4, 70)
    assert all(x.flags.c_contiguous for x in first)
    for a, b in zip(first, run(q, k, v, do, True)):
        assert np.array_equal(a, b)
    # The deterministic flag is accepted (the algorithm is always deterministic: dQ's shares are added
    # in key-block order), and so is the on-device backends' workspace, unused here.
    for kw in ({"deterministic": True}, {"workspace": np.zeros(64, dtype=np.uint8)}):
        for a, b in zip(nb.backward(do, q, k, v, o, lse, causal=True, **kw), (dq, dk, dv)):
            assert np.array_equal(a, b)


def test_available():
    assert nb.available() == (True, "")


# --- the block bookkeeping of kernels_cu/mask.cuh, against brute force --------------------------------


@settings(max_examples=200, deadline=None)
@given(sq=st.integers(1, 150), sk=st.integers(1, 150), causal=st.booleans(),
       block_m=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32, 64]))
def test_block_ranges(sq, sk, causal, block_m, block_n):
    """cuflash/_mask.py's block rules (which the backend's _Variants use) with causal folded in."""
    from cuflash import _mask

    lr = _mask.effective_window(causal)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    visible = (j <= i + sk - sq) if causal else np.ones((sq, sk), bool)
    for m_block in range(math.ceil(sq / block_m)):
        rows = visible[m_block * block_m:(m_block + 1) * block_m]
        cols = np.nonzero(rows.any(axis=0))[0]
        want = cols.max() // block_n + 1 if cols.size else 0  # last key block with a visible pair
        assert _mask.n_block_range(m_block, block_m, block_n, sq, sk, *lr)[1] == want
        for n_block in range(math.ceil(sk / block_n)):
            tile = rows[:, n_block * block_n:(n_block + 1) * block_n]
            full = tile.shape[1] == block_n and tile.all()
            m0, m1 = m_block * block_m, min((m_block + 1) * block_m, sq)
            if not _mask.block_needs_mask(m0, m1, n_block * block_n, (n_block + 1) * block_n, sq, sk, *lr):
                assert full  # skipping the mask is only allowed on a wholly visible tile
    for n_block in range(math.ceil(sk / block_n)):
        keys = visible[:, n_block * block_n:(n_block + 1) * block_n]
        first_row = np.nonzero(keys.any(axis=1))[0].min()  # every key sees some row (the last)
        assert _mask.m_block_range(n_block, block_m, block_n, sq, sk, *lr)[0] == first_row // block_m


# --- property test over random small shapes -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(0, 80), sk=st.integers(0, 80), hk=st.integers(1, 2),
       group=st.integers(1, 3), d=st.sampled_from([8, 16, 24]), causal=st.booleans(),
       block_m=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**32 - 1))
def test_property_float64(b, sq, sk, hk, group, d, causal, block_m, block_n, seed):
    q, k, v, do = make(b, sq, sk, hk * group, hk, d, seed=seed)
    got = run(q, k, v, do, causal, block_m=block_m, block_n=block_n)
    assert_close(got, oracle(q, k, v, do, causal), 1e-12)


# --- the step comments mirror the kernels' --------------------------------------------------------------

def test_step_comments():
    """Every step of the contract (tests/test_step_lists.py), forward then backward, none skipped."""
    from test_step_lists import BWD_STEPS, FWD_STEPS

    text = pathlib.Path(nb.__file__).read_text()
    steps = [(int(n), t) for n, t in re.findall(r"^\s*# \[(\d+)\] (.*)$", text, flags=re.M)]
    assert steps == FWD_STEPS + BWD_STEPS
