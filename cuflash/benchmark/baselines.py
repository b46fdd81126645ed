"""The implementations a benchmark compares, behind one small interface.

GPU: "cuflash" (cuflash.api on the cuda backend), "conventional" (materialized S and P in the input
dtype: cuBLAS matmul, a row softmax kernel, matmul, all through CuPy), and PyTorch's SDPA backends
"torch-flash", "torch-efficient", "torch-cudnn", "torch-math" (when torch is importable).
CPU: "cuflash-numpy" (the tiled NumPy backend) and "materialized-numpy" (cuflash.reference storing
every materialized stage in the input dtype: the accuracy rule's same-precision reference).

Each implementation gives `calls(case, sets, mode)`: one zero-argument callable per input set, so a
timer can rotate among the sets. Heavy modules (cupy, torch, ml_dtypes) are imported inside
functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings

import numpy as np

from ..config import DTYPES, numpy_dtype

MODES = ("fwd", "bwd", "fwd_bwd")
TORCH_BACKENDS = {
    "torch-flash": "FLASH_ATTENTION",
    "torch-efficient": "EFFICIENT_ATTENTION",
    "torch-cudnn": "CUDNN_ATTENTION",
    "torch-math": "MATH",
}
GPU_IMPLS = ("cuflash", "conventional", *TORCH_BACKENDS)
CPU_IMPLS = ("cuflash-numpy", "materialized-numpy")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "fp64": "float64"}
# atol of the accuracy rule max|ours - ref64| <= 2 max|same_precision - ref64| + atol
ACCURACY_ATOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-6, "float64": 1e-12}


def canonical_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(name.lower(), name.lower())
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or bf16, fp16, fp32, fp64), got {name!r}")
    return name


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


# ------------------------------------------------------------------------------------------------
# Arrays
# ------------------------------------------------------------------------------------------------


def gpu_cast(x32, dtype: str):
    """A CuPy float32 array in `dtype`; bfloat16 by round-to-nearest-even on the bits if astype can't."""
    import cupy

    dt = numpy_dtype(dtype)
    if dtype != "bfloat16":
        return x32.astype(dt)
    try:
        return x32.astype(dt)
    except Exception:
        u = cupy.ascontiguousarray(x32).view(cupy.uint32)
        r = (u + cupy.uint32(0x7FFF) + ((u >> cupy.uint32(16)) & cupy.uint32(1))) >> cupy.uint32(16)
        return r.astype(cupy.uint16).view(dt)


def gpu_to_f64(x):
    """A CuPy array as float64 (bfloat16 through its bits if CuPy cannot cast it)."""
    import cupy

    if x.dtype.name != "bfloat16":
        return x.astype(cupy.float64)
    try:
        return x.astype(cupy.float64)
    except Exception:
        u = cupy.ascontiguousarray(x).view(cupy.uint16).astype(cupy.uint32) << cupy.uint32(16)
        return u.view(cupy.float32).astype(cupy.float64)


def gpu_inputs(case: Case, n_sets: int, seed: int = 0) -> list[InputSet]:
    """Random normal q, k, v, dout (never zeros) in bshd layout, n_sets independent sets."""
    import cupy

    rs = cupy.random.RandomState(seed)
    qs = (case.batch, case.seqlen_q, case.nheads, case.head_dim)
    ks = (case.batch, case.seqlen_k, case.nheads, case.head_dim)
    out = []
    for _ in range(n_sets):
        q, k, v, do = (gpu_cast(rs.standard_normal(s, dtype=cupy.float32), case.dtype) for s in (qs, ks, ks, qs))
        out.append(InputSet(q, k, v, do))
    return out


def cpu_inputs(case: Case, seed: int = 0) -> InputSet:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(case.dtype)
    qs = (case.batch, case.seqlen_q, case.nheads, case.head_dim)
    ks = (case.batch, case.seqlen_k, case.nheads, case.head_dim)
    q, k, v, do = (rng.standard_normal(s, dtype=np.float32).astype(dt) for s in (qs, ks, ks, qs))
    return InputSet(q, k, v, do)


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


