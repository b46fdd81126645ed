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

from ._interop import is_torch
from ._params import UNBOUNDED
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


# The kernels scale scores in float32 (fp16, bf16, fp32 inputs): a factor outside its normal range would
# become 0 or inf there (or a denormal, flushed to 0), and the softmax NaN.
FLOAT32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def _to_float(x) -> float:
    try:
        return float(x)
    except OverflowError:  # an int too large for a float
        return math.inf


def check_softmax_scale(scale, head_dim: int) -> float:
    """None (1 / sqrt(head_dim)), or a real number: int, float, a NumPy integer or floating scalar.
    bool, str, complex and arrays are the wrong type; the value must be positive and a normal float32."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"softmax_scale: expected None or a real number (int, float, NumPy integer or floating "
                        f"scalar), got {scale!r} of type {type(scale).__name__}")
    s = _to_float(scale)
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"softmax_scale: expected a finite positive number, got {scale!r}")
    if not FLOAT32_NORMAL[0] <= s <= FLOAT32_NORMAL[1]:
        raise ValueError(f"softmax_scale: expected a number within float32's normal range "
                         f"[{FLOAT32_NORMAL[0]:.4g}, {FLOAT32_NORMAL[1]:.4g}] (the kernels scale in float32), "
                         f"got {scale!r}")
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


def _is_jax(x) -> bool:
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def is_traced(x) -> bool:
    """A JAX tracer (inside jax.jit, grad or vmap): an abstract value with no data to hand to a kernel."""
    return _is_jax(x) and "Tracer" in type(x).__name__


def check_concrete(name: str, x) -> None:
    """An array the public functions hand to a backend: not a JAX tracer (cuflash.jax's functions trace; its own
    checks take tracers, so this is not part of check_array)."""
    if is_traced(x):
        raise TypeError(f"{name}: a traced JAX value (inside jax.jit, grad or vmap) has no data to read; use "
                        f"cuflash.jax, whose functions trace")


def check_writable(name: str, x) -> None:
    """An array cuflash writes into in place (out=, dq=, dk=, dv=, a KV cache it appends to): not a JAX array,
    which JAX holds immutable (XLA may share its buffer with other arrays, or reuse it); not a read-only NumPy
    array; no two elements at one address (a zero stride: a broadcast view). Checked before anything is
    written."""
    if _is_jax(x):
        raise TypeError(f"{name}: a JAX array cannot be written in place (JAX arrays are immutable); use the "
                        f"result cuflash returns, or a CuPy / torch array")
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name}: the array is read-only (a broadcast view, or writeable=False); pass a writable "
                         f"array")
    if is_torch(x):  # writes bypass autograd's in-place checks: refuse as torch does
        import torch

        if x.requires_grad:
            raise ValueError(f"{name}: a tensor that requires grad cannot be written in place (autograd would not "
                             f"see the write); pass one that does not, or use cuflash.torch")
        if x.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{name}: an inference tensor can be written in place only under "
                             f"torch.inference_mode()")
    strides, _ = _byte_strides(x)
    if math.prod(x.shape) > 0 and any(s == 0 and n > 1 for n, s in zip(x.shape, strides)):
        raise ValueError(f"{name}: elements must not share memory (a zero stride, as in a broadcast view), got "
                         f"strides {strides} bytes for shape {tuple(x.shape)}")


def _last_dim_strided(x) -> int | None:
    """The last dimension's stride in bytes where it is not unit (the kernels' 16-byte rows need unit), else
    None; an array without elements has no stride to keep (NumPy gives them any)."""
    strides, itemsize = _byte_strides(x)
    if x.shape[-1] > 1 and math.prod(x.shape) > 0 and strides[-1] != itemsize:
        return strides[-1]
    return None


def check_out(out, shape: tuple, dtype: str, inputs: dict, name: str = "out") -> None:
    """`out=` (or dq=, dk=, dv=): writable (check_writable), exact shape and dtype, unit stride in the last
    dimension, no overlap with any input."""
    check_writable(name, out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    try:
        got = dtype_name(out.dtype)
    except TypeError:
        got = str(out.dtype)
    if got != dtype:
        raise TypeError(f"{name}: dtype must be {dtype} (q's), got {got}")
    stride = _last_dim_strided(out)
    if stride is not None:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {out.dtype.itemsize} bytes), "
                         f"got {stride}")
    check_no_overlap(name, out, inputs)


def check_no_overlap(name: str, out, inputs: dict) -> None:
    """An array written in place shares no memory with any array the call reads (inputs: name -> array)."""
    for other, x in inputs.items():
        if _overlaps(out, x):
            raise ValueError(f"{name}: must not share memory with {other}")


def _byte_strides(x) -> tuple[tuple[int, ...], int]:
    """(strides in bytes, itemsize) of a NumPy / CuPy array, a torch tensor or a JAX array."""
    if callable(getattr(x, "stride", None)):  # torch: strides in elements
        size = x.element_size()
        return tuple(s * size for s in x.stride()), size
    if _is_jax(x):  # row-major always, and no strides to read
        size = x.dtype.itemsize
        strides = [size] * len(x.shape)
        for i in range(len(x.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(int(x.shape[i + 1]), 1)
        return tuple(strides), size
    return tuple(x.strides), x.itemsize


def _base(x) -> int | None:
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    if callable(getattr(x, "data_ptr", None)):  # torch (a meta tensor has no memory)
        return None if getattr(x, "is_meta", False) else int(x.data_ptr())
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
    # any two kinds compare (an nn.Parameter and its .data, a NumPy view of a torch tensor): host and device
    # memory share one virtual address space (CUDA's unified addressing), and check_devices keeps one device
    if math.prod(a.shape) == 0 or math.prod(b.shape) == 0:
        return False
    ea, eb = _extent(a), _extent(b)
    return ea is not None and eb is not None and ea[0] < eb[1] and eb[0] < ea[1]


_TOO_HARD = getattr(np, "exceptions", np).TooHardError  # numpy.exceptions from NumPy 1.25


def shares_elements(a, b) -> bool:
    """Do two arrays share an element's bytes, not merely an address range (the interleaved halves of one buffer do
    not)? Exact, from their pointers, shapes and byte strides: NumPy's shares_memory over stand-ins at the same
    addresses, which reads nothing. A case too hard to settle within a bound counts as sharing."""
    if not _overlaps(a, b):
        return False
    try:
        return bool(np.shares_memory(_stand_in(a), _stand_in(b), max_work=1 << 20))
    except _TOO_HARD:
        return True


class _StandIn:
    """x's memory layout as a NumPy array interface (elements as opaque bytes), for address arithmetic only."""

    def __init__(self, x):
        strides, itemsize = _byte_strides(x)
        self.__array_interface__ = {"shape": tuple(int(n) for n in x.shape), "typestr": f"|V{itemsize}",
                                    "data": (_base(x), False), "strides": strides, "version": 3}


