"""flash_attn_with_kvcache on the GPU (backend="cuda"): every dtype, dense and paged caches (paged
bitwise equal to dense: the same tiles read the same values in the same order), the append in
place, and device-side cache_seqlens / block_table with out-of-range values (clamped: no crash, no read
or write outside the caches, checked with guard rows around them), check_inputs=True refusing them; the plan
cache (a repeated signature's launches) bitwise the general path, and a decoding step in a CUDA graph.

Judged as tests/test_gpu_variants.py judges the forward (DESIGN.md's accuracy rule), against
cuflash.reference on the GPU over each entry's logical keys (tests/test_kvcache.py's kv_reference):

    max|o - ref64| <= 2 * max|same_precision_ref - ref64| + atol

float32: a fixed bound against float64; float64: 1e-12. Rows that see no key: o = 0, lse = -inf.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FP32_FORWARD_ATOL, LSE_TOL, RULE_ATOL, jax_gpu
from test_kvcache import kv_reference, make_cache, slopes

pytestmark = pytest.mark.gpu

B, H, HK, CAP = 3, 8, 2, 1024
# (id, seqlen_q (= seqlen_new), cache_seqlens, causal, head_dim, variants)
CASES = [
    ("decode", 1, [700, 0, 1023], False, 128, {}),
    ("speculative-causal", 5, [300, 0, 1019], True, 64, {}),
    ("prefill-causal", 200, [0, 500, 824], True, 128, {}),
    ("variants", 3, [100, 7, 900], True, 64, dict(window=(64, 0), softcap=5.0, alibi_slopes=(B, H))),
]


def _device(gpu, c):
    """make_cache's NumPy arrays on the GPU (bfloat16 through its bits)."""
    from cuflash._interop import to_working

    return {n: (to_working(n, x, True) if isinstance(x, np.ndarray) else x) for n, x in c.items()}


def _check(gpu, ctx, dtype, o, lse, r64, sp):
    cp = gpu.cp
    fails = []
    o64, lse64 = o.astype(cp.float64), lse.astype(cp.float64)
    for name, x in (("o", o), ("lse", lse)):
        n = gpu.count_nan(x)
        if n:
            fails.append(f"{name}: {n} NaN of {x.size}")
    empty = cp.isneginf(r64[1])
    if int(cp.count_nonzero(cp.isneginf(lse64) != empty)):
        fails.append(f"lse: -inf pattern differs from the reference's ({int(cp.count_nonzero(empty))} empty rows)")
    elif int(cp.count_nonzero(~empty)):
        lr = r64[1][~empty]
        excess = cp.abs(lse64[~empty] - lr) - LSE_TOL[dtype] * cp.maximum(1.0, cp.abs(lr))
        if not float(cp.max(excess)) <= 0:
            fails.append(f"lse: max error {float(cp.max(cp.abs(lse64[~empty] - lr))):.3e}")
    mag = float(cp.max(cp.abs(r64[0])))
    err = float(cp.nan_to_num(cp.max(cp.abs(o64 - r64[0])), nan=np.inf))
    if dtype == "float32":
        bound = FP32_FORWARD_ATOL["cuda"] * max(1.0, mag)
    else:
        sp_err = 0.0 if dtype == "float64" else float(cp.max(cp.abs(sp[0] - r64[0])))
        bound = 2.0 * sp_err + RULE_ATOL[dtype] * max(1.0, mag)
    if not err <= bound:
        fails.append(f"o: error {err:.3e} > bound {bound:.3e} (max|ref| {mag:.3e})")
    n = int(cp.count_nonzero(o64[empty.transpose(0, 2, 1)]))
    if n:
        fails.append(f"o: {n} nonzero elements in rows that see no key")
    if fails:
        raise AssertionError(f"[{ctx}]\n  " + "\n  ".join(fails))


def _references(gpu, dtype, c, kw):
    cp = gpu.cp
    q, k, v = (c[n].astype(cp.float64) for n in ("q", "k_logical", "v_logical"))
    r64 = kv_reference(q, k, v, c["counts"], **kw)
    return r64, (r64 if dtype == "float64" else kv_reference(q, k, v, c["counts"], precision=dtype, **kw))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name,sq,lens,causal,d,variants", CASES, ids=[c[0] for c in CASES])
