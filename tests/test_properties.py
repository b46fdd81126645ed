"""Property tests: the public API on random problems against the float64 reference (cuflash.reference).

Each example draws a problem (batch 1-3, seqlen_q and seqlen_k 1-300, head_dim a multiple of 8 up to
256, nheads_k 1-3 with 1-4 query heads per kv head, causal or not, layout "bshd" or "bhsd", an explicit
softmax_scale or none) and, for each of q, k, v and dout, how it is laid out in memory: contiguous, or a
view into a larger array (a slice along the seqlen or head axis, every other row along seqlen, every
other element along head_dim). Forward (o, lse) and backward (dq, dk, dv) go through the public API and
are checked for shape, dtype, layout, rows that see no key (o = 0, lse = -inf, dq = 0 exactly), accuracy
against the reference, and inputs left untouched.

NumPy backend (CPU): float64 and float32, with the tolerances of tests/test_numpy_backend.py (relative to
max(1, max|ref|): float64 1e-12; float32 2e-6 for o and lse, 5e-6 for the gradients), where float32 o and
gradients that exceed them may still pass by DESIGN.md's accuracy rule (see FP32_RULE_ATOL). Problems are
capped at a work budget (CPU_WORK_BUDGET) to keep the CPU time bounded.

CUDA backend (marked gpu; skipped where no GPU is visible): float16, bfloat16, float32 and float64, judged
by conftest.py's GpuKit.run, the accuracy rule of DESIGN.md used by tests/test_gpu_kernels.py (outputs
poisoned with NaN first, so an unwritten element fails). The first examples may compile kernels for
head dims and dtypes that tests/test_gpu_kernels.py has not compiled yet in this kernel cache.
"""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference

LAYOUTS = ("bshd", "bhsd")
# How one input sits in memory (see make_view).
VIEWS = ("contiguous", "seq-slice", "seq-step", "head-slice", "dim-step")
NAMES = ("q", "k", "v", "dout")


class Case(typing.NamedTuple):
    dtype: str
    b: int
    sq: int
    sk: int
    h: int
    hk: int
    d: int
    causal: bool
    layout: str
    views: tuple  # one of VIEWS for each of q, k, v, dout
    offset: int  # where a slice starts in its larger array
    scale_factor: float | None  # softmax_scale = scale_factor / sqrt(d); None: the default
    with_out: bool  # forward through flash_attn(..., out=) instead of flash_attn_forward (on the GPU,
    #                GpuKit.run passes a NaN-filled out= either way: this picks the entry point)
    seed: int

    @property
    def scale(self):
        return None if self.scale_factor is None else self.scale_factor / math.sqrt(self.d)

    @property
    def no_key_rows(self) -> int:
        """Leading query rows that see no key (causal, bottom-right, with seqlen_q > seqlen_k)."""
        return max(0, self.sq - self.sk) if self.causal else 0

    def shapes(self):
        """(b, s, h, d) of q, k, v, dout."""
        return ((self.b, self.sq, self.h, self.d), (self.b, self.sk, self.hk, self.d),
                (self.b, self.sk, self.hk, self.d), (self.b, self.sq, self.h, self.d))

    def ctx(self) -> str:
        views = ",".join(f"{n}:{v}" for n, v in zip(NAMES, self.views))
        return (f"{self.dtype} b={self.b} sq={self.sq} sk={self.sk} h={self.h} hk={self.hk} d={self.d} "
                f"causal={self.causal} layout={self.layout} scale={self.scale} views={views} offset={self.offset} "
                f"out={self.with_out} seed={self.seed}")


