"""The public API: exact attention, FlashAttention's conventions.

Shapes ("bshd"): q (batch, seqlen_q, nheads, head_dim); k, v (batch, seqlen_k, nheads_k, head_dim);
lse (batch, nheads, seqlen_q), natural log, float32 (float64 for float64 inputs). layout="bhsd"
takes (batch, nheads, seqlen, head_dim) arrays through strides, with no copy.

Each public function first looks its call signature up in the plan cache (cuflash/_plan.py); a hit
launches straight away. A miss takes the general path below: validate, import the arrays, run the
backend, and, where the signature allows, leave a plan for the next call.

Variants (window, softcap, alibi_slopes, dropout_p with seed and offset; the varlen functions) run on
every backend. Plans serve calls with a window or a softcap (keyed by value), forward, backward and KV cache;
calls with ALiBi or dropout arguments not at their defaults take the general path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import numpy as np

from . import _checks, _interop, _mask, _philox, _plan
from .config import ITEMSIZE, acc_dtype as lse_dtype, backward_workspace, ceil_div, numpy_dtype

# The variants' defaults. The forward's and backward's plan caches are looked up only when ALiBi and the dropout
# arguments *are* their default objects (identity tests: an explicit dropout_p=0.0 takes the general path); the
# window and the softcap go into the key.
NO_WINDOW = _mask.NO_WINDOW
_OFF = 0.0
_ZERO = 0


def _plannable_variants(alibi_slopes, dropout_p, seed, offset) -> bool:
    """Neither ALiBi nor dropout (their defaults' very objects): a plan can serve the call (forward_key then
    checks the window and the softcap, which it keys by value)."""
    return alibi_slopes is None and dropout_p is _OFF and seed is _ZERO and offset is _ZERO


def _choose(name: str) -> str:
    """The backend a request runs on (backend='auto': cuda where a GPU is usable, else numpy)."""
    _checks.check_backend(name)
    if name == "auto":
        return "cuda" if _interop.gpu_status()[0] else "numpy"
    return name


def _backend(name: str):
    """The backend module for a request; a RuntimeError says why a forced one cannot run here."""
    name = _choose(name)
    mod = importlib.import_module(f".backends.{name}", __package__)
    ok, why = mod.available()
    if not ok:
        raise RuntimeError(f"backend={name!r} cannot run here: {why}")
    return mod


def _bshd(x, layout: str):
    """The (batch, seqlen, heads, dim) view of an array given in `layout`."""
    return x if layout == "bshd" or x is None else x.swapaxes(1, 2)


def _unit_last_stride(x):
    """Inputs whose last dimension is strided are copied once (the kernels need unit stride)."""
    if x is None or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize:
        return x
    return importlib.import_module("cupy" if _interop.is_cupy(x) else "numpy").ascontiguousarray(x)


class _Call:
    """Shared plumbing of the forward and backward entry points (the general path)."""

    def __init__(self, q, layout: str, backend: str, arrays: dict):
        _interop.check_devices(**arrays)  # first: its errors name the argument
        self.caller = _interop.classify(q)
        self.be = _backend(backend)
        self.on_device = getattr(self.be, "ON_DEVICE", False)
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

    def new(self, shape, dtype):
        """A new result from the caller's allocator: (the caller's array, the working array)."""
        return self.caller.new(tuple(shape), dtype, self.on_device)

    def working_out(self, out):
        """`out=` as a working array: the same memory where possible, else a temporary."""
        return _interop.to_working("out", out, self.on_device)

    def write_back(self, out, work) -> None:
        """Copy a temporary result into the caller's `out=`: host out with a device backend, or
        device out (CuPy, torch CUDA, any device DLPack array) with a host backend."""
        if _interop.is_numpy(out):
            if not _interop.is_numpy(work):
                out[...] = _interop.to_host(work)
        elif _interop.is_numpy(work) and not self.on_device and self.caller.device_id is not None:
            with self.caller.stream_context():  # torch callers: on torch's current stream
                _interop.to_working("out", out, True)[...] = _interop.to_working("result", work, True)

    def result(self, y):
        return self.caller.result(y)


def _validate_qkv(q, k, v, layout: str):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_ndim(name, x, layout)
    dt = _checks.check_dtype("q", q)
    _checks.check_same_dtype(dt, k=k, v=v)
    qb, kb, vb = _bshd(q, layout), _bshd(k, layout), _bshd(v, layout)
    _checks.check_qkv(qb, kb, vb)
    return dt, qb, kb, vb


def _inputs(**arrays) -> dict:
    """The arrays a call reads that are given (an output must share memory with none of them)."""
    return {name: x for name, x in arrays.items() if x is not None}


def _check_grad_outs(inputs: dict, dq, dk, dv, dtype: str) -> dict:
    """dq=, dk=, dv= checked like out= (q's, k's, v's shape), and against each other; returns them."""
    grads = {"dq": dq, "dk": dk, "dv": dv}
    for (name, x), like in zip(grads.items(), (inputs["q"], inputs["k"], inputs["v"])):
        if x is not None:
            others = {**inputs, **{n: y for n, y in grads.items() if n != name and y is not None}}
            _checks.check_out(x, tuple(like.shape), dtype, others, name=name)
    return grads


def _variants(causal, window, softcap, alibi_slopes, dropout_p, seed, offset, batch, nheads):
    """The variant arguments, validated: (the backend's keyword arguments, the variants in use)."""
    window = _checks.check_window(window)
    softcap = _checks.check_softcap(softcap)
    dropout_p = _checks.check_dropout_p(dropout_p)
    seed, offset = _checks.check_seed(seed), _checks.check_offset(offset)
    if alibi_slopes is not None:
        _checks.check_alibi_slopes(alibi_slopes, batch, nheads)
    kw, what = {}, []
    if _mask.effective_window(causal, window) != _mask.effective_window(causal, NO_WINDOW):
        kw["window"] = window
        what.append("window")
    if softcap:
        kw["softcap"] = softcap
        what.append("softcap")
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
        what.append("alibi_slopes")
    if dropout_p:
        kw.update(dropout_p=dropout_p, seed=seed, offset=offset)
        what.append("dropout")
    return kw, what


def _working_variants(call, kw: dict) -> dict:
    """The backend's keyword arguments with the ALiBi slopes in the backend's memory."""
    if kw.get("alibi_slopes") is not None:
        kw = {**kw, "alibi_slopes": call.working("alibi_slopes", kw["alibi_slopes"])}
    return kw


def flash_attn_forward(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", backend="auto", out=None,
                       window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """Exact attention and its log-sum-exp: returns (o, lse).

    o = softmax(softmax_scale * q k^T [+ causal mask]) v, the same shape and dtype as q;
    lse[b, h, i] = log(sum_j exp(softmax_scale * q_i . k_j)) over the keys row i sees
    (-inf, with o = 0, for a row that sees none).

    Variants (FlashAttention 2's semantics): window=(left, right) with -1
    unbounded (row i, at key position i' = i + seqlen_k - seqlen_q, sees keys i' - left ..
    i' + right; causal sets right = 0); softcap=c > 0 (scores c * tanh(score / c)); alibi_slopes,
    float32 (nheads,) or (batch, nheads) (bias -slope * |i' - j| after the softcap, in the LSE);
    dropout_p in [0, 1) with seed (0 <= seed < 2**64) and offset (the keep mask is
    cuflash.dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p=, seed=, offset=); the LSE is
    that of the undropped probabilities).
    """
    key = None
    if _plannable_variants(alibi_slopes, dropout_p, seed, offset):
        key = _plan.forward_key(q, k, v, out, causal, softmax_scale, window, softcap, layout, backend)
        plan = _plan.FORWARD.get(key)
        if plan is not None:
            return plan(q, k, v, out)
    return _forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, backend=backend,
                    out=out, key=key,
                    window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)


def _forward(q, k, v, *, causal, softmax_scale, layout, backend, out, key=None,
             window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """The general path of flash_attn_forward; with a key, it may leave a plan for the signature."""
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        _checks.check_array(name, x, optional=name == "out")
        _checks.check_concrete(name, x)
    causal = _checks.check_flag("causal", causal)
    _checks.check_layout(layout)
    dt, qb, kb, vb = _validate_qkv(q, k, v, layout)
    b, sq, h, d = qb.shape
    scale = _checks.check_softmax_scale(softmax_scale, d)
    vkw, _ = _variants(causal, window, softcap, alibi_slopes, dropout_p, seed, offset, b, h)
    if out is not None:
        _checks.check_out(out, tuple(q.shape), dt, _inputs(q=q, k=k, v=v, alibi_slopes=alibi_slopes))
    call = _Call(q, layout, backend, {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes})
    outputs = () if out is None else (out,)
    with call.context():
        o_arr, o_work = call.new(q.shape, numpy_dtype(dt)) if out is None else (out, call.working_out(out))
        o = _bshd(o_work, layout)
        lse_arr, lse = call.new((b, h, sq), lse_dtype(dt))
        inputs = [_bshd(call.working(n, x), layout) for n, x in (("q", q), ("k", k), ("v", v))]
        vkw = _working_variants(call, vkw)
        if key is not None and _plan.plannable(call.caller, call.be, q, k, v, *outputs):
            general = functools.partial(_forward, causal=causal, softmax_scale=softmax_scale, layout=layout,
                                        backend=backend, window=window, softcap=softcap)
            launches = call.be.forward_launches(*inputs, o, lse, causal=causal, softmax_scale=scale, **vkw)
            _plan.FORWARD[key] = _plan.ForwardPlan(call.caller, launches, q, k, v, out, (b, h, sq),
                                                   numpy_dtype(lse_dtype(dt)), general)
        if b and sq and h:
            call.be.forward(*inputs, causal=causal, softmax_scale=scale, out=o, lse=lse, **vkw)
    if out is None:
        return call.result(o_arr), call.result(lse_arr)
    call.write_back(out, o_work)
    return out, call.result(lse_arr)


def flash_attn(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, layout="bshd", backend="auto", out=None,
               window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """Exact attention o = softmax(softmax_scale * q k^T) v; with return_lse=True, (o, lse).
    The variant arguments are flash_attn_forward's."""
    if return_lse.__class__ is not bool:  # the check only where it can fail: this runs on every call
        return_lse = _checks.check_flag("return_lse", return_lse)
    o, lse = flash_attn_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
                                backend=backend, out=out,
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)
    return (o, lse) if return_lse else o


def flash_attn_backward(dout, q, k, v, o, lse, *, causal=False, softmax_scale=None, layout="bshd", backend="auto",
                        deterministic=False, dq=None, dk=None, dv=None,
                        window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """Gradients (dq, dk, dv) of the forward call that produced (o, lse), given dout = dL/do.

    P is recomputed from q, k and lse; no N x N matrix is stored. dq=, dk=, dv=, when given, receive
    the gradients in place (checked like `out=`). The variant arguments must be the forward's (dropout
    regenerates the forward's keep mask from seed, offset).

    deterministic: fp16 / bf16 on the GPU sum each dq element over key blocks in an fp32 accumulator with
    atomic adds, whose order varies from call to call (dq may differ in its last bits); with
    deterministic=True the adds go in key-block order and repeated calls are bitwise identical. dk, dv,
    fp32 / fp64 and the host backends are deterministic either way.
    """
    key = None
    if _plannable_variants(alibi_slopes, dropout_p, seed, offset):
        key = _plan.backward_key(dout, q, k, v, o, lse, dq, dk, dv, causal, softmax_scale, window, softcap, layout,
                                 backend, deterministic)
        plan = _plan.BACKWARD.get(key)
        if plan is not None:
            return plan(dout, q, k, v, o, lse, dq, dk, dv)
    return _backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, layout=layout,
                     backend=backend, deterministic=deterministic, dq=dq, dk=dk, dv=dv, key=key,
                     window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)


def _backward(dout, q, k, v, o, lse, *, causal, softmax_scale, layout, backend, deterministic, dq=None, dk=None,
              dv=None, key=None,
              window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """The general path of flash_attn_backward; with a key, it may leave a plan for the signature."""
    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse),
                    ("dq", dq), ("dk", dk), ("dv", dv)):
        _checks.check_array(name, x, optional=name in ("dq", "dk", "dv"))
        _checks.check_concrete(name, x)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    _checks.check_layout(layout)
    dt, qb, kb, vb = _validate_qkv(q, k, v, layout)
    b, sq, h, d = qb.shape
    for name, x in (("dout", dout), ("o", o)):
        _checks.check_ndim(name, x, layout)
        _checks.check_like(name, x, tuple(q.shape), dt)
    _checks.check_lse(lse, (b, h, sq), lse_dtype(dt))
    scale = _checks.check_softmax_scale(softmax_scale, d)
    vkw, _ = _variants(causal, window, softcap, alibi_slopes, dropout_p, seed, offset, b, h)
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    grads = _check_grad_outs(_inputs(**inputs, alibi_slopes=alibi_slopes), dq, dk, dv, dt)
    call = _Call(q, layout, backend, {**inputs, **grads, "alibi_slopes": alibi_slopes})
    with call.context():
        arrs, works = zip(*((x, call.working_out(x)) if x is not None else call.new(like.shape, numpy_dtype(dt))
                            for x, like in ((dq, q), (dk, k), (dv, v))))
        g = [_bshd(x, layout) for x in works]
        ws = [call.working(n, x) for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("o", o))]
        ins = [*(_bshd(x, layout) for x in ws), call.working("lse", lse)]
        # the workspace (D, the dQ accumulator), from the caller's allocator (host backends make their own)
        workspace = _workspace(call, dt, d, h, b, sq, b, sq, deterministic)
        vkw = _working_variants(call, vkw)
        if key is not None and _plan.plannable(call.caller, call.be, dout, q, k, v, o,
                                               *(x for x in (dq, dk, dv) if x is not None)):
            general = functools.partial(_backward, causal=causal, softmax_scale=softmax_scale, layout=layout,
                                        backend=backend, deterministic=deterministic, window=window, softcap=softcap)
            launches = call.be.backward_launches(*ins, *g, workspace, causal=causal, softmax_scale=scale,
                                                 deterministic=deterministic, **vkw)
            _plan.BACKWARD[key] = _plan.BackwardPlan(call.caller, launches, dout, q, k, v, o, lse, (dq, dk, dv),
                                                     workspace.shape, general)
        if b and h and (sq or kb.shape[1]):
            call.be.backward(*ins, causal=causal, softmax_scale=scale, deterministic=deterministic,
                             dq=g[0], dk=g[1], dv=g[2], workspace=workspace, **vkw)
        elif not h:  # no query head reads the keys (nheads_k may be > 0): they get no gradient
            for x in g[1:]:
                x[...] = 0
    for x, w in zip((dq, dk, dv), works):
        if x is not None:
            call.write_back(x, w)
    return tuple(a if x is not None else call.result(a) for a, x in zip(arrs, (dq, dk, dv)))


