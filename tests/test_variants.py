"""Attention variants (issue 14, the Python stage): sliding window, softcap, ALiBi, dropout and
variable-length batches. The tiled NumPy backend against the reference, the reference against
finite differences, the Philox generator against Random123's known answers, and the public API's
checks. CPU only."""

import math
import pathlib
import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _checks, _mask, _philox, api
from cuflash import reference as ref
from cuflash.backends import numpy as nb

pytestmark = pytest.mark.filterwarnings("error")

NAMES = ("o", "lse", "dq", "dk", "dv")


def make(b, sq, sk, h, hk, d, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def slopes(shape, seed=0):
    return (np.random.default_rng(seed).uniform(0.05, 0.5, shape)).astype(np.float32)


def assert_close(got, want, rtol, names=NAMES):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        assert not np.isnan(np.asarray(g, dtype=np.float64)).any(), name
        finite = np.isfinite(w)
        scale = max(1.0, float(np.abs(w[finite]).max())) if finite.any() else 1.0
        err = ref.max_abs_error(np.asarray(g), w)
        assert err <= rtol * scale, f"{name}: max abs error {err:.3e} > {rtol * scale:.3e}"


def backend_run(q, k, v, do, causal=False, **kw):
    o, lse = nb.forward(q, k, v, causal=causal, **kw)
    return (o, lse, *nb.backward(do, q, k, v, o, lse, causal=causal, **kw))


def oracle(q, k, v, do, causal=False, precision=None, seed=0, offset=0, **kw):
    """The reference with the backend's keyword arguments: dropout's mask made from seed/offset."""
    p = kw.get("dropout_p", 0.0)
    if p:
        b, sq, h, _ = q.shape
        kw["dropout_mask"] = cuflash.dropout_mask(b, h, sq, k.shape[1], dropout_p=p, seed=seed, offset=offset)
    return (*ref.forward(q, k, v, causal=causal, precision=precision, **kw),
            *ref.backward(do, q, k, v, causal=causal, precision=precision, **kw))


# --- Philox4x32-10 and the dropout mask ------------------------------------------------------------

# Random123's tests/kat_vectors, the "philox4x32 10" lines: counter (4 words), key (2 words) -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    got = _philox.philox4x32(*counter, *key)
    assert [int(x) for x in got] == list(want)
    # vectorized: the same answer in every lane of a broadcast
    lanes = _philox.philox4x32(*(np.full(5, c, dtype=np.uint32) for c in counter), *key)
    assert all((w == x).all() for w, x in zip(want, lanes))


def test_dropout_mask_keep_fraction_and_spec():
    for p in (0.1, 0.5, 0.9):
        m = cuflash.dropout_mask(2, 3, 200, 300, dropout_p=p, seed=123456789012345, offset=7)
        assert m.shape == (2, 3, 200, 300) and m.dtype == bool
        assert abs(m.mean() - (1 - p)) < 0.01
    assert cuflash.dropout_mask(1, 1, 8, 8, dropout_p=0.0, seed=1).all()
    # element (b, h, row, col): counter (col // 16 * 4 + col % 8 // 2, row // 16 * 8 + row % 8, b * nheads + h,
    # offset), key (seed lo, seed hi), word 2 * (row % 16 // 8) + col % 16 // 8, 16-bit half col % 2
    seed, offset, p = 2**40 + 12345, 3, 0.37
    m = cuflash.dropout_mask(2, 3, 37, 41, dropout_p=p, seed=seed, offset=offset)
    thr = math.floor(p * 2**16)
    for b, h, r, c in [(0, 0, 0, 0), (1, 2, 36, 40), (1, 0, 3, 5), (0, 2, 2, 7), (0, 1, 17, 25), (1, 1, 30, 9)]:
        words = _philox.philox4x32(c // 16 * 4 + c % 8 // 2, r // 16 * 8 + r % 8, b * 3 + h, offset,
                                   seed & 0xFFFFFFFF, seed >> 32)
        word = int(words[2 * (r % 16 // 8) + c % 16 // 8])
        assert bool(m[b, h, r, c]) == (((word >> 16 * (c % 2)) & 0xFFFF) >= thr)
    # a tile anywhere gives the same bits as the whole mask
    bh = np.arange(6).reshape(2, 3)
    tile = _philox.keep(p, seed, offset, bh, np.arange(1, 20), np.arange(3, 35))
    assert (tile == m[:, :, 1:20, 3:35]).all()
    # another offset or seed, another mask
    assert (m != cuflash.dropout_mask(2, 3, 37, 41, dropout_p=p, seed=seed, offset=offset + 1)).any()


# --- the NumPy backend against the reference -----------------------------------------------------------

CASES = {
    "window": dict(window=(20, 7)),
    "window_left_only": dict(window=(15, -1)),
    "window_right_only": dict(window=(-1, 3)),
    "softcap": dict(softcap=0.8),
    "alibi_h": dict(alibi_slopes="h"),
    "alibi_bh": dict(alibi_slopes="bh"),
    "dropout": dict(dropout_p=0.3, seed=99, offset=2),
    "all_causal": dict(causal=True, window=(25, 4), softcap=1.5, alibi_slopes="bh", dropout_p=0.2, seed=5),
}


def _kw(case, b, h):
    kw = dict(CASES[case])
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = slopes((h,))
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = slopes((b, h))
    return kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sq,sk", [(77, 91), (100, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_variants(case, sq, sk, causal):
    q, k, v, do = make(2, sq, sk, 4, 2, 16, seed=sq + sk)
    kw = _kw(case, 2, 4)
    kw["causal"] = kw.get("causal", False) or causal
    got = backend_run(q, k, v, do, block_m=32, block_n=16, **kw)
    assert_close(got, oracle(q, k, v, do, **kw), 1e-12)


@pytest.mark.parametrize("case", ["window", "softcap", "all_causal"])
def test_float32_variants(case):
    q, k, v, do = make(2, 113, 150, 4, 2, 32, dtype=np.float32, seed=3)
    kw = _kw(case, 2, 4)
    got = backend_run(q, k, v, do, **kw)
    assert [x.dtype for x in got] == [np.float32] * 5
    want = oracle(q, k, v, do, **kw)
    assert_close(got[:2], want[:2], 2e-6, NAMES[:2])
    assert_close(got[2:], want[2:], 5e-6, NAMES[2:])


@pytest.mark.parametrize("dtype,atol", [(np.float16, 1e-4), (ml_dtypes.bfloat16, 1e-3)])
@pytest.mark.parametrize("case", ["window", "all_causal"])
def test_low_precision_variants(dtype, atol, case):
    q, k, v, do = make(2, 90, 120, 4, 2, 32, dtype=dtype, seed=11)
    kw = _kw(case, 2, 4)
    got = backend_run(q, k, v, do, **kw)
    ref64 = oracle(q, k, v, do, **kw)
    same = oracle(q, k, v, do, precision=np.dtype(dtype).name, **kw)
    for name, g, r, s in zip(NAMES, got, ref64, same):
        err, bound = ref.accuracy_bound(g, r, s, atol)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


def test_window_skips_tiles(monkeypatch):
    """Tiles wholly outside the window are never computed (not merely masked)."""
    q, k, v, do = make(1, 256, 256, 2, 2, 16, seed=4)
    seen = []
    real = _mask.block_needs_mask

    def spy(row0, row1, col0, col1, *a):
        seen.append((row0 // 32, col0 // 32))
        return real(row0, row1, col0, col1, *a)

    monkeypatch.setattr(_mask, "block_needs_mask", spy)
    nb.forward(q, k, v, window=(10, 10), block_m=32, block_n=32)
    assert seen and all(abs(m - n) <= 1 for m, n in seen)
    assert len(seen) == 8 * 3 - 2


def _proto_mask_rules() -> dict:
    """cuflash/proto/mask.py's rules as plain Python functions: its source run with cuda.jit as the
    identity (they are CUDA device functions, which Python calls only under the simulator)."""
    path = pathlib.Path(cuflash.__file__).parent / "proto" / "mask.py"
    src = path.read_text()
    assert "from numba import cuda\n" in src
    ns = {"cuda": types.SimpleNamespace(jit=lambda **_: (lambda f: f)), "__name__": "proto_mask_rules"}
    exec(compile(src.replace("from numba import cuda\n", ""), str(path), "exec"), ns)
    return ns


def test_block_ranges_agree():
    """Query block m is in m_block_range(n) exactly when key block n is in n_block_range(m) (mask.cuh's
    rules, through proto/mask.py). flash_bwd's deterministic mode relies on it: key block n waits until
    the key blocks n + 1 .. n_end - 1 of n_block_range(m) have added into dQ tile m, each of which must
    visit m (its m_block_range), and every key block that visits m must be counted."""
    rules = _proto_mask_rules()
    U = rules["UNBOUNDED"]
    gen = np.random.default_rng(14)
    blocks = (16, 32, 64, 128)
    bounds = (-1, -1, 0, 0, 1, 3, 17, 64, 200)  # -1: unbounded
    checked = 0
    for case in range(1500):
        sq, sk = (int(x) for x in gen.integers(1, 300, 2))
        if case % 3 == 0:
            sk = int(gen.integers(1, sq + 1))  # seqlen_q >= seqlen_k (causal rows that see no key)
        bm, bn = (int(x) for x in gen.choice(blocks, 2))
        kind = case % 4
        if kind == 0:
            left, right = -1, -1  # plain
        elif kind == 1:
            left, right = -1, 0  # causal
        else:
            left, right = (int(x) for x in gen.choice(bounds, 2))
        local = not _mask.is_plain(left, right)
        wl, wr = (U if left < 0 else left), (U if right < 0 else right)
        args = (local, wl, wr, sq, sk, bm, bn)
        n_ranges = [rules["n_block_range"](*args, m) for m in range(-(-sq // bm))]
        m_ranges = [rules["m_block_range"](*args, n) for n in range(-(-sk // bn))]
        for m, (n_lo, n_hi) in enumerate(n_ranges):
            for n, (m_lo, m_hi) in enumerate(m_ranges):
                assert (m_lo <= m < m_hi) == (n_lo <= n < n_hi), (
                    f"seqlen_q={sq} seqlen_k={sk} block_m={bm} block_n={bn} window=({left}, {right}): "
                    f"m_block_range({n}) = {(m_lo, m_hi)}, n_block_range({m}) = {(n_lo, n_hi)}")
                checked += 1
    assert checked > 10_000


def test_fully_masked_rows():
    # sq > sk with a right window of 0: rows whose i' < 0 - right... use a window that excludes every key
    q, k, v, do = make(2, 60, 20, 2, 1, 16, seed=5)
    kw = dict(window=(3, 0))  # i' = i - 40: rows 0..36 see no key (i' + 0 < 0)
    o, lse, dq, dk, dv = got = backend_run(q, k, v, do, **kw)
    for x in got:
        assert not np.isnan(x).any()
    assert np.all(o[:, :40] == 0) and np.all(lse[:, :, :40] == -np.inf) and np.all(dq[:, :40] == 0)
    assert np.isfinite(lse[:, :, 40:]).all()
    assert_close(got, oracle(q, k, v, do, **kw), 1e-12)
    # a window beyond the keys in every row
    o, lse, *_ = backend_run(q, k, v, do, causal=True, window=(0, 0), alibi_slopes=slopes((2,)), softcap=2.0)
    assert np.all(o[:, :40] == 0) and np.all(lse[:, :, :40] == -np.inf)


# --- the reference's gradients against finite differences ------------------------------------------------

FD_CASES = {
    "plain": {},
    "causal_window": dict(causal=True, window=(2, 5)),
    "window": dict(window=(1, 2)),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.1, 0.2, 0.05], np.float32)),
    "dropout": dict(dropout_p=0.4, seed=8),
    "all": dict(causal=True, window=(3, 0), softcap=1.1, alibi_slopes=np.array([[0.3, 0.1, 0.2, 0.05]], np.float32),
                dropout_p=0.25, seed=3),
}


def _fd_check(f, do, args, grads, eps=1e-6):
    """Central differences of sum(f(*args) * do) for every entry of every argument."""
    for arg, grad in zip(args, grads):
        num = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            old = arg[idx]
            arg[idx] = old + eps
            up = np.sum(f() * do)
            arg[idx] = old - eps
            down = np.sum(f() * do)
            arg[idx] = old
            num[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", list(FD_CASES))
def test_reference_gradients_finite_differences(case):
    q, k, v, do = make(1, 5, 7, 4, 2, 8, seed=21)
    kw = dict(FD_CASES[case])
    seed = kw.pop("seed", 0)
    if kw.get("dropout_p"):
        kw["dropout_mask"] = cuflash.dropout_mask(1, 4, 5, 7, dropout_p=kw["dropout_p"], seed=seed)
        assert not kw["dropout_mask"].all()
    grads = ref.backward(do, q, k, v, **kw)
    _fd_check(lambda: ref.forward(q, k, v, **kw)[0], do, (q, k, v), grads)


def test_reference_varlen_gradients_finite_differences():
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 3, 3, 7], np.int32), np.array([0, 4, 6, 9], np.int32)
    q, do = rng.standard_normal((7, 2, 8)), rng.standard_normal((7, 2, 8))
    k, v = rng.standard_normal((9, 1, 8)), rng.standard_normal((9, 1, 8))
    kw = dict(causal=True, softcap=0.9, alibi_slopes=slopes((3, 2)), dropout_p=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              dropout_mask=cuflash.dropout_mask(3, 2, 4, 4, dropout_p=0.3, seed=1))
    grads = ref.backward(do, q, k, v, **kw)
    _fd_check(lambda: ref.forward(q, k, v, **kw)[0], do, (q, k, v), grads)


# --- variable-length batches ---------------------------------------------------------------------------


def varlen_inputs(lens_q, lens_k, h=4, hk=2, d=16, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, do = (rng.standard_normal((cu_q[-1], h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], hk, d)).astype(dtype) for _ in range(2))
    return q, k, v, do, cu_q, cu_k


VARLEN_CASES = {
    "plain": {},
    "combined": dict(causal=True, window=(30, 5), softcap=1.3, alibi_slopes="bh"),
    "dropout_causal": dict(causal=True, dropout_p=0.25, seed=77, offset=1),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_equals_dense_per_sequence(case):
    lens_q, lens_k = [37, 0, 70, 5, 20], [50, 12, 64, 0, 20]
    q, k, v, do, cu_q, cu_k = varlen_inputs(lens_q, lens_k, seed=len(case))
    kw = dict(VARLEN_CASES[case])
    if kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = slopes((5, 4))
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 70, 64, backend="numpy", **kw)
    grads = cuflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 70, 64, backend="numpy", **kw)
    assert o.shape == q.shape and lse.shape == (4, q.shape[0])
    for i in range(5):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        kwi = dict(kw)
        if "alibi_slopes" in kw:
            kwi["alibi_slopes"] = kw["alibi_slopes"][i]
        if kw.get("dropout_p"):  # sequence i is dropout's batch index i: the dense call's batch 0 is not
            b = i + 1
            mask = cuflash.dropout_mask(b, 4, q1 - q0, k1 - k0, dropout_p=kw["dropout_p"], seed=kw["seed"],
                                        offset=kw["offset"])[i:i + 1]
            kwi = {n: x for n, x in kwi.items() if n not in ("seed", "offset")}
            kwi["dropout_mask"] = mask
            want_o, want_lse = ref.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwi)
            want_g = ref.backward(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwi)
        else:
            sub = [x[None, a:bb] for x, a, bb in ((q, q0, q1), (k, k0, k1), (v, k0, k1), (do, q0, q1))]
            dense = cuflash.flash_attn_forward(*sub[:3], backend="numpy", **kwi)
            want_o, want_lse = dense
            want_g = cuflash.flash_attn_backward(sub[3], *sub[:3], *dense, backend="numpy", **kwi)
        assert_close((o[q0:q1], lse[:, q0:q1], grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1]),
                     (want_o[0], want_lse[0], want_g[0][0], want_g[1][0], want_g[2][0]), 1e-12)
    # and the reference's own varlen path
    rkw = {n: x for n, x in kw.items() if n not in ("seed", "offset")}
    if kw.get("dropout_p"):
        rkw["dropout_mask"] = cuflash.dropout_mask(5, 4, 70, 64, dropout_p=kw["dropout_p"], seed=kw["seed"],
                                                   offset=kw["offset"])
    want = (*ref.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rkw),
            *ref.backward(do, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rkw))
    assert_close((o, lse, *grads), want, 1e-12)


def test_varlen_zero_length_sequences():
    q, k, v, do, cu_q, cu_k = varlen_inputs([0, 9, 0], [0, 0, 5], seed=3)
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 5, backend="numpy")
    dq, dk, dv = cuflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 9, 5, backend="numpy")
    assert np.all(o == 0) and np.all(lse == -np.inf) and np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)
    q, k, v, do, cu_q, cu_k = varlen_inputs([0, 0], [0, 0], seed=3)
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 0, 0, backend="numpy")
    assert o.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_varlen_float32_and_out():
    q, k, v, do, cu_q, cu_k = varlen_inputs([40, 17], [33, 60], dtype=np.float32, seed=4)
    out = np.full_like(q, np.nan)
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 40, 60, causal=True, backend="numpy", out=out)
    assert o is out and lse.dtype == np.float32
    want_o, want_lse = ref.forward(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_close((o, lse), (want_o, want_lse), 2e-6, NAMES[:2])
    assert np.allclose(cuflash.flash_attn_varlen(q, k, v, cu_q, cu_k, 40, 60, causal=True, backend="numpy"), o)


# --- the public API: checks, the plan cache, backends without the variants --------------------------------


def _qkv(b=1, sq=8, sk=8, h=2, hk=1, d=16, dtype=np.float32):
    return make(b, sq, sk, h, hk, d, dtype=dtype)[:3]


BAD = [
    (dict(window=5), TypeError, "window: expected a pair of ints"),
    (dict(window=(1.0, 2)), TypeError, "window: expected a pair of ints"),
    (dict(window=(1, 2, 3)), TypeError, "window: expected a pair of ints"),
    (dict(window=(True, 2)), TypeError, "window: expected a pair of ints"),
    (dict(window=(-2, 3)), ValueError, "window: each side must be >= -1"),
    (dict(softcap="1"), TypeError, "softcap: expected a real number"),
    (dict(softcap=-0.5), ValueError, r"softcap: expected 0 \(off\) or a finite positive number"),
    (dict(softcap=float("inf")), ValueError, r"softcap: expected 0 \(off\)"),
    (dict(softcap=10**400), ValueError, r"softcap: expected 0 \(off\) or a finite positive number"),
    (dict(softcap=1e300), ValueError, r"softcap: expected 0 \(off\) or a number within float32's normal range"),
    (dict(softcap=1e-46), ValueError, r"softcap: expected 0 \(off\) or a number within float32's normal range"),
    (dict(dropout_p=10**400), ValueError, r"dropout_p: expected a number in \[0, 1\)"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a number in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p: expected a number in"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p: expected a real number"),
    (dict(dropout_p=0.1, seed=-1), ValueError, r"seed: expected 0 <= seed < 2\*\*64"),
    (dict(dropout_p=0.1, seed=2**64), ValueError, "seed: expected 0 <= seed"),
    (dict(dropout_p=0.1, seed=1.0), TypeError, "seed: expected an int"),
    (dict(offset=-3), ValueError, "offset: expected 0 <= offset"),
    (dict(offset="3"), TypeError, "offset: expected an int"),
    (dict(alibi_slopes=[0.1, 0.2]), TypeError, "alibi_slopes: expected a NumPy or CuPy array"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes: dtype must be float32"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes: expected shape \(2,\) or \(1, 2\)"),
    (dict(alibi_slopes=np.ones((2, 2), np.float32)), ValueError, "alibi_slopes: expected shape"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD)
def test_bad_variant_arguments(kw, exc, msg):
    q, k, v = _qkv()
    with pytest.raises(exc, match=msg):
        cuflash.flash_attn(q, k, v, backend="numpy", **kw)
    o, lse = cuflash.flash_attn_forward(q, k, v, backend="numpy")
    with pytest.raises(exc, match=msg):
        cuflash.flash_attn_backward(q, q, k, v, o, lse, backend="numpy", **kw)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(exc, match=msg):
        cuflash.flash_attn_varlen(q[0], k[0], v[0], cu, cu, 8, 8, backend="numpy", **kw)


BAD_CU = [
    (np.array([0, 8], np.int64), None, TypeError, "cu_seqlens_q: dtype must be int32"),
    ([0, 8], None, TypeError, "cu_seqlens_q: expected a NumPy or CuPy array"),
    (np.array([[0, 8]], np.int32), None, ValueError, "cu_seqlens_q: expected a 1-D array"),
    (np.array([1, 8], np.int32), None, ValueError, "cu_seqlens_q: must start at 0"),
    (np.array([0, 6, 4, 8], np.int32), np.array([0, 2, 4, 8], np.int32), ValueError, "cu_seqlens_q: must not decrease"),
    (np.array([0, 7], np.int32), None, ValueError, r"cu_seqlens_q: the last value must equal q's length \(total tokens 8\)"),
    (None, np.array([0, 4, 8], np.int32), ValueError, r"cu_seqlens_k: expected length 2"),
    (None, np.array([0, 9], np.int32), ValueError, "cu_seqlens_k: the last value must equal k's length"),
]


@pytest.mark.parametrize("cu_q,cu_k,exc,msg", BAD_CU)
def test_bad_cu_seqlens(cu_q, cu_k, exc, msg):
    q, k, v = (x[0] for x in _qkv())
    good = np.array([0, 8], np.int32)
    cu_q = good if cu_q is None else cu_q
    cu_k = good if cu_k is None else cu_k
    with pytest.raises(exc, match=msg):
        cuflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 8, 8, backend="numpy")


@pytest.mark.parametrize("kind", ["jax", "torch"])
def test_varlen_host_cu_seqlens_of_any_kind_are_checked(kind):
    """cu_seqlens on the host are checked whatever array holds them (a JAX CPU array or a torch CPU tensor as a
    NumPy array), and a valid one gives the NumPy one's result."""
    host = pytest.importorskip(kind)
    as_kind = host.numpy.asarray if kind == "jax" else host.from_numpy
    q, k, v = (x[0] for x in _qkv())
    good = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: must not decrease"):
        cuflash.flash_attn_varlen_forward(q, k, v, as_kind(np.array([0, 5, 4, 8], np.int32)),
                                          as_kind(np.array([0, 2, 4, 8], np.int32)), 8, 8, backend="numpy")
    with pytest.raises(ValueError, match="cu_seqlens_k: the last value must equal k's length"):
        cuflash.flash_attn_varlen_forward(q, k, v, good, as_kind(np.array([0, 60], np.int32)), 8, 8,
                                          backend="numpy")
    with pytest.raises(ValueError, match="max_seqlen_q: must be >= the longest sequence"):
        cuflash.flash_attn_varlen_forward(q, k, v, as_kind(good), good, 1, 8, backend="numpy")
    o = cuflash.flash_attn_varlen(q, k, v, as_kind(good), as_kind(good), 8, 8, backend="numpy")
    np.testing.assert_array_equal(o, cuflash.flash_attn_varlen(q, k, v, good, good, 8, 8, backend="numpy"))


def test_varlen_outputs_must_not_share_memory_with_cu_seqlens():
    """dq= / out= over the same bytes as cu_seqlens would overwrite the lengths while they are read."""
    q, k, v = (x[0] for x in _qkv())
    buf = np.zeros(q.size, q.dtype)
    cu = buf[:2].view(np.int32)[:2]
    cu[:] = [0, 8]
    good = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="out: must not share memory with cu_seqlens_q"):
        cuflash.flash_attn_varlen_forward(q, k, v, cu, good, 8, 8, backend="numpy", out=buf.reshape(q.shape))
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, good, good, 8, 8, backend="numpy")
    with pytest.raises(ValueError, match="dq: must not share memory with cu_seqlens_k"):
        cuflash.flash_attn_varlen_backward(o, q, k, v, o, lse, good, cu, 8, 8, backend="numpy",
                                           dq=buf.reshape(q.shape))
    assert list(cu) == [0, 8]


