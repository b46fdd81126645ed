"""The plan cache: the fast path of a cached call.

Everything about a call that depends only on its signature (array kind, device, dtypes, shapes,
strides, layout, flags, scale, out= given or not) is worked out once, on the general path in api.py,
which also validates it. When the call can run straight from the caller's memory (CUDA backend,
CuPy arrays or torch CUDA tensors, unit-stride rows, 16-byte strides), it leaves a plan here under
the signature. A call whose signature has a plan reads the data pointers, checks their alignment
(and that out=, or a KV cache appended to, shares no memory with an input), allocates the results
with the caller's allocator, patches the pointers into the params bytes and launches on the caller's
current stream. Anything else (a misaligned pointer this time, another current device) takes the
general path, which validates again, copies what it must and gives the same errors.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from . import _checks, _params, config
from .backends import cuda

FORWARD: dict = {}
BACKWARD: dict = {}
KVCACHE: dict = {}
MISALIGNED = cuda.ALIGNMENT - 1

_SIGNATURE: dict = {}  # array type -> its signature function


def _signature_of(cls):
    """The signature function for arrays of q's type: (type, shape, strides, dtype, device) of a CuPy
    array or torch tensor; for other types one that raises (no plan)."""
    f = _SIGNATURE.get(cls)
    if f is None:
        f = _no_signature
        module = cls.__module__.split(".")[0]
        if module == "cupy":
            import cupy

            f = _cupy_signature if issubclass(cls, cupy.ndarray) else f
        elif module == "torch":
            import torch

            f = _torch_signature if issubclass(cls, torch.Tensor) else f
        _SIGNATURE[cls] = f
    return f


def _no_signature(x):
    raise KeyError("no plan for this array type")


def _not_flag_or_scale(causal, softmax_scale, deterministic=False) -> bool:
    """Values the general path must check (it rejects some, converts others): no key for them."""
    return (causal.__class__ is not bool or deterministic.__class__ is not bool
            or (softmax_scale is not None and softmax_scale.__class__ not in (float, int)))


def _not_window_or_softcap(window, softcap) -> bool:
    """A window other than a tuple of two ints, or a softcap other than a float or int: the general path checks
    (or converts) it, so no key. Plans key both by value: their launches are built for them."""
    return (softcap.__class__ not in (float, int) or window.__class__ is not tuple or len(window) != 2
            or any(w.__class__ is not int for w in window))


def forward_key(q, k, v, out, causal, softmax_scale, window, softcap, layout, backend):
    """The plan-cache key of a forward call (without ALiBi or dropout), or None when the call cannot have a plan.
    Every array gets q's signature function: each signature holds its own type, and a foreign type raises."""
    if _not_flag_or_scale(causal, softmax_scale) or _not_window_or_softcap(window, softcap):
        return None
    try:
        sig = _signature_of(q.__class__)
        return (sig(q), sig(k), sig(v), None if out is None else sig(out), causal, softmax_scale, window, softcap,
                layout, backend, config._forced_family)
    except Exception:
        return None


def backward_key(do, q, k, v, o, lse, dq, dk, dv, causal, softmax_scale, window, softcap, layout, backend,
                 deterministic):
    """forward_key's counterpart for flash_attn_backward."""
    if _not_flag_or_scale(causal, softmax_scale, deterministic) or _not_window_or_softcap(window, softcap):
        return None
    try:
        sig = _signature_of(q.__class__)
        return (sig(do), sig(q), sig(k), sig(v), sig(o), sig(lse), None if dq is None else sig(dq),
                None if dk is None else sig(dk), None if dv is None else sig(dv),
                causal, softmax_scale, window, softcap, layout, backend, deterministic, config._forced_family)
    except Exception:
        return None


def kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window, softcap,
                num_splits, return_lse, backend):
    """The plan-cache key of a flash_attn_with_kvcache call (without ALiBi, check_inputs=False), or None. An int
    cache_seqlens keys as `int`: its value changes from call to call (the plan checks it on each); the window and
    the softcap by value, as for forward_key."""
    if (_not_flag_or_scale(causal, softmax_scale) or return_lse.__class__ is not bool
            or num_splits.__class__ is not int or _not_window_or_softcap(window, softcap)):
        return None
    try:
        sig = _signature_of(q.__class__)
        return (sig(q), sig(k_cache), sig(v_cache), None if k is None else sig(k), None if v is None else sig(v),
                int if cache_seqlens.__class__ is int else sig(cache_seqlens),
                None if block_table is None else sig(block_table), causal, softmax_scale, window, softcap, num_splits,
                return_lse, backend, config._forced_family)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# Array kinds the fast path serves
