"""cuflash for JAX: differentiable attention (jax.custom_vjp), eager or under jax.jit.

    import cuflash.jax as cfj
    o = cfj.flash_attn(q, k, v, causal=True)          # jax.Array in, jax.Array out
    dq = jax.grad(lambda q: cfj.flash_attn(q, k, v).sum())(q)

The forward saves (q, k, v, o, lse); the backward is cuflash's own (flash_attn_backward /
flash_attn_varlen_backward), which recomputes P from the LSE. How a call runs:

- Concrete arrays (eager calls, and jax.grad without jit): cuflash's public functions on the jax
  arrays themselves (DLPack: no copy on a GPU); results come back as jax.Arrays on q's device.
- Tracers (jax.jit, vmap): jax.experimental.buffer_callback. XLA hands the callback its buffers in
  place. On a GPU CuPy wraps them without a copy and the kernels run on XLA's own stream
  (ctx.stream), writing o and the gradients into XLA's output buffers: no host round trip, no sync.
  On the CPU they are NumPy views and the NumPy backend runs. Where JAX has no buffer_callback, jit
  on the CPU falls back to jax.pure_callback (host data stays on the host); jit on a GPU raises a
  RuntimeError rather than route device arrays through the host.

backend="auto" runs where the data is: "cuda" for GPU arrays, "numpy" for host arrays (cuflash's
own "auto" would take a JAX CPU array to the GPU when one is present). Every non-array argument is
static: a new value (a dropout seed included) retraces a jitted function. alibi_slopes and
cu_seqlens get no gradient (zero cotangents).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _interop, _mask, api
from .config import acc_dtype, numpy_dtype

_KDL_CPU = 1  # DLPack's device type of host memory


def _buffer_callback():
    """jax.experimental.buffer_callback.buffer_callback, or None in a JAX without it (a function, so
    that tests can take it away)."""
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        return None
    return buffer_callback


def _platform() -> str:
    """The platform jitted code runs on, for the path without buffer_callback. Tracers carry no
    device, so this is the default device's platform (jax_default_device, else
    jax.default_backend()): "cpu", "gpu", ..."""
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return dev if isinstance(dev, str) else dev.platform


def _backend_for(backend: str, on_device: bool) -> str:
    if backend == "auto":
        return "cuda" if on_device else "numpy"
    return backend


@dataclasses.dataclass(frozen=True)
class _Options:
    """The static arguments of one call, validated (hashable: custom_vjp's nondiff argument)."""

    causal: bool
    softmax_scale: float | None
    window: tuple[int, int]
    softcap: float
    dropout_p: float
    seed: int
    offset: int
    backend: str
    deterministic: bool = False  # the backward's (cuflash.flash_attn_backward)
    max_seqlen: tuple[int, int] | None = None  # varlen: (max_seqlen_q, max_seqlen_k)

    def kwargs(self, on_device: bool) -> dict:
        """cuflash's keyword arguments. Variants at their defaults are left out, so that a plain call
        on CuPy arrays can take the plan cache (it looks plans up only for the default objects)."""
        kw = dict(causal=self.causal, softmax_scale=self.softmax_scale, backend=_backend_for(self.backend, on_device))
        if self.window != _mask.NO_WINDOW:
            kw["window"] = self.window
        if self.softcap:
            kw["softcap"] = self.softcap
        if self.dropout_p:
            kw.update(dropout_p=self.dropout_p, seed=self.seed, offset=self.offset)
        return kw


def _options(head_dim, causal, softmax_scale, window, softcap, dropout_p, seed, offset, backend, deterministic,
             max_seqlen=None) -> _Options:
    _checks.check_backend(backend)
    scale = None if softmax_scale is None else _checks.check_softmax_scale(softmax_scale, head_dim)
    return _Options(_checks.check_flag("causal", causal), scale, _checks.check_window(window),
                    _checks.check_softcap(softcap), _checks.check_dropout_p(dropout_p), _checks.check_seed(seed),
                    _checks.check_offset(offset), backend, _checks.check_flag("deterministic", deterministic),
                    max_seqlen)


def _check_arrays(**arrays) -> None:
    for name, x in arrays.items():
        _checks.check_array(name, x, optional=name == "alibi_slopes")


def _as_jax(*arrays):
    """The arguments as jax arrays (after cuflash's checks, which see them as given); None stays None."""
    return [x if x is None or isinstance(x, jax.Array) else jnp.asarray(x) for x in arrays]


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Just a shape, for cuflash's shape checks (indexing a jax array would cost a device op)."""

    shape: tuple


def _host_values(cu):
    """cu_seqlens whose values can be read for free (NumPy, or a concrete jax array on the host):
    checked at once, as cuflash checks host cu_seqlens. Others (device, traced) are not read."""
    if isinstance(cu, np.ndarray):
        return cu
    if isinstance(cu, jax.Array) and not _is_traced(cu) and not _interop._is_device_dlpack(cu):
        return np.asarray(cu)
    return None


# --- the public functions ---------------------------------------------------------------------------------


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
               dropout_p=0.0, seed=0, offset=0, backend="auto", deterministic=False):
    """Exact attention o = softmax(softmax_scale * q k^T [+ mask]) v, differentiable in q, k, v.

    q (batch, seqlen_q, nheads, head_dim), k, v (batch, seqlen_k, nheads_k, head_dim); o like q. The
    arguments and their semantics are cuflash.flash_attn's (deterministic: cuflash.flash_attn_backward's);
    every one but q, k, v and alibi_slopes is static under jax.jit. alibi_slopes get no gradient.
    """
    # cuflash's own checks, at trace time: a wrong shape or variant fails here, not inside XLA
    _check_arrays(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    api._validate_qkv(q, k, v, "bshd")
    b, _, h, d = q.shape
    opts = _options(d, causal, softmax_scale, window, softcap, dropout_p, seed, offset, backend, deterministic)
    api._variants(opts.causal, window, softcap, alibi_slopes, dropout_p, seed, offset, b, h)
    return _attention(opts, *_as_jax(q, k, v, alibi_slopes), None, None)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                      softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0,
                      offset=0, backend="auto", deterministic=False):
    """Attention over packed sequences of different lengths, differentiable in q, k, v.

    q (total_q, nheads, head_dim), k, v (total_k, nheads_k, head_dim), cu_seqlens_q / cu_seqlens_k int32
    (batch + 1,) from 0; o like q. cuflash.flash_attn_varlen's semantics. max_seqlen_q / max_seqlen_k
    are static and size the kernels' grids: they must be right. cu_seqlens held on the host are
    checked, device ones are not (reading them would need a sync), as in cuflash.
    """
    _check_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_ndim_packed(name, x)
    dt = _checks.check_dtype("q", q)
    _checks.check_same_dtype(dt, k=k, v=v)
    _checks.check_qkv(*(_Shape((1, *x.shape)) for x in (q, k, v)))
    _checks.check_cu_seqlens_dtype("cu_seqlens_q", cu_seqlens_q)
    _checks.check_cu_seqlens_dtype("cu_seqlens_k", cu_seqlens_k)
    batch = _checks.check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    longest = {}
    for name, cu, x, packed in (("cu_seqlens_q", cu_seqlens_q, q, "q"), ("cu_seqlens_k", cu_seqlens_k, k, "k")):
        values = _host_values(cu)
        if values is not None:
            longest[name] = _checks.check_cu_seqlens_values(name, values, int(x.shape[0]), packed)
    max_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q, longest.get("cu_seqlens_q"))
    max_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k, longest.get("cu_seqlens_k"))
    opts = _options(q.shape[-1], causal, softmax_scale, window, softcap, dropout_p, seed, offset, backend,
                    deterministic, (max_q, max_k))
    api._variants(opts.causal, window, softcap, alibi_slopes, dropout_p, seed, offset, batch, q.shape[1])
    return _attention(opts, *_as_jax(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k))


