"""Materialized attention: the test oracle.

Computes the whole score matrix, so it is only for testing and small shapes. Works on NumPy and CuPy
arrays alike (the namespace is taken from the inputs), "bshd" layout, GQA, bottom-right causal, and
the variants (cuflash/_mask.py holds their rules): sliding window, softcap, ALiBi, dropout given as an
explicit keep mask (cuflash/_philox.py's `dropout_mask` makes the one every backend uses), and
variable-length batches (cu_seqlens_q / cu_seqlens_k: packed (total, nheads, head_dim) arrays,
computed sequence by sequence).

``precision=None`` computes everything in float64: that is ``ref64`` of the accuracy rule.
``precision="float16" | "bfloat16" | "float32"`` emulates a conventional materialized implementation
that stores every intermediate in that dtype (matmuls and softmax in float32, each materialized stage
rounded to the dtype): that is ``same_precision_ref`` of the accuracy rule (see DESIGN.md)::

    max|ours - ref64| <= 2 * max|same_precision_ref - ref64| + atol
"""

from __future__ import annotations

import math

import numpy as np

from . import _mask

try:
    from array_api_compat import is_cupy_array
except ImportError:  # a declared dependency, but the oracle must not fail for want of it

    def is_cupy_array(x):
        return type(x).__module__.split(".")[0] == "cupy"

PRECISIONS = ("float16", "bfloat16", "float32")


def _namespace(x):
    """numpy or cupy (the full modules, not the array-API wrappers)."""
    if is_cupy_array(x):
        import cupy

        return cupy
    return np


# ---------------------------------------------------------------------------------------------------
# Rounding to a storage dtype, values kept in float32


def _round_bf16(x, xp):
    """Round float32 to the nearest bfloat16 (ties to even), result still float32.

    Done on the bit pattern so that it works for NumPy and CuPy alike (no ml_dtypes cast needed):
    add 0x7FFF plus the lowest kept bit, then clear the 16 dropped bits. Overflow rounds to inf
    as it should; NaN is passed through untouched (the carry could otherwise turn it into -0).
    """
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    u = x.view(xp.uint32)
    lsb = (u >> xp.uint32(16)) & xp.uint32(1)
    r = ((u + xp.uint32(0x7FFF) + lsb) & xp.uint32(0xFFFF0000)).view(xp.float32)
    return xp.where(xp.isnan(x), x, r)


def _rounder(precision, xp):
    if precision is None or precision == "float32":
        return lambda x: x
    if precision == "float16":
        return lambda x: x.astype(xp.float16).astype(xp.float32)
    if precision == "bfloat16":
        return lambda x: _round_bf16(x, xp)
    raise ValueError(f"precision must be None or one of {PRECISIONS}, got {precision!r}")


# ---------------------------------------------------------------------------------------------------
# Shapes and masks


def _to_groups(x, nheads_k, cdt, rnd):
    """(B, S, H, D) -> (B, Hk, G, S, D) in the compute dtype, rounded to the storage dtype.

    Query head h = hk * G + g uses kv head hk = h // G, so splitting H as (Hk, G) is exactly the
    contract's GQA mapping. For k and v, H == Hk and G == 1.
    """
    b, s, h, d = x.shape
    x = rnd(x.astype(cdt))
    return x.transpose(0, 2, 1, 3).reshape(b, nheads_k, h // nheads_k, s, d)


def _from_groups(x):
    """(B, Hk, G, S, D) -> (B, S, Hk * G, D)."""
    b, hk, g, s, d = x.shape
    return x.reshape(b, hk * g, s, d).transpose(0, 2, 1, 3)


def _visible(seqlen_q, seqlen_k, causal, xp, window=_mask.NO_WINDOW):
    """(seqlen_q, seqlen_k) bool: query row i sees key j (bottom-right causal, the window)."""
    left, right = _mask.effective_window(causal, window)
    return _mask.visible(xp.arange(seqlen_q), xp.arange(seqlen_k), seqlen_q, seqlen_k, left, right, xp)


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D (batch, seqlen, nheads, head_dim)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_k ({k.shape[2]})")


def _grouped_heads(x, b, nheads_k, group, xp, cdt):
    """Per-head values (H,) or (B, H) -> (B or 1, Hk, G), in the compute dtype."""
    x = xp.asarray(x).astype(cdt)
    return x.reshape((x.shape[0] if x.ndim == 2 else 1), nheads_k, group)


def _probs(q, k, v, causal, softmax_scale, precision, window=_mask.NO_WINDOW, softcap=0.0, alibi_slopes=None,
           dropout_p=0.0, dropout_mask=None):
    """Shared forward: (xp, cdt, rnd, scale, qg, kg, vg, P, P dropped, tanh of the softcap or None, O, lse),
    P and O grouped (B, Hk, G, ...)."""
    _check_shapes(q, k, v)
    xp = _namespace(q)
    cdt = xp.float64 if precision is None else xp.float32
    rnd = _rounder(precision, xp)
    b, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)

    qg = _to_groups(q, nheads_k, cdt, rnd)  # (B, Hk, G, Sq, D)
    kg = _to_groups(k, nheads_k, cdt, rnd)  # (B, Hk, 1, Sk, D)
    vg = _to_groups(v, nheads_k, cdt, rnd)

    s = rnd(xp.matmul(qg, kg.swapaxes(-1, -2)))  # (B, Hk, G, Sq, Sk)
    logits = s * cdt(scale)
    t = None
    if softcap:
        logits, t = _mask.apply_softcap(logits, softcap, xp)
    rows, cols = xp.arange(seqlen_q), xp.arange(seqlen_k)
    if alibi_slopes is not None:
        slopes = _grouped_heads(alibi_slopes, b, nheads_k, group, xp, cdt)
        logits = logits + _mask.alibi_bias(slopes, rows, cols, seqlen_q, seqlen_k, xp)
    visible = _visible(seqlen_q, seqlen_k, causal, xp, window)
    scores = xp.where(visible, logits, cdt(-math.inf))
    # Rows that see no key: max is -inf; subtract 0 instead so exp gives 0, not NaN.
    if scores.shape[-1]:
        m = xp.max(scores, axis=-1, keepdims=True)
    else:
        m = xp.full(scores.shape[:-1] + (1,), -math.inf, dtype=cdt)
    m_safe = xp.where(m == -math.inf, cdt(0), m)
    p = xp.exp(scores - m_safe)
    l = xp.sum(p, axis=-1, keepdims=True)
    seen = l > 0
    l_safe = xp.where(seen, l, cdt(1))
    lse = xp.where(seen, m + xp.log(l_safe), cdt(-math.inf))[..., 0]  # (B, Hk, G, Sq)
    p = rnd(p / l_safe)
    pd = p
    if dropout_p:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs the keep mask: pass dropout_mask (cuflash.dropout_mask makes it)")
        keep = xp.asarray(dropout_mask).reshape(b, nheads_k, group, seqlen_q, seqlen_k)
        pd = rnd(xp.where(keep, p * cdt(1.0 / (1.0 - dropout_p)), cdt(0)))
    o = rnd(xp.matmul(pd, vg))  # (B, Hk, G, Sq, D); rows with no key: P = 0 so O = 0
    return xp, cdt, rnd, scale, qg, kg, vg, p, pd, t, o, lse