@st.composite
def cases(draw, dtypes, work_budget=None, max_scale_factor=1.5):
    """Random problems. With a work budget (on the CPU), problems with b * h * sq * sk * d above it
    lose batch entries, then query heads per kv head, then kv heads (never below 1), so that seqlens
    and head dims keep their whole range and the runtime stays bounded. An explicit softmax_scale is
    0.5 to max_scale_factor times the default 1 / sqrt(head_dim)."""
    b, hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    sq, sk, d = draw(st.integers(1, 300)), draw(st.integers(1, 300)), 8 * draw(st.integers(1, 32))
    while work_budget is not None and b * hk * group * sq * sk * d > work_budget and b * hk * group > 1:
        if b > 1:
            b -= 1
        elif group > 1:
            group -= 1
        else:
            hk -= 1
    return Case(
        dtype=draw(st.sampled_from(dtypes)),
        b=b,
        sq=sq,
        sk=sk,
        h=hk * group,
        hk=hk,
        d=d,
        causal=draw(st.booleans()),
        layout=draw(st.sampled_from(LAYOUTS)),
        views=tuple(draw(st.sampled_from(VIEWS)) for _ in NAMES),
        offset=draw(st.integers(1, 3)),
        scale_factor=draw(st.none() | st.floats(0.5, max_scale_factor)),
        with_out=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_view(randn, layout: str, shape_bshd: tuple, view: str, offset: int):
    """(the allocated array, the view of it passed to the API) for an input of logical shape
    (b, s, h, d) given in `layout`; `randn(shape)` allocates and fills the larger array."""
    b, s, h, d = shape_bshd
    seq_axis, head_axis = (1, 2) if layout == "bshd" else (2, 1)
    shape = [b, s, h, d] if layout == "bshd" else [b, h, s, d]
    index = [slice(None)] * 4
    if view == "seq-slice":
        shape[seq_axis] += offset + 2
        index[seq_axis] = slice(offset, offset + s)
    elif view == "seq-step":
        shape[seq_axis] *= 2
        index[seq_axis] = slice(None, None, 2)
    elif view == "head-slice":
        shape[head_axis] += offset + 1
        index[head_axis] = slice(offset, offset + h)
    elif view == "dim-step":
        shape[3] *= 2
        index[3] = slice(None, None, 2)
    else:
        assert view == "contiguous", view
    big = randn(tuple(shape))
    x = big[tuple(index)]
    assert tuple(x.shape) == ((b, s, h, d) if layout == "bshd" else (b, h, s, d))
    return big, x


def to_bshd(x, layout: str):
    return x.swapaxes(1, 2) if layout == "bhsd" else x


# ------------------------------------------------------------------------------------------------
# NumPy backend
# ------------------------------------------------------------------------------------------------

# Relative to max(1, max|ref|), as in tests/test_numpy_backend.py.
NUMPY_TOL = {"float64": {"o": 1e-12, "lse": 1e-12, "grad": 1e-12},
             "float32": {"o": 2e-6, "lse": 2e-6, "grad": 5e-6}}
# float32 o and gradients may instead meet DESIGN.md's accuracy rule, max|ours - ref64| <= 2 *
# max|same_precision - ref64| + atol (atol as conftest.RULE_ATOL's): where a float32 materialized
# attention is itself off by more than the fixed bound, so is any float32 implementation. Seen: dk and
# dq when seqlen_k = 1 (dS = P * (dP - D) with dP = D in exact arithmetic: the true gradient cancels to
# ~0 and the error is relative to the terms, not to max(1, max|ref|)), and o with softmax_scale 1.5x
# the default at large head dims (o off by ~1e-6 * max|o| in the materialized float32 attention too).
FP32_RULE_ATOL = 1e-6


def _same_precision(case: Case, inputs64: tuple) -> dict:
    """The float32 materialized attention (cuflash.reference with precision="float32")."""
    q64, k64, v64, do64 = inputs64
    kw = {"causal": case.causal, "softmax_scale": case.scale, "precision": "float32"}
    o, _ = reference.forward(q64, k64, v64, **kw)
    dq, dk, dv = reference.backward(do64, q64, k64, v64, **kw)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


def _numpy_errors(case: Case, got: dict, ref: dict, inputs64: tuple) -> list[str]:
    fails = []
    same_precision = None  # computed only when a fixed bound is exceeded
    for name, ours in got.items():
        want = ref[name]
        finite = np.isfinite(want)
        mag = max(1.0, float(np.abs(want[finite]).max())) if finite.any() else 1.0
        tol = NUMPY_TOL[case.dtype]["grad" if name.startswith("d") else name] * mag
        err = reference.max_abs_error(ours, want)
        if err <= tol:
            continue
        detail = f"{tol:.3e} (max|ref| {mag:.3e})"
        if case.dtype == "float32" and name != "lse":
            if same_precision is None:
                same_precision = _same_precision(case, inputs64)
            err, bound = reference.accuracy_bound(ours, want, same_precision[name], FP32_RULE_ATOL * mag)
            if err <= bound:
                continue
            detail += f" and > the accuracy rule's {bound:.3e}"
        fails.append(f"{name}: max abs error {err:.3e} > {detail}")  # NaN fails too
    return fails


# At most b * h * sq * sk * d = 6e7 per example (300 x 300 at head_dim 256 with b * h = 2): ~0.2 s each.
CPU_WORK_BUDGET = 60_000_000


@settings(max_examples=30, deadline=None)
@given(case=cases(("float64", "float32"), work_budget=CPU_WORK_BUDGET))
def test_numpy_backend_matches_reference(case):
    ctx = case.ctx()
    dt = np.dtype(case.dtype)
    rng = np.random.default_rng(case.seed)
    made = [make_view(lambda s: rng.standard_normal(s).astype(dt), case.layout, shape, view, case.offset)
            for shape, view in zip(case.shapes(), case.views)]
    bigs = [big for big, _ in made]
    q, k, v, do = (x for _, x in made)
    before = [big.copy() for big in bigs]
    kw = {"causal": case.causal, "softmax_scale": case.scale, "layout": case.layout, "backend": "numpy"}

    if case.with_out:
        out = np.full(q.shape, np.nan, dtype=dt)
        o, lse = cuflash.flash_attn(q, k, v, return_lse=True, out=out, **kw)
        assert o is out, f"out= was not returned [{ctx}]"
    else:
        o, lse = cuflash.flash_attn_forward(q, k, v, **kw)
    dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, **kw)

    lse_dt = np.float64 if case.dtype == "float64" else np.float32
    b, h, sq = case.b, case.h, case.sq
    for name, x, like in (("o", o, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert isinstance(x, np.ndarray), f"{name}: a {type(x).__name__} [{ctx}]"
        assert x.shape == like.shape and x.dtype == dt, f"{name}: {x.shape} {x.dtype}, expected {like.shape} {dt} [{ctx}]"
    assert lse.shape == (b, h, sq) and lse.dtype == lse_dt, f"lse: {lse.shape} {lse.dtype} [{ctx}]"

    for big, snap, name in zip(bigs, before, NAMES):
        assert np.array_equal(big, snap), f"{name}: the input's memory was written to [{ctx}]"

    got = {"o": to_bshd(o, case.layout), "lse": lse, "dq": to_bshd(dq, case.layout),
           "dk": to_bshd(dk, case.layout), "dv": to_bshd(dv, case.layout)}
    first = case.no_key_rows
    if first:
        assert np.all(got["o"][:, :first] == 0), f"o: nonzero in rows that see no key [{ctx}]"
        assert np.all(got["dq"][:, :first] == 0), f"dq: nonzero in rows that see no key [{ctx}]"
        assert np.all(lse[:, :, :first] == -np.inf), f"lse: not -inf in rows that see no key [{ctx}]"
    assert np.isfinite(lse[:, :, first:]).all(), f"lse: non-finite in rows that see keys [{ctx}]"

    q64, k64, v64, do64 = (to_bshd(x, case.layout).astype(np.float64) for x in (q, k, v, do))
    ref_o, ref_lse = reference.forward(q64, k64, v64, causal=case.causal, softmax_scale=case.scale)
    ref_dq, ref_dk, ref_dv = reference.backward(do64, q64, k64, v64, causal=case.causal, softmax_scale=case.scale)
    fails = _numpy_errors(case, got, {"o": ref_o, "lse": ref_lse, "dq": ref_dq, "dk": ref_dk, "dv": ref_dv},
                          (q64, k64, v64, do64))
    assert not fails, f"[{ctx}]\n  " + "\n  ".join(fails)


# ------------------------------------------------------------------------------------------------
# CUDA backend (GPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@settings(max_examples=60, deadline=None)
@given(case=cases(("float16", "bfloat16", "float32", "float64"), max_scale_factor=1.0))
def test_cuda_backend_matches_reference(gpu, case):
    """The same problems through backend="cuda", judged by GpuKit.run (DESIGN.md's accuracy rule).

    softmax_scale stays at or below the default here: GpuKit holds the float32 forward to a fixed
    bound (conftest.FP32_FORWARD_ATOL x max(1, max|o|)), set for the default scale; a larger scale sharpens the
    softmax and scales the float32 rounding of S with it (the NumPy test above covers up to 1.5x)."""
    ctx = case.ctx()
    rs = gpu.rng(ctx)
    made = [make_view(lambda s: gpu.randn(rs, s, case.dtype), case.layout, shape, view, case.offset)
            for shape, view in zip(case.shapes(), case.views)]
    bigs = [big for big, _ in made]
    q, k, v, do = (x for _, x in made)
    before = [big.copy() for big in bigs]
    o, lse, dq, dk, dv = gpu.run(ctx, case.dtype, q, k, v, do, causal=case.causal, scale=case.scale,
                                 layout=case.layout, entry="flash_attn" if case.with_out else "forward")
    for name, x, like in (("o", o, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert isinstance(x, gpu.cp.ndarray), f"{name}: a {type(x).__name__} [{ctx}]"
        assert x.shape == like.shape, f"{name}: shape {x.shape}, expected {like.shape} in {case.layout} [{ctx}]"
    for big, snap, name in zip(bigs, before, NAMES):
        n = gpu.same_bits(big, snap)
        assert n == 0, f"{name}: {n} elements of the input's memory changed [{ctx}]"
