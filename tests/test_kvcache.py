"""flash_attn_with_kvcache on the CPU: the NumPy backend always, the Numba prototypes under the CUDA
simulator, against the float64 reference over each entry's logical keys (the cache's first
cache_seqlens[b] rows followed by the appended k, v, gathered through the page table when paged).

The simulator runs in ONE subprocess started with NUMBA_ENABLE_CUDASIM=1 (this file run as a script,
`--sim-worker OUT.npz`), as in tests/test_proto.py. Shared with tests/test_gpu_kvcache.py: make_cache
and kv_reference (NumPy or CuPy arrays alike).
"""

from __future__ import annotations

import math
import sys
import traceback

import numpy as np
import pytest
from conftest import pin_to_one_core, simulator_results


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def make_cache(rng, b, sq, h, hk, d, capacity, seqlen_new, cache_seqlens, page_size=None, dtype=np.float64):
    """Inputs of one call, NumPy: q, the dense caches (every row random: rows past an entry's keys must
    be ignored), k, v to append (None when seqlen_new is 0), the logical caches (the dense ones with
    k, v written at cache_seqlens), and with page_size the page pools (3 spare random pages) and
    block_table (pages in random order) holding the same dense caches."""
    lens = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (b,))
    draw = lambda *s: rng.standard_normal(s).astype(dtype)
    c = dict(q=draw(b, sq, h, d), k_cache=draw(b, capacity, hk, d), v_cache=draw(b, capacity, hk, d),
             k=draw(b, seqlen_new, hk, d) if seqlen_new else None, v=draw(b, seqlen_new, hk, d) if seqlen_new else None)
    c["k_logical"], c["v_logical"] = c["k_cache"].copy(), c["v_cache"].copy()
    for i, n in enumerate(lens):
        if seqlen_new:
            c["k_logical"][i, n:n + seqlen_new], c["v_logical"][i, n:n + seqlen_new] = c["k"][i], c["v"][i]
    c["counts"] = (lens + seqlen_new).astype(np.int32)
    if page_size:
        max_pages = capacity // page_size
        num_pages = b * max_pages + 3
        table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
        for name in ("k_cache", "v_cache"):
            pool = draw(num_pages, page_size, hk, d)
            pool[table] = c[name].reshape(b, max_pages, page_size, hk, d)
            c[name + "_paged"] = pool
        c["block_table"] = table
    return c


def kv_reference(q, k_logical, v_logical, counts, precision=None, **variants):
    """(o, lse) of cuflash.reference, float64: entry b over its first counts[b] logical keys (a varlen
    batch, so that causal is bottom-right per entry)."""
    from cuflash import reference as ref

    xp = _xp(q)
    b, sq, h, d = q.shape
    counts = [int(n) for n in (counts.get() if hasattr(counts, "get") else np.asarray(counts))]
    cu_q = np.arange(b + 1, dtype=np.int32) * sq
    cu_k = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    kp, vp = (xp.concatenate([x[i, :n] for i, n in enumerate(counts)]) for x in (k_logical, v_logical))
    o, lse = ref.forward(q.reshape(b * sq, h, d), kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, precision=precision,
                         **variants)
    return o.reshape(b, sq, h, d), lse.reshape(h, b, sq).transpose(1, 0, 2)


def assert_matches(o, lse, want_o, want_lse, tol):
    """o, lse against the reference: no NaN, -inf exactly where no key is seen (there o = 0)."""
    o64, lse64 = np.asarray(o, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    assert not np.isnan(o64).any() and not np.isnan(lse64).any()
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(lse64), empty)
    assert not o64[empty.transpose(0, 2, 1)].any()
    scale = max(1.0, float(np.abs(want_o).max())) if want_o.size else 1.0
    assert np.abs(o64 - want_o).max(initial=0) <= tol * scale
    assert np.abs(lse64[~empty] - want_lse[~empty]).max(initial=0) <= tol * max(1.0, np.abs(want_lse[~empty]).max(initial=0))


def slopes(shape, seed=0):
    return np.random.default_rng(seed).uniform(0.05, 0.5, shape).astype(np.float32)


# --- the NumPy backend ----------------------------------------------------------------------------------

import cuflash  # noqa: E402

