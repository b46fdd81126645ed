"""Exact combination of partial attention results over disjoint key sets (LSE merge).

If (o_a, lse_a) is attention of the queries over key set A and (o_b, lse_b) over a disjoint set B,
attention over A u B is

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

Layout is flash_attn_forward's: o (batch, seqlen, nheads, head_dim), lse (batch, nheads, seqlen),
natural log. A side that saw no key (lse = -inf) contributes nothing, whatever its o holds; when
every side is empty the row gets o = 0 and lse = -inf, never NaN. A NaN or +inf lse (a part that met
NaN or overflowed) is carried: the row's lse is NaN or +inf and its o NaN, never a finite value.

The sums run in float32 (float64 for float64 inputs); o comes back in the inputs' dtype and lse in
float32 (float64). NumPy and CuPy arrays are used as they are (the array namespace is the inputs'
own); any other DLPack producer (torch, JAX, ...) goes through cuflash._interop and comes back as
its own kind.

`merge_states(o_a, lse_a, o_b, lse_b)` merges two states; `merge_states_list(os, lses)` merges any
number (a list/tuple of arrays, or stacked arrays whose leading axis indexes the parts) in one pass.
The internal `merge_into` is the accumulating form used by the ring (cuflash.distributed).
"""

from __future__ import annotations

import numpy as np

from . import _checks, _interop
from .config import DTYPES, acc_dtype

__all__ = ["merge_states", "merge_states_list"]


def _xp(x):
    if _interop.is_cupy(x):
        import cupy

        return cupy
    return np


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name if _interop.is_numpy(x) else str(x.dtype)


def to_acc(x, xp):
    """x (any of cuflash's dtypes) as a new float32 (float64 for float64) array. bfloat16 is widened
    through its bits, which is exact and needs no bfloat16 support from the namespace."""
    name = _dtype_name(x)
    if name == "bfloat16":
        bits = x.view(xp.uint16).astype(xp.uint32) << 16
        return bits.view(xp.float32)
    return x.astype(acc_dtype(name), copy=True)


def from_acc(x, name: str, xp):
    """A float32/float64 accumulator rounded to dtype `name` (bfloat16 round-to-nearest-even)."""
    if name == "bfloat16":
        from .config import numpy_dtype

        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        r = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(xp.uint16)
        r = xp.where(xp.isnan(x), xp.uint16(0x7FC0), r)
        return r.view(numpy_dtype("bfloat16"))
    return x.astype(name, copy=False)


def _weights(lses, xp):
    """exp(lse_i - lse) for each part and the merged lse, -inf safe; a NaN (or +inf) max is the merged lse."""
    m = lses[0]
    for l in lses[1:]:
        m = xp.maximum(m, l)  # NaN if any part's is
    finite = xp.isfinite(m)  # a row some part saw
    m0 = xp.where(finite, m, 0)
    ws = [xp.exp(l - m0) for l in lses]  # exp(-inf) = 0 for a part that saw nothing
    total = ws[0]
    for w in ws[1:]:
        total = total + w
    safe = xp.where(finite, total, 1)
    lse = xp.where(finite, m0 + xp.log(safe), m)
    return [w / safe for w in ws], lse


def _carry_poison(o, lse, xp):
    """o (b, s, h, d) NaN on the rows whose merged lse is NaN or +inf (the weights' `> 0` test would hide them)."""
    poisoned = (xp.isnan(lse) | (lse == xp.inf)).transpose(0, 2, 1)[..., None]
    return xp.where(poisoned, xp.nan, o)


def merge_into(o_acc, lse_acc, o, lse, xp):
    """One accumulating merge in the accumulator dtype: returns (o_acc', lse_acc').

    o_acc (b, s, h, d) and lse_acc (b, h, s) in float32/float64; o in any cuflash dtype (widened
    here); lse float32/float64. Nothing is checked: the ring calls it with arrays it made."""
    (wa, wb), lse_new = _weights([lse_acc, lse.astype(lse_acc.dtype, copy=False)], xp)
    wa = wa.transpose(0, 2, 1)[..., None]
    wb = wb.transpose(0, 2, 1)[..., None]
    ob = to_acc(o, xp)
    # where(): a part with weight 0 contributes 0 even if its o holds inf or NaN
    o_new = xp.where(wa > 0, wa * o_acc, 0) + xp.where(wb > 0, wb * ob, 0)
    return _carry_poison(o_new, lse_new, xp), lse_new


