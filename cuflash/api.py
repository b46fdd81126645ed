"""The public API: exact attention, FlashAttention's conventions.

Shapes ("bshd"): q (batch, seqlen_q, nheads, head_dim); k, v (batch, seqlen_k, nheads_k, head_dim);
lse (batch, nheads, seqlen_q), natural log, float32 (float64 for float64 inputs). layout="bhsd"
takes (batch, nheads, seqlen, head_dim) arrays through strides, with no copy.
"""

from __future__ import annotations

import contextlib
import importlib

from . import _checks, _interop
from .config import numpy_dtype


def _backend(name: str):
    """The backend module for a request; a RuntimeError says why a forced one cannot run here."""
    _checks.check_backend(name)
    if name == "auto":
        name = "cuda" if _interop.gpu_status()[0] else "numpy"
    mod = importlib.import_module(f".backends.{name}", __package__)
    ok, why = mod.available()
    if not ok:
        raise RuntimeError(f"backend={name!r} cannot run here: {why}")
    return mod


def _on_device(mod) -> bool:
    return getattr(mod, "ON_DEVICE", False)


def _bshd(x, layout: str):
    """The (batch, seqlen, heads, dim) view of an array given in `layout`."""
    return x if layout == "bshd" or x is None else x.swapaxes(1, 2)


def _unit_last_stride(x):
    """Inputs whose last dimension is strided are copied once (the kernels need unit stride)."""
    if x is None or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize:
        return x
    return importlib.import_module("cupy" if _interop.is_cupy(x) else "numpy").ascontiguousarray(x)


class _Call:
    """Shared plumbing of the forward and backward entry points."""

    def __init__(self, q, layout: str, backend: str, arrays: dict):
        self.caller = _interop.classify(q)
        _interop.check_devices(**arrays)
        self.be = _backend(backend)
        self.on_device = _on_device(self.be)
        self.layout = layout

    @contextlib.contextmanager
    def context(self):
        if not self.on_device:
            yield
            return
        import cupy

        dev = cupy.cuda.Device(self.caller.device_id) if self.caller.device_id is not None else contextlib.nullcontext()
        with dev, self.caller.stream_context():
            yield

    def working(self, name: str, x):
        return _unit_last_stride(_interop.to_working(name, x, self.on_device))

    def empty(self, shape, dtype):
        xp = importlib.import_module("cupy" if self.on_device else "numpy")
        return xp.empty(shape, dtype=dtype)

    def working_out(self, out):
        """`out=` as a working array: the same memory where possible, else a temporary."""
        return _interop.to_working("out", out, self.on_device)

    def write_back(self, out, work) -> None:
        """Copy a temporary result into the caller's `out=` (host out with a device backend)."""
        if _interop.is_numpy(out) and not _interop.is_numpy(work):
            out[...] = _interop.to_host(work)

    def out_array(self, shape_bshd, dtype, out=None):
        """A result array in the caller's layout; returns (array in layout, its bshd view)."""
        if out is None:
            b, s, h, d = shape_bshd
            shape = shape_bshd if self.layout == "bshd" else (b, h, s, d)
            out = self.empty(shape, dtype)
        return out, _bshd(out, self.layout)

    def result(self, y):
        return _interop.from_working(y, self.caller)


def _validate_qkv(q, k, v, layout: str):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_ndim(name, x, layout)
    dt = _checks.check_dtype("q", q)
    _checks.check_same_dtype(dt, k=k, v=v)
    qb, kb, vb = _bshd(q, layout), _bshd(k, layout), _bshd(v, layout)
    _checks.check_qkv(qb, kb, vb)
    return dt, qb, kb, vb


def lse_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def flash_attn_forward(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", backend="auto", out=None):
    """Exact attention and its log-sum-exp: returns (o, lse).

    o = softmax(softmax_scale * q k^T [+ causal mask]) v, the same shape and dtype as q;
    lse[b, h, i] = log(sum_j exp(softmax_scale * q_i . k_j)) over the keys row i sees
    (-inf, with o = 0, for a row that sees none).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        _checks.check_array(name, x, optional=name == "out")
    causal = _checks.check_flag("causal", causal)
    _checks.check_layout(layout)
    dt, qb, kb, vb = _validate_qkv(q, k, v, layout)
    b, sq, h, d = qb.shape
    scale = _checks.check_softmax_scale(softmax_scale, d)
    if out is not None:
        _checks.check_out(out, tuple(q.shape), dt, {"q": q, "k": k, "v": v})
    call = _Call(q, layout, backend, {"q": q, "k": k, "v": v, "out": out})
    with call.context():
        o_work = None if out is None else call.working_out(out)
        o_arr, o = call.out_array((b, sq, h, d), numpy_dtype(dt), o_work)
        lse = call.empty((b, h, sq), lse_dtype(dt))
        if b and sq and h:
            qw, kw, vw = (_bshd(call.working(n, x), layout) for n, x in (("q", q), ("k", k), ("v", v)))
            call.be.forward(qw, kw, vw, causal=bool(causal), softmax_scale=scale, out=o, lse=lse)
        if out is None:
            return call.result(o_arr), call.result(lse)
        call.write_back(out, o_arr)
        return out, call.result(lse)


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, layout="bshd", backend="auto", out=None):
    """Exact attention o = softmax(softmax_scale * q k^T) v; with return_lse=True, (o, lse)."""
    return_lse = _checks.check_flag("return_lse", return_lse)
    o, lse = flash_attn_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                                backend=backend, out=out)
    return (o, lse) if return_lse else o


def flash_attn_backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, layout="bshd", backend="auto",
                        deterministic=False):
    """Gradients (dq, dk, dv) of the forward call that produced (o, lse), given dout = dL/do.

    P is recomputed from q, k and lse; no N x N matrix is stored. The backward is deterministic:
    every gradient element is reduced in a fixed order (no atomics), so `deterministic` is accepted
    for FlashAttention compatibility and repeated calls are bitwise identical either way.
    """
    for name, x in (("dout", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        _checks.check_array(name, x)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    _checks.check_layout(layout)
    dt, qb, kb, vb = _validate_qkv(q, k, v, layout)
    b, sq, h, d = qb.shape
    for name, x in (("dout", do), ("o", o)):
        _checks.check_ndim(name, x, layout)
        _checks.check_like(name, x, tuple(q.shape), dt)
    _checks.check_lse(lse, (b, h, sq), lse_dtype(dt))
    scale = _checks.check_softmax_scale(softmax_scale, d)
    call = _Call(q, layout, backend, {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    with call.context():
        dq_arr, dq = call.out_array(tuple(qb.shape), numpy_dtype(dt))
        dk_arr, dk = call.out_array(tuple(kb.shape), numpy_dtype(dt))
        dv_arr, dv = call.out_array(tuple(vb.shape), numpy_dtype(dt))
        if b and h and (sq or kb.shape[1]):
            ws = [call.working(n, x) for n, x in (("dout", do), ("q", q), ("k", k), ("v", v), ("o", o))]
            dow, qw, kw, vw, ow = (_bshd(x, layout) for x in ws)
            lw = call.working("lse", lse)
            call.be.backward(dow, qw, kw, vw, ow, lw, causal=bool(causal), softmax_scale=scale,
                             deterministic=bool(deterministic), dq=dq, dk=dk, dv=dv)
        return call.result(dq_arr), call.result(dk_arr), call.result(dv_arr)


__all__ = ["flash_attn", "flash_attn_forward", "flash_attn_backward"]