def _workspace(call, dt, head_dim, nheads, slabs, rows, entries, max_seqlen_q, deterministic):
    """The backward's workspace (config.BackwardWorkspace) in the caller's allocator, as a 1-D array of the
    accumulation dtype; None for host backends (they make their own)."""
    if not call.on_device:
        return None
    nbytes = backward_workspace(dt, head_dim, nheads, slabs, rows, entries, max_seqlen_q, deterministic).nbytes
    acc = lse_dtype(dt)
    return call.new((ceil_div(nbytes, ITEMSIZE[acc]),), acc)[1]


# --- variable-length batches -------------------------------------------------------------------------------


def _varlen_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   check_inputs, variants):
    """Validation shared by the varlen forward and backward: (causal, dtype, scale, backend kwargs, what,
    (max_seqlen_q, max_seqlen_k)). The longest lengths size the kernels' grids: where cu_seqlens are
    not checked (on the device, check_inputs=False), they must be right, as in FlashAttention."""
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _checks.check_array(name, x)
        _checks.check_concrete(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_ndim_packed(name, x)
    causal = _checks.check_flag("causal", causal)
    check_inputs = _checks.check_flag("check_inputs", check_inputs)
    dt = _checks.check_dtype("q", q)
    _checks.check_same_dtype(dt, k=k, v=v)
    _checks.check_qkv(q[None], k[None], v[None])
    _checks.check_cu_seqlens_dtype("cu_seqlens_q", cu_seqlens_q)
    _checks.check_cu_seqlens_dtype("cu_seqlens_k", cu_seqlens_k)
    batch = _checks.check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    longest = {}
    for name, cu, x, packed in (("cu_seqlens_q", cu_seqlens_q, q, "q"), ("cu_seqlens_k", cu_seqlens_k, k, "k")):
        # Reading device values needs a sync: only with check_inputs=True.
        if not _on_device(cu) or check_inputs:
            longest[name] = _checks.check_cu_seqlens_values(name, _interop.to_working(name, cu, False),
                                                            int(x.shape[0]), packed)
    max_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q, longest.get("cu_seqlens_q"))
    max_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k, longest.get("cu_seqlens_k"))
    scale = _checks.check_softmax_scale(softmax_scale, q.shape[-1])
    vkw, what = _variants(causal, *variants, batch, q.shape[1])
    return causal, dt, scale, vkw, ["varlen", *what], (max_q, max_k)


