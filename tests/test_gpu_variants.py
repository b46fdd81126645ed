"""Attention variants on the GPU (backend="cuda"): sliding window, softcap, ALiBi, dropout and
variable-length batches, alone and combined, forward and backward, every dtype.

Judged as tests/test_gpu_kernels.py judges plain attention (DESIGN.md's accuracy rule):

    max|ours - ref64| <= 2 * max|same_precision_ref - ref64| + atol

with ref64 and the same-precision reference from cuflash.reference on the GPU, given the keep mask
of cuflash.dropout_mask for dropout (so a kernel whose mask differs from the specified one fails).
float32 forward output: a fixed bound against float64; float64: 1e-12. Rows that see no key must give
o = 0, lse = -inf and dq = 0 exactly. Outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

from conftest import FP32_FORWARD_ATOL, LSE_TOL, RULE_ATOL

pytestmark = pytest.mark.gpu

# (id, dtype, batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, variant keywords). "h" / "bh" slopes
# become random float32 (heads,) / (batch, heads) arrays; "varlen" packs the batch with random lengths.
CASES = [
    ("window", "bfloat16", 2, 300, 411, 4, 2, 128, dict(window=(40, 7))),
    ("window-left-causal", "float16", 2, 257, 257, 2, 2, 64, dict(window=(64, -1), causal=True)),
    ("window-right", "float32", 1, 200, 150, 2, 1, 64, dict(window=(-1, 30))),
    ("window-empty-rows", "bfloat16", 1, 300, 90, 2, 2, 64, dict(window=(5, 0))),
    ("softcap", "bfloat16", 2, 256, 320, 4, 4, 128, dict(softcap=2.0)),
    ("softcap", "float64", 1, 100, 130, 2, 1, 32, dict(softcap=1.5)),
    # tanh's ranges on the 16-bit kernels (tanh.approx there): logits of about +-1 against caps of 0.3
    # (saturated) and 30 with softmax_scale 1 (logits to about +-40: the curved range at a model's cap)
    ("softcap-saturated", "bfloat16", 2, 256, 320, 4, 2, 128, dict(softcap=0.3)),
    ("softcap-curved", "bfloat16", 2, 256, 320, 4, 2, 128, dict(softcap=30.0, softmax_scale=1.0)),
    ("softcap-curved-fp16", "float16", 2, 200, 260, 4, 4, 64, dict(softcap=30.0, softmax_scale=1.0)),
    # bf16 softcaps up to 50 without ALiBi take BOUNDED on flash_fwd (no running max; BOUNDED_CASES):
    # with dropout, a window and varlen
    ("softcap-dropout-window", "bfloat16", 2, 300, 300, 4, 2, 64,
     dict(softcap=20.0, dropout_p=0.1, seed=3, causal=True, window=(64, 0))),
    ("softcap-varlen", "bfloat16", 3, 256, 256, 4, 2, 128, dict(softcap=10.0, causal=True, varlen=True)),
    ("alibi-h-causal", "bfloat16", 2, 192, 192, 4, 2, 64, dict(alibi_slopes="h", causal=True)),
    ("alibi-bh", "float32", 2, 130, 170, 4, 4, 96, dict(alibi_slopes="bh")),
    ("dropout", "bfloat16", 2, 256, 300, 4, 2, 128, dict(dropout_p=0.17, seed=2**40 + 7, offset=3)),
    ("dropout-causal", "float16", 2, 200, 200, 2, 2, 64, dict(dropout_p=0.3, seed=11, causal=True)),
    ("dropout", "float32", 1, 100, 140, 2, 1, 32, dict(dropout_p=0.25, seed=5)),
    ("dropout", "float64", 1, 70, 90, 2, 2, 64, dict(dropout_p=0.4, seed=6, offset=1)),
    ("all-gqa-varlen", "bfloat16", 3, 300, 300, 4, 2, 128,
     dict(causal=True, window=(50, 3), softcap=3.0, alibi_slopes="bh", varlen=True)),
    ("all-gqa-varlen", "float16", 3, 160, 200, 4, 1, 256,
     dict(causal=True, window=(40, 0), softcap=2.5, alibi_slopes="h", varlen=True)),
    ("all-gqa-varlen", "float32", 3, 150, 150, 4, 2, 64,
     dict(causal=True, window=(30, 2), softcap=2.0, alibi_slopes="bh", varlen=True)),
    ("all-gqa-varlen", "float64", 2, 90, 120, 2, 1, 32,
     dict(causal=True, window=(20, 1), softcap=1.0, alibi_slopes="h", varlen=True)),
    ("dropout-causal-varlen", "bfloat16", 3, 256, 256, 4, 4, 64, dict(dropout_p=0.2, seed=9, causal=True, varlen=True)),
    ("dropout-causal-varlen", "float32", 2, 120, 150, 2, 2, 128, dict(dropout_p=0.1, seed=3, causal=True, varlen=True)),
    ("every-variant", "float16", 2, 333, 333, 4, 2, 160,
     dict(causal=True, window=(60, 0), softcap=4.0, alibi_slopes="bh", dropout_p=0.15, seed=1, varlen=True)),
    # dense 16-bit at head dims over 64: the Hopper backward's softcap (1 - t^2 recovered from P) under every
    # other variant, tails and GQA
    ("every-variant-dense", "bfloat16", 2, 333, 401, 4, 2, 128,
     dict(causal=True, window=(60, 0), softcap=4.0, alibi_slopes="bh", dropout_p=0.15, seed=1)),
    ("softcap-alibi-dense", "float16", 2, 200, 170, 4, 1, 96, dict(softcap=1.5, alibi_slopes="h")),
    ("window-long", "bfloat16", 1, 2048, 2048, 2, 2, 64, dict(window=(128, 128))),
    # enough key blocks for the backward's large tile (the small-grid rule gives the small cases another)
    ("window-wide-grid", "float16", 4, 1024, 1024, 8, 4, 128, dict(window=(100, 50))),
]


def _lengths(rs, batch, longest):
    """Random lengths for a varlen batch, one of them 0 and one `longest`."""
    n = [int(x) for x in rs.integers(1, longest + 1, size=batch)]
    n[0], n[-1] = longest, 0
    return n


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _case_inputs(gpu, key, dtype, b, sq, sk, h, hk, d, kw):
    cp = gpu.cp
    rs = gpu.rng(key)
    kw = dict(kw)
    varlen = kw.pop("varlen", False)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = cp.asarray(rs.uniform(0.05, 0.5, (h,)), dtype=cp.float32)
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = cp.asarray(rs.uniform(0.05, 0.5, (b, h)), dtype=cp.float32)
    if varlen:
        host = np.random.default_rng(len(key))
        lq = _lengths(host, b, sq)
        lk = lq if sq == sk else _lengths(host, b, sk)
        cu_q, cu_k = _cu(lq), _cu(lk)
        shapes = ((cu_q[-1], h, d), (cu_k[-1], hk, d), (cu_k[-1], hk, d), (cu_q[-1], h, d))
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    else:
        shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
        packed = None
    q, k, v, do = (gpu.randn(rs, s, dtype) for s in shapes)
    return q, k, v, do, kw, packed


def _run(gpu, dtype, q, k, v, do, kw, packed, deterministic=False, repeats=1):
    """Forward into a NaN-filled out= and backward, through the public API on backend='cuda'. With
    repeats > 1 the backward runs again (poisoned pool) and must give the same bits each time."""
    cf = gpu.cuflash
    lse_isz = 8 if dtype == "float64" else 4
    rows, d = q.size // q.shape[-1], q.shape[-1]  # query rows times heads
    # o, lse, the gradients, and the workspace: D, the fp32 dQ accumulator (at most 256 wide), semaphores
    nbytes = 2 * q.nbytes + 2 * k.nbytes + 2 * rows * lse_isz + rows * 256 * 4 + rows * 4
    out = gpu.nan_like(q)
    gpu.poison(nbytes)
    if packed is None:
        o, lse = cf.flash_attn_forward(q, k, v, backend="cuda", out=out, **kw)
        backward = lambda: cf.flash_attn_backward(do, q, k, v, o, lse, backend="cuda", deterministic=deterministic,  # noqa: E731
                                                  **kw)
    else:
        cu = {n: gpu.cp.asarray(packed[n]) for n in ("cu_seqlens_q", "cu_seqlens_k")}
        lens = (packed["max_seqlen_q"], packed["max_seqlen_k"])
        o, lse = cf.flash_attn_varlen_forward(q, k, v, *cu.values(), *lens, backend="cuda", out=out, **kw)
        backward = lambda: cf.flash_attn_varlen_backward(do, q, k, v, o, lse, *cu.values(), *lens,  # noqa: E731
                                                         backend="cuda", deterministic=deterministic, **kw)
    assert o is out
    gpu.poison(nbytes)
    grads = backward()
    for i in range(1, repeats):
        gpu.poison(nbytes)
        for name, x, x0 in zip(("dq", "dk", "dv"), backward(), grads):
            n = gpu.same_bits(x, x0)
            assert not n, f"backward call {i + 1}/{repeats}: {name} differs from call 1 in {n} of {x.size} elements"
    return (o, lse, *grads)


def _references(gpu, dtype, q, k, v, do, kw, packed):
    """(ref64, same_precision) tuples of (o, lse, dq, dk, dv), on the GPU, with the specified keep mask."""
    cp, ref, cf = gpu.cp, gpu.ref, gpu.cuflash
    rk = dict(kw)
    rk.pop("seed", None), rk.pop("offset", None)
    if kw.get("dropout_p"):
        if packed is None:
            b, sq, h, _ = q.shape
            sk = k.shape[1]
        else:
            b, sq, sk, h = len(packed["cu_seqlens_q"]) - 1, packed["max_seqlen_q"], packed["max_seqlen_k"], q.shape[1]
        rk["dropout_mask"] = cp.asarray(cf.dropout_mask(b, h, sq, sk, dropout_p=kw["dropout_p"], seed=kw["seed"],
                                                        offset=kw.get("offset", 0)))
    if packed is not None:
        rk.update(cu_seqlens_q=packed["cu_seqlens_q"], cu_seqlens_k=packed["cu_seqlens_k"])
    q64, k64, v64, do64 = (x.astype(cp.float64) for x in (q, k, v, do))
    r64 = (*ref.forward(q64, k64, v64, **rk), *ref.backward(do64, q64, k64, v64, **rk))
    if dtype == "float64":
        return r64, r64
    sp = (*ref.forward(q64, k64, v64, precision=dtype, **rk), *ref.backward(do64, q64, k64, v64, precision=dtype, **rk))
    return r64, sp


def _check(gpu, ctx, dtype, got, r64, sp):
    cp = gpu.cp
    f64 = lambda x: x.astype(cp.float64)
    fails = []
    names = ("o", "lse", "dq", "dk", "dv")
    for name, x in zip(names, got):
        n = gpu.count_nan(x)
        if n:
            fails.append(f"{name}: {n} NaN of {x.size} (unwritten output, or 0/0)")
    # LSE: -inf exactly where no key is seen, else within LSE_TOL of the float64 LSE
    lse, lr = f64(got[1]), r64[1]
    empty = cp.isneginf(lr)
    if int(cp.count_nonzero(cp.isneginf(lse) != empty)):
        fails.append(f"lse: -inf pattern differs from the reference's ({int(cp.count_nonzero(empty))} empty rows)")
    elif int(cp.count_nonzero(~empty)):
        excess = cp.abs(lse[~empty] - lr[~empty]) - LSE_TOL[dtype] * cp.maximum(1.0, cp.abs(lr[~empty]))
        if not float(cp.max(excess)) <= 0:
            fails.append(f"lse: max error {float(cp.max(cp.abs(lse[~empty] - lr[~empty]))):.3e}")
    for i, name in ((0, "o"), (2, "dq"), (3, "dk"), (4, "dv")):
        ours, ref64 = f64(got[i]), r64[i]
        mag = float(cp.max(cp.abs(ref64))) if ref64.size else 0.0
        err = float(cp.max(cp.abs(ours - ref64))) if ref64.size else 0.0
        err = math.inf if math.isnan(err) else err
        if dtype == "float32" and name == "o":
            bound = FP32_FORWARD_ATOL["cuda"] * max(1.0, mag)
        else:
            sp_err = 0.0 if dtype == "float64" else float(cp.max(cp.abs(sp[i] - ref64)))
            bound = 2.0 * sp_err + RULE_ATOL[dtype] * max(1.0, mag)
        if not err <= bound:
            fails.append(f"{name}: error {err:.3e} > bound {bound:.3e} (max|ref| {mag:.3e})")
    # rows that see no key: o and dq exactly 0 (empty is (batch, heads, rows), or (heads, total_q) for varlen)
    rows = empty.transpose(0, 2, 1) if empty.ndim == 3 else empty.T
    for name, x in (("o", got[0]), ("dq", got[2])):
        n = int(cp.count_nonzero(f64(x)[rows]))
        if n:
            fails.append(f"{name}: {n} nonzero elements in the {int(cp.count_nonzero(rows))} rows that see no key")
    if fails:
        raise AssertionError(f"[{ctx}]\n  " + "\n  ".join(fails))


# The cases that take BOUNDED (bf16, a softcap of at most 50, no ALiBi) where flash_fwd runs run again on the
# mma.sync family, forced: a Hopper GPU's own forward keeps the running max.
BOUNDED_CASES = [c for c in CASES if c[1] == "bfloat16" and 0 < c[8].get("softcap", 0) <= 50
                 and "alibi_slopes" not in c[8]]


@pytest.mark.parametrize("family,name,dtype,b,sq,sk,h,hk,d,kw",
                         [pytest.param(None, *c, id=f"{c[0]}-{c[1]}-d{c[7]}") for c in CASES]
                         + [pytest.param("mma", *c, id=f"mma-bounded-{c[0]}-{c[1]}-d{c[7]}") for c in BOUNDED_CASES])
def test_variant(gpu, family, name, dtype, b, sq, sk, h, hk, d, kw):
    from cuflash import config

    ctx = (f"{family} " if family else "") + f"{name} {dtype} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {kw}"
    q, k, v, do, kw, packed = _case_inputs(gpu, ctx, dtype, b, sq, sk, h, hk, d, kw)
    with config.kernel_family(family) if family else contextlib.nullcontext():  # else the session's family
        got = _run(gpu, dtype, q, k, v, do, kw, packed)
    r64, sp = _references(gpu, dtype, q, k, v, do, kw, packed)
    _check(gpu, ctx, dtype, got, r64, sp)


@pytest.mark.parametrize("family", [None, "mma"])
@pytest.mark.parametrize("softcap", [50.0, 50.5])
def test_bounded_softcap_at_the_ends_of_its_range(gpu, family, softcap):
    """BOUNDED (bf16 on the mma.sync forward, a softcap of at most 50): no running max, P = e^logit. Rows whose
    every logit sits at -softcap (every P about e^-50, the bottom of the range), rows at +softcap (e^50, the
    top) and ordinary rows, at the bound and just above it (the running max), on mma.sync and the default
    family (the Hopper kernel, always the running max, on the H200)."""
    cp = gpu.cp
    from cuflash import _params, config
    from cuflash.backends.cuda import compute_capability

    b, sq, sk, h, hk, d = 2, 200, 333, 4, 2, 128
    kw = dict(softcap=softcap, softmax_scale=1.0)
    cfg = config.choose_forward("bfloat16", d, _params.variant(False, **kw), compute_capability=compute_capability(),
                                family=family)
    assert bool(cfg.variant & config.BOUNDED) == (softcap <= config.BOUNDED_SOFTCAP and cfg.kernel == "flash_fwd")
    ctx = f"bounded softcap={softcap} family={family}"
    rs = gpu.rng(ctx)
    q, k, v, do = (gpu.randn(rs, s, "float32") for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    # along a shared unit direction u: k's component 16, q's -16, +16 or 0 by row; q.k = +-256 + noise,
    # saturating tanh(q.k / softcap) to within 1e-3 of +-1
    u = cp.full(d, 1 / math.sqrt(d), dtype=cp.float32)
    side = cp.asarray(np.resize([-1.0, 1.0, 0.0], sq), dtype=cp.float32)[None, :, None, None]
    q = 0.1 * q + 16 * side * u
    k = k + 16 * u
    q, k, v, do = (x.astype(gpu.np_dtype("bfloat16")) for x in (q, k, v, do))
    with config.kernel_family(family):
        got = _run(gpu, "bfloat16", q, k, v, do, kw, None)
    r64, sp = _references(gpu, "bfloat16", q, k, v, do, kw, None)
    lse = r64[1]
    assert float(cp.max(lse[:, :, 0::3])) < -softcap + 6 and float(cp.min(lse[:, :, 1::3])) > softcap  # the ends
    _check(gpu, ctx, "bfloat16", got, r64, sp)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [64, 256])
def test_dropout_keep_mask_is_the_specified_one(gpu, dtype, d):
    """Read the kernels' keep mask directly: q = 0 makes every P entry 1 / seqlen_k, and V = I (seqlen_k =
    head_dim) puts entry (i, j) of the dropped P in o[i, j]; it must be cuflash.dropout_mask, bit for bit. At
    d = 256 the 16-bit forwards visit several key blocks (4 of 64 on the Hopper one)."""
    cp, cf = gpu.cp, gpu.cuflash
    b, sq, h, p = 2, 77, 3, 0.3
    q = cp.zeros((b, sq, h, d), dtype=gpu.np_dtype(dtype))
    k = gpu.randn(gpu.rng(dtype), (b, d, h, d), dtype)
    v = cp.broadcast_to(cp.eye(d, dtype=gpu.np_dtype(dtype))[None, :, None, :], (b, d, h, d)).copy()
    o = cf.flash_attn(q, k, v, dropout_p=p, seed=1234, offset=5, backend="cuda")
    kept = cp.asnumpy(o.astype(cp.float32) > 0.5 / d).transpose(0, 2, 1, 3)  # (b, h, sq, d)
    want = cf.dropout_mask(b, h, sq, d, dropout_p=p, seed=1234, offset=5)
    assert (kept == want).all(), f"{int((kept != want).sum())} of {want.size} keep flags differ"
    assert abs(float(want.mean()) - (1 - p)) < 0.02



# deterministic=True: the dQ adds in key-block order, each dQ tile's turn from a semaphore, counted from the
# first key block the mask gives its query block; windows, GQA and varlen move that first block.
DETERMINISTIC_CASES = [c for c in CASES if c[0] in ("window", "window-left-causal", "all-gqa-varlen", "window-long",
                                                    "window-wide-grid") and c[1] in ("bfloat16", "float16")]


@pytest.mark.parametrize("name,dtype,b,sq,sk,h,hk,d,kw",
                         [pytest.param(*c, id=f"{c[0]}-{c[1]}-d{c[7]}") for c in DETERMINISTIC_CASES])
def test_variant_deterministic(gpu, name, dtype, b, sq, sk, h, hk, d, kw):
    ctx = f"deterministic {name} {dtype} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {kw}"
    q, k, v, do, kw, packed = _case_inputs(gpu, ctx, dtype, b, sq, sk, h, hk, d, kw)
    got = _run(gpu, dtype, q, k, v, do, kw, packed, deterministic=True, repeats=10)
    r64, sp = _references(gpu, dtype, q, k, v, do, kw, packed)
    _check(gpu, ctx, dtype, got, r64, sp)