# ------------------------------------------------------------------------------------------------


class _Kind:
    """How the fast path treats one array kind on one device: pointers, the allocator (`same`: a new
    C-contiguous array with another's dtype and device; `new`: with a given dtype; `like`: `same` with
    another's shape, for a C-contiguous one only), the current stream."""

    def __init__(self, caller):
        from cupy.cuda.runtime import getDevice

        self.device = caller.device_id
        self.current_device = getDevice  # the CUDA runtime's current device, which launches go to
        if caller.kind == "cupy":
            import cupy

            ndarray, current = cupy.ndarray, cupy.cuda.get_current_stream
            self.ptr = _cupy_ptr
            self.same = lambda like, shape: ndarray(shape, like.dtype)
            self.like = lambda like: ndarray(like.shape, like.dtype)
            self.contiguous = lambda x: x.flags.c_contiguous
            self.new = lambda like, shape, dtype: ndarray(shape, dtype)
            self.dtype = lambda np_dtype: np_dtype
            self.stream = lambda: current().ptr
        else:
            import torch

            self.ptr = torch.Tensor.data_ptr
            self.same = torch.Tensor.new_empty  # cheaper than torch.empty: no dtype or device to parse
            self.like = torch.empty_like  # cheaper still (no shape to parse); C-contiguous given C-contiguous
            self.contiguous = torch.Tensor.is_contiguous
            self.new = lambda like, shape, dtype: like.new_empty(shape, dtype=dtype)
            self.dtype = lambda np_dtype: getattr(torch, np_dtype.name)
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self.stream = (functools.partial(raw, self.device) if raw is not None
                           else lambda: torch.cuda.current_stream(self.device).cuda_stream)


def _cupy_ptr(x) -> int:
    return x.data.ptr


def _cupy_signature(x):
    return (x.__class__, x.shape, x.strides, x.dtype, x.data.device_id)


def _torch_signature(x):
    return (x.__class__, x.shape, x.stride(), x.dtype, x.get_device())


def plannable(caller, backend_module, *arrays, indices=()) -> bool:
    """Can calls of this signature run from the caller's memory as they are? (the CUDA backend,
    CuPy or torch CUDA arrays whose strides the kernels take; pointers are checked per call). indices: int32
    arrays (a KV cache's counts and page table; None or an int where there is none): unit last stride."""
    if backend_module is not cuda or caller.kind not in ("cupy", "torch"):
        return False
    for x in arrays:
        strides, itemsize = _checks._byte_strides(x)
        if (x.ndim and x.shape[-1] > 1 and strides[-1] != itemsize) or any(s % cuda.ALIGNMENT for s in strides[:-1]):
            return False
    for x in indices:
        if x is not None and x.__class__ is not int:
            strides, itemsize = _checks._byte_strides(x)
            if x.shape[-1] > 1 and strides[-1] != itemsize:
                return False
    return True


def _span(x) -> tuple[int, int]:
    """[lo, hi) bytes an array touches, relative to its data pointer ((0, 0): none)."""
    if 0 in tuple(x.shape):
        return 0, 0
    base = _checks._base(x)
    lo, hi = _checks._extent(x)
    return lo - base, hi - base


# ------------------------------------------------------------------------------------------------
# Plans
# ------------------------------------------------------------------------------------------------


class ForwardPlan:
    """One forward signature: its launches, and how to allocate o and lse."""

    def __init__(self, caller, launches, q, k, v, out, lse_shape, lse_dtype, general):
        self.kind = kind = _Kind(caller)
        self.launches = launches
        self.o_shape = tuple(q.shape)
        self.o_like = kind.contiguous(q)  # o as q, so empty_like makes it (the signature fixes q's strides)
        self.lse_shape, self.lse_dtype = tuple(lse_shape), kind.dtype(lse_dtype)
        self.spans = None if out is None else (_span(out), _span(q), _span(k), _span(v))
        self.general = general  # the general path (a functools.partial of api._forward), for what this does not serve

    def __call__(self, q, k, v, out):
        kind = self.kind
        ptr = kind.ptr
        pq, pk, pv = ptr(q), ptr(k), ptr(v)
        po = 0 if out is None else ptr(out)
        if ((pq | pk | pv | po) & MISALIGNED or kind.current_device() != kind.device
                or (out is not None and _overlaps(self.spans, po, pq, pk, pv))):
            return self.general(q, k, v, out=out)
        if out is None:
            o = kind.like(q) if self.o_like else kind.same(q, self.o_shape)
        else:
            o = out
        lse = kind.new(q, self.lse_shape, self.lse_dtype)
        L = self.launches
        with L.lock:
            L.patch(_params.FWD_POINTERS, pq, pk, pv, ptr(o), ptr(lse))
            L.run(kind.stream())
        return o, lse


