"""The call path on a GPU: the plan cache, misaligned inputs, outputs from the caller's allocator,
CUDA graphs, dq=/dk=/dv=, tensors that require grad.

Every result here is compared bitwise with a result of the same kernels through another path (the
general path, aligned copies, eager calls), and the eager results with the float64 reference.
"""

from __future__ import annotations

import math

import pytest

import cuflash
from cuflash import _plan, api
from cuflash.config import backward_workspace
from conftest import jax_gpu

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _inputs(gpu, kind, dtype, shape_q, shape_k, key):
    """q, k, v, dout as CuPy arrays or torch tensors (zero-copy views of the same CuPy memory)."""
    rs = gpu.rng(key)
    arrs = [gpu.randn(rs, s, dtype) for s in (shape_q, shape_k, shape_k, shape_q)]
    return [_as(kind, x) for x in arrs]


def _as(kind, x):
    if kind == "cupy":
        return x
    return _torch().from_dlpack(x)


def _cupy(x):
    import cupy

    return x if isinstance(x, cupy.ndarray) else cupy.from_dlpack(x)


def _misaligned_copy(gpu, kind, x, offset: int):
    """A contiguous copy of x whose data pointer is `offset` elements past an aligned allocation."""
    cp = gpu.cp
    xc = _cupy(x)
    buf = cp.empty(xc.size + 8, dtype=xc.dtype)
    view = buf[offset:offset + xc.size].reshape(xc.shape)
    view[...] = xc
    assert view.flags.c_contiguous and (view.data.ptr % 16 != 0) == (offset * xc.itemsize % 16 != 0)
    return _as(kind, view)


def _bits_equal(gpu, a, b) -> int:
    return gpu.same_bits(_cupy(a), _cupy(b))


def _run(q, k, v, do, causal, **kw):
    """Forward then backward through the public API: (o, lse, dq, dk, dv). The backward is the
    deterministic one: callers compare results bitwise (the atomic dQ adds' order varies)."""
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal, **kw)
    return (o, lse, *cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, deterministic=True, **kw))


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 2, 3, 4])
def test_misaligned_inputs(gpu, kind, dtype, offset):
    """Contiguous inputs whose base is 1-4 elements off 16-byte alignment (a view with a storage
    offset) never reach the 16-byte loads: misaligned first (no plan yet), then aligned (the plan),
    then misaligned again (a plan hit that must step aside); all three bitwise equal, and correct."""
    b, sq, sk, h, hk, d, causal = 1, 100, 130, 4, 2, 64, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra=f"{kind} misaligned offset={offset}")
    q, k, v, do = _inputs(gpu, kind, dtype, (b, sq, h, d), (b, sk, hk, d), ctx)
    mis = [_misaligned_copy(gpu, kind, x, offset) for x in (q, k, v, do)]
    first = _run(*mis, causal)
    o_mis = _misaligned_copy(gpu, kind, first[0], offset)  # the backward's o misaligned too
    cf = gpu.cuflash
    dq_mis = cf.flash_attn_backward(mis[3], *mis[:3], o_mis, first[1], causal=causal, deterministic=True)
    ref = _run(q, k, v, do, causal)
    again = _run(*mis, causal)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, x, y, z in zip(names, first, ref, again):
        assert _bits_equal(gpu, x, y) == 0, f"{name}: misaligned (first call) differs from aligned [{ctx}]"
        assert _bits_equal(gpu, z, y) == 0, f"{name}: misaligned (plan hit) differs from aligned [{ctx}]"
    for name, x, y in zip(names[2:], dq_mis, ref[2:]):
        assert _bits_equal(gpu, x, y) == 0, f"{name}: with a misaligned o differs [{ctx}]"
    gpu.check(ctx, dtype, causal, None, *(_cupy(x) for x in (q, k, v, do, *ref)))


