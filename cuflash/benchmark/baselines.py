"""The implementations a benchmark compares, behind one small interface.

GPU: "cuflash" (cuflash.api on the cuda backend), "conventional" (materialized S and P in the input
dtype: matmul, a fused row-softmax kernel masked by cuflash.reference's rule, matmul), and PyTorch's SDPA backends "torch-flash",
"torch-efficient", "torch-cudnn", "torch-math" (when torch is importable). The launch suite also
runs cuflash on torch tensors ("cuflash-torch") and SDPA's backward through its low-level ops.
CPU: "cuflash-numpy" (the tiled NumPy backend) and "materialized-numpy" (cuflash.reference storing
every materialized stage in the input dtype: the accuracy rule's same-precision reference).

An implementation gives `forward(case, s) -> state` and `backward(case, s, state) -> grads`, and
from them `calls(case, sets, mode)`: one zero-argument callable per input set, so that a timer can
rotate among the sets. Heavy modules (cupy, torch) are imported inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import warnings

import numpy as np

from ..config import numpy_dtype

TORCH_BACKENDS = {
    "torch-flash": "FLASH_ATTENTION",
    "torch-efficient": "EFFICIENT_ATTENTION",
    "torch-cudnn": "CUDNN_ATTENTION",
    "torch-math": "MATH",
}
GPU_IMPLS = ("cuflash", "conventional", *TORCH_BACKENDS)
# atol of the accuracy rule max|ours - ref64| <= 2 max|same_precision - ref64| + atol
ACCURACY_ATOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-6, "float64": 1e-12}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    nheads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    causal: bool

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def label(self) -> str:
        return f"B={self.batch} H={self.nheads} N={self.seqlen_q} d={self.head_dim}"

    def shape(self) -> dict:
        return {"batch": self.batch, "nheads": self.nheads, "seqlen_q": self.seqlen_q,
                "seqlen_k": self.seqlen_k, "head_dim": self.head_dim}

    def set_bytes(self, mode: str) -> int:
        """Bytes of one input set a call reads: q, k, v (and dout, o for the backward)."""
        n = self.batch * self.nheads * self.head_dim * (self.seqlen_q + 2 * self.seqlen_k)
        if mode != "fwd":
            n += 2 * self.batch * self.nheads * self.head_dim * self.seqlen_q
        return n * numpy_dtype(self.dtype).itemsize

    def flops(self, mode: str) -> int:
        from .timing import flops

        return flops(self.batch, self.nheads, self.seqlen_q, self.seqlen_k, self.head_dim, self.causal, mode)


@dataclasses.dataclass
class InputSet:
    q: object
    k: object
    v: object
    do: object


class Unavailable(Exception):
    """An implementation cannot run this case here; the message says why."""


def short_reason(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0] if msg else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_oom(e: BaseException) -> bool:
    name = type(e).__name__
    return "OutOfMemory" in name or "out of memory" in str(e).lower()


@contextlib.contextmanager
def refusals_as_unavailable():
    """A call inside that raises (a backend that cannot run the case) raises Unavailable instead, with
    the error and the first warnings it gave (torch says there why an SDPA backend declined). Out of
    memory passes through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except Exception as e:
            if is_oom(e):
                raise
            why = [str(w.message).splitlines()[0] for w in caught][:3]
            raise Unavailable("; ".join([short_reason(e, 200), *why])[:500]) from e


# ------------------------------------------------------------------------------------------------
# Arrays (NumPy or CuPy: the namespace is the input's)
# ------------------------------------------------------------------------------------------------


def _xp(x):
    from ..reference import _namespace

    return _namespace(x)


def cast(x32, dtype: str):
    """A float32 array in `dtype`; bfloat16 by round-to-nearest-even on the bits where astype can't."""
    xp = _xp(x32)
    dt = numpy_dtype(dtype)
    try:
        return x32.astype(dt)
    except Exception:
        if dtype != "bfloat16":
            raise
        u = xp.ascontiguousarray(x32, dtype=xp.float32).view(xp.uint32)
        r = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)
        return r.astype(xp.uint16).view(dt)


def upcast(x, dtype=np.float64):
    """An array as float32 or float64 (bfloat16 through its bits where astype can't)."""
    xp = _xp(x)
    try:
        return x.astype(dtype)
    except Exception:
        if x.dtype.name != "bfloat16":
            raise
        u = xp.ascontiguousarray(x).view(xp.uint16).astype(xp.uint32) << xp.uint32(16)
        return u.view(xp.float32).astype(dtype)