@pytest.mark.parametrize("window,plain", [((-1, 2**63 - 1), (-1, -1)), ((2**63, 0), (-1, 0)),
                                          ((np.uint64(2**64 - 1), 2**30), (-1, -1)), ((3, 2**30 - 1), (3, 2**30 - 1))])
def test_window_sides_past_unbounded_are_unbounded(window, plain):
    """A side of 2**30 keys or more is -1: it reaches past any sequence (its arithmetic wrapped int64 before)."""
    assert _checks.check_window(window) == plain
    q, k, v = _qkv(sq=5, sk=9)
    want = cuflash.flash_attn(q, k, v, backend="numpy", window=plain)
    np.testing.assert_array_equal(cuflash.flash_attn(q, k, v, backend="numpy", window=window), want)
    assert not np.all(want == 0)


def test_bad_varlen_other_arguments():
    q, k, v = (x[0] for x in _qkv())
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="max_seqlen_q: must be >= the longest sequence"):
        cuflash.flash_attn_varlen_forward(q, k, v, cu, cu, 7, 8, backend="numpy")
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int"):
        cuflash.flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8.0, backend="numpy")
    with pytest.raises(ValueError, match="q: expected a 3-D packed array"):
        cuflash.flash_attn_varlen_forward(q[None], k, v, cu, cu, 8, 8, backend="numpy")
    with pytest.raises(TypeError, match="check_inputs: expected a bool"):
        cuflash.flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, backend="numpy", check_inputs=1)
    o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, backend="numpy")
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 8\) \(nheads, total_q\)"):
        cuflash.flash_attn_varlen_backward(q, q, k, v, o, lse.T.copy(), cu, cu, 8, 8, backend="numpy")
    with pytest.raises(ValueError, match="seqlen_q: expected an int >= 0"):
        cuflash.dropout_mask(1, 1, -1, 3, dropout_p=0.1, seed=0)
    with pytest.raises(ValueError, match="dropout_p: expected a number in"):
        cuflash.dropout_mask(1, 1, 1, 3, dropout_p=1.5, seed=0)