def _layout_inputs(gpu, kind, layout, b, s, h, hk, d, key):
    """q, k, v, dout in "bshd": C-contiguous, or strided views of (b, h, s, d) arrays."""
    if layout == "contiguous":
        return _inputs(gpu, kind, "bfloat16", (b, s, h, d), (b, s, hk, d), key)
    xs = _inputs(gpu, "cupy", "bfloat16", (b, h, s, d), (b, hk, s, d), key)
    return [_as(kind, x.transpose(0, 2, 1, 3)) for x in xs]


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_plan_cache_serves_repeated_calls(gpu, monkeypatch, kind, layout):
    """The second call of a signature never reaches the general path and gives the general path's
    results, bitwise (the deterministic backward, as `_run`: the atomic dQ adds' order varies), in arrays of
    the same type and strides; another signature does reach it. The atomic backward's plans:
    test_gpu_sm90.py."""
    cf = gpu.cuflash
    b, s, h, hk, d = 2, 256, 4, 2, 64
    ctx = gpu.ctx("bfloat16", b, s, s, h, hk, d, True, extra=f"plan cache, {kind}, {layout}")
    q, k, v, do = _layout_inputs(gpu, kind, layout, b, s, h, hk, d, ctx)
    o, lse = cf.flash_attn_forward(q, k, v, causal=True)
    g = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    general = []
    real_fwd, real_bwd = api._forward, api._backward
    monkeypatch.setattr(api, "_forward", lambda *a, **kw: (general.append("fwd"), real_fwd(*a, **kw))[1])
    monkeypatch.setattr(api, "_backward", lambda *a, **kw: (general.append("bwd"), real_bwd(*a, **kw))[1])
    q2, k2, v2, do2 = _layout_inputs(gpu, kind, layout, b, s, h, hk, d, ctx)
    o2, lse2 = cf.flash_attn_forward(q2, k2, v2, causal=True)
    g2 = cf.flash_attn_backward(do2, q2, k2, v2, o2, lse2, causal=True, deterministic=True)
    assert general == [], f"a cached signature took the general path: {general} [{ctx}]"
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *g), (o2, lse2, *g2)):
        assert type(y) is type(q) and y.shape == x.shape, f"{name}: {type(y)} {y.shape} [{ctx}]"
        assert _cupy(y).strides == _cupy(x).strides, f"{name}: strides {_cupy(y).strides} [{ctx}]"
        assert _bits_equal(gpu, x, y) == 0, f"{name}: plan result differs [{ctx}]"
    cf.flash_attn_forward(q, k, v, causal=False)
    assert general == ["fwd"], f"a new signature (causal=False) must take the general path once: {general}"
    gpu.check(ctx, "bfloat16", True, None, *map(_cupy, (q, k, v, do, o2, lse2, *g2)))


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_plans_serve_window_and_softcap(gpu, monkeypatch, kind):
    """A repeated call with a window and a softcap runs from a plan (never the general path), bitwise the first
    call's results; another window value takes the general path once, then has its own plan."""
    cf = gpu.cuflash
    b, s, h, hk, d = 2, 256, 4, 2, 64
    kw = dict(causal=True, window=(40, 0), softcap=3.0)
    ctx = gpu.ctx("bfloat16", b, s, s, h, hk, d, True, extra=f"plan with window and softcap, {kind}")
    q, k, v, do = _inputs(gpu, kind, "bfloat16", (b, s, h, d), (b, s, hk, d), ctx)
    o, lse = cf.flash_attn_forward(q, k, v, **kw)
    g = cf.flash_attn_backward(do, q, k, v, o, lse, deterministic=True, **kw)
    general = []
    real_fwd, real_bwd = api._forward, api._backward
    monkeypatch.setattr(api, "_forward", lambda *a, **k_: (general.append("fwd"), real_fwd(*a, **k_))[1])
    monkeypatch.setattr(api, "_backward", lambda *a, **k_: (general.append("bwd"), real_bwd(*a, **k_))[1])
    o2, lse2 = cf.flash_attn_forward(q, k, v, **kw)
    g2 = cf.flash_attn_backward(do, q, k, v, o2, lse2, deterministic=True, **kw)
    assert general == [], f"a cached signature took the general path: {general} [{ctx}]"
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *g), (o2, lse2, *g2)):
        assert _bits_equal(gpu, x, y) == 0, f"{name}: plan result differs [{ctx}]"
    other = dict(kw, window=(41, 0))
    o3, lse3 = cf.flash_attn_forward(q, k, v, **other)
    cf.flash_attn_forward(q, k, v, **other)
    assert general == ["fwd"], f"a new window must take the general path once: {general}"
    assert _bits_equal(gpu, o3, o2) != 0, "window (41, 0) gave window (40, 0)'s output"