# --- custom_vjp: one rule for the dense and the varlen functions (cu_seqlens None for dense) ---------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(opts, q, k, v, alibi, cu_q, cu_k):
    return _forward(opts, q, k, v, alibi, cu_q, cu_k)[0]


def _attention_fwd(opts, q, k, v, alibi, cu_q, cu_k):
    o, lse = _forward(opts, q, k, v, alibi, cu_q, cu_k)
    return o, (q, k, v, o, lse, alibi, cu_q, cu_k)


def _attention_bwd(opts, res, do):
    q, k, v, o, lse, alibi, cu_q, cu_k = res
    dq, dk, dv = _backward(opts, do, q, k, v, o, lse, alibi, cu_q, cu_k)
    return dq, dk, dv, None, None, None  # None: zero cotangents for alibi_slopes and cu_seqlens


_attention.defvjp(_attention_fwd, _attention_bwd)


def _on_device_of(x, like):
    """x on like's device(s): cuflash's results for a host caller come from the default device."""
    return x if x.devices() == like.devices() else jax.device_put(x, like.sharding)


def _forward(opts, q, k, v, alibi, cu_q, cu_k):
    if not _is_traced(q, k, v, alibi, cu_q, cu_k):
        on_device = _interop._is_device_dlpack(q)
        alibi, cu_q, cu_k = (None if x is None else _on_device_of(x, q) for x in (alibi, cu_q, cu_k))
        o, lse = _call_forward(opts, q, k, v, alibi, cu_q, cu_k, on_device=on_device)
        return _on_device_of(o, q), _on_device_of(lse, q)
    lse_shape = (q.shape[1], q.shape[0]) if cu_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    lse_dt = numpy_dtype(acc_dtype(np.dtype(q.dtype).name))
    types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, lse_dt))
    return _callback(functools.partial(_forward_into, opts), types, q, k, v, alibi, cu_q, cu_k)