def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                              softmax_scale=None, backend="auto", out=None, check_inputs=False,
                              window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """Attention over a batch of sequences of different lengths, packed: returns (o, lse).

    q (total_q, nheads, head_dim), k, v (total_k, nheads_k, head_dim); cu_seqlens_q, cu_seqlens_k int32
    (batch + 1,) cumulative lengths from 0 (sequence i is rows cu[i]:cu[i + 1]; empty sequences are
    allowed); max_seqlen_q, max_seqlen_k the longest lengths. o like q, lse (nheads, total_q). Each
    sequence is attended on its own, with the dense functions' semantics and variants (for dropout
    the batch index is the sequence index). cu_seqlens held on the host are always checked; device
    arrays only with check_inputs=True (it costs a sync).
    """
    causal, dt, scale, vkw, what, (max_q, max_k) = _varlen_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal, softmax_scale, check_inputs,
                                                  (window, softcap, alibi_slopes, dropout_p, seed, offset))
    _checks.check_array("out", out, optional=True)
    if out is not None:
        _checks.check_out(out, tuple(q.shape), dt, _inputs(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                                           cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes))
    call = _Call(q, "bshd", backend, {"q": q, "k": k, "v": v, "out": out, "cu_seqlens_q": cu_seqlens_q,
                                      "cu_seqlens_k": cu_seqlens_k, "alibi_slopes": alibi_slopes})
    with call.context():
        o_arr, o_work = call.new(q.shape, numpy_dtype(dt)) if out is None else (out, call.working_out(out))
        lse_arr, lse = call.new((q.shape[1], q.shape[0]), lse_dtype(dt))
        ins = [call.working(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                                                ("cu_seqlens_k", cu_seqlens_k))]
        call.be.varlen_forward(*ins, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
                               softmax_scale=scale, out=o_work, lse=lse, **_working_variants(call, vkw))
    if out is None:
        return call.result(o_arr), call.result(lse_arr)
    call.write_back(out, o_work)
    return out, call.result(lse_arr)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                      softmax_scale=None, return_lse=False, backend="auto", out=None, check_inputs=False,
                      window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """flash_attn_varlen_forward's o; with return_lse=True, (o, lse)."""
    return_lse = _checks.check_flag("return_lse", return_lse)
    o, lse = flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, softmax_scale=softmax_scale, backend=backend, out=out,
                                       check_inputs=check_inputs,
                                       window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset)
    return (o, lse) if return_lse else o