# ------------------------------------------------------------------------------------------------
# Base class
# ------------------------------------------------------------------------------------------------


class Impl:
    name = ""
    clock = "cupy"  # which events time it: "cupy" or "torch"
    memory = "cupy"  # which allocator sees its memory: "cupy", "torch" or "host"
    notes: dict = {}

    def available(self) -> tuple[bool, str]:
        return True, ""

    def context(self):
        return contextlib.nullcontext()

    def calls(self, case: Case, sets: list[InputSet], mode: str) -> list:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------
# cuflash
# ------------------------------------------------------------------------------------------------


class CuflashGPU(Impl):
    name = "cuflash"

    def available(self):
        try:
            from ..backends import cuda

            return cuda.available()
        except Exception as e:
            return False, short_reason(e)

    def calls(self, case, sets, mode):
        from ..api import flash_attn_backward, flash_attn_forward

        kw = dict(causal=case.causal, softmax_scale=case.scale, backend="cuda")

        def fwd(s):
            return flash_attn_forward(s.q, s.k, s.v, **kw)

        if mode == "fwd":
            return [functools.partial(fwd, s) for s in sets]
        if mode == "bwd":
            out = []
            for s in sets:
                o, lse = fwd(s)
                out.append(functools.partial(flash_attn_backward, s.do, s.q, s.k, s.v, o, lse, **kw))
            return out

        def fwd_bwd(s):
            o, lse = fwd(s)
            return flash_attn_backward(s.do, s.q, s.k, s.v, o, lse, **kw)

        return [functools.partial(fwd_bwd, s) for s in sets]


# ------------------------------------------------------------------------------------------------
# Conventional: materialized S and P in the input dtype, on CuPy
# ------------------------------------------------------------------------------------------------

# Row softmax (forward) and its backward for the materialized baseline. One block per score row;
# the accumulator is float (double for double inputs); the stored values are in the input dtype.
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