# (batch, seqlen_q, nheads, nheads_k, capacity, seqlen_new, cache_seqlens)
SHAPES = [
    (3, 1, 8, 2, 128, 1, [17, 0, 127]),  # decoding, one entry with an empty cache
    (3, 1, 8, 2, 128, 0, [17, 0, 128]),  # no append: an entry with no key at all
    (2, 3, 8, 2, 128, 3, [70, 0]),  # speculative decoding
    (2, 64, 4, 2, 192, 64, [0, 100]),  # chunked prefill
    (2, 3, 4, 4, 64, 2, 30),  # cache_seqlens an int
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}-sq{s[1]}-h{s[2]}:{s[3]}-new{s[5]}")
def test_numpy_backend_matches_reference(shape, causal):
    b, sq, h, hk, cap, new, lens = shape
    c = make_cache(np.random.default_rng(sq + new), b, sq, h, hk, 32, cap, new, lens, page_size=16)
    cs = lens if isinstance(lens, int) else np.array(lens, dtype=np.int32)
    o, lse = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                             causal=causal, return_lse=True, backend="numpy")
    assert_matches(o, lse, *kv_reference(c["q"], c["k_logical"], c["v_logical"], c["counts"], causal=causal), 1e-12)
    assert isinstance(lens, int) or np.array_equal(cs, lens)  # cache_seqlens itself is not advanced
    # the append, in place: the dense caches are now the logical ones, bit for bit
    assert np.array_equal(c["k_cache"], c["k_logical"]) and np.array_equal(c["v_cache"], c["v_logical"])
    # paged: the same answer, bitwise; the pages hold the appended rows, the spare pages are untouched
    kp, vp = c["k_cache_paged"], c["v_cache_paged"]
    spare = np.setdiff1d(np.arange(kp.shape[0]), c["block_table"])
    before = kp[spare].copy()
    o2, lse2 = cuflash.flash_attn_with_kvcache(c["q"], kp, vp, c["k"], c["v"], cache_seqlens=cs,
                                               block_table=c["block_table"], causal=causal, return_lse=True,
                                               backend="numpy")
    assert np.array_equal(o2, o) and np.array_equal(lse2, lse)
    assert np.array_equal(kp[c["block_table"]].reshape(c["k_logical"].shape), c["k_logical"])
    assert np.array_equal(kp[spare], before)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_paged_equals_dense_low_precision(page_size, dtype):
    from cuflash.config import numpy_dtype

    c = make_cache(np.random.default_rng(1), 2, 5, 8, 2, 64, 256, 5, [200, 9], page_size=page_size,
                   dtype=numpy_dtype(dtype))
    cs = np.array([200, 9], dtype=np.int32)
    dense = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                           causal=True, return_lse=True, backend="numpy")
    paged = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"],
                                           cache_seqlens=cs, block_table=c["block_table"], causal=True,
                                           return_lse=True, backend="numpy")
    assert dense[0].dtype == c["q"].dtype
    for x, y in zip(dense, paged):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    q64 = c["q"].astype(np.float64)
    want = kv_reference(q64, c["k_logical"].astype(np.float64), c["v_logical"].astype(np.float64), c["counts"],
                        causal=True)
    assert_matches(*dense, *want, {"float32": 2e-6, "float16": 2e-3, "bfloat16": 2e-2}[dtype])


VARIANTS = [
    dict(window=(5, 1)),
    dict(window=(9, -1), causal=True),
    dict(softcap=2.0),
    dict(alibi_slopes=(8,), causal=True),
    dict(alibi_slopes=(3, 8), window=(20, 0), softcap=3.0),
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(kw))
def test_variants(kw):
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = slopes(kw["alibi_slopes"])
    lens = [40, 0, 3]
    c = make_cache(np.random.default_rng(7), 3, 4, 8, 2, 32, 64, 4, lens, page_size=16)
    o, lse = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"],
                                             cache_seqlens=np.array(lens, dtype=np.int32),
                                             block_table=c["block_table"], return_lse=True, backend="numpy", **kw)
    assert_matches(o, lse, *kv_reference(c["q"], c["k_logical"], c["v_logical"], c["counts"], **kw), 1e-12)


def test_empty_entries_and_no_keys():
    c = make_cache(np.random.default_rng(3), 2, 3, 2, 1, 16, 32, 0, 0)
    o, lse = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=0, return_lse=True,
                                             backend="numpy")
    assert not o.any() and np.isneginf(lse).all()
    # causal with more queries than keys: the first rows see nothing
    c = make_cache(np.random.default_rng(4), 1, 6, 2, 1, 16, 32, 2, 1)
    o, lse = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=1,
                                             causal=True, return_lse=True, backend="numpy")
    assert np.isneginf(lse[:, :, :3]).all() and np.isfinite(lse[:, :, 3:]).all() and not o[:, :3].any()


def test_backend_clamps_out_of_range_counts_and_pages():
    """The NumPy backend's kvcache_forward, given what the API would refuse on the host, does what the
    kernels do: counts clamped to [0, capacity], pages outside the pool read as zeros."""
    from cuflash.backends import numpy as nb

    c = make_cache(np.random.default_rng(5), 3, 2, 2, 1, 16, 64, 0, 0, page_size=16)
    counts = np.array([-5, 1000, 40], dtype=np.int32)
    table = c["block_table"].copy()
    table[2, 1], table[2, 2] = -1, 10_000  # rows 16..47 of entry 2
    o, lse = nb.kvcache_forward(c["q"], c["k_cache_paged"], c["v_cache_paged"], counts, table, causal=False,
                                softmax_scale=0.25)
    k, v = c["k_cache"].copy(), c["v_cache"].copy()
    k[2, 16:48] = v[2, 16:48] = 0
    want = kv_reference(c["q"], k, v, np.array([0, 64, 40]), softmax_scale=0.25)
    assert_matches(o, lse, *want, 1e-12)