def test_cached_call_still_rejects_bad_input(gpu):
    """A cached signature with out= overlapping q (a pointer matter, not a signature one) raises."""
    cf = gpu.cuflash
    q, k, v, _ = _inputs(gpu, "cupy", "float16", (1, 64, 2, 64), (1, 64, 2, 64), "reject")
    out = gpu.cp.empty_like(q)
    cf.flash_attn_forward(q, k, v, out=out)
    cf.flash_attn_forward(q, k, v, out=out)  # the plan
    with pytest.raises(ValueError, match="out: must not share memory with q"):
        cf.flash_attn_forward(q, k, v, out=q)
    with pytest.raises(ValueError, match="out: must not share memory with v"):
        cf.flash_attn_forward(q, k, v, out=v)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_grad_out_arguments(gpu, kind):
    """dq=, dk=, dv= receive the gradients in place (the same arrays back), bitwise equal to the
    allocated ones; overlapping one with an input or another gradient raises."""
    cf = gpu.cuflash
    dtype, b, sq, sk, h, hk, d = "bfloat16", 2, 96, 160, 4, 2, 128
    q, k, v, do = _inputs(gpu, kind, dtype, (b, sq, h, d), (b, sk, hk, d), f"grad out {kind}")
    o, lse = cf.flash_attn_forward(q, k, v, causal=True)
    want = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    for _ in range(2):  # general path, then the plan
        outs = [_as(kind, gpu.nan_like(_cupy(x))) for x in (q, k, v)]
        got = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, deterministic=True, dq=outs[0], dk=outs[1],
                                     dv=outs[2])
        for name, x, y, z in zip(("dq", "dk", "dv"), got, outs, want):
            assert x is y, f"{name}=: expected the given array back"
            assert _bits_equal(gpu, x, z) == 0, f"{name}=: differs from the allocated gradient"
    dk_only = _as(kind, gpu.nan_like(_cupy(k)))
    got = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, dk=dk_only)
    # dk's bits are the same from call to call of one mode, not across modes (the deterministic mode visits
    # query blocks in another order)
    atomic = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True)
    assert got[1] is dk_only and _bits_equal(gpu, got[1], atomic[1]) == 0
    with pytest.raises(ValueError, match="dq: must not share memory with dout"):
        cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, dq=do)
    shared = _as(kind, gpu.nan_like(_cupy(k)))
    with pytest.raises(ValueError, match="must not share memory with"):
        cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, dk=shared, dv=shared)
    with pytest.raises(ValueError, match="dv: expected shape"):
        cf.flash_attn_backward(do, q, k, v, o, lse, causal=True, dv=_as(kind, gpu.nan_like(_cupy(q))))