def test_kvcache(gpu, dtype, name, sq, lens, causal, d, variants):
    cp, cf = gpu.cp, gpu.cuflash
    ctx = f"{name} {dtype} b={B} sq={sq} h={H}:{HK} d={d} lens={lens} causal={causal} {variants}"
    kw = dict(variants, causal=causal)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = cp.asarray(slopes(kw["alibi_slopes"]))
    for page_size in (16, 64):
        c = _device(gpu, make_cache(np.random.default_rng(sq * 7 + page_size), B, sq, H, HK, d, CAP, sq, lens,
                                    page_size=page_size, dtype=gpu.np_dtype(dtype)))
        cs = cp.asarray(np.array(lens, dtype=np.int32))
        gpu.poison(4 * c["q"].nbytes)
        o, lse = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                            return_lse=True, backend="cuda", **kw)
        cp.cuda.get_current_stream().synchronize()
        _check(gpu, ctx, dtype, o, lse, *_references(gpu, dtype, c, kw))
        # the append, in place: the dense caches are the logical ones, bit for bit
        for n in ("k", "v"):
            assert gpu.same_bits(c[f"{n}_cache"], c[f"{n}_logical"]) == 0, f"[{ctx}] {n}_cache after the append"
        # paged: bitwise the dense result; the table's pages hold the logical caches, the spare ones unchanged
        kp, vp, table = c["k_cache_paged"], c["v_cache_paged"], c["block_table"]
        spare = cp.asarray(np.setdiff1d(np.arange(kp.shape[0]), cp.asnumpy(table)))
        before = kp[spare].copy()
        o2, lse2 = cf.flash_attn_with_kvcache(c["q"], kp, vp, c["k"], c["v"], cache_seqlens=cs, block_table=table,
                                              return_lse=True, backend="cuda", **kw)
        ctxp = f"{ctx} page_size={page_size}"
        assert gpu.same_bits(o2, o) == 0 and gpu.same_bits(lse2, lse) == 0, f"[{ctxp}] paged differs from dense"
        for pool, logical in ((kp, c["k_logical"]), (vp, c["v_logical"])):
            assert gpu.same_bits(pool[table].reshape(logical.shape), logical) == 0, f"[{ctxp}] pages after the append"
        assert gpu.same_bits(kp[spare], before) == 0, f"[{ctxp}] a spare page was written"


# flash_decode (fp16 / bf16 where config.choose_decode serves the call): the heads of a GQA group packed into
# 16-row tiles, the keys split over num_splits blocks and merged by flash_decode_combine.
# (id, batch, seqlen_q, nheads, nheads_k, cache_seqlens, seqlen_new, causal, head_dim, variants)
DECODE_CASES = [
    ("mha", 2, 1, 4, 4, [1000, 37], 1, False, 64, {}),
    ("gqa8-speculative", 2, 5, 16, 2, [900, 3], 5, True, 128, {}),  # 40 packed rows: 3 tiles
    ("window-softcap", 3, 2, 8, 2, [700, 0, 1017], 2, True, 96, dict(window=(100, 0), softcap=4.0)),
    ("empty-entry", 2, 1, 8, 2, [0, 1024], 0, False, 128, {}),  # entry 0 has no key at all
    ("d256", 1, 1, 8, 1, [1020], 1, False, 256, {}),
    ("d32-window", 2, 4, 4, 1, [500, 60], 4, False, 32, dict(window=(30, 10))),
    ("gqa3-causal", 2, 6, 12, 4, [400, 9], 6, True, 64, {}),  # 18 packed rows: a query row's heads in two tiles
]


@pytest.fixture
def decode_spy(monkeypatch):
    """Records, per call of backends.cuda.decode_launches, whether flash_decode served it and how many kernels
    it launched (2: split, with the combine). An empty plan cache: each signature's first call builds its
    launches (a plan's later calls reuse them)."""
    from cuflash import _plan
    from cuflash.backends import cuda

    monkeypatch.setattr(_plan, "KVCACHE", {})
    seen = []

    def spy(*args, **kwargs):
        launches = cuda_decode(*args, **kwargs)
        seen.append(None if launches is None else len(launches.kernels))
        return launches

    cuda_decode = cuda.decode_launches
    monkeypatch.setattr(cuda, "decode_launches", spy)
    return seen


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,b,sq,h,hk,lens,new,causal,d,variants", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_splits(gpu, decode_spy, dtype, name, b, sq, h, hk, lens, new, causal, d, variants):
    """Each num_splits (1: unsplit, several, more than the key blocks, 0: chosen) against the float64 reference by
    the accuracy rule, the LSE of every split count against the unsplit one, and the paged cache bitwise equal to
    the dense one at every split count; flash_decode served each call, with the combine exactly when split."""
    cp, cf = gpu.cp, gpu.cuflash
    cap = 1024
    c = _device(gpu, make_cache(np.random.default_rng(b * 100 + sq * 10 + d), b, sq, h, hk, d, cap, new, lens,
                                page_size=64, dtype=gpu.np_dtype(dtype)))
    kw = dict(variants, causal=causal)
    refs = _references(gpu, dtype, c, kw)
    cs = cp.asarray(np.array(lens, dtype=np.int32))
    # the append once, up front: every call below attends over the same caches
    cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs, backend="cuda",
                               **kw)
    cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"], cache_seqlens=cs,
                               block_table=c["block_table"], backend="cuda", **kw)
    counts = cp.asarray(c["counts"])
    unsplit = None
    for num_splits in (1, 3, 16, 128, 0):
        ctx = f"{name} {dtype} b={b} sq={sq} h={h}:{hk} d={d} lens={lens} causal={causal} {variants} " \
              f"num_splits={num_splits}"
        del decode_spy[:]
        gpu.poison(8 * c["q"].nbytes)
        o, lse = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=counts,
                                            num_splits=num_splits, return_lse=True, backend="cuda", **kw)
        o2, lse2 = cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], cache_seqlens=counts,
                                              block_table=c["block_table"], num_splits=num_splits, return_lse=True,
                                              backend="cuda", **kw)
        cp.cuda.get_current_stream().synchronize()
        assert decode_spy[0] is not None and decode_spy[0] == decode_spy[1], f"[{ctx}] launches {decode_spy}"
        if num_splits:
            assert decode_spy[0] == (1 if num_splits == 1 else 2), f"[{ctx}] kernels launched: {decode_spy[0]}"
        _check(gpu, ctx, dtype, o, lse, *refs)
        assert gpu.same_bits(o2, o) == 0 and gpu.same_bits(lse2, lse) == 0, f"[{ctx}] paged differs from dense"
        if unsplit is None:
            unsplit = lse
        else:
            seen = ~cp.isneginf(unsplit)
            assert bool((cp.isneginf(lse) == ~seen).all()), f"[{ctx}] -inf pattern differs from the unsplit one"
            if int(cp.count_nonzero(seen)):
                err = float(cp.max(cp.abs(lse[seen] - unsplit[seen])))
                assert err <= 1e-5 * max(1.0, float(cp.max(cp.abs(unsplit[seen])))), f"[{ctx}] lse {err:.3e}"