def _stand_in(x) -> np.ndarray:
    return np.asarray(_StandIn(x))


def check_batch(batch: int, limit: int = 65535) -> None:
    """The CUDA grid's z dimension carries the batch."""
    if batch > limit:
        raise ValueError(f"q: batch must be <= {limit} for the CUDA kernels, got {batch}")


def check_grid_heads(name: str, nheads: int, limit: int = 65535) -> None:
    """A grid's y dimension carries the heads (flash_decode: the kv heads)."""
    if nheads > limit:
        raise ValueError(f"{name}: nheads must be <= {limit} for the CUDA kernels, got {nheads}")


# --- attention variants (window, softcap, ALiBi, dropout) and variable-length batches -------------------


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_window(window) -> tuple[int, int]:
    """window=(left, right): a pair of ints, each >= -1 (-1: unbounded on that side). A side of UNBOUNDED
    (2**30) keys or more reaches past any sequence the kernels index (int32, below 2**30 rows): it is -1."""
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(_is_int(x) for x in window):
        raise TypeError(f"window: expected a pair of ints (left, right), -1 for unbounded, got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window: each side must be >= -1 (-1: unbounded), got {(left, right)}")
    return tuple(-1 if x >= UNBOUNDED else x for x in (left, right))


def check_softcap(softcap) -> float:
    """softcap: a real number, 0 (off) or finite and > 0."""
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected a real number (0 for off), got {softcap!r} of type {type(softcap).__name__}")
    c = _to_float(softcap)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"softcap: expected 0 (off) or a finite positive number, got {softcap!r}")
    if c and not FLOAT32_NORMAL[0] <= c <= FLOAT32_NORMAL[1]:
        raise ValueError(f"softcap: expected 0 (off) or a number within float32's normal range "
                         f"[{FLOAT32_NORMAL[0]:.4g}, {FLOAT32_NORMAL[1]:.4g}] (the kernels cap in float32), "
                         f"got {softcap!r}")
    return c