class BackwardPlan:
    """One backward signature: its launches, and how to allocate dq, dk, dv and the workspace."""

    def __init__(self, caller, launches, do, q, k, v, o, lse, grads, workspace_shape, general):
        self.kind = kind = _Kind(caller)
        self.launches = launches
        self.shapes = tuple(tuple(x.shape) for x in (q, k, v))
        self.workspace_shape = tuple(workspace_shape)  # 1-D, lse's dtype (api._workspace)
        # dq, dk, dv shaped as C-contiguous q, k, v: empty_like makes them
        self.like = all(map(kind.contiguous, (q, k, v)))
        # dq=, dk=, dv= given: their spans, and those of everything they must not overlap
        self.grads_given = any(x is not None for x in grads)
        if self.grads_given:
            self.spans = [None if x is None else _span(x) for x in (*grads, do, q, k, v, o, lse)]
        self.general = general

    def __call__(self, do, q, k, v, o, lse, dq=None, dk=None, dv=None):
        kind = self.kind
        ptr = kind.ptr
        pdo, pq, pk, pv, po = ptr(do), ptr(q), ptr(k), ptr(v), ptr(o)
        if (pdo | pq | pk | pv | po) & MISALIGNED or kind.current_device() != kind.device:
            return self.general(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv)
        same = kind.same
        if self.like and not self.grads_given:
            like = kind.like
            grads = [like(q), like(k), like(v)]
        elif not self.grads_given:
            grads = [same(q, shape) for shape in self.shapes]
        else:
            grads = [x if x is not None else same(q, shape) for x, shape in zip((dq, dk, dv), self.shapes)]
            ptrs = [ptr(x) for x in (*grads, do, q, k, v, o, lse)]
            if any(p & MISALIGNED for p in ptrs[:3]) or _any_overlap(self.spans, ptrs):
                return self.general(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv)
        workspace = same(lse, self.workspace_shape)
        L = self.launches
        with L.lock:
            L.patch(_params.FWD_POINTERS, pq, pk, pv, po, ptr(lse))
            L.patch(_params.BWD_POINTERS, pdo, *map(ptr, grads), ptr(workspace))
            L.run(kind.stream())
        return tuple(grads)


def _any_overlap(spans, ptrs) -> bool:
    """Does a given gradient share bytes with another array? spans (None for a gradient allocated
    here) and ptrs: dq, dk, dv, then the inputs."""
    ranges = [None if s is None else (p + s[0], p + s[1]) for p, s in zip(ptrs, spans)]
    return any(a is not None and b is not None and a[0] < b[1] and b[0] < a[1]
               for i, a in enumerate(ranges[:3]) for j, b in enumerate(ranges) if j != i)


def _overlaps(spans, po: int, *pointers: int) -> bool:
    """Does out (at po) share bytes with any input? spans: [lo, hi) of out, then of each input."""
    (olo, ohi), *inputs = spans
    return any(po + olo < p + hi and p + lo < po + ohi for p, (lo, hi) in zip(pointers, inputs))


def _cache_shares(writes, kv_deltas, pkc: int, pvc: int, reads, read_ptrs) -> bool:
    """Might the caches (at pkc, pvc; writes: their spans) share memory with one another or with an array the
    call reads (reads: spans or None, read_ptrs: their pointers)? Then the general path tells exactly (and
    refuses). Caches whose ranges overlap at a distance pvc - pkc in kv_deltas are a layout a call of this
    signature validated (interleaved, element-disjoint)."""
    (klo, khi), (vlo, vhi) = writes
    k0, k1, v0, v1 = pkc + klo, pkc + khi, pvc + vlo, pvc + vhi
    if k0 < v1 and v0 < k1 and pvc - pkc not in kv_deltas:
        return True
    for span, p in zip(reads, read_ptrs):
        if span is not None and span[0] < span[1]:
            lo, hi = p + span[0], p + span[1]
            if lo < k1 and k0 < hi or lo < v1 and v0 < hi:
                return True
    return False