def test_decode_nan_key_stays_nan(gpu, decode_spy):
    """A NaN in a cached key makes the rows that see it NaN, split or not, as unsplit attention does; neither the
    warps' merge nor the combine turns it into an empty row (o = 0, lse = -inf). Entry 0: one NaN key among 1000
    (a warp with finite scores beside it). Entry 2: its only key is NaN, so the warp holding it has no finite
    score (row max -inf, sum NaN) and, split, every other split is empty (lse -inf beside one NaN). The other
    rows stay finite."""
    cp, cf = gpu.cp, gpu.cuflash
    c = _device(gpu, make_cache(np.random.default_rng(11), 3, 1, 8, 2, 64, 1024, 0, [1000, 1000, 1],
                                dtype=gpu.np_dtype("float16")))
    k = c["k_cache"].copy()
    k[0, 500, 1, 3] = k[2, 0, 1, 3] = cp.nan  # kv head 1: query heads 4 to 7
    cs = cp.asarray(np.array([1000, 1000, 1], dtype=np.int32))
    for num_splits in (1, 4):
        o, lse = cf.flash_attn_with_kvcache(c["q"], k, c["v_cache"], cache_seqlens=cs, num_splits=num_splits,
                                            return_lse=True, backend="cuda")
        cp.cuda.get_current_stream().synchronize()
        for b in (0, 2):
            assert bool(cp.isnan(lse[b, 4:]).all()) and bool(cp.isnan(o[b, :, 4:]).all()), (num_splits, b)
        assert gpu.count_nan(o[1]) == 0 and gpu.count_nan(o[:, :, :4]) == 0 and gpu.count_nan(lse[:, :4]) == 0
    assert decode_spy == [1, 2]


def test_decode_serves_only_what_it_can(gpu, decode_spy):
    """float32, ALiBi and long query chunks take flash_fwd, where num_splits changes nothing (bitwise); num_splits
    > 1 sends a long chunk to flash_decode, whose result meets the rule too."""
    cp, cf = gpu.cp, gpu.cuflash
    c = _device(gpu, make_cache(np.random.default_rng(9), 2, 40, 8, 2, 64, 512, 0, [300, 512],
                                dtype=gpu.np_dtype("bfloat16")))
    cs = cp.asarray(np.array([300, 512], dtype=np.int32))
    r64, sp = _references(gpu, "bfloat16", c, dict(causal=True))
    o, lse = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=cs, causal=True,
                                        return_lse=True, backend="cuda")  # 160 packed rows: flash_fwd
    o4, lse4 = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=cs, causal=True,
                                          num_splits=4, return_lse=True, backend="cuda")
    assert decode_spy == [None, 2]
    _check(gpu, "160 rows, flash_fwd", "bfloat16", o, lse, r64, sp)
    _check(gpu, "160 rows, num_splits=4", "bfloat16", o4, lse4, r64, sp)
    slopes_dev = cp.asarray(slopes((8,)))
    c32 = {n: c[n].astype(cp.float32) for n in ("q", "k_cache", "v_cache")}
    for name, args, kw in (("alibi", (c["q"][:, :1], c["k_cache"], c["v_cache"]), dict(alibi_slopes=slopes_dev)),
                           ("float32", (c32["q"][:, :1], c32["k_cache"], c32["v_cache"]), {})):
        del decode_spy[:]
        outs = [cf.flash_attn_with_kvcache(*args, cache_seqlens=cs, num_splits=n, backend="cuda", **kw) for n in (4, 0)]
        cp.cuda.get_current_stream().synchronize()
        assert decode_spy == [None, None], name
        assert gpu.same_bits(outs[0], outs[1]) == 0, f"{name}: num_splits changed a flash_fwd result"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int_cache_seqlens_and_host_arrays(gpu, dtype):
    """cache_seqlens an int, block_table on the host with device caches; no append."""
    cp, cf = gpu.cp, gpu.cuflash
    c = _device(gpu, make_cache(np.random.default_rng(2), B, 4, H, HK, 64, 256, 0, 130, page_size=16,
                                dtype=gpu.np_dtype(dtype)))
    o, lse = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=130, causal=True,
                                        return_lse=True, backend="cuda")
    _check(gpu, f"int cache_seqlens {dtype}", dtype, o, lse, *_references(gpu, dtype, c, dict(causal=True)))
    o2 = cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], cache_seqlens=130,
                                    block_table=cp.asnumpy(c["block_table"]), causal=True, backend="cuda")
    assert gpu.same_bits(o2, o) == 0