def same_bits(a, b) -> bool:
    """Two arrays (or tuples of arrays) hold the same bytes."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    xp = _xp(a)
    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    return a.shape == b.shape and bool(xp.array_equal(a.view(xp.uint8), b.view(xp.uint8)))


def gpu_inputs(case: Case, n_sets: int, seed: int = 0) -> list[InputSet]:
    """Random normal q, k, v, dout (never zeros) in bshd layout on the GPU, n_sets independent sets."""
    import cupy

    rs = cupy.random.RandomState(seed)
    qs = (case.batch, case.seqlen_q, case.nheads, case.head_dim)
    ks = (case.batch, case.seqlen_k, case.nheads, case.head_dim)
    return [InputSet(*(cast(rs.standard_normal(s, dtype=cupy.float32), case.dtype) for s in (qs, ks, ks, qs)))
            for _ in range(n_sets)]


def cpu_inputs(case: Case, seed: int = 0) -> InputSet:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(case.dtype)
    qs = (case.batch, case.seqlen_q, case.nheads, case.head_dim)
    ks = (case.batch, case.seqlen_k, case.nheads, case.head_dim)
    return InputSet(*(rng.standard_normal(s, dtype=np.float32).astype(dt) for s in (qs, ks, ks, qs)))


def bhsd(s: InputSet) -> InputSet:
    """The same values as contiguous (B, H, N, d) CuPy arrays."""
    import cupy

    return InputSet(*(cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (s.q, s.k, s.v, s.do)))


def to_torch(x):
    """A CuPy array as a torch tensor, zero-copy through DLPack (bfloat16 through its uint16 bits)."""
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception:
        if x.dtype.name != "bfloat16":
            raise
        import cupy

        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)


def torch_cuda() -> tuple[bool, str]:
    try:
        import torch
    except Exception as e:
        return False, f"torch not importable ({short_reason(e)})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


# ------------------------------------------------------------------------------------------------
# Base class
# ------------------------------------------------------------------------------------------------


class Impl:
    name = ""
    clock = "cupy"  # which events time it: "cupy" or "torch"
    memory = "cupy"  # which allocator sees its memory: "cupy", "torch" or "host"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def context(self):
        return contextlib.nullcontext()

    def notes(self, dtype: str) -> dict:
        return {}

    def prepare(self, s: InputSet) -> InputSet:
        """The input set as this implementation takes it (done once, outside any timed call)."""
        return s

    def forward_call(self, case: Case, s: InputSet):
        """The forward as a user calls it, bound to its arguments (no wrapper frame: the launch suite times
        its host cost). Returns state for the backward; its first element is the output o."""
        raise NotImplementedError

    def backward_call(self, case: Case, s: InputSet, state):
        """The backward, bound likewise; returns (dq, dk, dv)."""
        raise NotImplementedError

    def forward(self, case: Case, s: InputSet):
        return self.forward_call(case, s)()

    def backward(self, case: Case, s: InputSet, state):
        return self.backward_call(case, s, state)()

    def fwd_bwd(self, case: Case, s: InputSet):
        return self.backward(case, s, self.forward(case, s))

    def calls(self, case: Case, sets: list[InputSet], mode: str) -> list:
        sets = [self.prepare(s) for s in sets]
        if mode == "fwd":
            return [self.forward_call(case, s) for s in sets]
        if mode == "bwd":
            return [self.backward_call(case, s, self.forward(case, s)) for s in sets]
        return [functools.partial(self.fwd_bwd, case, s) for s in sets]


# ------------------------------------------------------------------------------------------------
# cuflash
# ------------------------------------------------------------------------------------------------


class Cuflash(Impl):
    """cuflash through its public API: the cuda backend on CuPy arrays or torch tensors (torch_inputs),
    or the tiled NumPy backend on NumPy arrays (backend="numpy")."""

    def __init__(self, name: str = "cuflash", backend: str = "cuda", layout: str = "bshd",
                 torch_inputs: bool = False, variant: dict | None = None, kv_heads: int | None = None,
                 varlen: bool = False):
        """variant: the API's variant keywords; kv_heads: GQA through the first kv_heads heads of k, v
        (strided views); varlen: the batch as packed equal-length sequences (flash_attn_varlen_*)."""
        self.name, self.backend, self.layout, self.torch_inputs = name, backend, layout, torch_inputs
        self.variant, self.kv_heads, self.varlen = dict(variant or {}), kv_heads, varlen
        self.clock = "torch" if torch_inputs else "cupy"
        self.memory = "host" if backend == "numpy" else "cupy"

    def available(self):
        try:
            ok, why = importlib.import_module(f"..backends.{self.backend}", __package__).available()
        except Exception as e:
            return False, short_reason(e)
        return torch_cuda() if ok and self.torch_inputs else (ok, why)

    def prepare(self, s):
        s = InputSet(*(to_torch(x) for x in (s.q, s.k, s.v, s.do))) if self.torch_inputs else s
        if self.kv_heads:
            s = InputSet(s.q, s.k[:, :, :self.kv_heads], s.v[:, :, :self.kv_heads], s.do)
        if isinstance(self.variant.get("alibi_slopes"), str):  # "h": ALiBi's geometric slopes 2**(-8 (h + 1) / H)
            import cupy

            h = s.q.shape[2]
            self.variant["alibi_slopes"] = cupy.asarray([2.0 ** (-8 * (i + 1) / h) for i in range(h)], cupy.float32)
        if self.varlen:  # (B, N, H, d) -> (B * N, H, d), and the cumulative lengths of B sequences of N
            import cupy

            b, n = s.q.shape[:2]
            s = InputSet(*(x.reshape(b * n, *x.shape[2:]) for x in (s.q, s.k, s.v, s.do)))
            self.cu = cupy.arange(0, (b + 1) * n, n, dtype=cupy.int32)
        return s

    def _kw(self, case):
        kw = dict(causal=case.causal, softmax_scale=case.scale, backend=self.backend, **self.variant)
        return kw if self.varlen else {**kw, "layout": self.layout}

    def forward_call(self, case, s):
        from ..api import flash_attn_forward, flash_attn_varlen_forward

        if self.varlen:
            return functools.partial(flash_attn_varlen_forward, s.q, s.k, s.v, self.cu, self.cu, case.seqlen_q,
                                     case.seqlen_k, **self._kw(case))
        return functools.partial(flash_attn_forward, s.q, s.k, s.v, **self._kw(case))

    def backward_call(self, case, s, state):
        from ..api import flash_attn_backward, flash_attn_varlen_backward

        if self.varlen:
            return functools.partial(flash_attn_varlen_backward, s.do, s.q, s.k, s.v, *state, self.cu, self.cu,
                                     case.seqlen_q, case.seqlen_k, **self._kw(case))
        return functools.partial(flash_attn_backward, s.do, s.q, s.k, s.v, *state, **self._kw(case))


# ------------------------------------------------------------------------------------------------
# Materialized attention: S and P stored in the input dtype
# ------------------------------------------------------------------------------------------------

# Row softmax (forward) and its backward for the materialized baseline, one block per score row:
# the accumulator is float (double for double inputs), stored values are in the input dtype. Which
# keys a row sees comes from the host (_row_limits): the mask rule lives in cuflash.reference only.
CONV_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(double* p, double x) { *p = x; }
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) { return __longlong_as_double(0xfff0000000000000ULL); }

template <typename A, bool kMax>
__device__ __forceinline__ A warp_reduce(A v) {
    for (int o = 16; o > 0; o >>= 1) {
        A w = __shfl_xor_sync(0xffffffffu, v, o);
        v = kMax ? (w > v ? w : v) : v + w;
    }
    return v;
}

template <typename A, bool kMax>
__device__ A block_reduce(A v, A* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce<A, kMax>(v);
    __syncthreads();  // sh may still be read from the previous reduction
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? sh[lane] : (kMax ? neg_inf(A(0)) : A(0));
        v = warp_reduce<A, kMax>(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

// P[row, :] = softmax(scale * S[row, :]) over keys j < limit[row % seqlen_q] (the keys the row sees,
// counted on the host from the library's mask rule), 0 elsewhere.
template <typename T, typename A>
__global__ void conv_softmax_fwd(const T* __restrict__ s, T* __restrict__ p, const long long* __restrict__ limits,
                                 long long seqlen_q, long long seqlen_k, A scale) {
    __shared__ A sh[32];
    const long long row = blockIdx.x;
    const long long limit = limits[row % seqlen_q];
    const T* sr = s + row * seqlen_k;
    T* pr = p + row * seqlen_k;
    A m = neg_inf(A(0));
    for (long long j = threadIdx.x; j < limit; j += blockDim.x) {
        A x = to_acc(sr[j]);
        m = x > m ? x : m;
    }
    m = block_reduce<A, true>(m, sh);
    A l = A(0);
    for (long long j = threadIdx.x; j < limit; j += blockDim.x) l += exp_acc((to_acc(sr[j]) - m) * scale);
    l = block_reduce<A, false>(l, sh);
    const A inv = limit > 0 ? A(1) / l : A(0);
    for (long long j = threadIdx.x; j < seqlen_k; j += blockDim.x)
        store(pr + j, j < limit ? exp_acc((to_acc(sr[j]) - m) * scale) * inv : A(0));
}

// In place: dP[row, :] becomes dS * scale = scale * P * (dP - D), D = rowsum(P * dP) (= rowsum(dO * O)).
template <typename T, typename A>
__global__ void conv_softmax_bwd(const T* __restrict__ p, T* dp, long long seqlen_k, A scale) {
    __shared__ A sh[32];
    const long long row = blockIdx.x;
    const T* pr = p + row * seqlen_k;
    T* dr = dp + row * seqlen_k;
    A d = A(0);
    for (long long j = threadIdx.x; j < seqlen_k; j += blockDim.x) d += to_acc(pr[j]) * to_acc(dr[j]);
    d = block_reduce<A, false>(d, sh);
    for (long long j = threadIdx.x; j < seqlen_k; j += blockDim.x)
        store(dr + j, scale * to_acc(pr[j]) * (to_acc(dr[j]) - d));
}
"""
_CTYPE = {"float16": ("__half", "float"), "bfloat16": ("__nv_bfloat16", "float"),
          "float32": ("float", "float"), "float64": ("double", "double")}
