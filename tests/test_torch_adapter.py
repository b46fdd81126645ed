"""cuflash.torch: the differentiable torch functions (custom ops with autograd, torch.compile, CUDA graphs).

CPU tests run the NumPy backend (backend="numpy": the same code path a GPU-less machine takes with
"auto"); the `gpu` tests run the CUDA kernels on torch CUDA tensors.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cuflash.torch")

from cuflash import reference  # noqa: E402


def _qkv(shape_q, shape_k, dtype=torch.float64, device="cpu", seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
          for s in (shape_q, shape_k, shape_k)]
    return [x.requires_grad_(requires_grad) for x in xs]


def _np(x):
    return x.detach().cpu().double().numpy()


def _grads(f, q, k, v, w):
    """o = f(q, k, v) and the gradients of sum(o * w)."""
    o = f(q, k, v)
    dq, dk, dv = torch.autograd.grad((o * w).sum(), (q, k, v))
    return o, dq, dk, dv


VARIANTS = [
    {},
    {"causal": True},
    {"causal": True, "window": (5, 0), "softcap": 2.0},
    {"alibi_slopes": "h", "window": (4, 3)},
]


def _slopes(kw, nheads, device="cpu"):
    if kw.get("alibi_slopes") == "h":
        kw = {**kw, "alibi_slopes": torch.tensor([2.0 ** -(h + 1) for h in range(nheads)], dtype=torch.float32,
                                                 device=device)}
    return kw


@pytest.mark.parametrize("kw", VARIANTS, ids=["plain", "causal", "causal-window-softcap", "alibi-window"])
def test_matches_reference(kw):
    q, k, v = _qkv((2, 23, 4, 16), (2, 31, 2, 16))
    kw = _slopes(kw, 4)
    w = torch.randn(q.shape, dtype=torch.float64)
    o, dq, dk, dv = _grads(lambda q, k, v: ct.flash_attn_func(q, k, v, backend="numpy", **kw), q, k, v, w)
    rkw = {n: (_np(x) if torch.is_tensor(x) else x) for n, x in kw.items()}
    o_ref, _ = reference.forward(_np(q), _np(k), _np(v), **rkw)
    g_ref = reference.backward(_np(w), _np(q), _np(k), _np(v), **rkw)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64 and o.shape == q.shape
    np.testing.assert_allclose(_np(o), o_ref, atol=1e-12)
    for name, ours, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref):
        np.testing.assert_allclose(_np(ours), ref, atol=1e-11, err_msg=name)


def test_gradcheck_float64_cpu():
    q, k, v = _qkv((1, 9, 2, 8), (1, 12, 1, 8))
    f = lambda q, k, v: ct.flash_attn_func(q, k, v, causal=True, softcap=3.0, backend="numpy")  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_dropout_replays_the_forward_mask():
    """The backward regenerates the forward's keep mask from the seed it was given: gradcheck
    (finite differences of the forward against the backward) holds only if both use one mask."""
    q, k, v = _qkv((1, 10, 2, 8), (1, 10, 2, 8))
    f = lambda q, k, v: ct.flash_attn_func(q, k, v, dropout_p=0.3, seed=7, offset=2, backend="numpy")  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_seed_none_draws_from_torch_generator():
    q, k, v = _qkv((1, 16, 2, 8), (1, 16, 2, 8), requires_grad=False)
    run = lambda: ct.flash_attn_func(q, k, v, dropout_p=0.5, backend="numpy")  # noqa: E731
    torch.manual_seed(3)
    a, b = run(), run()
    torch.manual_seed(3)
    c = run()
    assert torch.equal(a, c), "the same torch seed must give the same dropout mask"
    assert not torch.equal(a, b), "successive calls must draw fresh seeds"


def test_lse_is_returned_and_not_differentiable():
    q, k, v = _qkv((1, 8, 2, 8), (1, 8, 2, 8))
    o, lse = ct.flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    _, lse_ref = reference.forward(_np(q), _np(k), _np(v))
    assert lse.shape == (1, 2, 8) and lse.dtype == torch.float64
    np.testing.assert_allclose(_np(lse), lse_ref, atol=1e-12)
    assert not lse.requires_grad
    with pytest.raises(RuntimeError):
        lse.sum().backward()


def test_varlen_matches_dense_per_sequence():
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    total, h, d = 19, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(total, h, d, generator=g, dtype=torch.float64)
    o = ct.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, backend="numpy")
    dq, dk, dv = torch.autograd.grad((o * w).sum(), (q, k, v))
    o_ref, _ = reference.forward(_np(q), _np(k), _np(v), causal=True, cu_seqlens_q=cu.numpy(), cu_seqlens_k=cu.numpy())
    g_ref = reference.backward(_np(w), _np(q), _np(k), _np(v), causal=True, cu_seqlens_q=cu.numpy(),
                               cu_seqlens_k=cu.numpy())
    np.testing.assert_allclose(_np(o), o_ref, atol=1e-12)
    for name, ours, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref):
        np.testing.assert_allclose(_np(ours), ref, atol=1e-11, err_msg=name)
    small = [x.detach()[:7].clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.flash_attn_varlen_func(q, k, v, cu[:2], cu[:2], 7, 7, causal=True, backend="numpy"), small)


@pytest.mark.parametrize("op, args", [
    ("forward", lambda q, k, v: (q, k, v, True, None, -1, -1, 0.0, None, 0.0, 0, 0, "numpy", False)),
    # the backward op has no double backward: its inputs do not require grad
    ("backward", lambda q, k, v: (q, q, k, v, q, torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype),
                                  True, 0.5, -1, -1, 0.0, None, 0.0, 0, 0, "numpy", True)),
])
def test_opcheck(op, args):
    """Schema, fake tensors (shapes, dtypes, strides), autograd registration, AOT dispatch."""
    q, k, v = _qkv((1, 6, 2, 8), (1, 6, 2, 8), requires_grad=op == "forward")
    res = torch.library.opcheck(getattr(torch.ops.cuflash, op).default, args(q, k, v))
    assert all(r == "SUCCESS" for r in res.values()), res


def test_opcheck_varlen():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    res = torch.library.opcheck(torch.ops.cuflash.varlen_forward.default,
                                (q, k, v, cu, cu, 5, 5, True, None, -1, -1, 0.0, None, 0.0, 0, 0, "numpy", False))
    assert all(r == "SUCCESS" for r in res.values()), res


def test_compile_fullgraph_no_graph_break():
    """torch.compile(fullgraph=True) traces through the ops (a graph break would raise), and the compiled
    value and gradients equal eager's."""
    q, k, v = _qkv((1, 12, 2, 8), (1, 12, 2, 8))
    w = torch.randn(q.shape, dtype=torch.float64)

    def loss(q, k, v):
        x = ct.flash_attn_func(torch.tanh(q), k, v, causal=True, backend="numpy")
        return (x * w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager_l = loss(q, k, v)
    eager_g = torch.autograd.grad(eager_l, (q, k, v))
    comp_l = compiled(q, k, v)
    comp_g = torch.autograd.grad(comp_l, (q, k, v))
    assert torch.equal(eager_l, comp_l)
    for a, b in zip(eager_g, comp_g):
        assert torch.equal(a, b)


def test_compile_dropout_needs_a_seed():
    q, k, v = _qkv((1, 8, 2, 8), (1, 8, 2, 8), requires_grad=False)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: ct.flash_attn_func(q, k, v, dropout_p=0.1, backend="numpy"), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(Exception, match="explicit seed"):
        f(q, k, v)


def test_bad_input_keeps_cuflash_messages():
    q, k, v = _qkv((1, 8, 2, 8), (1, 8, 2, 8), requires_grad=False)
    with pytest.raises(TypeError, match="window"):
        ct.flash_attn_func(q, k, v, window=3, backend="numpy")
    with pytest.raises(ValueError, match="softcap"):
        ct.flash_attn_func(q, k, v, softcap=-1.0, backend="numpy")
    with pytest.raises(ValueError, match="shapes must be equal"):
        ct.flash_attn_func(q, k[..., :4], v, backend="numpy")
    with pytest.raises(TypeError, match="deterministic"):
        ct.flash_attn_func(q, k, v, deterministic="yes", backend="numpy")


# --- on the GPU -------------------------------------------------------------------------------------


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


@pytest.mark.gpu
def test_gpu_gradcheck_float64(gpu):
    """float64 kernels (SIMT) make gradcheck possible on the GPU; GQA and causal with a window."""
    _cuda()
    q, k, v = _qkv((1, 11, 4, 16), (1, 14, 2, 16), device="cuda")
    f = lambda q, k, v: ct.flash_attn_func(q, k, v, causal=True, window=(6, 0))  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_matches_reference(gpu, dtype):
    """Forward and backward through autograd on torch CUDA tensors, by the accuracy rule; results are
    torch tensors on the input's device."""
    _cuda()
    cp = gpu.cp
    b, sq, sk, h, hk, d = 2, 200, 257, 4, 2, 64
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, True, extra="cuflash.torch")
    rs = gpu.rng(ctx)
    xs = [torch.from_dlpack(gpu.randn(rs, s, dtype)) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d),
                                                                (b, sq, h, d))]
    q, k, v = (x.clone().requires_grad_() for x in xs[:3])
    do = xs[3]
    o, lse = ct.flash_attn_func(q, k, v, causal=True, return_lse=True)
    o.backward(do)
    for name, x in (("o", o), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert isinstance(x, torch.Tensor) and x.device == q.device, f"{name}: {type(x)} on {x.device} [{ctx}]"
    gpu.check(ctx, dtype, True, None, *(cp.from_dlpack(x.detach()) for x in (q, k, v, do, o, lse, q.grad, k.grad,
                                                                             v.grad)))


class _Block(torch.nn.Module):
    """A small attention block: what torch.compile must trace without a graph break."""

    def __init__(self, width=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        return x + self.proj(ct.flash_attn_func(q, k, v, causal=True).reshape(b, n, c))


def _block_grads(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().mean().backward()
    return y.detach().clone(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compile(gpu, mode):
    """torch.compile(fullgraph=True) with inductor, and with CUDA graphs (reduce-overhead), replayed on
    new data: outputs and parameter gradients equal eager's (the same kernels run, so bitwise for the
    attention; the surrounding inductor code may reorder float ops, hence a tight tolerance)."""
    _cuda()
    torch.manual_seed(0)
    model = _Block().cuda().to(torch.bfloat16)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for step in range(4):  # compile, warm-up, record, replay (with reduce-overhead)
        x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y_e, g_e = _block_grads(model, x)
        y_c, g_c = _block_grads(compiled, x)
        assert torch.isfinite(y_c).all()
        torch.testing.assert_close(y_c, y_e, atol=2e-2, rtol=2e-2, msg=f"{mode} step {step}: output")
        for i, (a, b) in enumerate(zip(g_c, g_e)):
            torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2, msg=f"{mode} step {step}: grad {i}")
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped CUDA graphs (see the warning above)"


@pytest.mark.gpu
def test_gpu_side_stream(gpu):
    """Forward and backward through autograd inside `with torch.cuda.stream(s)`, behind a long busy
    kernel on s, results consumed on s at once: equal to the default-stream results (bitwise, but dq: its
    fp32 adds are atomic, their order free; a kernel on the wrong stream would leave it far off)."""
    _cuda()
    q, k, v = _qkv((2, 300, 4, 64), (2, 411, 2, 64), dtype=torch.bfloat16, device="cuda")
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def run(q, k, v, do):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = ct.flash_attn_func(q, k, v, causal=True)
        o.backward(do)
        return [x.clone() for x in (o.detach(), q.grad, k.grad, v.grad)]

    ref = run(q, k, v, do)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # tens of ms of spinning queued ahead on s
        got = run(q, k, v, do.clone())
    s.synchronize()
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        if name == "dq":
            assert torch.allclose(a, b, rtol=1e-2, atol=1e-3), "dq: differs from the default-stream result"
        else:
            assert torch.equal(a, b), f"{name}: differs from the default-stream result"