def _guarded(cp, x, guard):
    """A copy of x inside a larger buffer with `guard` extra rows of dimension 1 (dense) or 0 (pools),
    filled with a bit pattern: (the view, the buffer, the guard's slices)."""
    axis = 1 if guard[0] == "rows" else 0
    shape = list(x.shape)
    shape[axis] += guard[1]
    buf = cp.empty(shape, dtype=x.dtype)
    buf.view(cp.uint8).fill(0x5A)
    view = buf[:, :x.shape[1]] if axis == 1 else buf[:x.shape[0]]
    view[...] = x
    rest = (slice(None), slice(x.shape[1], None)) if axis == 1 else (slice(x.shape[0], None),)
    return view, buf, rest


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_device_values_out_of_range_are_clamped(gpu, dtype):
    """Unchecked device cache_seqlens (negative, past the capacity, near 2**31) and block_table entries
    outside the pool: no error, nothing read or written outside the caches (guard rows keep their
    bits), entries with no key give o = 0, lse = -inf, others attend over the clamped keys."""
    cp, cf = gpu.cp, gpu.cuflash
    cap, new = 256, 2
    c = _device(gpu, make_cache(np.random.default_rng(3), B, new, H, HK, 64, cap, new, 0, page_size=16,
                                dtype=gpu.np_dtype(dtype)))
    # dense: entry 0 negative, entry 1 straddles the end, entry 2 far past it
    kc, kbuf, krest = _guarded(cp, c["k_cache"], ("rows", 16))
    vc, vbuf, vrest = _guarded(cp, c["v_cache"], ("rows", 16))
    guard = (kbuf[krest].copy(), vbuf[vrest].copy())
    cs = cp.asarray(np.array([-7, cap - 1, 2**31 - 2], dtype=np.int32))
    o, lse = cf.flash_attn_with_kvcache(c["q"], kc, vc, c["k"], c["v"], cache_seqlens=cs, return_lse=True,
                                        backend="cuda")
    cp.cuda.get_current_stream().synchronize()
    assert gpu.same_bits(kbuf[krest], guard[0]) == 0 and gpu.same_bits(vbuf[vrest], guard[1]) == 0
    assert gpu.count_nan(o) == 0 and gpu.count_nan(lse) == 0
    assert not bool(o[0].any()) and bool(cp.isneginf(lse[0]).all())
    # entry 2 wrote nothing and attends over its whole (original) cache
    assert gpu.same_bits(kc[2], c["k_cache"][2]) == 0
    r64 = kv_reference(*(c[n][2:].astype(cp.float64) for n in ("q", "k_cache", "v_cache")), np.array([cap]))
    assert float(cp.max(cp.abs(o[2:].astype(cp.float64) - r64[0]))) < 2e-2

    # paged: entry 2's pages 1 and 2 outside the pool, counts past the capacity; no append
    pool_k, kbuf, krest = _guarded(cp, c["k_cache_paged"], ("pages", 2))
    pool_v, vbuf, vrest = _guarded(cp, c["v_cache_paged"], ("pages", 2))
    guard = (kbuf[krest].copy(), vbuf[vrest].copy())
    table = c["block_table"].copy()
    table[2, 1], table[2, 2] = -1, pool_k.shape[0] + 1  # the second is a guard page: never to be read
    counts = cp.asarray(np.array([0, 5000, 2**31 - 1], dtype=np.int32))
    o, lse = cf.flash_attn_with_kvcache(c["q"], pool_k, pool_v, cache_seqlens=counts, block_table=table,
                                        return_lse=True, backend="cuda")
    cp.cuda.get_current_stream().synchronize()
    assert gpu.same_bits(kbuf[krest], guard[0]) == 0 and gpu.same_bits(vbuf[vrest], guard[1]) == 0
    k, v = c["k_cache"].astype(cp.float64), c["v_cache"].astype(cp.float64)
    k[2, 16:48] = v[2, 16:48] = 0  # pages outside the pool read as zeros
    r64 = kv_reference(c["q"].astype(cp.float64), k, v, np.array([0, cap, cap]))
    assert gpu.count_nan(o) == 0 and bool(cp.isneginf(lse[0]).all()) and not bool(o[0].any())
    assert float(cp.max(cp.abs(o[1:].astype(cp.float64) - r64[0][1:]))) < 2e-2
    # and an append through that table writes nothing outside the pool
    # (entry 1 crosses the capacity, entry 2 lands on the page outside the pool)
    cf.flash_attn_with_kvcache(c["q"], pool_k, pool_v, c["k"], c["v"], cache_seqlens=cp.asarray(
        np.array([0, cap - 1, 32], dtype=np.int32)), block_table=table, backend="cuda")
    cp.cuda.get_current_stream().synchronize()
    assert gpu.same_bits(kbuf[krest], guard[0]) == 0 and gpu.same_bits(vbuf[vrest], guard[1]) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one-element-off"])