def flash_attn_varlen_backward(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, softmax_scale=None, backend="auto", deterministic=False, dq=None,
                               dk=None, dv=None, check_inputs=False,
                               window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, dropout_p=_OFF, seed=_ZERO, offset=_ZERO):
    """Gradients (dq, dk, dv) of the flash_attn_varlen_forward call that produced (o, lse); the same
    arguments as that call (dout and o like q, lse (nheads, total_q))."""
    causal, dt, scale, vkw, what, (max_q, max_k) = _varlen_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal, softmax_scale, check_inputs,
                                                  (window, softcap, alibi_slopes, dropout_p, seed, offset))
    deterministic = _checks.check_flag("deterministic", deterministic)
    for name, x in (("dout", dout), ("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        _checks.check_array(name, x, optional=name in ("dq", "dk", "dv"))
        _checks.check_concrete(name, x)
    for name, x in (("dout", dout), ("o", o)):
        _checks.check_like(name, x, tuple(q.shape), dt)
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse: expected shape {(q.shape[1], q.shape[0])} (nheads, total_q), got {tuple(lse.shape)}")
    _checks.check_lse(lse, tuple(lse.shape), lse_dtype(dt))
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    grads = _check_grad_outs(_inputs(**inputs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     alibi_slopes=alibi_slopes), dq, dk, dv, dt)
    call = _Call(q, "bshd", backend, {**inputs, **grads, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                                      "alibi_slopes": alibi_slopes})
    with call.context():
        arrs, works = zip(*((x, call.working_out(x)) if x is not None else call.new(like.shape, numpy_dtype(dt))
                            for x, like in ((dq, q), (dk, k), (dv, v))))
        ins = [call.working(n, x) for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse),
                                                ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))]
        total_q, h, d = q.shape
        workspace = _workspace(call, dt, d, h, 1, total_q, int(cu_seqlens_q.shape[0]) - 1, max_q, deterministic)
        call.be.varlen_backward(*ins, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
                                softmax_scale=scale, deterministic=deterministic, dq=works[0], dk=works[1],
                                dv=works[2], workspace=workspace, **_working_variants(call, vkw))
    for x, w in zip((dq, dk, dv), works):
        if x is not None:
            call.write_back(x, w)
    return tuple(a if x is not None else call.result(a) for a, x in zip(arrs, (dq, dk, dv)))