def _dense_forward(q, k, v, causal, softmax_scale, precision, **variants):
    xp, _, _, _, _, _, _, _, _, _, o, lse = _probs(q, k, v, causal, softmax_scale, precision, **variants)
    b, hk, g, sq = lse.shape
    o = xp.ascontiguousarray(_from_groups(o).astype(xp.float64))
    lse = lse.reshape(b, hk * g, sq).astype(xp.float64)
    return o, lse


def _dense_backward(do, q, k, v, causal, softmax_scale, precision, dropout_p=0.0, dropout_mask=None, **variants):
    xp, cdt, rnd, scale, qg, kg, vg, p, pd, t, o, _ = _probs(q, k, v, causal, softmax_scale, precision,
                                                              dropout_p=dropout_p, dropout_mask=dropout_mask,
                                                              **variants)
    dog = _to_groups(do, k.shape[2], cdt, rnd)
    dv = rnd(xp.sum(xp.matmul(pd.swapaxes(-1, -2), dog), axis=2, keepdims=True))
    dp = rnd(xp.matmul(dog, vg.swapaxes(-1, -2)))
    if dropout_p:  # dL/dP = (dO V^T) * keep / (1 - p); D = rowsum(dO * O) with the dropped O still
        keep = xp.asarray(dropout_mask).reshape(p.shape)
        dp = rnd(xp.where(keep, dp * cdt(1.0 / (1.0 - dropout_p)), cdt(0)))
    d = xp.sum(dog * o, axis=-1, keepdims=True)
    ds = p * (dp - d)  # P = 0 where masked, so dS = 0 there
    if t is not None:  # through the softcap: times 1 - tanh^2
        ds = ds * _mask.softcap_grad(t)
    ds = rnd(ds)
    dq = rnd(xp.matmul(ds, kg) * cdt(scale))
    dk = rnd(xp.sum(xp.matmul(ds.swapaxes(-1, -2), qg), axis=2, keepdims=True) * cdt(scale))
    return tuple(xp.ascontiguousarray(_from_groups(x).astype(xp.float64)) for x in (dq, dk, dv))


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """[(index, q0, q1, k0, k1)] of a varlen batch, from its cumulative lengths (read on the host)."""
    cq = [int(x) for x in _host(cu_seqlens_q)]
    ck = [int(x) for x in _host(cu_seqlens_k)]
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k: lengths differ ({len(cq)} and {len(ck)})")
    return [(i, cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _host(x):
    return x.get() if is_cupy_array(x) else np.asarray(x)


def _per_sequence(i, sq, sk, alibi_slopes, dropout_mask, variants):
    """The variant arguments of sequence i: its slopes row, its corner of the padded keep mask."""
    v = dict(variants)
    if alibi_slopes is not None:
        v["alibi_slopes"] = alibi_slopes[i:i + 1] if alibi_slopes.ndim == 2 else alibi_slopes
    if dropout_mask is not None:
        v["dropout_mask"] = dropout_mask[i:i + 1, :, :sq, :sk]
    return v


def forward(q, k, v, *, causal=False, softmax_scale=None, precision=None, window=_mask.NO_WINDOW, softcap=0.0,
            alibi_slopes=None, dropout_p=0.0, dropout_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Materialized attention. Returns (o, lse): o (B, Sq, H, D) and lse (B, H, Sq), both float64.

    precision=None: float64 throughout. Otherwise the values are those of an implementation that
    stores in `precision` (already rounded to it), returned as float64.

    Variants: window=(left, right), softcap, alibi_slopes (H,) or (B, H), dropout_p with its keep
    mask dropout_mask (B, H, Sq, Sk) (required when dropout_p > 0). With cu_seqlens_q and
    cu_seqlens_k, q, k, v are packed (total, H, D), o is (total_q, H, D), lse (H, total_q), and
    dropout_mask is (batch, H, max_seqlen_q, max_seqlen_k), sequence i using its [i, :, :sq, :sk].
    """
    variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                    dropout_mask=dropout_mask)
    if cu_seqlens_q is None:
        return _dense_forward(q, k, v, causal, softmax_scale, precision, **variants)
    xp = _namespace(q)
    o = xp.zeros(q.shape, dtype=xp.float64)
    lse = xp.full((q.shape[1], q.shape[0]), -math.inf, dtype=xp.float64)
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        vi = _per_sequence(i, q1 - q0, k1 - k0, alibi_slopes, dropout_mask, variants)
        oi, li = _dense_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale, precision,
                                **vi)
        o[q0:q1], lse[:, q0:q1] = oi[0], li[0]
    return o, lse


def backward(do, q, k, v, *, causal=False, softmax_scale=None, precision=None, window=_mask.NO_WINDOW, softcap=0.0,
             alibi_slopes=None, dropout_p=0.0, dropout_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Analytic gradients of sum(o * do). Returns (dq, dk, dv) as float64, shapes of q, k, v.

    dV = Pd^T dO, dP = (dO V^T) * Z / (1 - p), D = rowsum(dO * O), dS = P * (dP - D) [* (1 - tanh^2)
    with a softcap], dQ = scale * dS K, dK = scale * dS^T Q, with P the softmax, Z the keep mask and
    Pd = P * Z / (1 - p) the dropped P; dk/dv of a kv head sum over its group of query heads. With a
    precision, S, P, O, dP, dS and the gradients are rounded to it (group sums are done in float32
    first). The variant arguments are those of `forward`.
    """
    variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                    dropout_mask=dropout_mask)
    if cu_seqlens_q is None:
        return _dense_backward(do, q, k, v, causal, softmax_scale, precision, **variants)
    xp = _namespace(q)
    dq, dk, dv = (xp.zeros(x.shape, dtype=xp.float64) for x in (q, k, v))
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        vi = _per_sequence(i, q1 - q0, k1 - k0, alibi_slopes, dropout_mask, variants)
        g = _dense_backward(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
                            precision, **vi)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# FLOPs and the accuracy rule


def flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd"):
    """Nominal FLOPs, DESIGN's rule: forward 4 * B * H * Sq * Sk * d (two matmuls), halved when causal.

    The causal halving is the conventional approximation (exact only for Sq == Sk and large N), kept
    so that numbers compare with FlashAttention's published ones. "bwd" is 2.5x the forward (five
    matmuls instead of two), "fwd_bwd" 3.5x. Returned as an int (the forward count is always even).
    """
    fwd = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        fwd //= 2
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return fwd * 5 // 2
    if mode == "fwd_bwd":
        return fwd * 7 // 2
    raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd_bwd', got {mode!r}")


def max_abs_error(x, ref):
    """max|x - ref| as a Python float, computed in float64.

    Equal values count as no error, infinities included (a -inf LSE matching a -inf LSE is exact).
    Any NaN in x or ref gives NaN. Empty arrays give 0.0.
    """
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(ref.shape)}")
    xp = _namespace(x)
    a = x.astype(xp.float64)
    b = ref.astype(xp.float64)
    if a.size == 0:
        return 0.0
    same = a == b
    # Zero out equal entries before subtracting: inf - inf would warn and give NaN.
    diff = xp.abs(xp.where(same, 0.0, a) - xp.where(same, 0.0, b))
    return float(xp.max(diff))


def accuracy_bound(ours, ref64, same_precision, atol):
    """(error, bound) for the rule max|ours - ref64| <= 2 * max|same_precision - ref64| + atol.

    Passing means ``error <= bound``. A NaN anywhere must fail whichever way the caller compares, so
    a NaN in `ours` or `ref64` makes error = inf, and a NaN in `same_precision` or `ref64` makes
    bound = -inf.
    """
    error = max_abs_error(ours, ref64)
    baseline = max_abs_error(same_precision, ref64)
    if math.isnan(error):
        error = math.inf
    bound = -math.inf if math.isnan(baseline) else 2.0 * baseline + float(atol)
    return error, bound