def test_append_from_views(gpu, dtype, offset):
    """kvcache_append's two copies: 16-byte chunks (k, v rows 16-byte aligned) and single elements (k, v views
    one element into wider buffers): the caches after the append hold the logical rows bit for bit, dense and
    paged, and the attention over them is the same."""
    cp, cf = gpu.cp, gpu.cuflash
    d, new = 64, 3
    c = _device(gpu, make_cache(np.random.default_rng(5), B, new, H, HK, d, 256, new, [10, 0, 200], page_size=16,
                                dtype=gpu.np_dtype(dtype)))
    views = {}
    for n in ("k", "v"):
        buf = cp.zeros(c[n].shape[:-1] + (d + 8,), dtype=c[n].dtype)
        views[n] = buf[..., offset:offset + d]
        views[n][...] = c[n]
    cs = cp.asarray(np.array([10, 0, 200], dtype=np.int32))
    o = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], views["k"], views["v"], cache_seqlens=cs,
                                   backend="cuda")
    kp, vp, table = c["k_cache_paged"], c["v_cache_paged"], c["block_table"]
    o2 = cf.flash_attn_with_kvcache(c["q"], kp, vp, views["k"], views["v"], cache_seqlens=cs, block_table=table,
                                    backend="cuda")
    cp.cuda.get_current_stream().synchronize()
    for n in ("k", "v"):
        assert gpu.same_bits(c[f"{n}_cache"], c[f"{n}_logical"]) == 0, f"{n}_cache after the append"
    for pool, logical in ((kp, c["k_logical"]), (vp, c["v_logical"])):
        assert gpu.same_bits(pool[table].reshape(logical.shape), logical) == 0, "pages after the append"
    assert gpu.same_bits(o2, o) == 0


def test_check_inputs_refuses_device_values(gpu):
    cp, cf = gpu.cp, gpu.cuflash
    c = _device(gpu, make_cache(np.random.default_rng(4), B, 1, H, HK, 64, 64, 1, 0, page_size=16,
                                dtype=gpu.np_dtype("float16")))
    over = cp.asarray(np.array([0, 64, 3], dtype=np.int32))
    with pytest.raises(ValueError, match="cache_seqlens: cache_seqlens \\+ seqlen_new must be <= the cache's capacity 64"):
        cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=over,
                                   backend="cuda", check_inputs=True)
    table = c["block_table"].copy()
    table[1, 0] = -3
    with pytest.raises(ValueError, match="block_table: entries must be page indices"):
        cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], cache_seqlens=3, block_table=table,
                                   backend="cuda", check_inputs=True)
    # without check_inputs the same device values run (clamped)
    cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], cache_seqlens=3, block_table=table,
                               backend="cuda")
    cp.cuda.get_current_stream().synchronize()


def test_torch_tensors(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    cp, cf = gpu.cp, gpu.cuflash
    c = make_cache(np.random.default_rng(5), B, 2, H, HK, 128, 512, 2, [10, 0, 400], page_size=64,
                   dtype=np.float32)
    t = {n: torch.from_numpy(c[n]).to("cuda", torch.bfloat16) for n in ("q", "k_cache", "v_cache", "k", "v")}
    cs = torch.tensor([10, 0, 400], dtype=torch.int32, device="cuda")
    o = cf.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], cache_seqlens=cs, causal=True)
    assert isinstance(o, torch.Tensor) and o.is_cuda and o.dtype == torch.bfloat16
    torch.cuda.synchronize()
    got = cp.from_dlpack(t["k_cache"][:, 10:12])  # the append, in the tensor's own memory
    assert gpu.same_bits(got[0], cp.from_dlpack(t["k"][0])) == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_other_backends_on_device_caches(gpu, backend, dtype):
    """The Numba backend (its own kernels) and the NumPy backend (on the host, the append on the device) given
    CuPy caches: o and lse by the rule (fp32: the Numba bound), the append in the caches' own memory, the paged
    pool bitwise the dense cache (at one split count: num_splits=0 may split pages of 16 more)."""
    from cuflash.backends import numba as nb

    if backend == "numba" and (not nb.available()[0] or nb._simulator()):
        pytest.skip("the Numba backend needs numba-cuda on a GPU")
    cp, cf = gpu.cp, gpu.cuflash
    ctx = f"{backend} {dtype}"
    c = _device(gpu, make_cache(np.random.default_rng(6), B, 3, H, HK, 64, 256, 3, [40, 0, 253], page_size=16,
                                dtype=gpu.np_dtype(dtype)))
    cs = cp.asarray(np.array([40, 0, 253], dtype=np.int32))
    kw = dict(causal=True, num_splits=2, backend=backend)
    o, lse = cf.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                        return_lse=True, **kw)
    assert isinstance(o, cp.ndarray) and isinstance(lse, cp.ndarray), f"[{ctx}] results not CuPy arrays"
    if dtype == "float32":
        r64 = kv_reference(*(c[n].astype(cp.float64) for n in ("q", "k_logical", "v_logical")), c["counts"],
                           causal=True)
        err = float(cp.max(cp.abs(o - r64[0])))
        assert err <= FP32_FORWARD_ATOL["numba"] * max(1.0, float(cp.max(cp.abs(r64[0])))), f"[{ctx}] o: {err:.3e}"
    else:
        _check(gpu, ctx, dtype, o, lse, *_references(gpu, dtype, c, {"causal": True}))
    for n in ("k", "v"):
        assert gpu.same_bits(c[f"{n}_cache"], c[f"{n}_logical"]) == 0, f"[{ctx}] {n}_cache after the append"
    o2 = cf.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"], cache_seqlens=cs,
                                    block_table=c["block_table"], **kw)
    assert gpu.same_bits(o2, o) == 0, f"[{ctx}] paged differs from dense"