CONV_NAMES = tuple(f"conv_softmax_{k}<{t}, {a}>" for k in ("fwd", "bwd") for t, a in _CTYPE.values())
CONV_THREADS = 256


@functools.lru_cache(maxsize=None)
def _conv_module(device_id: int):
    import cupy

    mod = cupy.RawModule(code=CONV_SRC, options=("-std=c++17",), name_expressions=CONV_NAMES)
    mod.compile()
    return mod


def _conv_kernel(kind: str, dtype: str, device_id: int):
    t, a = _CTYPE[dtype]
    return _conv_module(device_id).get_function(f"conv_softmax_{kind}<{t}, {a}>")


@functools.lru_cache(maxsize=64)
def _row_limits(seqlen_q: int, seqlen_k: int, causal: bool, device_id: int):
    """How many keys each query row sees, by cuflash.reference's mask rule (kept on the device). The keys a
    row sees are a prefix of the keys for every mask the bench runs (bottom-right causal, or none)."""
    import cupy

    from ..reference import _visible

    return _visible(seqlen_q, seqlen_k, causal, cupy).sum(axis=1, dtype=cupy.int64)


def _acc_scalar(dtype: str, x: float):
    return np.float64(x) if dtype == "float64" else np.float32(x)


def conv_softmax_fwd(s, scale: float, causal: bool):
    """P = softmax(scale * S) by rows of a (..., seqlen_q, seqlen_k) CuPy array, in S's dtype."""
    import cupy

    s = cupy.ascontiguousarray(s)
    p = cupy.empty_like(s)
    sq, sk = s.shape[-2:]
    if s.size:
        dev, dt = cupy.cuda.Device().id, s.dtype.name
        _conv_kernel("fwd", dt, dev)((s.size // sk,), (CONV_THREADS,), (
            s, p, _row_limits(sq, sk, bool(causal), dev), np.int64(sq), np.int64(sk), _acc_scalar(dt, scale)))
    return p