def _check(os, lses):
    """Shapes and dtypes of the parts; returns the dtype name of o."""
    if len(os) != len(lses):
        raise ValueError(f"merge: {len(os)} outputs but {len(lses)} lse arrays")
    if len(os) == 0:
        raise ValueError("merge: need at least one (o, lse) part")
    for i, (o, lse) in enumerate(zip(os, lses)):
        for name, x in ((f"o[{i}]", o), (f"lse[{i}]", lse)):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"merge: {name} must be an array, got {type(x).__name__}")
    name = _dtype_name(os[0])
    if name not in DTYPES:
        raise TypeError(f"merge: o dtype must be one of {', '.join(DTYPES)}, got {name}")
    lse_name = acc_dtype(name)
    shape = tuple(os[0].shape)
    if len(shape) != 4:
        raise ValueError(f"merge: o must be 4-D (batch, seqlen, nheads, head_dim), got shape {shape}")
    b, s, h, _ = shape
    for i, (o, lse) in enumerate(zip(os, lses)):
        if _dtype_name(o) != name:
            raise TypeError(f"merge: o[{i}] has dtype {_dtype_name(o)}, o[0] has {name}")
        if tuple(o.shape) != shape:
            raise ValueError(f"merge: o[{i}] has shape {tuple(o.shape)}, o[0] has {shape}")
        if _dtype_name(lse) != lse_name:
            raise TypeError(f"merge: lse[{i}] must be {lse_name} for {name} outputs, got {_dtype_name(lse)}")
        if tuple(lse.shape) != (b, h, s):
            raise ValueError(f"merge: lse[{i}] must have shape (batch, nheads, seqlen) = {(b, h, s)}, "
                             f"got {tuple(lse.shape)}")
    return name


def _kinds(arrays):
    kinds = {"numpy" if _interop.is_numpy(x) else "cupy" if _interop.is_cupy(x) else "other" for x in arrays}
    return kinds


def merge_states_list(os, lses):
    """Merge attention results over disjoint key sets: returns (o, lse).

    os: a sequence of o arrays (batch, seqlen, nheads, head_dim), or one array stacked along a new
    leading axis; lses: the matching lse arrays (batch, nheads, seqlen) (or stacked). Every part has
    the same shape and dtype. o comes back in the inputs' dtype, lse in float32 (float64 for float64).
    """
    for name, parts in (("os", os), ("lses", lses)):
        if not hasattr(parts, "__iter__") or isinstance(parts, (str, bytes)):
            raise TypeError(f"merge: {name} must be a sequence of arrays or one stacked array, got "
                            f"{type(parts).__name__}")
    os, lses = list(os), list(lses)
    arrays = os + lses
    for x in arrays:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not hasattr(x, "__dlpack__"):
            raise TypeError(f"merge: expected NumPy/CuPy arrays or DLPack producers, got {type(x).__name__}")
        if _checks.is_traced(x):
            raise TypeError("merge: a traced JAX value (inside jax.jit, grad or vmap) has no data to read; merge "
                            "outside the traced function")
    kinds = _kinds(arrays)
    if "other" in kinds:  # torch, JAX...: through the interop layer, results as the caller's kind
        caller = _interop.classify(os[0])
        _interop.check_devices(**{f"a{i}": x for i, x in enumerate(arrays)})
        on_device = caller.device_id is not None
        with caller.stream_context():
            w_os = [_interop.to_working(f"o[{i}]", x, on_device) for i, x in enumerate(os)]
            w_lses = [_interop.to_working(f"lse[{i}]", x, on_device) for i, x in enumerate(lses)]
            o, lse = merge_states_list(w_os, w_lses)
            return caller.result(o), caller.result(lse)
    if len(kinds) > 1:
        raise TypeError("merge: mix of NumPy and CuPy arrays; put every part on the same device")
    if kinds == {"cupy"}:
        _interop.check_devices(**{f"a{i}": x for i, x in enumerate(arrays)})
    name = _check(os, lses)
    xp = _xp(os[0])
    ws, lse = _weights([l.astype(acc_dtype(name), copy=False) for l in lses], xp)
    o = None
    for w, part in zip(ws, os):
        w = w.transpose(0, 2, 1)[..., None]
        term = xp.where(w > 0, w * to_acc(part, xp), 0)
        o = term if o is None else o + term
    return from_acc(_carry_poison(o, lse, xp), name, xp), lse


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention results over disjoint key sets A and B: returns (o, lse) over A u B.

    o_a, o_b (batch, seqlen, nheads, head_dim) of one dtype; lse_a, lse_b (batch, nheads, seqlen)
    float32 (float64 for float64), as flash_attn_forward returns them. -inf safe (see the module).
    """
    return merge_states_list([o_a, o_b], [lse_a, lse_b])