def re_escape(s):
    import re

    return re.escape(s)


def test_window_that_is_only_causal_is_plain():
    """causal with window (-1, 0) or (-1, 5) is plain causal attention: the plain kernel runs (no variant bit)."""
    _, what = api._variants(True, (-1, 5), 0.0, None, 0.0, 0, 0, 1, 2)
    assert what == []
    _, what = api._variants(False, (-1, 5), 0.0, None, 0.0, 0, 0, 1, 2)
    assert what == ["window"]


def test_plan_cache_skips_alibi_and_dropout(monkeypatch):
    """A call with ALiBi or a dropout argument away from its default object never computes a plan key; plain
    calls and calls with a window or a softcap do (the key holds their values)."""
    calls = []
    monkeypatch.setattr(api._plan, "forward_key", lambda *a: calls.append(("f", a[6:8])))
    monkeypatch.setattr(api._plan, "backward_key", lambda *a: calls.append(("b", a[11:13])))
    q, k, v = _qkv()
    for kw in (dict(dropout_p=0.2, seed=4), dict(dropout_p=0.0), dict(seed=3), dict(offset=1),
               dict(alibi_slopes=np.ones(2, np.float32)), dict(alibi_slopes=np.ones(2, np.float32), window=(2, 2))):
        o, lse = cuflash.flash_attn_forward(q, k, v, backend="numpy", **kw)
        cuflash.flash_attn_backward(q, q, k, v, o, lse, backend="numpy", **kw)
    assert calls == []
    for kw in ({}, dict(window=(2, 2)), dict(softcap=1.5)):
        o, lse = cuflash.flash_attn_forward(q, k, v, backend="numpy", **kw)
        cuflash.flash_attn_backward(q, q, k, v, o, lse, backend="numpy", **kw)
    assert calls == [("f", ((-1, -1), 0.0)), ("b", ((-1, -1), 0.0)), ("f", ((2, 2), 0.0)), ("b", ((2, 2), 0.0)),
                     ("f", ((-1, -1), 1.5)), ("b", ((-1, -1), 1.5))]


def test_api_variants_match_backend():
    q, k, v, do = make(2, 50, 70, 4, 2, 16, seed=9)
    kw = dict(causal=True, window=(20, 3), softcap=1.2, alibi_slopes=slopes((2, 4)), dropout_p=0.2, seed=3, offset=5)
    o, lse = cuflash.flash_attn_forward(q, k, v, backend="numpy", **kw)
    grads = cuflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy", **kw)
    assert_close((o, lse, *grads), oracle(q, k, v, do, **kw), 1e-12)
    # bhsd layout through the same keywords
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    o2 = cuflash.flash_attn(t(q), t(k), t(v), layout="bhsd", backend="numpy", **kw)
    assert np.allclose(o2.transpose(0, 2, 1, 3), o, rtol=0, atol=1e-13)