def test_torch_host_tensors():
    torch = pytest.importorskip("torch")
    c = make_cache(np.random.default_rng(6), 2, 1, 4, 2, 16, 32, 1, [3, 30])
    t = {n: torch.from_numpy(c[n]) for n in ("q", "k_cache", "v_cache", "k", "v")}
    o = cuflash.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"],
                                        cache_seqlens=torch.tensor([3, 30], dtype=torch.int32), backend="numpy")
    assert isinstance(o, torch.Tensor)
    assert np.array_equal(t["k_cache"].numpy(), c["k_logical"])  # appended in the tensor's memory
    want = kv_reference(c["q"], c["k_logical"], c["v_logical"], c["counts"])[0]
    assert np.abs(o.numpy() - want).max() <= 1e-12


def test_jax_host_arrays():
    """JAX arrays in, a JAX array out; JAX caches are refused an append (JAX arrays are immutable), so new rows
    go in with JAX's own ops and k = v = None here."""
    jax = pytest.importorskip("jax")
    c = make_cache(np.random.default_rng(6), 2, 1, 4, 2, 16, 32, 1, [3, 30], dtype=np.float32)
    j = {n: jax.numpy.asarray(c[n]) for n in ("q", "k_cache", "v_cache", "k", "v")}
    with pytest.raises(TypeError, match="k_cache: a JAX array cannot be written in place"):
        cuflash.flash_attn_with_kvcache(j["q"], j["k_cache"], j["v_cache"], j["k"], j["v"], cache_seqlens=3,
                                        backend="numpy")
    k_cache, v_cache = (j[f"{n}_cache"].at[0, 3].set(j[n][0, 0]).at[1, 30].set(j[n][1, 0]) for n in ("k", "v"))
    o = cuflash.flash_attn_with_kvcache(j["q"], k_cache, v_cache, cache_seqlens=jax.numpy.asarray(c["counts"]),
                                        backend="numpy")
    assert isinstance(o, jax.Array)
    want = kv_reference(c["q"], c["k_logical"], c["v_logical"], c["counts"])[0]
    assert np.abs(np.asarray(o) - want).max() <= 1e-6 * max(1.0, np.abs(want).max())


# --- bad input ------------------------------------------------------------------------------------------


def _bad_inputs():
    c = make_cache(np.random.default_rng(8), 2, 1, 4, 2, 16, 32, 1, [3, 30], page_size=16)
    base = dict(q=c["q"], k_cache=c["k_cache"], v_cache=c["v_cache"], k=c["k"], v=c["v"],
                cache_seqlens=np.array([3, 30], dtype=np.int32))
    paged = dict(base, k_cache=c["k_cache_paged"], v_cache=c["v_cache_paged"], block_table=c["block_table"])
    return c, base, paged


def _call(q, k_cache, v_cache, k=None, v=None, **kw):
    return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, backend="numpy", **kw)


def _row_apart(cache):
    """k_cache and v_cache one row apart in one buffer: every row but one of each is a row of the other."""
    buf = np.concatenate([cache, cache[:, :1]], axis=1)
    return dict(k_cache=buf[:, :-1], v_cache=buf[:, 1:])