def check_dropout_p(dropout_p) -> float:
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a real number in [0, 1), got {dropout_p!r} of type "
                        f"{type(dropout_p).__name__}")
    p = _to_float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    return p


def check_seed(seed) -> int:
    if not _is_int(seed):
        raise TypeError(f"seed: expected an int, got {seed!r} of type {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed: expected 0 <= seed < 2**64, got {seed}")
    return int(seed)


def check_offset(offset) -> int:
    if not _is_int(offset):
        raise TypeError(f"offset: expected an int, got {offset!r} of type {type(offset).__name__}")
    if not 0 <= int(offset) < 2**32:
        raise ValueError(f"offset: expected 0 <= offset < 2**32 (the fourth Philox counter word), got {offset}")
    return int(offset)


def check_count(name: str, value) -> int:
    """A size argument: an int >= 0."""
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {value!r} of type {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return int(value)


def check_num_splits(value) -> int:
    """num_splits: an int in [0, MAX_SPLITS] (0: the library chooses)."""
    from .config import MAX_SPLITS

    n = check_count("num_splits", value)
    if n > MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [0, {MAX_SPLITS}] (0: chosen per call), got {n}")
    return n


def check_alibi_slopes(slopes, batch: int, nheads: int) -> None:
    """alibi_slopes: a float32 array of shape (nheads,) or (batch, nheads)."""
    check_array("alibi_slopes", slopes)
    if "float32" not in str(slopes.dtype):
        raise TypeError(f"alibi_slopes: dtype must be float32, got {slopes.dtype}")
    shape = tuple(slopes.shape)
    if shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes: expected shape ({nheads},) or ({batch}, {nheads}) (nheads or batch, nheads), "
                         f"got {shape}")


def check_ndim_packed(name: str, x) -> None:
    if x.ndim != 3:
        raise ValueError(f"{name}: expected a 3-D packed array (total_tokens, nheads, head_dim), got {x.ndim}-D "
                         f"with shape {tuple(x.shape)}")


def check_cu_seqlens_dtype(name: str, cu) -> None:
    check_array(name, cu)
    dt = str(cu.dtype)
    if not dt.endswith("int32") or dt.endswith("uint32"):
        raise TypeError(f"{name}: dtype must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of length batch + 1 >= 1, got shape {tuple(cu.shape)}")


def check_cu_seqlens_pair(cu_q, cu_k) -> int:
    """The two cumulative-length arrays have the same length, batch + 1: returns batch."""
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected length {cu_q.shape[0]} (batch + 1, as cu_seqlens_q), "
                         f"got {cu_k.shape[0]}")
    return int(cu_q.shape[0]) - 1


def check_cu_seqlens_values(name: str, values, total: int, packed: str) -> int:
    """Host values of a cumulative-length array: start at 0, never decrease, end at the packed array's
    length. Returns the largest sequence length."""
    values = np.asarray(values, dtype=np.int64)
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(values[0])}")
    steps = np.diff(values)
    if (steps < 0).any():
        at = int(np.nonzero(steps < 0)[0][0])
        raise ValueError(f"{name}: must not decrease, got {int(values[at])} then {int(values[at + 1])} at index {at}")
    if values[-1] != total:
        raise ValueError(f"{name}: the last value must equal {packed}'s length (total tokens {total}), "
                         f"got {int(values[-1])}")
    return int(steps.max()) if steps.size else 0


def check_max_seqlen(name: str, value, longest: int | None) -> int:
    value = check_count(name, value)
    if longest is not None and value < longest:
        raise ValueError(f"{name}: must be >= the longest sequence ({longest}), got {value}")
    return value


# --- the KV cache (flash_attn_with_kvcache) ----------------------------------------------------------------


def _check_int32(name: str, x, ndim: int, what: str) -> None:
    check_array(name, x)
    dt = str(x.dtype)
    if not dt.endswith("int32") or dt.endswith("uint32"):
        raise TypeError(f"{name}: dtype must be int32, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array ({what}), got shape {tuple(x.shape)}")


