"""The Hopper kernels (kernels_cu/flash_fwd_sm90.cu, flash_bwd_sm90.cu) beside the mma.sync ones, on a compute
capability 9.0 GPU (skipped elsewhere). The rest of the GPU suite runs them too, as the default of every
16-bit dense call they serve there; these tests check what is their own: which family runs, that both
families meet the accuracy rule on the same inputs, that a cached plan re-addresses its tensor maps, and
the fallbacks."""

from __future__ import annotations

import pytest

import cuflash
from cuflash import _compile, _plan, config

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper(gpu):
    from cuflash.backends import cuda

    if cuda.compute_capability() != 90:
        pytest.skip("needs a compute capability 9.0 GPU (H100, H200)")
    return gpu


def _qkv(gpu, key, dtype, b, sq, sk, h, hk, d):
    rs = gpu.rng(key)
    return [gpu.randn(rs, s, dtype) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


def _forward_error(gpu, dtype, causal, q, k, v, o, lse):
    """max|o - ref64| against the rule's bound (2 x the same-precision error + atol), and max|lse - ref64|."""
    cp = gpu.cp
    r64, sp = gpu.references(dtype, causal, None, q, k, v, q, forward_sp=True)
    mag = max(1.0, float(cp.max(cp.abs(r64["o"]))))
    bound = 2 * gpu._max_abs(sp["o"], r64["o"]) + 1e-5 * mag
    finite = cp.isfinite(r64["lse"])
    lse_err = float(cp.max(cp.abs(cp.where(finite, lse.astype(cp.float64) - r64["lse"], 0.0))))
    return gpu._max_abs(o, r64["o"]), bound, lse_err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [40, 64, 128, 200, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_families_meet_the_rule_on_the_same_inputs(hopper, dtype, d, causal):
    q, k, v = _qkv(hopper, f"sm90-{dtype}-{d}-{causal}", dtype, 2, 391, 517, 4, 2, d)
    errors = {}
    for family in ("sm90", "mma"):
        with cuflash.kernel_family(family):
            o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        errors[family] = _forward_error(hopper, dtype, causal, q, k, v, o, lse)
    for family, (err, bound, lse_err) in errors.items():
        assert err <= bound and lse_err <= 1e-4, f"{family}: o error {err:.3e} (bound {bound:.3e}), lse {lse_err:.3e}"


@pytest.mark.parametrize("d", [40, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiles_by_key_count_meet_the_rule(hopper, d, causal):
    """Each of _TILES_BY_KEYS' tiles, 37 keys past the count that takes it: tails in both lengths, GQA, the
    bottom-right causal diagonal inside a key block; one consumer warpgroup (block_m 64, two blocks an SM, no
    turns) where the tile has one, with causal rows that see no key (seqlen_q > seqlen_k)."""
    from cuflash.backends import cuda

    cp = hopper.cp
    steps = config._TILES_BY_KEYS["flash_fwd_sm90"][64 if d <= 64 else d][1 if causal else 0]
    for fewest, (block_m, block_n, warps) in steps:
        sk = fewest + 37
        for b, sq in ((2, 333), (1, sk + 70)):
            q, k, v = _qkv(hopper, f"sm90-keys-{d}-{causal}-{sk}-{sq}", "bfloat16", b, sq, sk, 4, 2, d)
            o, lse = hopper.nan_like(q), cp.empty((b, 4, sq), cp.float32)
            launches = cuda.forward_launches(q, k, v, o, lse, causal=causal, softmax_scale=d ** -0.5)
            assert launches.kernels[0][1] == config.ceil_div(sq, block_m) and launches.kernels[0][4] == 32 * warps
            launches.run(cp.cuda.get_current_stream().ptr)
            err, bound, lse_err = _forward_error(hopper, "bfloat16", causal, q, k, v, o, lse)
            assert err <= bound and lse_err <= 1e-4, \
                f"{block_m, block_n} at {b, sq, sk}: o error {err:.3e} (bound {bound:.3e}), lse {lse_err:.3e}"


def test_hopper_forward_is_the_default(hopper):
    from cuflash.backends import cuda

    q, k, v = _qkv(hopper, "sm90-default", "bfloat16", 1, 256, 256, 2, 2, 128)
    launches = cuda.forward_launches(q, k, v, hopper.nan_like(q), hopper.cp.empty((1, 2, 256), hopper.cp.float32),
                                     causal=True, softmax_scale=128 ** -0.5)
    assert isinstance(launches, cuda.TmaLaunches)
    with cuflash.kernel_family("mma"):
        launches = cuda.forward_launches(q, k, v, hopper.nan_like(q), hopper.cp.empty((1, 2, 256), hopper.cp.float32),
                                         causal=True, softmax_scale=128 ** -0.5)
    assert not isinstance(launches, cuda.TmaLaunches)


def test_cached_plan_readdresses_its_tensor_maps(hopper):
    """A plan made on one set of arrays runs another set of the same signature: its q, k, v tensor maps must
    follow (the result equals a fresh, uncached call's bit for bit)."""
    first = _qkv(hopper, "sm90-plan-a", "bfloat16", 2, 300, 300, 4, 4, 64)
    second = _qkv(hopper, "sm90-plan-b", "bfloat16", 2, 300, 300, 4, 4, 64)
    _plan.FORWARD.clear()
    cuflash.flash_attn_forward(*first, causal=True)
    assert len(_plan.FORWARD) == 1
    o_cached, lse_cached = cuflash.flash_attn_forward(*second, causal=True)
    _plan.FORWARD.clear()
    o_fresh, lse_fresh = cuflash.flash_attn_forward(*second, causal=True)
    assert hopper.same_bits(o_cached, o_fresh) == 0 and hopper.same_bits(lse_cached, lse_fresh) == 0


def test_broadcast_kv_heads(hopper):
    """k and v broadcast over heads (head stride 0): whatever kernel takes it, the result is right."""
    cp = hopper.cp
    q, k1, v1 = _qkv(hopper, "sm90-broadcast", "float16", 1, 200, 300, 4, 1, 128)
    k, v = (cp.broadcast_to(x, (1, 300, 4, 128)) for x in (k1, v1))
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=False)
    err, bound, lse_err = _forward_error(hopper, "float16", False, q, cp.ascontiguousarray(k), cp.ascontiguousarray(v),
                                         o, lse)
    assert err <= bound and lse_err <= 1e-4


def test_forcing_sm90_where_it_cannot_serve_raises(hopper):
    """The Hopper kernels serve varlen, but not the backward of varlen with ALiBi and dropout together."""
    cp = hopper.cp
    q, k, v = (x[0] for x in _qkv(hopper, "sm90-varlen", "bfloat16", 1, 64, 64, 2, 2, 64))
    cu = cp.asarray([0, 30, 64], dtype=cp.int32)
    kw = {"alibi_slopes": cp.asarray([0.5, 0.25], dtype=cp.float32), "dropout_p": 0.1, "seed": 1}
    with cuflash.kernel_family("sm90"):
        o, lse = cuflash.flash_attn_varlen_forward(q, k, v, cu, cu, 34, 34, **kw)
        with pytest.raises(ValueError, match="sm90 kernel family cannot serve this backward"):
            cuflash.flash_attn_varlen_backward(o, q, k, v, o, lse, cu, cu, 34, 34, **kw)


@pytest.mark.parametrize("d,cu_q,cu_k", [
    (64, [0, 100, 100, 357, 700], [0, 130, 250, 517, 610]),
    (128, [0, 100, 100, 357, 700], [0, 130, 250, 517, 610]),
    (128, [0, 300, 600], [0, 4100, 4300]),  # _TILES_BY_KEYS' 176-key blocks where not causal
    (64, [0, 300, 600], [0, 2100, 2300]),  # its 64 x 192 blocks (one consumer), causal too
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_on_the_hopper_kernel(hopper, d, cu_q, cu_k, causal):
    """Packed sequences (an empty one; tiles that run past a sequence into the next; causal rows that see no
    key) on flash_fwd_sm90: each sequence meets the accuracy rule against the reference of its rows alone. The
    first sequence's last key tile reaches into the second, whose V holds an inf: the first stays finite (its
    tile's V rows past its end are zeroed, not multiplied by P = 0)."""
    cp = hopper.cp
    q, k, v = (x[0] for x in _qkv(hopper, f"sm90-varlen-{d}-{len(cu_k)}-{causal}", "bfloat16", 1, cu_q[-1],
                                  cu_k[-1], 4, 2, d))
    v[cu_k[1] + 3, 1, 5] = float("inf")
    cus = [cp.asarray(c, dtype=cp.int32) for c in (cu_q, cu_k)]
    lengths = [max(b - a for a, b in zip(c, c[1:])) for c in (cu_q, cu_k)]
    with cuflash.kernel_family("sm90"):
        o, lse = cuflash.flash_attn_varlen_forward(q, k, v, *cus, *lengths, causal=causal)
    for i in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[i], cu_q[i + 1]), (cu_k[i], cu_k[i + 1])
        if i == 1 or q1 == q0:  # the sequence holding the inf: not finite, as its reference
            continue
        err, bound, lse_err = _forward_error(hopper, "bfloat16", causal, q[None, q0:q1], k[None, k0:k1],
                                             v[None, k0:k1], o[None, q0:q1], lse[None, :, q0:q1])
        assert err <= bound and lse_err <= 1e-4, \
            f"sequence {i}: o error {err:.3e} (bound {bound:.3e}), lse {lse_err:.3e}"


@pytest.mark.parametrize("d,deterministic", [(64, False), (128, False), (128, True), (256, False), (256, True)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_backward_on_the_hopper_kernel(hopper, d, deterministic, causal):
    """flash_bwd_sm90 on packed sequences: each meets the accuracy rule against the reference of its rows alone
    (test_varlen_forward_on_the_hopper_kernel's sequences). Sequence 0's last key block reaches into sequence
    1's keys and its last query block into sequence 2's queries, which hold an inf in K, V, Q and dO: sequences
    0 and 3 stay finite (the rows past a sequence are zeroed, not multiplied by P = 0 or dS = 0)."""
    if _compile.nvrtc_major() < config.SM90_BWD_VARLEN_NVRTC:
        pytest.skip("NVRTC 12 builds the varlen Hopper backward with spills: flash_bwd serves varlen there")
    cp = hopper.cp
    cu_q, cu_k = [0, 100, 100, 357, 700], [0, 130, 250, 517, 610]
    key = f"sm90-varlen-bwd-{d}-{deterministic}-{causal}"
    q, k, v = (x[0] for x in _qkv(hopper, key, "bfloat16", 1, cu_q[-1], cu_k[-1], 4, 2, d))
    do = hopper.randn(hopper.rng(key + "-do"), q.shape, "bfloat16")
    for x, row in ((k, cu_k[1] + 3), (v, cu_k[1] + 3), (q, cu_q[2] + 5), (do, cu_q[2] + 5)):
        x[row, 1, 5] = float("inf")
    cus = [cp.asarray(c, dtype=cp.int32) for c in (cu_q, cu_k)]
    lengths = [max(b - a for a, b in zip(c, c[1:])) for c in (cu_q, cu_k)]
    with cuflash.kernel_family("sm90"):
        o, lse = cuflash.flash_attn_varlen_forward(q, k, v, *cus, *lengths, causal=causal)
        dq, dk, dv = cuflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *cus, *lengths, causal=causal,
                                                        deterministic=deterministic)
    for i in (0, 3):
        (q0, q1), (k0, k1) = (cu_q[i], cu_q[i + 1]), (cu_k[i], cu_k[i + 1])
        qs, dos, os_, dqs = (x[None, q0:q1] for x in (q, do, o, dq))
        ks, vs, dks, dvs = (x[None, k0:k1] for x in (k, v, dk, dv))
        hopper.check(f"sequence {i} d={d} deterministic={deterministic} causal={causal}", "bfloat16", causal, None,
                     qs, ks, vs, dos, os_, lse[None, :, q0:q1], dqs, dks, dvs)


@pytest.mark.parametrize("page_size", [None, 48, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_cache_prefill_on_the_hopper_kernel(hopper, page_size, causal):
    """flash_attn_with_kvcache with query chunks too long for the decode kernel, on flash_fwd_sm90 (forced: it
    raises where it cannot serve): a dense cache, or pages of 48 rows (boxes of 16) or 256 (boxes of 128),
    NaN in every cache row past an entry's keys and table entries past the used pages outside the pool;
    against the reference over each entry's keys, and paged bitwise equal to dense."""
    import numpy as np
    from test_gpu_kvcache import _check, _device, _references
    from test_kvcache import make_cache

    cp = hopper.cp
    lens, sq, ps = [300, 0, 660], 100, page_size or 256
    c = make_cache(np.random.default_rng(ps + causal), 3, sq, 8, 2, 128, 768, sq, lens, page_size=ps,
                   dtype=hopper.np_dtype("bfloat16"))
    for i, n in enumerate(c["counts"]):  # stale rows: past the keys after the append
        for name in ("k", "v"):
            c[f"{name}_cache"][i, n:] = np.nan
            for j in range(n, 768):
                c[f"{name}_cache_paged"][c["block_table"][i, j // ps], j % ps] = np.nan
        c["block_table"][i, -(-n // ps):] = 1 << 20
    c = _device(hopper, c)
    cs = cp.asarray(np.array(lens, dtype=np.int32))
    ctx = f"page_size={page_size} causal={causal}"
    with cuflash.kernel_family("sm90"):
        o, lse = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], cache_seqlens=cs,
                                                 causal=causal, return_lse=True, backend="cuda")
        _check(hopper, ctx, "bfloat16", o, lse, *_references(hopper, "bfloat16", c, {"causal": causal}))
        if page_size:
            o2, lse2 = cuflash.flash_attn_with_kvcache(c["q"], c["k_cache_paged"], c["v_cache_paged"], c["k"], c["v"],
                                                       cache_seqlens=cs, block_table=c["block_table"], causal=causal,
                                                       return_lse=True, backend="cuda")
            assert hopper.same_bits(o2, o) == 0 and hopper.same_bits(lse2, lse) == 0, f"[{ctx}] paged differs"


def _training_step(gpu, dtype, causal, key, b, sq, sk, h, hk, d):
    q, k, v = _qkv(gpu, key, dtype, b, sq, sk, h, hk, d)
    do = gpu.randn(gpu.rng(key + "-do"), q.shape, dtype)
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
    dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    return (q, k, v, do), (o, lse, dq, dk, dv)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [40, 64, 96, 128, 200, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_families_meet_the_rule_on_the_same_inputs(hopper, dtype, d, causal):
    """Tails (517 queries, 391 keys: query blocks of 64 and key blocks of 128 or 64 cut short), GQA (4 heads on
    2), head dims padded to the compiled 64 / 128 / 256 (d = 200: dQ's accumulator 224 floats wide, the split
    dims' second consumer adding 96 of its 128 columns); causal with rows that see no key."""
    for family in ("sm90", "mma"):
        with cuflash.kernel_family(family):
            (q, k, v, do), out = _training_step(hopper, dtype, causal, f"sm90-bwd-{dtype}-{d}-{causal}", 2, 517, 391,
                                                4, 2, d)
        hopper.check(f"{family} {dtype} d={d} causal={causal}", dtype, causal, None, q, k, v, do, *out)


def test_hopper_backward_is_the_default_where_it_serves(hopper):
    from cuflash import _params
    from cuflash.backends import cuda

    cp = hopper.cp

    def launches(d, **kw):
        q, k, v = _qkv(hopper, f"sm90-bwd-default-{d}", "bfloat16", 1, 256, 256, 2, 2, d)
        o, lse = hopper.nan_like(q), cp.empty((1, 2, 256), cp.float32)
        grads = [hopper.nan_like(x) for x in (q, k, v)]
        ws = cp.empty(_params.workspace_layout(q, None, kw.get("deterministic", False)).nbytes, cp.uint8)
        return cuda.backward_launches(q, q, k, v, o, lse, *grads, ws, causal=True, softmax_scale=d ** -0.5, **kw)

    assert isinstance(launches(128), cuda.TmaLaunches)
    assert isinstance(launches(64, deterministic=True), cuda.TmaLaunches)
    assert isinstance(launches(128, softcap=30.0), cuda.TmaLaunches)
    assert isinstance(launches(256, deterministic=True), cuda.TmaLaunches)
    with cuflash.kernel_family("mma"):
        assert not isinstance(launches(64), cuda.TmaLaunches)
        assert not isinstance(launches(256), cuda.TmaLaunches)


@pytest.mark.parametrize("family", ["sm90", "mma"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_backward_is_bitwise_repeatable(hopper, family, d, causal):
    """deterministic=True, both families: by the rule, and 50 calls bitwise identical. 6 key blocks add into each
    dQ tile in turn (d = 256: 11 blocks of 64 keys; GQA: the blocks of a kv head visit both of its query heads'
    tiles); sm90 at d = 64 sums the two consumers' partials of the one dQ tile before the adds, at d = 256 the
    tile lies over the pair's Q and dO stage (two reduces, whose dQ warp also gives the stage back). (Windows:
    test_gpu_variants' test_variant_deterministic, whose dense 16-bit cases run the sm90 family here.)"""
    (q, k, v, do), (o, lse, *_) = _training_step(hopper, "bfloat16", causal, f"sm90-det-{d}-{causal}", 2, 517, 700,
                                                 4, 2, d)
    with cuflash.kernel_family(family):
        first = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
        hopper.check(f"{family} deterministic d={d} causal={causal}", "bfloat16", causal, None, q, k, v, do, o, lse,
                     *first)
        for call in range(49):
            again = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
            for name, x, y in zip(("dq", "dk", "dv"), first, again):
                assert hopper.same_bits(x, y) == 0, f"{name} differs at call {call + 2}"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_small_backward_grids_split_over_clusters(hopper, monkeypatch, d, causal, split):
    """A grid too small for the GPU runs flash_bwd_sm90 with QUERY_SPLIT (clusters of two blocks, rank 0's dK and
    dV added into rank 1's through the cluster's shared memory): by the rule against the float64 reference, with
    GQA, rows that see no key (causal, seqlen_q > seqlen_k), 7 query blocks (full: 4 and 3), and key blocks whose
    rank 1 has no pair (seqlen_q of one query block); dK and dV bitwise repeatable. "whole": the same shapes with
    config.query_split refusing, the kernel larger grids run (small shapes elsewhere in the suite split)."""
    if not split:
        monkeypatch.setattr(config, "query_split", lambda *args: False)
    for b, sq, sk in ((1, 397, 300), (2, 50, 200)):
        (q, k, v, do), (o, lse, *_) = _training_step(hopper, "bfloat16", causal, f"sm90-split-{d}-{causal}-{sq}", b,
                                                     sq, sk, 4, 2, d)
        _plan.BACKWARD.clear()
        first = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
        (plan,) = _plan.BACKWARD.values()
        # Launches.kernels: (function, grid x, y, z, threads, shared memory) of the pre-, main and postprocess;
        # x: two blocks per kv head with QUERY_SPLIT
        assert plan.launches.kernels[1][1] == 2 * (2 if split else 1)
        hopper.check(f"query split={split} d={d} causal={causal} sq={sq}", "bfloat16", causal, None, q, k, v, do, o,
                     lse, *first)
        again = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
        assert hopper.same_bits(first[1], again[1]) == 0 and hopper.same_bits(first[2], again[2]) == 0
    _plan.BACKWARD.clear()


def test_cached_backward_plan_readdresses_its_tensor_maps(hopper):
    """As for the forward: a backward plan made on one set of arrays runs another (q, k, v and dout maps)."""
    (q1, k1, v1, do1), (o1, lse1, *_) = _training_step(hopper, "bfloat16", True, "sm90-bwd-plan-a", 2, 300, 300, 4,
                                                        2, 128)
    (q, k, v, do), (o, lse, *_) = _training_step(hopper, "bfloat16", True, "sm90-bwd-plan-b", 2, 300, 300, 4, 2, 128)
    _plan.BACKWARD.clear()
    cuflash.flash_attn_backward(do1, q1, k1, v1, o1, lse1, causal=True)
    assert len(_plan.BACKWARD) == 1
    cached = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True)
    _plan.BACKWARD.clear()
    fresh = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True)
    hopper.check("cached plan", "bfloat16", True, None, q, k, v, do, o, lse, *cached)
    # dQ's adds are atomic (their order varies); dK and dV are summed in registers: bitwise repeatable
    assert hopper.same_bits(cached[1], fresh[1]) == 0 and hopper.same_bits(cached[2], fresh[2]) == 0


def test_backward_where_tma_refuses_runs_the_mma_kernel(hopper, monkeypatch):
    """A layout the driver will not map (the refusal faked) sends the backward to flash_bwd, whose dQ accumulator
    is not swizzled as flash_bwd_sm90's is: the postprocess must read it plainly, or dq fails the rule."""
    from cuflash import _tma

    (q, k, v, do), (o, lse, *_) = _training_step(hopper, "bfloat16", True, "sm90-bwd-refused", 2, 300, 300, 4, 2, 128)

    def refuse(*args, **kwargs):
        raise _tma.Unencodable("refused for the test")

    monkeypatch.setattr(_tma, "SM90Params", refuse)
    _plan.BACKWARD.clear()
    try:
        grads = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True)
        assert len(_plan.BACKWARD) == 1
    finally:
        _plan.BACKWARD.clear()
    hopper.check("tma refused", "bfloat16", True, None, q, k, v, do, o, lse, *grads)
