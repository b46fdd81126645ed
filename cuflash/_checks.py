"""Input validation: one function per rule, one clear message per failure.

Each message names the argument, what was expected and what was given. One rule for the exception
type: an argument of the wrong type or dtype raises TypeError (a list where an array belongs, a
string where a bool or a number belongs, layout=3, a float64 `out=` for float32 inputs); an argument
of the right type with a wrong value raises ValueError (a shape, a head_dim, a layout or backend
name, a softmax_scale that is not finite and positive, memory shared between `out=` and an input).
"""

from __future__ import annotations

import math

import numpy as np

from .config import DTYPES, MAX_HEAD_DIM, dtype_name

LAYOUTS = ("bshd", "bhsd")
BACKENDS = ("auto", "cuda", "numba", "numpy")


def check_array(name: str, x, *, optional: bool = False) -> None:
    """`x` is an array (it has shape, dtype and ndim); None passes when the argument is optional.

    Runs before anything reads an array's attributes, so that a list or a scalar gives a TypeError
    naming the argument instead of an AttributeError from deep inside."""
    if x is None and optional:
        return
    if not all(hasattr(x, attr) for attr in ("shape", "dtype", "ndim")):
        raise TypeError(f"{name}: expected a NumPy or CuPy array or a DLPack producer (torch, JAX...), "
                        f"got {type(x).__name__}")


def check_flag(name: str, value) -> bool:
    """A boolean argument: Python bool or numpy.bool_ only (a string "False" is truthy, 1 is not a bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool (True or False), got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_dtype(name: str, x) -> str:
    try:
        return dtype_name(x.dtype)
    except TypeError:
        raise TypeError(f"{name}: dtype must be one of {', '.join(DTYPES)}, got {x.dtype}") from None


def check_same_dtype(expected: str, **arrays) -> None:
    for name, x in arrays.items():
        got = check_dtype(name, x)
        if got != expected:
            raise TypeError(f"{name}: dtype must match q ({expected}), got {got}")


def check_ndim(name: str, x, layout: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name}: expected a 4-D array ({_axes(layout)}), got {x.ndim}-D with shape {tuple(x.shape)}")


def _axes(layout: str) -> str:
    return "batch, seqlen, nheads, head_dim" if layout == "bshd" else "batch, nheads, seqlen, head_dim"


def _check_choice(name: str, value, choices: tuple) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, one of {choices}, got {value!r} of type {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def check_layout(layout) -> None:
    _check_choice("layout", layout, LAYOUTS)


def check_backend(backend) -> None:
    _check_choice("backend", backend, BACKENDS)


def check_qkv(q, k, v) -> None:
    """q (b, sq, h, d), k and v (b, sk, hk, d), in the bshd view."""
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v: shapes must be equal, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    b, _, h, d = q.shape
    kb, _, hk, kd = k.shape
    if kb != b:
        raise ValueError(f"k: batch must equal q's ({b}), got {kb}")
    if kd != d:
        raise ValueError(f"k: head_dim must equal q's ({d}), got {kd}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"k: nheads_k must divide q's nheads ({h}), got nheads_k={hk}")
    check_head_dim(d)


def check_head_dim(d: int) -> None:
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {d}")
    if d <= 0 or d % 8 != 0:
        raise ValueError(f"head_dim must be a positive multiple of 8 (pad q, k, v to one), got {d}")


def check_softmax_scale(scale, head_dim: int) -> float:
    """None (1 / sqrt(head_dim)), or a real number: int, float, a NumPy integer or floating scalar.
    bool, str, complex and arrays are the wrong type; the value must be finite and > 0."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"softmax_scale: expected None or a real number (int, float, NumPy integer or floating "
                        f"scalar), got {scale!r} of type {type(scale).__name__}")
    try:
        s = float(scale)
    except OverflowError:  # an int too large for a float
        s = math.inf
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"softmax_scale: expected a finite positive number, got {scale!r}")
    return s


def check_like(name: str, x, shape: tuple, dtype: str) -> None:
    """An input that must have an exact shape and dtype (dout, o in the backward)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    got = check_dtype(name, x)
    if got != dtype:
        raise TypeError(f"{name}: dtype must be {dtype}, got {got}")


def check_lse(lse, shape: tuple, dtype: str) -> None:
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse: expected shape {tuple(shape)} (batch, nheads, seqlen_q), got {tuple(lse.shape)}")
    got = check_dtype("lse", lse)
    if got != dtype:
        raise TypeError(f"lse: dtype must be {dtype}, got {got}")


def check_out(out, shape: tuple, dtype: str, inputs: dict, name: str = "out") -> None:
    """`out=` (or dq=, dk=, dv=): exact shape and dtype, unit stride in the last dimension, no
    overlap with any input."""
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    try:
        got = dtype_name(out.dtype)
    except TypeError:
        got = str(out.dtype)
    if got != dtype:
        raise TypeError(f"{name}: dtype must be {dtype} (q's), got {got}")
    strides, itemsize = _byte_strides(out)
    if out.shape[-1] > 1 and strides[-1] != itemsize:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {itemsize} bytes), got {strides[-1]}")
    for other, x in inputs.items():
        if _overlaps(out, x):
            raise ValueError(f"{name}: must not share memory with {other}")


def _byte_strides(x) -> tuple[tuple[int, ...], int]:
    """(strides in bytes, itemsize) of a NumPy / CuPy array or a torch tensor."""
    if callable(getattr(x, "stride", None)):  # torch: strides in elements
        size = x.element_size()
        return tuple(s * size for s in x.stride()), size
    return tuple(x.strides), x.itemsize


def _base(x) -> int | None:
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    if callable(getattr(x, "data_ptr", None)):  # torch
        return int(x.data_ptr())
    ptr = getattr(getattr(x, "data", None), "ptr", None)  # CuPy
    return None if ptr is None else int(ptr)


def _extent(x) -> tuple[int, int] | None:
    """[first, last) byte address an array can touch, or None when it cannot be told."""
    base = _base(x)
    if base is None:
        return None
    strides, itemsize = _byte_strides(x)
    lo = base + sum((n - 1) * s for n, s in zip(x.shape, strides) if s < 0 and n > 0)
    hi = base + sum((n - 1) * s for n, s in zip(x.shape, strides) if s > 0 and n > 0) + itemsize
    return lo, hi


def _overlaps(a, b) -> bool:
    if math.prod(a.shape) == 0 or math.prod(b.shape) == 0 or type(a) is not type(b):
        return False
    ea, eb = _extent(a), _extent(b)
    return ea is not None and eb is not None and ea[0] < eb[1] and eb[0] < ea[1]


def check_batch(batch: int, limit: int = 65535) -> None:
    """The CUDA grid's z dimension carries the batch."""
    if batch > limit:
        raise ValueError(f"q: batch must be <= {limit} for the CUDA kernels, got {batch}")