BAD = [
    ("over capacity (dense)", lambda c, d, p: dict(d, cache_seqlens=np.array([3, 32], dtype=np.int32)), ValueError,
     "cache_seqlens: cache_seqlens + seqlen_new must be <= the cache's capacity 32 (k_cache's dimension 1), got 32 + 1"),
    ("over capacity (int)", lambda c, d, p: dict(d, cache_seqlens=32), ValueError, "cache_seqlens: cache_seqlens + seqlen_new"),
    ("over capacity (paged)", lambda c, d, p: dict(p, cache_seqlens=np.array([32, 3], dtype=np.int32)), ValueError,
     "capacity 32 (max_pages * page_size"),
    ("negative", lambda c, d, p: dict(d, cache_seqlens=np.array([-1, 3], dtype=np.int32)), ValueError,
     "cache_seqlens: must be >= 0, got -1 at index 0"),
    ("negative int", lambda c, d, p: dict(d, cache_seqlens=-2), ValueError, "cache_seqlens: expected an int >= 0"),
    ("page out of pool", lambda c, d, p: dict(p, block_table=np.array([[0, 1], [2, 7]], dtype=np.int32)), ValueError,
     "block_table: entries must be page indices in [0, num_pages=7), got 7 at (1, 1)"),
    ("negative page", lambda c, d, p: dict(p, block_table=np.array([[0, -1], [2, 3]], dtype=np.int32)), ValueError,
     "block_table: entries must be page indices"),
    ("page size", lambda c, d, p: dict(p, k_cache=c["k_cache_paged"][:, :8], v_cache=c["v_cache_paged"][:, :8]),
     ValueError, "k_cache: page_size (dimension 1 of a paged cache) must be a positive multiple of 16, got 8"),
    ("cache_seqlens int64", lambda c, d, p: dict(d, cache_seqlens=np.array([3, 3])), TypeError,
     "cache_seqlens: dtype must be int32, got int64"),
    ("cache_seqlens float", lambda c, d, p: dict(d, cache_seqlens=3.0), TypeError, "cache_seqlens: expected an int"),
    ("cache_seqlens shape", lambda c, d, p: dict(d, cache_seqlens=np.array([3, 3, 3], dtype=np.int32)), ValueError,
     "cache_seqlens: expected shape (2,) (batch)"),
    ("block_table int64", lambda c, d, p: dict(p, block_table=c["block_table"].astype(np.int64)), TypeError,
     "block_table: dtype must be int32"),
    ("block_table shape", lambda c, d, p: dict(p, block_table=c["block_table"][:1]), ValueError,
     "block_table: batch must equal q's (2)"),
    ("block_table 1-D", lambda c, d, p: dict(p, block_table=c["block_table"][0]), ValueError,
     "block_table: expected a 2-D array (batch, max_pages)"),
    ("cache dtype", lambda c, d, p: dict(d, k_cache=c["k_cache"].astype(np.float32)), TypeError,
     "k_cache: dtype must match q (float64), got float32"),
    ("new dtype", lambda c, d, p: dict(d, v=c["v"].astype(np.float32)), TypeError, "v: dtype must match q"),
    ("k without v", lambda c, d, p: dict(d, v=None), ValueError, "k and v: pass both (the new keys and values) or "
     "neither, got only k"),
    ("v without k", lambda c, d, p: dict(d, k=None), ValueError, "got only v"),
    ("new shape", lambda c, d, p: dict(d, k=c["k"][:, :, :1], v=c["v"][:, :, :1]), ValueError,
     "k: expected shape (2, seqlen_new, 2, 16)"),
    ("k, v lengths", lambda c, d, p: dict(d, k=np.concatenate([c["k"], c["k"]], axis=1)), ValueError,
     "k and v: shapes must be equal"),
    ("cache shapes", lambda c, d, p: dict(d, v_cache=c["v_cache"][:, :16]), ValueError,
     "k_cache and v_cache: shapes must be equal"),
    ("cache batch", lambda c, d, p: dict(d, k_cache=c["k_cache"][:1], v_cache=c["v_cache"][:1]), ValueError,
     "k_cache: batch must equal q's (2), got 1"),
    ("cache heads", lambda c, d, p: dict(d, q=c["q"][:, :, :3]), ValueError, "k_cache: nheads_k must divide q's nheads (3)"),
    ("cache head_dim", lambda c, d, p: dict(d, q=np.zeros((2, 1, 4, 8))), ValueError, "k_cache: head_dim must equal q's (8)"),
    ("cache 3-D", lambda c, d, p: dict(d, k_cache=c["k_cache"][0]), ValueError, "k_cache: expected a 4-D array"),
    ("strided cache", lambda c, d, p: dict(d, k_cache=c["k_cache"][..., ::2], v_cache=c["v_cache"][..., ::2],
                                           q=c["q"][..., :8], k=c["k"][..., :8], v=c["v"][..., :8]), ValueError,
     "k_cache: the last dimension must be contiguous"),
    ("cache a list", lambda c, d, p: dict(d, k_cache=[1.0]), TypeError, "k_cache: expected a NumPy or CuPy array"),
    ("broadcast cache", lambda c, d, p: dict(d, v_cache=np.broadcast_to(c["v_cache"][:1], c["v_cache"].shape)),
     ValueError, "v_cache: the array is read-only"),
    ("new rows in the cache", lambda c, d, p: dict(d, k=d["k_cache"][:, :1], v=d["v_cache"][:, 1:2]), ValueError,
     "k_cache: must not share memory with k"),
    ("one cache for both", lambda c, d, p: dict(d, v_cache=d["k_cache"]), ValueError,
     "k_cache: must not share memory with v_cache (one array for both)"),
    ("caches a row apart", lambda c, d, p: dict(d, **_row_apart(d["k_cache"])), ValueError,
     "k_cache: must not share memory with v_cache"),
    ("causal", lambda c, d, p: dict(d, causal=1), TypeError, "causal: expected a bool"),
    ("window", lambda c, d, p: dict(d, window=(1,)), TypeError, "window: expected a pair of ints"),
    ("alibi shape", lambda c, d, p: dict(d, alibi_slopes=np.ones(3, dtype=np.float32)), ValueError, "alibi_slopes"),
    ("num_splits negative", lambda c, d, p: dict(d, num_splits=-1), ValueError, "num_splits: expected an int >= 0"),
    ("num_splits too many", lambda c, d, p: dict(d, num_splits=129), ValueError,
     "num_splits: expected an int in [0, 128] (0: chosen per call), got 129"),
    ("num_splits float", lambda c, d, p: dict(d, num_splits=2.0), TypeError, "num_splits: expected an int"),
]


def test_interleaved_caches_of_one_buffer():
    """k_cache, v_cache as the halves of one (batch, capacity, 2, nheads_k, head_dim) buffer: two caches, each
    appended and read as its own (their address ranges overlap, their elements do not)."""
    c, dense, _ = _bad_inputs()
    buf = np.stack([c["k_cache"], c["v_cache"]], axis=2)
    kc, vc = buf[:, :, 0], buf[:, :, 1]
    got = _call(**dict(dense, k_cache=kc, v_cache=vc))
    want = _call(**dense)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kc, c["k_cache"])
    np.testing.assert_array_equal(vc, c["v_cache"])