class KVCachePlan:
    """One flash_attn_with_kvcache signature: kvcache_append's launch where the call has new rows or an int
    cache_seqlens (it writes the rows and each entry's key count), the attention's launches (flash_decode's, or a
    forward's), and how to allocate o, lse and the scratch (flash_decode's split partials, the key counts).
    Built from a call that validated (q and cache_seqlens: the caller's; the rest as the general path's working
    arrays, k, v and block_table None where absent; variants: its window and softcap); every pointer is patched on
    each call."""

    def __init__(self, caller, q, cache_seqlens, wq, k_cache, v_cache, k, v, block_table, seqlen_new: int,
                 capacity: int, num_splits: int, causal: bool, scale: float, lse_dtype, return_lse: bool, general,
                 **variants):
        import cupy

        self.kind = kind = _Kind(caller)
        self.o_shape, self.o_like = tuple(q.shape), kind.contiguous(q)
        b, sq, h, _ = wq.shape
        self.lse_shape, self.lse_dtype = (b, h, sq), kind.dtype(lse_dtype)
        # placeholders with the strides of what each call allocates: C-contiguous o, lse and counts
        o, lse = cupy.empty(wq.shape, wq.dtype), cupy.empty(self.lse_shape, lse_dtype)
        counts = cupy.empty((b,), cupy.int32)
        self.int_start = cache_seqlens.__class__ is int  # an int: checked on every call, patched as AppendParams.start
        self.room = capacity - seqlen_new  # the largest int cache_seqlens
        self.rows = seqlen_new > 0
        if self.rows:  # the caches are written: their spans, those of what the call reads, distances validated
            self.writes = (_span(k_cache), _span(v_cache))
            self.reads = tuple(None if x is None or x.__class__ is int else _span(x)
                               for x in (q, k, v, cache_seqlens, block_table))
            self.kv_deltas = {_checks._base(v_cache) - _checks._base(k_cache)}
        self.append = None
        if self.rows or self.int_start:  # the rows and the key counts, in one launch before the attention's
            self.append = cuda.append_launches(k_cache, v_cache, k, v, 0, block_table, counts, seqlen_new=seqlen_new,
                                               batch=b, capacity=capacity)
        self.attend = cuda.kvcache_launches(wq, k_cache, v_cache, o, lse, kvcache=(counts, block_table),
                                            num_splits=num_splits, causal=causal, softmax_scale=scale, **variants)
        partial = self.attend.partial or (0, 0)
        self.lse_partial = partial[1]
        self.counts_offset = -(-partial[0] // 16) * 16
        self.scratch = self.counts_offset + (4 * b if self.append is not None else 0)
        self.u8 = kind.dtype(np.dtype(np.uint8))
        self.return_lse = return_lse
        self.general = general  # the general path (api._with_kvcache), for what this does not serve
        self.lock = threading.Lock()

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        kind = self.kind
        ptr = kind.ptr
        pq, pkc, pvc = ptr(q), ptr(k_cache), ptr(v_cache)
        pk, pv = (ptr(k), ptr(v)) if self.rows else (0, 0)
        if self.int_start:
            start, pcs, bad = cache_seqlens, 0, not 0 <= cache_seqlens <= self.room
        else:
            start, pcs, bad = 0, ptr(cache_seqlens), False
        pbt = 0 if block_table is None else ptr(block_table)
        if bad or (pq | pkc | pvc | pk | pv) & MISALIGNED or kind.current_device() != kind.device:
            return self.general(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table)
        if self.rows and _cache_shares(self.writes, self.kv_deltas, pkc, pvc, self.reads, (pq, pk, pv, pcs, pbt)):
            result = self.general(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table)
            self.kv_deltas.add(pvc - pkc)  # it did not raise: caches this far apart share no element
            return result
        o = kind.like(q) if self.o_like else kind.same(q, self.o_shape)
        lse = kind.new(q, self.lse_shape, self.lse_dtype)
        scratch = kind.new(q, (self.scratch,), self.u8) if self.scratch else None
        ps = 0 if scratch is None else ptr(scratch)
        counts = pcs if self.append is None else ps + self.counts_offset
        attend = self.attend
        with self.lock:
            if self.append is not None:
                self.append.patch(_params.APPEND_POINTERS, pk, pv, pkc, pvc, pcs, pbt, counts, start)
            attend.patch(_params.FWD_POINTERS, pq, pkc, pvc, ptr(o), ptr(lse))
            attend.patch(_params.KVCACHE_POINTERS, counts, pbt)
            if attend.partial:
                attend.patch(_params.PARTIAL_POINTERS, ps, ps + self.lse_partial)
            stream = kind.stream()
            if self.append is not None:
                self.append.run(stream)
            attend.run(stream)
        return (o, lse) if self.return_lse else o