# --- decoding: attention over a KV cache ---------------------------------------------------------------------


def _on_device(x) -> bool:
    """Is x in GPU memory (CuPy, torch CUDA, any device DLPack producer)?"""
    if _interop.is_numpy(x):
        return False
    if _interop.is_cupy(x):
        return True
    return hasattr(x, "__dlpack_device__") and _interop._is_device_dlpack(x)


def _bits(x):
    """x viewed as unsigned integers of its item size: a copy of raw bits needs no dtype support."""
    return x.view({2: "uint16", 4: "uint32", 8: "uint64"}[x.dtype.itemsize])


def _append_on_host(k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int) -> None:
    """k, v into host caches (NumPy, in place) at logical rows cache_seqlens[b] .. + seqlen_new - 1, as
    kvcache_append.cu does on the GPU: a row past an entry's capacity, or on a page outside the pool, is not
    written."""
    kc, vc, kn, vn = (_bits(_interop.to_working(n, x, False)) for n, x in (("k_cache", k_cache), ("v_cache", v_cache),
                                                                          ("k", k), ("v", v)))
    batch, seqlen_new = kn.shape[0], kn.shape[1]
    if not _checks._is_int(cache_seqlens):
        cache_seqlens = _interop.to_working("cache_seqlens", cache_seqlens, False)
    start = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64).reshape(-1, 1), (batch, 1))
    pos = start + np.arange(seqlen_new, dtype=np.int64)[None, :]  # (batch, seqlen_new) logical rows
    ok = (pos >= 0) & (pos < capacity)
    if block_table is None:
        slab, row = np.broadcast_to(np.arange(batch)[:, None], pos.shape), pos
    else:
        page_size, num_pages = kc.shape[1], kc.shape[0]
        bt = _interop.to_working("block_table", block_table, False)
        slab = np.full(pos.shape, -1, dtype=np.int64)
        slab[ok] = bt[np.nonzero(ok)[0], pos[ok] // page_size]
        ok &= (slab >= 0) & (slab < num_pages)
        row = pos % page_size
    for cache, new in ((kc, kn), (vc, vn)):
        cache[slab[ok], row[ok]] = new[ok]


def _append_on_device(k_cache, v_cache, k, v, cache_seqlens, block_table, counts, seqlen_new: int,
                      capacity: int) -> None:
    """One kvcache_append launch on the current stream: k, v (None: no rows to write) into device caches, and
    with counts (an int32 (batch,) CuPy array) each entry's key count after seqlen_new new rows."""
    from .backends import cuda

    kc, vc = (_interop.to_working(n, x, True) for n, x in (("k_cache", k_cache), ("v_cache", v_cache)))
    kn, vn = (None, None) if k is None else (_interop.to_working(n, x, True) for n, x in (("k", k), ("v", v)))
    cs = int(cache_seqlens) if _checks._is_int(cache_seqlens) else _device_int32("cache_seqlens", cache_seqlens)
    bt = None if block_table is None else _device_int32("block_table", block_table)
    cuda.append_launches(kc, vc, kn, vn, cs, bt, counts, seqlen_new=seqlen_new, batch=kc.shape[0] if bt is None
                         else bt.shape[0], capacity=capacity).run(cuda._current_stream())


def _device_int32(name: str, x):
    import cupy

    return cupy.ascontiguousarray(_interop.to_working(name, x, True))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None, causal=False,
                            softmax_scale=None, window=NO_WINDOW, softcap=_OFF, alibi_slopes=None, num_splits=0,
                            return_lse=False, backend="auto", check_inputs=False):
    """Attention of q over a KV cache (decoding, speculative decoding, chunked prefill), forward only:
    o, or with return_lse=True (o, lse).

    q (batch, seqlen_q, nheads, head_dim). k_cache, v_cache: dense (batch, capacity, nheads_k, head_dim),
    or with block_table int32 (batch, max_pages) paged (num_pages, page_size, nheads_k, head_dim), page_size a
    multiple of 16: logical key j of entry b is row j % page_size of page block_table[b, j // page_size].
    cache_seqlens: an int or int32 (batch,) array, the keys already in each entry. k, v (batch, seqlen_new,
    nheads_k, head_dim), optional (both or neither), are first written into the caches in place at
    logical rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (cache_seqlens is not changed);
    entry b then attends over its seqlen_k[b] = cache_seqlens[b] + seqlen_new keys, causal
    bottom-right (query i sees keys j <= i + seqlen_k[b] - seqlen_q). window, softcap, alibi_slopes as
    for flash_attn_forward; lse (batch, nheads, seqlen_q).

    num_splits: how many thread blocks share each entry's keys on the GPU (split-KV: each computes a partial
    result over its share, and a second kernel merges them exactly); 0 (the default) chooses per call, so that
    small batches still fill the GPU. It changes rounding only, never the result beyond it. A paged cache gives
    the dense cache's result bit for bit at the same split count; with 0, pools of pages under 64 keys may take
    more splits than the same cache dense (config.decode_splits), so there the two differ in rounding. The CUDA backend
    honours it where its decode kernel serves the call (fp16 / bf16 without ALiBi, seqlen_q * nheads / nheads_k
    <= 64 rows or num_splits > 1, and the kernel's block within the GPU's shared memory) and computes unsplit
    elsewhere; the Numba backend where the same rule serves the call (for any dtype); the NumPy backend
    unsplit.

    cache_seqlens and block_table held on the host are always checked (capacity, page indices in
    [0, num_pages)); device arrays only with check_inputs=True (it costs a sync). Unchecked device
    values never reach outside the caches: counts are clamped to [0, capacity] (a negative count as 0),
    rows past the capacity are not written, and a page outside the pool is neither written nor read
    (its keys read as zeros).
    """
    key = None
    if alibi_slopes is None and check_inputs is False:
        key = _plan.kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window,
                                softcap, num_splits, return_lse, backend)
        plan = _plan.KVCACHE.get(key)
        if plan is not None:
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    return _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
                         softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         num_splits=num_splits, return_lse=return_lse, backend=backend, check_inputs=check_inputs,
                         key=key)