def check_kv_cache(q, k_cache, v_cache, block_table) -> tuple[int, int]:
    """The cache's layout against q: dense (batch, capacity, nheads_k, head_dim), or with block_table
    int32 (batch, max_pages) page pools (num_pages, page_size, nheads_k, head_dim), page_size a positive
    multiple of 16. Returns (capacity of an entry, num_pages; 0 when dense)."""
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache: shapes must be equal, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    b, _, h, d = q.shape
    first, rows, hk, kd = k_cache.shape
    if kd != d:
        raise ValueError(f"k_cache: head_dim must equal q's ({d}), got {kd}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"k_cache: nheads_k must divide q's nheads ({h}), got nheads_k={hk}")
    check_head_dim(d)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        stride = _last_dim_strided(x)
        if stride is not None:
            raise ValueError(f"{name}: the last dimension must be contiguous (the cache is written in place), "
                             f"got a stride of {stride} bytes")
    if block_table is None:
        if first != b:
            raise ValueError(f"k_cache: batch must equal q's ({b}), got {first}")
        return int(rows), 0
    _check_int32("block_table", block_table, 2, "batch, max_pages")
    if block_table.shape[0] != b:
        raise ValueError(f"block_table: batch must equal q's ({b}), got shape {tuple(block_table.shape)}")
    if rows == 0 or rows % 16 != 0:
        raise ValueError(f"k_cache: page_size (dimension 1 of a paged cache) must be a positive multiple of 16, "
                         f"got {rows}")
    return int(block_table.shape[1]) * int(rows), int(first)


def check_new_kv(k, v, like, dtype: str) -> int:
    """k, v (batch, seqlen_new, nheads_k, head_dim) to append, both or neither: returns seqlen_new (0 for
    neither). `like`: (batch, nheads_k, head_dim) of the cache."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v: pass both (the new keys and values) or neither, got only {'k' if v is None else 'v'}")
    if k is None:
        return 0
    check_same_dtype(dtype, k=k, v=v)
    b, hk, d = like
    for name, x in (("k", k), ("v", v)):
        check_ndim(name, x, "bshd")
        if (x.shape[0], x.shape[2], x.shape[3]) != (b, hk, d):
            raise ValueError(f"{name}: expected shape ({b}, seqlen_new, {hk}, {d}) (batch, seqlen_new, nheads_k, "
                             f"head_dim of the cache), got {tuple(x.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v: shapes must be equal, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    return int(k.shape[1])


def check_cache_seqlens(cache_seqlens, batch: int) -> None:
    """cache_seqlens: an int >= 0, or an int32 array of shape (batch,)."""
    if _is_int(cache_seqlens):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens: expected an int >= 0, got {cache_seqlens}")
        return
    if not hasattr(cache_seqlens, "dtype"):
        raise TypeError(f"cache_seqlens: expected an int or an int32 array (batch,), got "
                        f"{type(cache_seqlens).__name__}")
    _check_int32("cache_seqlens", cache_seqlens, 1, "batch")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected shape ({batch},) (batch), got {tuple(cache_seqlens.shape)}")


def check_cache_seqlens_values(values, seqlen_new: int, capacity: int, paged: bool) -> None:
    """Host values: each >= 0, and cache_seqlens + seqlen_new within an entry's capacity."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if (values < 0).any():
        at = int(np.nonzero(values < 0)[0][0])
        raise ValueError(f"cache_seqlens: must be >= 0, got {int(values[at])} at index {at}")
    over = values + seqlen_new > capacity
    if over.any():
        at = int(np.nonzero(over)[0][0])
        what = "max_pages * page_size of block_table and k_cache" if paged else "k_cache's dimension 1"
        raise ValueError(f"cache_seqlens: cache_seqlens + seqlen_new must be <= the cache's capacity {capacity} "
                         f"({what}), got {int(values[at])} + {seqlen_new} at index {at}")


def check_block_table_values(values, num_pages: int) -> None:
    """Host values: every entry a page of the pool, in [0, num_pages) (pad unused slots with a valid page)."""
    values = np.asarray(values)
    bad = (values < 0) | (values >= num_pages)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table: entries must be page indices in [0, num_pages={num_pages}), got "
                         f"{int(values[at])} at {at}")