def conv_softmax_bwd_(p, dp, scale: float):
    """dP -> scale * dS, in place (dp contiguous, the same shape and dtype as p)."""
    import cupy

    if p.size:
        dt = p.dtype.name
        _conv_kernel("bwd", dt, cupy.cuda.Device().id)((p.size // p.shape[-1],), (CONV_THREADS,), (
            p, dp, np.int64(p.shape[-1]), _acc_scalar(dt, scale)))
    return dp


@functools.lru_cache(maxsize=None)
def conventional_matmul_mode(dtype: str) -> tuple[str, str]:
    """("native" | "torch" | "fp32", note): how the GPU baseline multiplies in `dtype`.

    CuPy's matmul in the input dtype where it works; otherwise torch's matmul in the input dtype
    (through DLPack), else float32 on CuPy (and the JSON says so).
    """
    import cupy

    try:
        a = cast(cupy.random.RandomState(1).standard_normal((2, 3, 16, 8), dtype=cupy.float32), dtype)
        c = cupy.matmul(a, a.swapaxes(-1, -2))
        ref = cupy.matmul(upcast(a), upcast(a).swapaxes(-1, -2))
        err = float(cupy.abs(upcast(c) - ref).max())
        if not err < 0.5:  # catches NaN too
            raise RuntimeError(f"matmul in {dtype} is off by {err}")
        return "native", f"cupy.matmul in {dtype}"
    except Exception as e:
        why = short_reason(e)
    if torch_cuda()[0]:
        return "torch", f"torch.matmul in {dtype} (cupy.matmul failed: {why})"
    return "fp32", f"cupy.matmul in float32 (cupy.matmul in {dtype} failed: {why}; torch absent)"