def _with_kvcache(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, causal, softmax_scale, window, softcap,
                  alibi_slopes, num_splits, return_lse, backend, check_inputs, key=None):
    """The general path of flash_attn_with_kvcache; with a key, it may leave a plan for the signature."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        _checks.check_array(name, x, optional=name in ("k", "v"))
        _checks.check_concrete(name, x)
    _checks.check_array("block_table", block_table, optional=True)
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    check_inputs = _checks.check_flag("check_inputs", check_inputs)
    num_splits = _checks.check_num_splits(num_splits)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.check_ndim(name, x, "bshd")
    dt = _checks.check_dtype("q", q)
    _checks.check_same_dtype(dt, k_cache=k_cache, v_cache=v_cache)
    b, sq, h, d = q.shape
    capacity, num_pages = _checks.check_kv_cache(q, k_cache, v_cache, block_table)
    seqlen_new = _checks.check_new_kv(k, v, (b, k_cache.shape[2], d), dt)
    if seqlen_new:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            _checks.check_writable(name, x)
    _checks.check_cache_seqlens(cache_seqlens, b)
    # Reading device values needs a sync: only with check_inputs=True.
    for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if x is None or not (_checks._is_int(x) or not _on_device(x) or check_inputs):
            continue
        host = x if _checks._is_int(x) else _interop.to_working(name, x, False)
        if name == "cache_seqlens":
            _checks.check_cache_seqlens_values(host, seqlen_new, capacity, block_table is not None)
        else:
            _checks.check_block_table_values(host, num_pages)
    scale = _checks.check_softmax_scale(softmax_scale, d)
    vkw, _ = _variants(causal, window, softcap, alibi_slopes, _OFF, _ZERO, _ZERO, b, h)
    if seqlen_new:  # the caches are written: they share memory with nothing the call reads
        read = _inputs(q=q, k=k, v=v, block_table=block_table, alibi_slopes=alibi_slopes,
                       cache_seqlens=None if _checks._is_int(cache_seqlens) else cache_seqlens)
        _checks.check_no_overlap("k_cache", k_cache, read)
        _checks.check_no_overlap("v_cache", v_cache, read)
        # nor one another's elements: one array for both, or caches a row apart in one buffer, are refused; the
        # interleaved halves of one buffer, (b, s, 2, h, d) say, are two caches (address ranges overlap, elements not)
        if _checks.shares_elements(k_cache, v_cache):
            raise ValueError("k_cache: must not share memory with v_cache"
                             + (" (one array for both)" if _checks._base(k_cache) == _checks._base(v_cache) else ""))
    # host cache_seqlens / block_table may go with device arrays (they are copied where needed)
    devices = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "alibi_slopes": alibi_slopes}
    devices.update({n: x for n, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table))
                    if x is not None and not _checks._is_int(x) and _on_device(x)})
    call = _Call(q, "bshd", backend, devices)
    with call.context():
        if key is not None and b and sq and h and _plan.plannable(
                call.caller, call.be, q, k_cache, v_cache, *([] if k is None else [k, v]),
                indices=(cache_seqlens, block_table)):  # this call and the next of its signature, from a plan
            general = functools.partial(_with_kvcache, causal=causal, softmax_scale=softmax_scale, window=window,
                                        softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                                        return_lse=return_lse, backend=backend, check_inputs=check_inputs)
            ins = [call.working(n, x) for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                   ("k", k), ("v", v), ("block_table", block_table))]
            plan = _plan.KVCACHE[key] = _plan.KVCachePlan(call.caller, q, cache_seqlens, *ins, seqlen_new, capacity,
                                                          num_splits, causal, scale, numpy_dtype(lse_dtype(dt)),
                                                          return_lse, general, **vkw)
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        on_gpu = _on_device(k_cache)
        if seqlen_new and not on_gpu:
            _append_on_host(k_cache, v_cache, k, v, cache_seqlens, block_table, capacity)
        elif seqlen_new and not call.on_device:  # device caches, the NumPy backend
            _append_on_device(k_cache, v_cache, k, v, cache_seqlens, block_table, None, seqlen_new, capacity)
        o_arr, o_work = call.new(q.shape, numpy_dtype(dt))
        lse_arr, lse = call.new((b, h, sq), lse_dtype(dt))
        ins = [call.working(n, x) for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))]
        bt = call.working("block_table", block_table)
        if not call.on_device:
            cs = np.asarray(cache_seqlens if _checks._is_int(cache_seqlens) else
                            call.working("cache_seqlens", cache_seqlens), dtype=np.int64)
            counts = np.clip(np.broadcast_to(cs, (b,)) + seqlen_new, -1, 2**31 - 1).astype(np.int32)
        elif seqlen_new or _checks._is_int(cache_seqlens):  # one launch: the device append and the key counts
            import cupy

            counts = cupy.empty((b,), dtype=cupy.int32)
            rows = (k, v) if seqlen_new and on_gpu else (None, None)
            _append_on_device(ins[1], ins[2], *rows, cache_seqlens, bt, counts, seqlen_new, capacity)
        else:
            counts = call.working("cache_seqlens", cache_seqlens)
        if b and sq and h:
            call.be.kvcache_forward(*ins, counts, bt, causal=causal, softmax_scale=scale, out=o_work, lse=lse,
                                    num_splits=num_splits, **_working_variants(call, vkw))
    o, lse_out = call.result(o_arr), call.result(lse_arr)
    return (o, lse_out) if return_lse else o


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, *, dropout_p, seed, offset=0):
    """The boolean keep mask (batch, nheads, seqlen_q, seqlen_k), NumPy, that every backend uses for these
    dropout arguments (True: kept and scaled by 1 / (1 - dropout_p)). The generator is specified in
    cuflash/_philox.py: Philox4x32-10 keyed by the seed, one call per 8 scores (the counter holds the
    16 x 16 tile, the position in it, batch * nheads + head and offset), a score kept iff its 16-bit
    draw is >= floor(dropout_p * 2**16)."""
    sizes = [_checks.check_count(n, x) for n, x in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q),
                                                    ("seqlen_k", seqlen_k))]
    p, seed, offset = _checks.check_dropout_p(dropout_p), _checks.check_seed(seed), _checks.check_offset(offset)
    if 0 in sizes:  # nothing to draw (and no index range of the other sizes to build)
        return np.zeros(sizes, dtype=bool)
    return _philox.dropout_mask(*sizes, dropout_p=p, seed=seed, offset=offset)


__all__ = ["flash_attn", "flash_attn_forward", "flash_attn_backward", "flash_attn_varlen",
           "flash_attn_varlen_forward", "flash_attn_varlen_backward", "flash_attn_with_kvcache", "dropout_mask"]