def _backward(opts, do, q, k, v, o, lse, alibi, cu_q, cu_k):
    if not _is_traced(do, q, k, v, o, lse, alibi, cu_q, cu_k):
        dq, dk, dv = _call_backward(opts, do, q, k, v, o, lse, alibi, cu_q, cu_k,
                                    on_device=_interop._is_device_dlpack(q))
        return tuple(_on_device_of(g, x) for g, x in zip((dq, dk, dv), (q, k, v)))
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return _callback(functools.partial(_backward_into, opts), types, do, q, k, v, o, lse, alibi, cu_q, cu_k)


def _call_forward(opts, q, k, v, alibi, cu_q, cu_k, *, on_device, out=None):
    kw = opts.kwargs(on_device)
    if cu_q is None:
        return api.flash_attn_forward(q, k, v, out=out, alibi_slopes=alibi, **kw)
    return api.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, *opts.max_seqlen, out=out, alibi_slopes=alibi, **kw)


def _call_backward(opts, do, q, k, v, o, lse, alibi, cu_q, cu_k, *, on_device, grads=(None, None, None)):
    kw = {**opts.kwargs(on_device), "deterministic": opts.deterministic}
    dq, dk, dv = grads
    if cu_q is None:
        return api.flash_attn_backward(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv, alibi_slopes=alibi, **kw)
    return api.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *opts.max_seqlen, dq=dq, dk=dk, dv=dv,
                                          alibi_slopes=alibi, **kw)


def _in_place(opts, on_device: bool) -> bool:
    """Whether cuflash can write into the output buffers: not a host backend forced on device
    buffers (cuflash copies a result back into a NumPy out=, not into a device one)."""
    return not (on_device and _backend_for(opts.backend, on_device) == "numpy")


def _forward_into(opts, outs, q, k, v, alibi, cu_q, cu_k, *, on_device):
    """The forward inside a callback: NumPy or CuPy views of XLA's buffers in, o and lse written into outs."""
    o, lse = outs
    direct = _in_place(opts, on_device)
    o_got, lse_got = _call_forward(opts, q, k, v, alibi, cu_q, cu_k, on_device=on_device, out=o if direct else None)
    if not direct:
        o[...] = o_got
    # cuflash takes no lse= buffer: one copy of the (small) LSE, on the current stream (XLA's on a GPU)
    lse[...] = lse_got


def _backward_into(opts, outs, do, q, k, v, o, lse, alibi, cu_q, cu_k, *, on_device):
    direct = _in_place(opts, on_device)
    got = _call_backward(opts, do, q, k, v, o, lse, alibi, cu_q, cu_k, on_device=on_device,
                         grads=outs if direct else (None, None, None))
    if not direct:
        for buf, g in zip(outs, got):
            buf[...] = g


# --- the callbacks ---------------------------------------------------------------------------------------


class _XlaStream:
    """XLA's CUDA stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def _host_array(buf):
    return None if buf is None else np.asarray(buf)


def _device_array(buf):
    """A CuPy view of an XLA device buffer. cupy.from_dlpack, not cupy.asarray: the buffer's
    __cuda_array_interface__ cannot describe bfloat16; its __dlpack__ can, and ignores the stream
    argument (we already run on XLA's stream)."""
    import cupy

    return None if buf is None else cupy.from_dlpack(buf)


def _run_on_buffers(run, ctx, outs, *bufs):
    """buffer_callback's callback: outs and bufs as arrays where they live, then `run` into outs."""
    dev_type, dev_id = outs[0].__dlpack_device__()
    if int(dev_type) == _KDL_CPU:
        run([_host_array(b) for b in outs], *(_host_array(b) for b in bufs), on_device=False)
        return
    import cupy

    with cupy.cuda.Device(int(dev_id)), cupy.cuda.Stream.from_external(_XlaStream(ctx.stream)):
        run([_device_array(b) for b in outs], *(_device_array(b) for b in bufs), on_device=True)


def _pure_callback_kwargs() -> dict:
    # vmap_method arrived in JAX 0.4.34; before it, the default (vectorized=False) was sequential too
    return {"vmap_method": "sequential"} if "vmap_method" in inspect.signature(jax.pure_callback).parameters else {}


def _callback(run, types, *args):
    """Run `run(outs, *arrays, on_device=...)` from jitted code, results of `types`."""
    buffer_callback = _buffer_callback()
    if buffer_callback is not None:
        call = buffer_callback(functools.partial(_run_on_buffers, run), types, vmap_method="sequential",
                               command_buffer_compatible=False)
        return call(*args)
    platform = _platform()
    if platform != "cpu":
        raise RuntimeError(
            f"cuflash.jax under jax.jit on {platform!r} needs jax.experimental.buffer_callback, which JAX "
            f"{jax.__version__} lacks: cuflash.jax never routes device arrays through the host. Upgrade JAX to a "
            "version with buffer_callback, or call cuflash.jax outside jax.jit")

    def host(*arrays):
        outs = [np.empty(t.shape, t.dtype) for t in types]
        run(outs, *(_host_array(x) for x in arrays), on_device=False)
        return tuple(outs)

    return jax.pure_callback(host, types, *args, **_pure_callback_kwargs())


__all__ = ["flash_attn", "flash_attn_varlen"]