def _mm(mode: str):
    import cupy

    if mode == "torch":
        import torch

        return lambda a, b: cupy.from_dlpack(torch.matmul(to_torch(a), to_torch(b)))
    return cupy.matmul


def conventional_forward(q, k, v, *, causal: bool, scale: float, mode: str = "native"):
    """Materialized attention on CuPy: S = Q K^T, P = softmax(S), O = P V. Returns (o bshd view, P)."""
    mm, dtype = _mm(mode), q.dtype.name
    if mode == "fp32":
        q, k, v = (upcast(x, np.float32) for x in (q, k, v))
    p = conv_softmax_fwd(mm(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)), scale, causal)  # (B, H, Sq, Sk)
    o = mm(p, v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return (cast(o, dtype) if mode == "fp32" else o), p


def conventional_backward(do, q, k, v, p, *, scale: float, mode: str = "native"):
    """Gradients from the saved P: dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = dS K, dK = dS^T Q."""
    mm, dtype = _mm(mode), q.dtype.name
    if mode == "fp32":
        do, q, k, v = (upcast(x, np.float32) for x in (do, q, k, v))
    doh = do.transpose(0, 2, 1, 3)
    dv = mm(p.swapaxes(-1, -2), doh)
    ds = conv_softmax_bwd_(p, mm(doh, v.transpose(0, 2, 3, 1)), scale)  # scale * dS, in dP's memory
    dq = mm(ds, k.transpose(0, 2, 1, 3))
    dk = mm(ds.swapaxes(-1, -2), q.transpose(0, 2, 1, 3))
    grads = tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    return tuple(cast(x, dtype) for x in grads) if mode == "fp32" else grads


class Conventional(Impl):
    name = "conventional"

    def notes(self, dtype):
        return {"matmul": conventional_matmul_mode(dtype)[1]}

    def forward_call(self, case, s):
        return functools.partial(conventional_forward, s.q, s.k, s.v, causal=case.causal, scale=case.scale,
                                 mode=conventional_matmul_mode(case.dtype)[0])

    def backward_call(self, case, s, state):
        return functools.partial(conventional_backward, s.do, s.q, s.k, s.v, state[1], scale=case.scale,
                                 mode=conventional_matmul_mode(case.dtype)[0])


class MaterializedNumpy(Impl):
    """cuflash.reference with every materialized stage stored in the input dtype."""

    name = "materialized-numpy"
    memory = "host"

    @staticmethod
    def _kw(case):
        precision = None if case.dtype == "float64" else case.dtype
        return dict(causal=case.causal, softmax_scale=case.scale, precision=precision)

    def forward_call(self, case, s):
        from .. import reference

        return functools.partial(reference.forward, s.q, s.k, s.v, **self._kw(case))

    def backward_call(self, case, s, state):
        from .. import reference

        return functools.partial(reference.backward, s.do, s.q, s.k, s.v, **self._kw(case))

    def fwd_bwd(self, case, s):  # reference.backward runs its own forward
        return self.backward(case, s, None)


# ------------------------------------------------------------------------------------------------
# torch SDPA backends
# ------------------------------------------------------------------------------------------------


class TorchSDPA(Impl):
    """F.scaled_dot_product_attention with one backend forced (sdpa_kernel, entered outside the timed
    calls). Backward through autograd, or (raw_backward, flash and cuDNN only) through the aten
    backward op that autograd would call, fed the saved outputs of the aten forward op."""

    clock = "torch"
    memory = "torch"

    def __init__(self, name: str, layout: str = "bshd", raw_backward: bool = False, variant: dict | None = None,
                 kv_heads: int | None = None):
        """variant: extra keywords of F.scaled_dot_product_attention (dropout_p); kv_heads: GQA
        (enable_gqa) through the first kv_heads heads of k, v."""
        self.name, self.layout, self.raw_backward = name, layout, raw_backward
        self.variant, self.kv_heads = dict(variant or {}), kv_heads
        self.backend = TORCH_BACKENDS[name]

    def notes(self, dtype):
        if self.layout == "bhsd":
            return {"layout": "contiguous (B, H, N, d) tensors sharing the CuPy inputs' memory (DLPack)"}
        return {"layout": "(B, H, N, d) transposed views of the bshd CuPy inputs, zero-copy (DLPack)"}

    def available(self):
        ok, why = torch_cuda()
        if not ok:
            return ok, why
        try:
            from torch.nn.attention import SDPBackend
        except Exception as e:
            return False, f"this torch has no torch.nn.attention ({short_reason(e)})"
        if not hasattr(SDPBackend, self.backend):
            return False, f"this torch has no SDPBackend.{self.backend}"
        return True, ""

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.backend))

    def prepare(self, s):
        s = InputSet(*(to_torch(x) if self.layout == "bhsd" else to_torch(x).transpose(1, 2)
                       for x in (s.q, s.k, s.v, s.do)))
        if self.kv_heads:  # (B, H, N, d): the first kv_heads heads
            s = InputSet(s.q, s.k[:, :self.kv_heads], s.v[:, :self.kv_heads], s.do)
        return s

    def calls(self, case, sets, mode):
        with refusals_as_unavailable():
            out = [self._call(case, self.prepare(s), mode) for s in sets]
            out[0]()  # a backend that cannot run this case raises here
        return out

    def _call(self, case, s, mode):
        import torch
        import torch.nn.functional as F

        kw = dict(is_causal=case.causal, scale=case.scale)  # causal: top-left == bottom-right for Sq == Sk
        kw.update(self.variant, **({"enable_gqa": True} if self.kv_heads else {}))
        if mode == "fwd":
            return functools.partial(F.scaled_dot_product_attention, s.q, s.k, s.v, **kw)
        if mode == "bwd" and self.raw_backward:
            return self._raw_backward(case, s)
        q, k, v = (x.detach().requires_grad_(True) for x in (s.q, s.k, s.v))
        if mode == "bwd":
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            return functools.partial(torch.autograd.grad, o, (q, k, v), s.do, retain_graph=True)

        def fwd_bwd():
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), s.do)

        return fwd_bwd

    def _raw_backward(self, case, s):
        """Signatures of torch 2.11's native_functions.yaml:
        _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
          -> (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
        _scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, logsumexp, cum_seq_q,
          cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale)
        _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
          return_debug_mask, *, scale) -> (the same nine outputs)
        _scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp, philox_seed,
          philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale)
        """
        import torch

        aten, c, sc = torch.ops.aten, case.causal, case.scale
        if self.name == "torch-flash":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(
                s.q, s.k, s.v, 0.0, c, False, scale=sc)
            return functools.partial(aten._scaled_dot_product_flash_attention_backward, s.do, s.q, s.k, s.v, o, lse,
                                     cq, ck, mq, mk, 0.0, c, seed, off, scale=sc)
        if self.name == "torch-cudnn":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
                s.q, s.k, s.v, None, True, 0.0, c, False, scale=sc)
            return functools.partial(aten._scaled_dot_product_cudnn_attention_backward, s.do, s.q, s.k, s.v, o, lse,
                                     seed, off, None, cq, ck, mq, mk, 0.0, c, scale=sc)
        raise Unavailable(f"no low-level backward op wired for {self.name}")


def gpu_impls(names) -> list[Impl]:
    out: list[Impl] = []
    for n in names:
        if n == "cuflash":
            out.append(Cuflash())
        elif n == "conventional":
            out.append(Conventional())
        elif n in TORCH_BACKENDS:
            out.append(TorchSDPA(n))
    return out