def test_jax_arrays(gpu):
    """JAX arrays on the GPU in, a JAX array out, bitwise the CuPy call's; a JAX cache is refused an append
    (JAX arrays are immutable) before anything runs."""
    jax, dev = jax_gpu()
    cp, cf = gpu.cp, gpu.cuflash
    c = _device(gpu, make_cache(np.random.default_rng(7), B, 1, H, HK, 128, 512, 1, [10, 0, 400],
                                dtype=gpu.np_dtype("bfloat16")))
    cs = cp.asarray(c["counts"])
    want, want_lse = cf.flash_attn_with_kvcache(c["q"], c["k_logical"], c["v_logical"], cache_seqlens=cs,
                                                return_lse=True, backend="cuda")
    j = {n: jax.device_put(jax.dlpack.from_dlpack(c[n]), dev) for n in ("q", "k_logical", "v_logical", "k", "v")}
    js = jax.device_put(jax.dlpack.from_dlpack(cs), dev)
    with pytest.raises(TypeError, match="k_cache: a JAX array cannot be written in place"):
        cf.flash_attn_with_kvcache(j["q"], j["k_logical"], j["v_logical"], j["k"], j["v"], cache_seqlens=js - 1)
    o, lse = cf.flash_attn_with_kvcache(j["q"], j["k_logical"], j["v_logical"], cache_seqlens=js, return_lse=True)
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array), f"results: {type(o)}, {type(lse)}"
    assert gpu.same_bits(cp.from_dlpack(o), want) == 0 and gpu.same_bits(cp.from_dlpack(lse), want_lse) == 0


# The plan cache (cuflash/_plan.py): a call whose signature repeats launches from the plan its first call left,
# kvcache_append first where there are new rows or an int cache_seqlens. The plan's result and caches must be
# bitwise the general path's, for CuPy and torch inputs, whichever kernel serves the call.
# (id, dtype, b, sq, h, hk, d, capacity, page_size, cache_seqlens, seqlen_new, causal, variants)
PLAN_CASES = [
    ("decode-split", "bfloat16", 1, 1, 16, 2, 128, 4096, None, [3000], 1, False, {}),  # num_splits=0 splits it
    ("decode-paged-int", "float16", 3, 1, 8, 2, 64, 1024, 64, 700, 1, False, {}),
    ("speculative-paged", "bfloat16", 2, 4, 8, 2, 128, 1024, 16, [500, 9], 4, True, {}),
    ("chunk", "bfloat16", 2, 200, 8, 2, 128, 1024, None, [300, 0], 200, True, {}),  # flash_fwd_sm90 on Hopper
    ("chunk-paged-int", "float16", 2, 130, 4, 4, 64, 512, 64, 100, 130, True, {}),
    ("no-append", "bfloat16", 2, 1, 8, 2, 128, 2048, None, [2000, 5], 0, False, {}),
    ("no-append-int-fp32", "float32", 2, 3, 4, 2, 64, 256, None, 100, 0, True, {}),  # the SIMT forward
    ("window-softcap", "bfloat16", 3, 2, 8, 2, 96, 1024, 16, [700, 0, 1017], 2, True,
     dict(window=(100, 0), softcap=4.0)),
    ("window-softcap-chunk-int", "float16", 2, 150, 8, 2, 128, 512, None, 200, 150, False,
     dict(window=(64, 32), softcap=30.0)),
]