def test_torch_outputs_from_torch_allocator(gpu):
    """torch callers get o, lse, dq, dk, dv (and the backward's workspace) from torch's caching allocator:
    CuPy's pool allocates nothing during the calls, torch allocates exactly the results."""
    torch = _torch()
    cp, cf = gpu.cp, gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "bfloat16", 2, 512, 512, 4, 2, 128, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="torch allocator")
    q, k, v, do = _inputs(gpu, "torch", dtype, (b, sq, h, d), (b, sk, hk, d), ctx)
    for plan_state in ("general path", "plan"):
        pool = cp.get_default_memory_pool()
        torch.cuda.synchronize()
        cupy_before = pool.used_bytes()
        torch_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o, lse = cf.flash_attn_forward(q, k, v, causal=causal)
        fwd = torch.cuda.memory_allocated() - torch_before
        dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - torch_before
        r512 = lambda n: -(-n // 512) * 512  # noqa: E731  (torch rounds blocks to 512 B)
        o_b, lse_b = r512(q.numel() * 2), r512(b * h * sq * 4)
        grads = r512(q.numel() * 2) + 2 * r512(k.numel() * 2)
        workspace = r512(backward_workspace(dtype, d, h, b, sq, b, sq, False).nbytes)
        msg = f"[{ctx}, {plan_state}] torch: forward {fwd} B, peak {peak} B; cupy pool grew {pool.used_bytes() - cupy_before} B"
        assert pool.used_bytes() == cupy_before, "CuPy's pool allocated during a torch call " + msg
        assert fwd == o_b + lse_b, "forward: torch allocated other than o + lse " + msg
        assert peak == o_b + lse_b + grads + workspace, "peak other than o, lse, dq, dk, dv, workspace " + msg
        for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert isinstance(x, torch.Tensor) and x.device == q.device, f"{name}: {type(x)} " + msg
        del o, lse, dq, dk, dv


def test_requires_grad_tensors(gpu):
    """Tensors with requires_grad=True go through the raw functions (read through a detached view)."""
    torch = _torch()
    cf = gpu.cuflash
    q, k, v, do = _inputs(gpu, "torch", "float16", (1, 80, 2, 64), (1, 90, 2, 64), "requires grad")
    want = _run(q, k, v, do, True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    for _ in range(2):  # general path, then the plan
        o, lse = cf.flash_attn_forward(*leaves, causal=True)
        got = (o, lse, *cf.flash_attn_backward(do, *leaves, o, lse, causal=True, deterministic=True))
        for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            assert _bits_equal(gpu, x.detach(), y) == 0, f"{name}: requires_grad inputs give another result"
    assert all(x.grad is None for x in leaves)


def test_torch_cuda_graph(gpu):
    """A cached forward + backward captured in a torch CUDA graph, replayed on new data written into
    the same input buffers, equals eager calls on that data bitwise."""
    torch = _torch()
    cf = gpu.cuflash
    dtype, b, sq, sk, h, hk, d = "bfloat16", 2, 300, 300, 4, 2, 128
    static = _inputs(gpu, "torch", dtype, (b, sq, h, d), (b, sk, hk, d), "torch graph a")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run(*static, True)  # compile, plan, warm the graph pool's allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(*static, True)
    fresh = _inputs(gpu, "torch", dtype, (b, sq, h, d), (b, sk, hk, d), "torch graph b")
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _run(*fresh, True)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), captured, eager):
        assert _bits_equal(gpu, x, y) == 0, f"{name}: torch graph replay differs from eager"
    gpu.check(gpu.ctx(dtype, b, sq, sk, h, hk, d, True, extra="torch graph"), dtype, True, None,
              *(_cupy(x) for x in (*fresh, *eager)))


def test_cupy_cuda_graph(gpu):
    """The same through CuPy's stream capture."""
    cp = gpu.cp
    dtype, b, sq, sk, h, hk, d = "float16", 1, 257, 300, 4, 4, 64
    static = _inputs(gpu, "cupy", dtype, (b, sq, h, d), (b, sk, hk, d), "cupy graph a")
    # before the capture: CuPy's pool is not graph-aware, so memory a captured call frees (the backward's
    # workspace) may be handed out again after the capture while every replay still writes it
    fresh = _inputs(gpu, "cupy", dtype, (b, sq, h, d), (b, sk, hk, d), "cupy graph b")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2):
            _run(*static, False)
        stream.synchronize()
        stream.begin_capture()
        try:
            captured = _run(*static, False)
        finally:
            graph = stream.end_capture()
        for dst, src in zip(static, fresh):
            dst[...] = src
        graph.launch(stream)
        stream.synchronize()
        eager = _run(*fresh, False)
        stream.synchronize()
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), captured, eager):
        assert gpu.same_bits(x, y) == 0, f"{name}: CuPy graph replay differs from eager"
    assert not math.isnan(float(cp.abs(captured[0]).max()))