def test_plan_checks_the_caches_written_against_each_other_and_the_reads():
    """A cached KV-cache call's pointers: caches whose ranges overlap at a distance no call has validated, or any
    read array inside a cache, send the call to the general path (which refuses it, or validates the distance)."""
    from cuflash._plan import _cache_shares

    writes, reads = ((0, 1000), (0, 1000)), ((0, 64), None, None, (0, 8), None)  # q, k, v, cache_seqlens, table
    ok = dict(writes=writes, kv_deltas={2000}, pkc=10_000, pvc=12_000, reads=reads, read_ptrs=(0, 0, 0, 50_000, 0))
    assert not _cache_shares(**ok)
    assert _cache_shares(**dict(ok, pvc=10_000))  # one array for both
    assert _cache_shares(**dict(ok, pvc=10_016))  # a row apart
    assert not _cache_shares(**dict(ok, kv_deltas={2000, 16}, pvc=10_016))  # a validated (interleaved) layout
    assert _cache_shares(**dict(ok, read_ptrs=(10_990, 0, 0, 50_000, 0)))  # q's last bytes in k_cache
    assert _cache_shares(**dict(ok, read_ptrs=(0, 0, 0, 12_500, 0)))  # cache_seqlens inside v_cache
    assert not _cache_shares(**dict(ok, read_ptrs=(9_936, 0, 0, 13_000, 0)))  # just outside both
    assert not _cache_shares(**dict(ok, reads=((0, 0), *reads[1:]), read_ptrs=(10_500, 0, 0, 50_000, 0)))  # empty q