def _plan_inputs(gpu, kind, dtype, b, sq, h, hk, d, cap, page, lens, new, seed):
    """One call's arrays as `kind` ("cupy" or "torch"): q, (k_cache, v_cache), k, v (None without new rows),
    cache_seqlens (an int, or an int32 array) and block_table (None for a dense cache)."""
    c = make_cache(np.random.default_rng(seed), b, sq, h, hk, d, cap, new, lens, page_size=page, dtype=np.float32)
    names = ["q", "k_cache_paged" if page else "k_cache", "v_cache_paged" if page else "v_cache", "k", "v"]
    if kind == "torch":
        import torch

        tdt = getattr(torch, dtype)
        arrs = [None if c[n] is None else torch.from_numpy(c[n]).to("cuda", tdt) for n in names]
        index = lambda x: None if x is None else torch.from_numpy(np.asarray(x, dtype=np.int32)).cuda()
    else:
        arrs = [None if c[n] is None else gpu.cp.asarray(c[n]).astype(gpu.np_dtype(dtype)) for n in names]
        index = lambda x: None if x is None else gpu.cp.asarray(np.asarray(x, dtype=np.int32))
    q, kc, vc, k, v = arrs
    cs = lens if isinstance(lens, int) else index(lens)
    return q, (kc, vc), k, v, cs, index(c.get("block_table")) if page else None


def _raw(x, cp):
    """x's bytes as a CuPy uint8 array (torch tensors through DLPack)."""
    if not isinstance(x, cp.ndarray):
        import torch

        x = cp.from_dlpack(x.contiguous().view(torch.uint8))
    return x.view(cp.uint8)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("name,dtype,b,sq,h,hk,d,cap,page,lens,new,causal,variants", PLAN_CASES,
                         ids=[c[0] for c in PLAN_CASES])