// P[row, :] = softmax(scale * S[row, :]) over the keys the row sees (bottom-right causal), 0 elsewhere.
template <typename T, typename A>
__global__ void conv_softmax_fwd(const T* __restrict__ s, T* __restrict__ p, long long seqlen_q,
                                 long long seqlen_k, A scale, int causal) {
    __shared__ A sh[32];
    const long long row = blockIdx.x;
    const long long i = row % seqlen_q;
    long long limit = causal ? i + 1 + seqlen_k - seqlen_q : seqlen_k;
    limit = limit > seqlen_k ? seqlen_k : (limit < 0 ? 0 : limit);
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


def _conv_kernel(kind: str, dtype: str):
    import cupy

    t, a = _CTYPE[dtype]
    return _conv_module(cupy.cuda.Device().id).get_function(f"conv_softmax_{kind}<{t}, {a}>")


def _acc_scalar(dtype: str, x: float):
    return np.float64(x) if dtype == "float64" else np.float32(x)


def conv_softmax_fwd(s, scale: float, causal: bool):
    """P = softmax(scale * S) by rows of a contiguous (..., seqlen_q, seqlen_k) array, same dtype."""
    import cupy

    s = cupy.ascontiguousarray(s)
    p = cupy.empty_like(s)
    sq, sk = s.shape[-2], s.shape[-1]
    rows = s.size // sk if sk else 0
    if rows:
        dt = s.dtype.name
        _conv_kernel("fwd", dt)((rows,), (CONV_THREADS,),
                                (s, p, np.int64(sq), np.int64(sk), _acc_scalar(dt, scale), np.int32(bool(causal))))
    return p


def conv_softmax_bwd_(p, dp, scale: float):
    """dP -> scale * dS, in place (dp contiguous, the same shape and dtype as p)."""
    sk = p.shape[-1]
    rows = p.size // sk if sk else 0
    if rows:
        dt = p.dtype.name
        _conv_kernel("bwd", dt)((rows,), (CONV_THREADS,), (p, dp, np.int64(sk), _acc_scalar(dt, scale)))
    return dp


@functools.lru_cache(maxsize=None)
def conventional_matmul_mode(dtype: str) -> tuple[str, str]:
    """("cupy" | "torch" | "cupy-fp32", note): how the baseline multiplies in `dtype`.

    CuPy's matmul in the input dtype where it works; otherwise torch's matmul in the input dtype
    (through DLPack), else float32 on CuPy (and the JSON says so).
    """
    import cupy

    try:
        a32 = cupy.random.RandomState(1).standard_normal((2, 3, 16, 8), dtype=cupy.float32)
        a = gpu_cast(a32, dtype)
        c = cupy.matmul(a, a.swapaxes(-1, -2))
        ref = cupy.matmul(gpu_to_f64(a), gpu_to_f64(a).swapaxes(-1, -2))
        err = float(cupy.abs(gpu_to_f64(c) - ref).max())
        if not err < 0.5:  # catches NaN too
            raise RuntimeError(f"matmul in {dtype} is off by {err}")
        return "cupy", f"cupy.matmul in {dtype}"
    except Exception as e:
        why = short_reason(e)
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", f"torch.matmul in {dtype} (cupy.matmul failed: {why})"
    except Exception:
        pass
    return "cupy-fp32", f"cupy.matmul in float32 (cupy.matmul in {dtype} failed: {why}; torch absent)"


def _mm(mode: str):
    import cupy

    if mode == "torch":
        import torch

        return lambda a, b: cupy.from_dlpack(torch.matmul(to_torch(a), to_torch(b)))
    return cupy.matmul


def conventional_forward(q, k, v, *, causal: bool, scale: float, mode: str = "cupy"):
    """Materialized attention on CuPy: S = Q K^T, P = softmax(S), O = P V. Returns (o bshd view, P)."""
    mm = _mm(mode)
    dtype = q.dtype
    if mode == "cupy-fp32":
        import cupy

        q, k, v = (gpu_to_f64(x).astype(cupy.float32) for x in (q, k, v))
    s = mm(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1))  # (B, H, Sq, Sk), materialized
    p = conv_softmax_fwd(s, scale, causal)  # (B, H, Sq, Sk), materialized
    del s
    o = mm(p, v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if mode == "cupy-fp32":
        o = gpu_cast(o, dtype.name)
    return o, p


def conventional_backward(do, q, k, v, p, *, scale: float, mode: str = "cupy"):
    """Gradients from the saved P: dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = dS K, dK = dS^T Q."""
    mm = _mm(mode)
    dtype = q.dtype
    if mode == "cupy-fp32":
        import cupy

        do, q, k, v = (gpu_to_f64(x).astype(cupy.float32) for x in (do, q, k, v))
    doh = do.transpose(0, 2, 1, 3)
    dv = mm(p.swapaxes(-1, -2), doh)
    dp = mm(doh, v.transpose(0, 2, 3, 1))  # (B, H, Sq, Sk), materialized
    ds = conv_softmax_bwd_(p, dp, scale)  # scale * dS, in dP's memory
    dq = mm(ds, k.transpose(0, 2, 1, 3))
    dk = mm(ds.swapaxes(-1, -2), q.transpose(0, 2, 1, 3))
    grads = tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    if mode == "cupy-fp32":
        grads = tuple(gpu_cast(x, dtype.name) for x in grads)
    return grads


class Conventional(Impl):
    name = "conventional"

    def __init__(self):
        self.notes = {}

    def calls(self, case, sets, mode):
        mm_mode, note = conventional_matmul_mode(case.dtype)
        self.notes = {"matmul": note}
        kw = dict(causal=case.causal, scale=case.scale, mode=mm_mode)

        def fwd(s):
            return conventional_forward(s.q, s.k, s.v, **kw)

        def bwd(s, p):
            return conventional_backward(s.do, s.q, s.k, s.v, p, scale=case.scale, mode=mm_mode)

        if mode == "fwd":
            return [functools.partial(fwd, s) for s in sets]
        if mode == "bwd":
            return [functools.partial(bwd, s, fwd(s)[1]) for s in sets]

        def fwd_bwd(s):
            _, p = fwd(s)
            return bwd(s, p)

        return [functools.partial(fwd_bwd, s) for s in sets]


# ------------------------------------------------------------------------------------------------
# torch SDPA backends
# ------------------------------------------------------------------------------------------------


class TorchSDPA(Impl):
    clock = "torch"
    memory = "torch"

    def __init__(self, name: str):
        self.name = name
        self.backend = TORCH_BACKENDS[name]
        self.notes = {"layout": "(B, H, N, d) transposed views of the bshd CuPy inputs, zero-copy (DLPack)"}

    def available(self):
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as e:
            return False, f"torch not importable ({short_reason(e)})"
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        if not hasattr(SDPBackend, self.backend):
            return False, f"this torch has no SDPBackend.{self.backend}"
        return True, ""

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.backend))

    def calls(self, case, sets, mode):
        import torch
        import torch.nn.functional as F

        kw = dict(is_causal=case.causal, scale=case.scale)  # causal: top-left == bottom-right for Sq == Sk

        def t(x):
            return to_torch(x).transpose(1, 2)

        out = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for s in sets:
                    q, k, v, do = t(s.q), t(s.k), t(s.v), t(s.do)
                    if mode == "fwd":
                        out.append(functools.partial(F.scaled_dot_product_attention, q, k, v, **kw))
                        continue
                    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
                    if mode == "bwd":
                        o = F.scaled_dot_product_attention(qg, kg, vg, **kw)
                        out.append(functools.partial(torch.autograd.grad, o, (qg, kg, vg), do, retain_graph=True))
                    else:
                        def fwd_bwd(qg=qg, kg=kg, vg=vg, do=do):
                            o = F.scaled_dot_product_attention(qg, kg, vg, **kw)
                            return torch.autograd.grad(o, (qg, kg, vg), do)

                        out.append(fwd_bwd)
                out[0]()  # a backend that cannot run this case raises here
            except Exception as e:
                why = [str(w.message).splitlines()[0] for w in caught][:3]
                if is_oom(e):
                    raise
                raise Unavailable("; ".join([short_reason(e, 200), *why])[:500]) from e
        return out