@pytest.mark.parametrize("name,make,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, make, exc, msg):
    c, dense, paged = _bad_inputs()
    kw = make(c, dense, paged)
    before = (c["k_cache"].copy(), c["k_cache_paged"].copy())
    with pytest.raises(exc, match=re_escape(msg)):
        _call(**kw)
    # nothing was appended by a refused call
    assert np.array_equal(before[0], c["k_cache"]) and np.array_equal(before[1], c["k_cache_paged"])


def re_escape(s):
    import re

    return re.escape(s)


# --- the Numba prototypes, on the simulator --------------------------------------------------------------

# name -> (batch, seqlen_q, nheads, nheads_k, head_dim, capacity, seqlen_new, cache_seqlens, causal, page_size,
#          dtype, variants). Tiles 16 x 16, one warp (the simulator runs each thread as a Python thread).
SIM_CASES = {
    "decode_gqa": (3, 1, 8, 2, 16, 48, 1, [20, 0, 47], False, 16, "float32", {}),
    "speculative_causal": (2, 3, 4, 2, 16, 48, 3, [7, 0], True, 16, "float64", {}),
    "prefill_chunk_causal": (2, 20, 2, 1, 16, 64, 20, [10, 30], True, 32, "float64", {}),
    "no_keys": (2, 2, 2, 1, 16, 32, 0, [0, 5], True, 16, "float64", {}),
    "variants": (2, 3, 4, 2, 16, 48, 2, [9, 30], False, 16, "float32",
                 dict(window=(6, 1), softcap=2.0, alibi_slopes=(2, 4))),
}
# through the public API with the backend's own config: (case, page_size for the paged call)
SIM_API = ("api_append", (2, 2, 2, 1, 16, 128, 2, [5, 100], True, 64, "float64", {}))


# flash_decode's prototype (proto/flash_decode.py) with small tiles: 16 packed rows, key blocks of 16 keys over 2
# warps (8 keys each), the compiled head dim 32 (the arrays' 16 zero-filled past it).
# name -> (batch, seqlen_q, nheads, nheads_k, head_dim, capacity, cache_seqlens, causal, page_size, dtype,
#          variants, num_splits to run). Each runs dense (and paged with a page_size: bitwise the dense result).
DECODE_CASES = {
    "group1": (2, 1, 2, 2, 16, 48, [0, 35], False, None, "float64", {}, (1, 2, 3)),  # entry 0: no key; 2: uneven shares
    "group4_causal_sq3": (2, 3, 8, 2, 16, 48, [41, 2], True, 16, "float64", {}, (1, 3)),
    "group4_sq3": (2, 3, 8, 2, 16, 48, [41, 17], False, None, "float32", {}, (1, 3)),
    "group4_sq5_causal": (1, 5, 4, 1, 16, 48, [33], True, None, "float64", {}, (1, 3)),  # 20 packed rows: 2 tiles
    "window": (2, 3, 4, 2, 16, 48, [44, 9], False, 16, "float64", dict(window=(6, 1)), (1, 2, 3)),
    "window_causal": (1, 1, 4, 1, 16, 48, [47], True, None, "float64", dict(window=(20, -1)), (1, 3)),
    "softcap": (2, 1, 8, 2, 16, 48, [30, 47], True, None, "float32", dict(softcap=2.0), (1, 3)),
    # num_splits past the cache's 2 key blocks: clamped to 2; entry 1's one block leaves split 1 empty
    "more_splits": (2, 2, 4, 2, 16, 32, [31, 5], True, None, "float64", {}, (1, 7)),
}
DECODE_BLOCK_N, DECODE_WARPS, DECODE_HEAD_DIM = 16, 2, 32


def _decode_cfgs(dt, variant, stages=0):
    from cuflash.config import KernelConfig

    return (KernelConfig("flash_decode", dt, DECODE_HEAD_DIM, 16, DECODE_BLOCK_N, DECODE_WARPS, variant),
            KernelConfig("flash_decode_combine", dt, DECODE_HEAD_DIM, 0, 0, 4, 0), stages)


def _decode_worker(arrays):
    import cuflash.api as api
    from cuflash import _params
    from cuflash.backends import numba as nb

    for seed, (name, case) in enumerate(DECODE_CASES.items(), 100):
        b, sq, h, hk, d, cap, lens, causal, ps, dt, variants, splits = case
        try:
            c = make_cache(np.random.default_rng(seed), b, sq, h, hk, d, cap, 0, lens, page_size=ps, dtype=dt)
            layouts = [("dense", c["k_cache"], c["v_cache"], None)]
            if ps:
                layouts.append(("paged", c["k_cache_paged"], c["v_cache_paged"], c["block_table"]))
            for label, kc, vc, table in layouts:
                kvcache = (c["counts"], table)
                cfgs = _decode_cfgs(dt, _params.variant(causal, kvcache=kvcache, **variants))
                for n in splits:
                    o, lse = nb._decode(c["q"], kc, vc, kvcache=kvcache, causal=causal, softmax_scale=1.0 / math.sqrt(d),
                                        num_splits=n, cfgs=cfgs, **variants)
                    arrays[f"decode/{name}/{label}/{n}/o"], arrays[f"decode/{name}/{label}/{n}/lse"] = o, lse
            arrays[f"decode/{name}/failure"] = np.array("")
        except Exception:
            arrays[f"decode/{name}/failure"] = np.array(traceback.format_exc())

    # the ring: 2 stages against decode_stages' 3, the same loads in the same order (bitwise)
    try:
        b, sq, h, hk, d, cap, lens, causal, ps, dt, variants, _ = DECODE_CASES["group4_causal_sq3"]
        c = make_cache(np.random.default_rng(101), b, sq, h, hk, d, cap, 0, lens, page_size=ps, dtype=dt)
        kvcache = (c["counts"], None)
        variant = _params.variant(causal, kvcache=kvcache)
        for stages in (2, 3):
            o, lse = nb._decode(c["q"], c["k_cache"], c["v_cache"], kvcache=kvcache, causal=causal,
                                softmax_scale=1.0 / math.sqrt(d), num_splits=2, cfgs=_decode_cfgs(dt, variant, stages))
            arrays[f"decode/stages/{stages}/o"], arrays[f"decode/stages/{stages}/lse"] = o, lse
        arrays["decode/stages/failure"] = np.array("")
    except Exception:
        arrays["decode/stages/failure"] = np.array(traceback.format_exc())

    # 16-bit inputs through the public API, the backend's own configs (16 x 64 tiles, 4 warps) and num_splits
    for dt in ("float16", "bfloat16"):
        try:
            from cuflash.config import numpy_dtype

            c = make_cache(np.random.default_rng(110), 2, 2, 8, 2, 32, 128, 1, [100, 3], page_size=16,
                           dtype=numpy_dtype(dt))
            cs = np.array([100, 3], dtype=np.int32)
            for n in (0, 1, 2):
                kc, vc = c["k_cache"].copy(), c["v_cache"].copy()
                o, lse = api.flash_attn_with_kvcache(c["q"], kc, vc, c["k"], c["v"], cache_seqlens=cs, causal=True,
                                                     num_splits=n, return_lse=True, backend="numba")
                arrays[f"decode/api_{dt}/{n}/o"], arrays[f"decode/api_{dt}/{n}/lse"] = o.astype(np.float64), lse
            arrays[f"decode/api_{dt}/failure"] = np.array("")
        except Exception:
            arrays[f"decode/api_{dt}/failure"] = np.array(traceback.format_exc())


def _sim_kw(variants):
    kw = dict(variants)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = slopes(kw["alibi_slopes"])
    return kw


def _sim_worker(out_path: str) -> None:
    import cuflash.api as api
    from cuflash import _params
    from cuflash.backends import numba as nb
    from cuflash.config import KernelConfig

    assert nb._simulator(), "NUMBA_ENABLE_CUDASIM=1 must be set before numba is imported"
    pin_to_one_core()
    arrays = {}
    for seed, (name, case) in enumerate(SIM_CASES.items()):
        b, sq, h, hk, d, cap, new, lens, causal, ps, dt, variants = case
        try:
            c = make_cache(np.random.default_rng(seed), b, sq, h, hk, d, cap, new, lens, page_size=ps, dtype=dt)
            vkw = _sim_kw(variants)
            for label, caches, table in (("dense", ("k_logical", "v_logical"), None),
                                         ("paged", ("k_cache_paged", "v_cache_paged"), c["block_table"])):
                if table is not None:  # the pools hold the pre-append caches: append as the API would
                    for n, new_rows in (("k_cache_paged", c["k"]), ("v_cache_paged", c["v"])):
                        for i, start in enumerate(np.broadcast_to(lens, (b,))):
                            for r in range(new):
                                j = start + r
                                c[n][table[i, j // ps], j % ps] = new_rows[i, r]
                kvcache = (c["counts"], table)
                cfg = KernelConfig("flash_fwd", dt, d, 16, 16, 1, _params.variant(causal, kvcache=kvcache, **vkw))
                o, lse = nb._forward(c["q"], c[caches[0]], c[caches[1]], causal=causal,
                                     softmax_scale=1.0 / math.sqrt(d), cfg=cfg, kvcache=kvcache, **vkw)
                arrays[f"{name}/{label}/o"], arrays[f"{name}/{label}/lse"] = o, lse
            arrays[f"{name}/failure"] = np.array("")
        except Exception:
            arrays[f"{name}/failure"] = np.array(traceback.format_exc())

    # out-of-range counts and pages straight to the backend (what unchecked device values can be)
    try:
        c = make_cache(np.random.default_rng(50), 3, 2, 2, 1, 16, 64, 0, 0, page_size=16)
        table = c["block_table"].copy()
        table[2, 1], table[2, 2] = -1, 10_000
        counts = np.array([-5, 1000, 40], dtype=np.int32)
        o, lse = nb.kvcache_forward(c["q"], c["k_cache_paged"], c["v_cache_paged"], counts, table, causal=False,
                                    softmax_scale=0.25)
        arrays["clamp/o"], arrays["clamp/lse"] = o, lse
        arrays["clamp/failure"] = np.array("")
    except Exception:
        arrays["clamp/failure"] = np.array(traceback.format_exc())

    name, (b, sq, h, hk, d, cap, new, lens, causal, ps, dt, _) = SIM_API
    try:
        c = make_cache(np.random.default_rng(60), b, sq, h, hk, d, cap, new, lens, page_size=ps, dtype=dt)
        cs = np.array(lens, dtype=np.int32)
        o, lse = api.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                             causal=causal, return_lse=True, backend="numba")
        o2, lse2 = api.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"],
                                               cache_seqlens=cs, block_table=c["block_table"], causal=causal,
                                               return_lse=True, backend="numba")
        arrays.update({f"{name}/dense/o": o, f"{name}/dense/lse": lse, f"{name}/paged/o": o2, f"{name}/paged/lse": lse2,
                       f"{name}/k_cache": c["k_cache"], f"{name}/k_pool": c["k_cache_paged"]})
        arrays[f"{name}/failure"] = np.array("")
    except Exception:
        arrays[f"{name}/failure"] = np.array(traceback.format_exc())
    _decode_worker(arrays)
    np.savez(out_path, **arrays)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    return simulator_results(__file__, tmp_path_factory.mktemp("kvcache_sim"), timeout=900)


def _ok(sim, name):
    failure = str(sim[f"{name}/failure"])
    assert not failure, failure


@pytest.mark.parametrize("name", list(SIM_CASES))
def test_numba_matches_reference(sim, name):
    _ok(sim, name)
    b, sq, h, hk, d, cap, new, lens, causal, ps, dt, variants = SIM_CASES[name]
    c = make_cache(np.random.default_rng(list(SIM_CASES).index(name)), b, sq, h, hk, d, cap, new, lens,
                   page_size=ps, dtype=dt)
    kw = dict(_sim_kw(variants), causal=causal)
    want = kv_reference(c["q"].astype(np.float64), c["k_logical"].astype(np.float64),
                        c["v_logical"].astype(np.float64), c["counts"], **kw)
    got = sim[f"{name}/dense/o"], sim[f"{name}/dense/lse"]
    assert_matches(*got, *want, 1e-12 if dt == "float64" else 2e-6)
    # in-kernel paging reads the same values in the same order: bitwise the dense result
    for key in ("o", "lse"):
        assert np.array_equal(sim[f"{name}/paged/{key}"], sim[f"{name}/dense/{key}"])


def test_numba_clamps_like_numpy(sim):
    from cuflash.backends import numpy as nb

    _ok(sim, "clamp")
    c = make_cache(np.random.default_rng(50), 3, 2, 2, 1, 16, 64, 0, 0, page_size=16)
    table = c["block_table"].copy()
    table[2, 1], table[2, 2] = -1, 10_000
    counts = np.array([-5, 1000, 40], dtype=np.int32)
    want = nb.kvcache_forward(c["q"], c["k_cache_paged"], c["v_cache_paged"], counts, table, causal=False,
                              softmax_scale=0.25)
    assert_matches(sim["clamp/o"], sim["clamp/lse"], *want, 1e-12)


def test_numba_api_append(sim):
    name, (b, sq, h, hk, d, cap, new, lens, causal, ps, dt, _) = SIM_API
    _ok(sim, name)
    c = make_cache(np.random.default_rng(60), b, sq, h, hk, d, cap, new, lens, page_size=ps, dtype=dt)
    assert np.array_equal(sim[f"{name}/k_cache"], c["k_logical"])
    pool = sim[f"{name}/k_pool"]
    assert np.array_equal(pool[c["block_table"]].reshape(c["k_logical"].shape), c["k_logical"])
    want = kv_reference(c["q"], c["k_logical"], c["v_logical"], c["counts"], causal=causal)
    assert_matches(sim[f"{name}/dense/o"], sim[f"{name}/dense/lse"], *want, 1e-12)
    for key in ("o", "lse"):
        assert np.array_equal(sim[f"{name}/paged/{key}"], sim[f"{name}/dense/{key}"])


DECODE_TOL = {"float64": 1e-12, "float32": 2e-6}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_numba_decode_matches_reference(sim, name):
    """flash_decode's prototype, unsplit and split, against the float64 reference; the split result within
    rounding of the unsplit one; paged bitwise dense."""
    from cuflash.backends.numba import decode_num_splits

    _ok(sim, f"decode/{name}")
    b, sq, h, hk, d, cap, lens, causal, ps, dt, variants, splits = DECODE_CASES[name]
    c = make_cache(np.random.default_rng(100 + list(DECODE_CASES).index(name)), b, sq, h, hk, d, cap, 0, lens,
                   page_size=ps, dtype=dt)
    want = kv_reference(c["q"].astype(np.float64), c["k_logical"].astype(np.float64),
                        c["v_logical"].astype(np.float64), c["counts"], causal=causal, **variants)
    tol = DECODE_TOL[dt]
    key = lambda label, n, x: sim[f"decode/{name}/{label}/{n}/{x}"]
    for n in splits:
        assert_matches(key("dense", n, "o"), key("dense", n, "lse"), *want, tol)
    base = splits[0]
    for n in splits[1:]:
        # the same keys, merged in another order: equal to rounding (exactly -inf where no key is seen)
        assert_matches(key("dense", n, "o"), key("dense", n, "lse"), key("dense", base, "o").astype(np.float64),
                       key("dense", base, "lse").astype(np.float64), tol)
    if ps:
        for n in splits:
            for x in ("o", "lse"):
                assert np.array_equal(key("paged", n, x), key("dense", n, x))
    if name == "more_splits":
        m_blocks = -(-sq * (h // hk) // 16)
        assert decode_num_splits(splits[-1], b * hk * m_blocks, -(-cap // DECODE_BLOCK_N)) == 2
    if 0 in lens:  # an entry with no key: o = 0, lse = -inf, split or not
        for n in splits:
            assert np.isneginf(key("dense", n, "lse")[lens.index(0)]).all()
            assert not key("dense", n, "o")[lens.index(0)].any()


def test_numba_decode_ring_stages(sim):
    _ok(sim, "decode/stages")
    for x in ("o", "lse"):
        assert np.array_equal(sim[f"decode/stages/2/{x}"], sim[f"decode/stages/3/{x}"])


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_numba_decode_api_16bit(sim, dt):
    """fp16 / bf16 through flash_attn_with_kvcache: choose_decode's configs, num_splits 0 (chosen), 1 and 2,
    against the float64 reference over the same (rounded) inputs, the 16-bit rule of test_paged_equals_dense."""
    from cuflash.config import numpy_dtype

    _ok(sim, f"decode/api_{dt}")
    c = make_cache(np.random.default_rng(110), 2, 2, 8, 2, 32, 128, 1, [100, 3], page_size=16, dtype=numpy_dtype(dt))
    want = kv_reference(*(c[n].astype(np.float64) for n in ("q", "k_logical", "v_logical")), c["counts"], causal=True)
    for n in (0, 1, 2):
        assert_matches(sim[f"decode/api_{dt}/{n}/o"], sim[f"decode/api_{dt}/{n}/lse"], *want,
                       {"float16": 2e-3, "bfloat16": 2e-2}[dt])


def test_decode_num_splits_rule():
    """num_splits=0 on the Numba backend: config.decode_splits over DECODE_NOTIONAL_SMS SMs, clamped to
    the key blocks; an explicit count is clamped to [1, key blocks]."""
    from cuflash.backends.numba import DECODE_NOTIONAL_SMS, decode_num_splits
    from cuflash.config import decode_splits

    assert decode_num_splits(0, 4, 10) == decode_splits(4, 10, DECODE_NOTIONAL_SMS) > 1
    assert decode_num_splits(0, 1000, 10) == 1  # a full wave: no split
    assert decode_num_splits(7, 4, 2) == 2 and decode_num_splits(3, 4, 10) == 3 and decode_num_splits(1, 1, 1) == 1


def test_decode_configs_fit_static_smem(monkeypatch):
    """On a GPU (not the simulator) the decode prototype's tiles fit Numba's 48 KiB of static shared memory, or the
    call goes to flash_fwd's prototype; choose_decode's rule decides which calls the decode prototype serves."""
    pytest.importorskip("numba_cuda")
    from cuflash.backends import numba as nb
    from cuflash.config import ALIBI, HEAD_DIMS, LOCAL, PAGED, SEQUSED, SOFTCAP, WINDOW
    from cuflash.proto import flash_decode as fd

    monkeypatch.setattr(nb, "_simulator", lambda: False)
    served = 0
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for d in HEAD_DIMS:
            got = nb._decode_configs(dt, d, SEQUSED | PAGED | LOCAL | WINDOW | SOFTCAP, 4, 0)
            if got is not None:
                cfg, combine, stages = got
                assert cfg.dtype == combine.dtype == dt and combine.head_dim == cfg.head_dim
                assert fd.layout_ok(cfg) and fd.smem_bytes(cfg, stages) <= nb.STATIC_SMEM_LIMIT
                served += 1
    assert served >= 8
    assert nb._decode_configs("float16", 64, SEQUSED | ALIBI, 4, 0) is None
    assert nb._decode_configs("float16", 64, SEQUSED, 65, 1) is None
    assert nb._decode_configs("float16", 64, SEQUSED, 65, 2) is not None


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sim-worker":
    _sim_worker(sys.argv[2])