def test_plan_is_the_general_path(gpu, monkeypatch, kind, name, dtype, b, sq, h, hk, d, cap, page, lens, new, causal,
                                  variants):
    """The general path (no key), then the signature's first call (it builds the plan and runs from it) and its
    second (the plan alone): o, lse and the caches bitwise alike; with an int cache_seqlens, another value through
    the plan against the general path's, and a value the cache cannot hold refused with the general path's error."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
    cp, cf = gpu.cp, gpu.cuflash
    from cuflash import _plan, api

    q, caches, k, v, cs, table = _plan_inputs(gpu, kind, dtype, b, sq, h, hk, d, cap, page, lens, new, seed=len(name))
    general_calls = []
    general = api._with_kvcache
    monkeypatch.setattr(api, "_with_kvcache", lambda *a, **kw: general_calls.append(1) or general(*a, **kw))

    def call(caches, start):
        kc, vc = (x.clone() if kind == "torch" else x.copy() for x in caches)
        o, lse = cf.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=start, block_table=table, causal=causal,
                                            return_lse=True, backend="cuda", **variants)
        return o, lse, kc, vc

    monkeypatch.setattr(_plan, "KVCACHE", {})
    with monkeypatch.context() as m:  # the general path: no key, no plan
        m.setattr(_plan, "kvcache_key", lambda *a: None)
        general_result = call(caches, cs)
    assert len(general_calls) == 1 and not _plan.KVCACHE, name
    first = call(caches, cs)  # the general path validates, leaves a plan and runs from it
    assert len(general_calls) == 2 and len(_plan.KVCACHE) == 1, name
    if kind == "cupy":  # what the plan allocates reads as NaN until written
        gpu.poison(4 * (first[0].nbytes + first[1].nbytes) + (1 << 20))
    second = call(caches, cs)  # the plan alone
    cp.cuda.runtime.deviceSynchronize()
    assert len(general_calls) == 2, f"{name}: the second call did not run from the plan"
    for run in (first, second):
        for what, x, y in zip(("o", "lse", "k_cache", "v_cache"), general_result, run):
            assert int(cp.count_nonzero(_raw(x, cp) != _raw(y, cp))) == 0, f"[{name} {kind}] {what}: plan != general"
    if isinstance(cs, int):  # another start through the plan, against the general path's
        from_plan = call(caches, cs - 1)
        assert len(general_calls) == 2
        with monkeypatch.context() as m:
            m.setattr(_plan, "kvcache_key", lambda *a: None)
            from_general = call(caches, cs - 1)
        cp.cuda.runtime.deviceSynchronize()
        for what, x, y in zip(("o", "lse", "k_cache", "v_cache"), from_plan, from_general):
            assert int(cp.count_nonzero(_raw(x, cp) != _raw(y, cp))) == 0, f"[{name} {kind}] start - 1: {what}"
        # a start the cache cannot hold: the general path's error, from the planned signature too
        with pytest.raises(ValueError, match="cache_seqlens \\+ seqlen_new must be <= the cache's capacity"):
            call(caches, cap - new + 1)


def test_decoding_step_in_a_torch_cuda_graph(gpu):
    """A decoding step from its plan (the append, then the attention) captured in a torch CUDA graph: replayed after
    new q, k, v values and cache_seqlens + 1 are written into the captured buffers, it leaves the caches and the
    output bitwise as an eager call on a copy does."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    cp, cf = gpu.cp, gpu.cuflash
    b, h, hk, d, cap, page = 2, 8, 2, 128, 256, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    draw = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)
    pages = b * cap // page + 2
    kc, vc = draw(pages, page, hk, d), draw(pages, page, hk, d)
    table = torch.randperm(pages, device="cuda", generator=gen)[:b * cap // page].reshape(b, -1).to(torch.int32)
    q, k, v = draw(b, 1, h, d), draw(b, 1, hk, d), draw(b, 1, hk, d)
    cs = torch.tensor([100, 7], dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return cf.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cs, block_table=table, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(kc, vc)  # compile, plan, warm the graph pool's allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(kc, vc)
    kc2, vc2 = kc.clone(), vc.clone()
    for x in (q, k, v):
        x.copy_(draw(*x.shape))
    cs.add_(1)
    graph.replay()
    eager = step(kc2, vc2)
    torch.cuda.synchronize()
    for name, x, y in (("o", captured[0], eager[0]), ("lse", captured[1], eager[1]), ("k_cache", kc, kc2),
                       ("v_cache", vc, vc2)):
        assert int(cp.count_nonzero(_raw(x, cp) != _raw(y, cp))) == 0, f"{name}: graph replay differs from eager"
    assert bool(torch.isfinite(captured[0].float()).all())
    # the replay appended at the new counts: rows 101 and 8 hold this step's k
    for e, row in ((0, 101), (1, 8)):
        got = kc[table[e, row // page], row % page]
        assert torch.equal(got.view(torch.int16), k[e, 0].view(torch.int16)), f"entry {e}: row {row}"


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_plan_refuses_caches_that_share_memory(gpu, monkeypatch, kind):
    """A planned signature's later call whose caches share elements (one array for both, caches a row apart in
    one buffer) or whose q lies in a cache: the general path's error, nothing appended. Interleaved halves of one
    buffer run from the plan, bitwise as contiguous copies of them, once a call has validated their distance."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
    cp, cf = gpu.cp, gpu.cuflash
    from cuflash import _plan, api

    b, h, hk, d, cap = 2, 8, 2, 64, 256
    rs = gpu.rng(f"plan-shared-caches-{kind}")
    as_kind = (lambda x: x) if kind == "cupy" else (lambda x: torch.from_dlpack(x))
    new = lambda *shape: gpu.randn(rs, shape, "bfloat16")
    q, k, v = new(b, 1, h, d), new(b, 1, hk, d), new(b, 1, hk, d)
    lens = cp.asarray([100, 7], dtype=cp.int32)
    general_calls = []
    general = api._with_kvcache
    monkeypatch.setattr(api, "_with_kvcache", lambda *a, **kw: general_calls.append(1) or general(*a, **kw))
    monkeypatch.setattr(_plan, "KVCACHE", {})

    def call(kc, vc, q=q):
        return cf.flash_attn_with_kvcache(*map(as_kind, (q, kc, vc, k, v)), cache_seqlens=as_kind(lens),
                                         backend="cuda")

    def refused(kc, vc, msg, q=q):
        before, calls = (kc.copy(), vc.copy()), len(general_calls)
        with pytest.raises(ValueError, match=msg):
            call(kc, vc, q)
        cp.cuda.runtime.deviceSynchronize()
        assert len(general_calls) == calls + 1  # the plan handed the call to the general path
        assert gpu.same_bits(kc, before[0]) == 0 and gpu.same_bits(vc, before[1]) == 0

    # caches a row apart in one buffer: the plan comes from two buffers of that layout
    x, y, z = new(b, cap + 1, hk, d), new(b, cap + 1, hk, d), new(b, cap + 1, hk, d)
    call(x[:, :-1], y[:, 1:])
    call(x[:, :-1], y[:, 1:])
    assert len(general_calls) == 1 and len(_plan.KVCACHE) == 1
    refused(z[:, :-1], z[:, 1:], "k_cache: must not share memory with v_cache")
    # one array for both, and q inside k_cache
    kc, vc = new(b, cap, hk, d), new(b, cap, hk, d)
    call(kc, vc)
    refused(kc, kc, "k_cache: must not share memory with v_cache \\(one array for both\\)")
    in_cache = kc.reshape(-1)[: q.size].reshape(q.shape)
    refused(kc, vc, "k_cache: must not share memory with q", q=in_cache)
    # interleaved halves: from the plan, bitwise as contiguous copies
    halves = new(b, cap, 2, hk, d)
    first = call(halves[:, :, 0].copy(), halves[:, :, 1].copy())  # contiguous caches (their plan, built above)
    pair = new(b, cap, 2, hk, d)
    call(pair[:, :, 0], pair[:, :, 1])  # builds the interleaved signature's plan
    calls = len(general_calls)
    o = call(halves[:, :, 0], halves[:, :, 1])
    cp.cuda.runtime.deviceSynchronize()
    assert len(general_calls) == calls, "interleaved caches did not run from the plan"
    assert gpu.same_bits(cp.from_dlpack(o), cp.from_dlpack(first)) == 0
    # the halves swapped: a distance not yet validated takes the general path once, then the plan
    call(halves[:, :, 1], halves[:, :, 0])
    call(halves[:, :, 1], halves[:, :, 0])
    assert len(general_calls) == calls + 1