def gpu_impls(names) -> list[Impl]:
    out = []
    for n in names:
        if n == "cuflash":
            out.append(CuflashGPU())
        elif n == "conventional":
            out.append(Conventional())
        elif n in TORCH_BACKENDS:
            out.append(TorchSDPA(n))
    return out


# ------------------------------------------------------------------------------------------------
# CPU: the NumPy backend against materialized NumPy
# ------------------------------------------------------------------------------------------------


class CuflashNumpy(Impl):
    """cuflash's tiled NumPy backend, through the public API (backend="numpy")."""

    name = "cuflash-numpy"
    memory = "host"

    def forward(self, q, k, v, *, causal, scale):
        from ..api import flash_attn_forward

        return flash_attn_forward(q, k, v, causal=causal, softmax_scale=scale, backend="numpy")

    def backward(self, do, q, k, v, o, lse, *, causal, scale):
        from ..api import flash_attn_backward

        return flash_attn_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, backend="numpy")

    def available(self):
        try:
            from ..backends import numpy as nb

            return nb.available()
        except Exception as e:
            return False, short_reason(e)


class MaterializedNumpy(Impl):
    """cuflash.reference with every materialized stage stored in the input dtype."""

    name = "materialized-numpy"
    memory = "host"

    @staticmethod
    def _precision(x):
        name = x.dtype.name
        return None if name == "float64" else name

    def forward(self, q, k, v, *, causal, scale):
        from .. import reference

        return reference.forward(q, k, v, causal=causal, softmax_scale=scale, precision=self._precision(q))

    def backward(self, do, q, k, v, *, causal, scale):
        from .. import reference

        return reference.backward(do, q, k, v, causal=causal, softmax_scale=scale, precision=self._precision(q))