def test_jax_results_are_jax_arrays_without_copy(gpu, monkeypatch):
    """JAX arrays in: JAX arrays out, wrapping the memory the kernels wrote (no copy)."""
    jax, dev = jax_gpu()
    cp, cf = gpu.cp, gpu.cuflash
    q, k, v, do = (jax.device_put(jax.dlpack.from_dlpack(x), dev)
                   for x in _inputs(gpu, "cupy", "float32", (1, 70, 2, 32), (1, 90, 2, 32), "jax"))
    made = []
    real_empty = cp.empty
    monkeypatch.setattr(cp, "empty", lambda *a, **kw: (made.append(real_empty(*a, **kw)), made[-1])[1])
    o, lse = cf.flash_attn_forward(q, k, v, causal=True)
    dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o, lse, causal=True)
    ptrs = {x.data.ptr for x in made}
    for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert isinstance(x, jax.Array), f"{name}: {type(x)}"
        assert x.unsafe_buffer_pointer() in ptrs, f"{name}: not the memory the kernels wrote (a copy)"
    gpu.check("jax", "float32", True, None, *(cp.from_dlpack(x) for x in (q, k, v, do, o, lse, dq, dk, dv)))


def test_plans_are_per_signature():
    """Signatures differing only in a flag, the scale's type-compatible value, the window, the softcap, or out=
    get distinct keys; values the general path must check (non-bool flags, bool or str scales, windows that are
    not tuples of two ints, softcaps that are not numbers) get none."""
    import cupy

    q = cupy.empty((1, 8, 2, 32), dtype=cupy.float16)
    key = lambda **kw: _plan.forward_key(q, q, q, kw.get("out"), kw.get("causal", False),  # noqa: E731
                                         kw.get("scale"), kw.get("window", (-1, -1)), kw.get("softcap", 0.0),
                                         "bshd", "auto")
    assert key() is not None and key() == key()
    assert key(causal=True) != key()
    assert key(scale=0.5) != key() and key(scale=1) == key(scale=1.0)
    assert key(window=(8, 0)) != key() and key(window=(8, 0)) != key(window=(8, 1))
    assert key(softcap=2.0) != key() and key(softcap=2) == key(softcap=2.0)
    assert key(out=q) != key()
    for bad in ({"causal": 1}, {"causal": "False"}, {"scale": True}, {"scale": "0.5"}, {"window": [8, 0]},
                {"window": (8, 0.0)}, {"window": (8,)}, {"softcap": "2"}, {"softcap": None}):
        assert key(**bad) is None, bad
    assert _plan.forward_key([1], q, q, None, False, None, (-1, -1), 0.0, "bshd", "auto") is None


def test_plans_from_other_threads(gpu):
    """A cached signature called from fresh threads (which never touched CUDA before), four at a
    time, each on its own CuPy stream, gives the serial result bitwise."""
    import threading

    cp = gpu.cp
    q, k, v, do = _inputs(gpu, "cupy", "bfloat16", (2, 200, 4, 64), (2, 230, 2, 64), "threads")
    want = _run(q, k, v, do, True)
    cp.cuda.Device().synchronize()
    got, errors = {}, []

    def work(i):
        try:
            with cp.cuda.Device(0), cp.cuda.Stream(non_blocking=True) as s:
                got[i] = _run(q, k, v, do, True)
                s.synchronize()
        except BaseException as e:  # reported below: an exception in a thread would vanish
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, res in got.items():
        for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), res, want):
            assert gpu.same_bits(x, y) == 0, f"{name}: thread {i} differs from the serial call"
