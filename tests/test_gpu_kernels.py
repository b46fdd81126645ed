"""The CUDA kernels through the public API (backend="cuda"), judged by DESIGN.md's accuracy rule.

    max|ours - ref64| <= 2 * max|same_precision_ref - ref64| + atol

ref64 is cuflash.reference in float64 and same_precision_ref the materialized attention in the input
dtype, both computed on the GPU through CuPy. float32 forward: a fixed bound against float64;
float64: 1e-12 (relative to max(1, max|ref|)). LSE against the float64 LSE of the same rounded
inputs. Outputs are poisoned before every call (out= filled with NaN, and the memory pool refilled
with NaN bits for the other outputs), so an element no kernel writes fails as NaN.

Coverage is a covering design, not the full cross product (which would not fit the GPU budget):
  * every (dtype, head_dim, causal) at a medium seqlen pair (rotating over three), GQA rotating;
  * every seqlen pair at (bf16, 128), (fp32, 64), (fp16, 256), causal and not; the two largest
    pairs at (bf16, 128) and (fp32, 64) only;
  * then layouts and strides, GQA, empty / fully masked rows, reproducibility, races, the compile
    cache, CuPy streams and peak memory.
All references run on the GPU in float64; the largest (4224 x 4224, 2 heads) is about 0.3 GB a matrix.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 192, 256)
SEQLENS = ((1, 1), (1, 239), (113, 203), (127, 512), (512, 256), (1023, 1024), (2048, 2048), (4224, 4224))
MEDIUM = ((113, 203), (127, 512), (512, 256))
LARGE = ((2048, 2048), (4224, 4224))


def _tag(dtype, d, sq, sk, causal, h, hk):
    return f"{dtype}-d{d}-{sq}x{sk}-{'causal' if causal else 'full'}-h{h}k{hk}"


def _grid_cases():
    """Every (dtype, head_dim, causal); seqlen pair, GQA and an explicit softmax_scale rotate."""
    cases = []
    for i, (dtype, d, causal) in enumerate(itertools.product(DTYPES, HEAD_DIMS, (False, True))):
        sq, sk = MEDIUM[i % 3]
        hk = (4, 2, 1)[(i // 3) % 3]
        scale = 0.125 if i % 5 == 4 else None
        cases.append(pytest.param(dtype, 2, sq, sk, 4, hk, d, causal, scale, id=_tag(dtype, d, sq, sk, causal, 4, hk)))
    return cases


def _seqlen_cases():
    """Every seqlen pair at three (dtype, head_dim) points, causal and not; largest at two only."""
    cases = []
    for sq, sk in SEQLENS:
        large = (sq, sk) in LARGE
        points = (("bfloat16", 128), ("float32", 64)) if large else (("bfloat16", 128), ("float32", 64), ("float16", 256))
        b, h, hk = (1, 2, 1) if large else (2, 2, 2)
        for (dtype, d), causal in itertools.product(points, (False, True)):
            cases.append(pytest.param(dtype, b, sq, sk, h, hk, d, causal, None, id=_tag(dtype, d, sq, sk, causal, h, hk)))
    return cases


def _inputs(gpu, key, dtype, b, sq, sk, h, hk, d):
    rs = gpu.rng(key)
    return (gpu.randn(rs, (b, sq, h, d), dtype), gpu.randn(rs, (b, sk, hk, d), dtype),
            gpu.randn(rs, (b, sk, hk, d), dtype), gpu.randn(rs, (b, sq, h, d), dtype))


def _run_case(gpu, dtype, b, sq, sk, h, hk, d, causal, scale, **kw):
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, scale)
    q, k, v, do = _inputs(gpu, ctx, dtype, b, sq, sk, h, hk, d)
    return gpu.run(ctx, dtype, q, k, v, do, causal=causal, scale=scale, **kw)


# ------------------------------------------------------------------------------------------------
# Accuracy: the covering design
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,b,sq,sk,h,hk,d,causal,scale", _grid_cases())
def test_dtype_headdim_causal(gpu, dtype, b, sq, sk, h, hk, d, causal, scale):
    _run_case(gpu, dtype, b, sq, sk, h, hk, d, causal, scale)


@pytest.mark.parametrize("dtype,b,sq,sk,h,hk,d,causal,scale", _seqlen_cases())
def test_seqlens(gpu, dtype, b, sq, sk, h, hk, d, causal, scale):
    _run_case(gpu, dtype, b, sq, sk, h, hk, d, causal, scale, deterministic=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hk", [2, 1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(gpu, dtype, hk, causal):
    """nheads 8 over nheads_k 2 (GQA) and 1 (MQA): dk, dv sum over each kv head's group."""
    d = 128 if dtype == "bfloat16" else 64
    _run_case(gpu, dtype, 2, 257, 300, 8, hk, d, causal, None, entry="flash_attn")


@pytest.mark.parametrize("dtype,causal,hk,d", [("bfloat16", True, 2, 96), ("float16", False, 4, 64),
                                               ("float32", True, 1, 128), ("float64", False, 2, 40)])
def test_layout_bhsd(gpu, dtype, causal, hk, d):
    """layout="bhsd": (batch, nheads, seqlen, head_dim) arrays in, the same layout out."""
    b, sq, sk, h = 2, 200, 333, 4
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, layout="bhsd")
    rs = gpu.rng(ctx)
    q, do = gpu.randn(rs, (b, h, sq, d), dtype), gpu.randn(rs, (b, h, sq, d), dtype)
    k, v = gpu.randn(rs, (b, hk, sk, d), dtype), gpu.randn(rs, (b, hk, sk, d), dtype)
    o, _, dq, dk, dv = gpu.run(ctx, dtype, q, k, v, do, causal=causal, layout="bhsd", entry="flash_attn")
    for name, x, ref in (("o", o, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert x.shape == ref.shape, f"{name}: expected bhsd shape {ref.shape}, got {x.shape} [{ctx}]"


@pytest.mark.parametrize("dtype,causal,offset", [("float16", True, 0), ("bfloat16", False, 0), ("float32", True, 0),
                                                 ("float64", False, 0), ("bfloat16", True, 4)],
                         ids=["fp16", "bf16", "fp32", "fp64", "bf16-misaligned"])
def test_strided_inputs(gpu, dtype, causal, offset):
    """Non-contiguous inputs: q and dout sliced out of wider rows (row stride > head_dim), k a
    transposed view (head stride > row stride), v one half of a packed kv array, o passed to the
    backward from a wider buffer. offset=4 moves q's base off 16-byte alignment (copied inside).
    The inputs' memory, padding included, must come out untouched."""
    cp = gpu.cp
    b, sq, sk, h, hk, d = 2, 200, 333, 4, 2, 64
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra=f"strided offset={offset}")
    rs = gpu.rng(ctx)
    q_big = gpu.randn(rs, (b, sq, h, d + 16), dtype)
    k_bhsd = gpu.randn(rs, (b, hk, sk, d), dtype)
    kv = gpu.randn(rs, (b, sk, 2, hk, d), dtype)
    do_big = gpu.randn(rs, (b, sq, h, d + 8), dtype)
    q = q_big[..., offset:offset + d]
    k = k_bhsd.transpose(0, 2, 1, 3)
    v = kv[:, :, 1]
    do = do_big[..., :d]
    assert not any(x.flags.c_contiguous for x in (q, k, v, do))
    snapshot = [x.copy() for x in (q_big, k_bhsd, kv, do_big)]
    o_big = cp.full((b, sq, h, d + 24), math.nan, dtype=gpu.np_dtype(dtype))

    def strided_o(o):
        o_big[..., 8:8 + d] = o
        return o_big[..., 8:8 + d]

    gpu.run(ctx, dtype, q, k, v, do, causal=causal, o_view=strided_o)
    for name, before, after in zip(("q", "k", "kv", "dout"), snapshot, (q_big, k_bhsd, kv, do_big)):
        n = gpu.same_bits(before, after)
        assert n == 0, f"{name}: {n} elements of an input's memory changed [{ctx}]"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlen_k_zero(gpu, dtype, causal):
    """No keys at all: o = 0, lse = -inf, dq = 0, empty dk / dv, no NaN anywhere."""
    b, sq, h, hk, d = 2, 37, 4, 2, 64
    _, _, _, dk, dv = _run_case(gpu, dtype, b, sq, 0, h, hk, d, causal, None)
    ctx = gpu.ctx(dtype, b, sq, 0, h, hk, d, causal)
    assert dk.shape == (b, 0, hk, d) and dv.shape == (b, 0, hk, d), f"dk {dk.shape}, dv {dv.shape} [{ctx}]"


@pytest.mark.parametrize("dtype,sq,sk,d", [("bfloat16", 239, 1, 64), ("float32", 300, 17, 128),
                                           ("float16", 129, 64, 256), ("float64", 70, 3, 32),
                                           ("bfloat16", 1000, 129, 160)])
def test_fully_masked_rows(gpu, dtype, sq, sk, d):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key
    (o = 0, lse = -inf, dq = 0, never NaN); the rest must match the reference."""
    _run_case(gpu, dtype, 2, sq, sk, 4, 2, d, True, None)


# ------------------------------------------------------------------------------------------------
# Reproducibility and races
# ------------------------------------------------------------------------------------------------

REPEAT_CASES = [
    # id, dtype, b, sq, sk, h, hk, d, causal, forward calls, backward calls
    ("bf16-d128-causal-gqa", "bfloat16", 2, 1023, 1024, 4, 2, 128, True, 10, 50),
    ("fp16-d64-full", "float16", 2, 1024, 1023, 4, 4, 64, False, 10, 50),
    ("fp32-d64-causal-mqa", "float32", 2, 513, 1024, 4, 1, 64, True, 10, 50),
    ("fp64-d32-full", "float64", 1, 300, 301, 2, 2, 32, False, 10, 50),
    # Many blocks in flight: a missing barrier or a cross-block dependency shows up as a moving result.
    ("race-b60-bf16-causal", "bfloat16", 60, 257, 257, 2, 2, 64, True, 20, 20),
    ("race-b60-fp16-full-mqa", "float16", 60, 257, 257, 2, 1, 64, False, 20, 20),
    ("race-b60-fp32-causal", "float32", 60, 257, 257, 2, 2, 64, True, 20, 20),
]


@pytest.mark.parametrize("dtype,b,sq,sk,h,hk,d,causal,n_fwd,n_bwd", [pytest.param(*c[1:], id=c[0]) for c in REPEAT_CASES])
def test_bitwise_reproducible(gpu, dtype, b, sq, sk, h, hk, d, causal, n_fwd, n_bwd):
    """The first call is checked against the reference; every later forward (poisoned out=) and
    backward (deterministic=True, poisoned pool) must be bitwise identical to it."""
    cf = gpu.cuflash
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal)
    q, k, v, do = _inputs(gpu, ctx, dtype, b, sq, sk, h, hk, d)
    o0, lse0, dq0, dk0, dv0 = gpu.run(ctx, dtype, q, k, v, do, causal=causal, deterministic=True)
    nbytes = gpu.output_bytes(q, k, 8)
    fails = []
    for i in range(1, n_fwd):
        out = gpu.nan_like(q)
        gpu.poison(nbytes)
        o, lse = cf.flash_attn_forward(q, k, v, causal=causal, backend="cuda", out=out)
        for name, x, x0 in (("o", o, o0), ("lse", lse, lse0)):
            n = gpu.same_bits(x, x0)
            if n:
                fails.append(f"forward call {i + 1}/{n_fwd}: {name} differs from call 1 in {n} of {x.size} elements")
    for i in range(1, n_bwd):
        gpu.poison(nbytes)
        grads = cf.flash_attn_backward(do, q, k, v, o0, lse0, causal=causal, backend="cuda", deterministic=True)
        for name, x, x0 in zip(("dq", "dk", "dv"), grads, (dq0, dk0, dv0)):
            n = gpu.same_bits(x, x0)
            if n:
                fails.append(f"backward call {i + 1}/{n_bwd}: {name} differs from call 1 in {n} of {x.size} elements")
        if len(fails) > 20:
            break
    assert not fails, f"[{ctx}]\n  " + "\n  ".join(fails[:20])


@pytest.mark.parametrize("dtype,b,s,h,d", [("bfloat16", 2, 512, 8, 128), ("bfloat16", 2, 1024, 8, 128),
                                           ("float16", 2, 1024, 8, 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_tile_by_grid(gpu, dtype, b, s, h, d, deterministic):
    """The backward's tile depends on the grid (config._TILES_SMALL_GRID): B=2 H=8 N=512 d=128 takes the small
    tile on a GPU with >= 66 SMs, N=1024 the large one; both judged by the accuracy rule, atomic and ordered."""
    from cuflash import config
    from cuflash.backends import cuda

    main = config.choose_backward(dtype, d, config.LOCAL, key_slabs=b * h, seqlen_k=s, sms=cuda._multiprocessors())[1]
    if cuda._multiprocessors() >= 66 and s == 512:
        assert main.block_n == 64, main
    _run_case(gpu, dtype, b, s, s, h, h, d, True, None, deterministic=deterministic)


# ------------------------------------------------------------------------------------------------
# Compile cache, streams, memory
# ------------------------------------------------------------------------------------------------


def test_compile_cache_reuses_kernels(gpu, monkeypatch):
    """A config's second call reuses the loaded kernel: no new RawModule, the same kernel object."""
    cp = gpu.cp
    from cuflash import _compile, config

    dtype, d, causal = "bfloat16", 64, True
    _run_case(gpu, dtype, 2, 100, 130, 2, 2, d, causal, None)  # first use: compiled or loaded
    n_kernels, n_modules = len(_compile._kernels), len(_compile._modules)
    built = []
    real = cp.RawModule

    def counting_raw_module(*args, **kwargs):
        built.append(kwargs.get("name_expressions"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cp, "RawModule", counting_raw_module)
    _run_case(gpu, dtype, 1, 77, 130, 2, 1, d, causal, None)  # same configs, another shape
    assert not built, f"second call of the same configs built {len(built)} new RawModule(s): {built}"
    assert len(_compile._kernels) == n_kernels, f"kernel cache grew {n_kernels} -> {len(_compile._kernels)}"
    assert len(_compile._modules) == n_modules, f"module cache grew {n_modules} -> {len(_compile._modules)}"
    from cuflash.backends import cuda

    # the first call's configs on this GPU (a small grid: the mma backward's small-grid tile, config._TILES_SMALL_GRID)
    on_this_gpu = {"compute_capability": cuda.compute_capability(), "family": config.forced_family()}
    cfgs = [config.choose_forward(dtype, d, causal, **on_this_gpu),
            *config.choose_backward(dtype, d, causal, key_slabs=2 * 2, seqlen_k=130, sms=cuda._multiprocessors(),
                                    **on_this_gpu)]
    cached = {key[0] for key in _compile._kernels}
    for cfg in cfgs:
        assert cfg in cached, f"{cfg.template_name} not in the kernel cache after use"
        assert _compile.kernel(cfg) is _compile.kernel(cfg), f"{cfg.template_name}: kernel() gave two objects"


def test_cupy_stream_ordering(gpu):
    """Inside `with cupy.cuda.Stream(non_blocking=True)`, launches follow the current stream: inputs
    written on that stream after a long busy kernel, and outputs consumed on it, still give the
    default-stream result bit for bit (a launch on another stream would race both ways)."""
    cp, cf = gpu.cp, gpu.cuflash
    dtype, b, sq, sk, h, hk, d, causal = "bfloat16", 2, 511, 700, 4, 2, 128, True
    ctx = gpu.ctx(dtype, b, sq, sk, h, hk, d, causal, extra="non-blocking stream")
    q, k, v, do = _inputs(gpu, ctx, dtype, b, sq, sk, h, hk, d)
    base = gpu.run(ctx, dtype, q, k, v, do, causal=causal, deterministic=True)  # compared bitwise
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        busy = cp.ones((4096, 4096), dtype=cp.float32)
        for _ in range(4):  # ~tens of ms of work queued ahead of the input copies
            busy = busy @ busy * (1.0 / 4096)
        q2, k2, v2, do2 = (x.copy() for x in (q, k, v, do))
        out = gpu.nan_like(q2)
        o2, lse2 = cf.flash_attn_forward(q2, k2, v2, causal=causal, backend="cuda", out=out)
        grads = cf.flash_attn_backward(do2, q2, k2, v2, o2, lse2, causal=causal, backend="cuda", deterministic=True)
        taken = [x.copy() for x in (o2, lse2, *grads)]  # consumed on the stream, right after
    stream.synchronize()
    fails = []
    for name, x, x0 in zip(("o", "lse", "dq", "dk", "dv"), taken, base):
        n = gpu.same_bits(x, x0)
        if n:
            fails.append(f"{name}: {n} of {x.size} elements differ from the default-stream result")
    assert not fails, f"[{ctx}]\n  " + "\n  ".join(fails)


def _memory_check_module():
    path = Path(__file__).resolve().parents[1] / "bench" / "memory_check.py"
    spec = importlib.util.spec_from_file_location("cuflash_bench_memory_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peak_memory_forward_backward(gpu):
    """B=1, H=8, N=8192, d=128, bf16: what forward + backward allocate above the inputs is within
    10% of o + lse + dq + dk + dv + the workspace (D, the fp32 dQ accumulator, the semaphores): no N x N
    matrix, no input copy."""
    r = _memory_check_module().measure(batch=1, nheads=8, seqlen=8192, head_dim=128, dtype="bfloat16")
    mib = 1 / 2**20
    summary = (f"peak above inputs {r['peak_extra_bytes'] * mib:.2f} MiB, unavoidable {r['unavoidable_bytes'] * mib:.2f} MiB "
               f"(ratio {r['ratio']:.4f}; forward peak {r['peak_forward_extra_bytes'] * mib:.2f} MiB; "
               f"breakdown {r['unavoidable_breakdown']})")
    print(summary)
    assert not r["nan_in_outputs"], f"NaN in outputs; {summary}"
    assert r["peak_extra_bytes"] >= r["outputs_bytes"], (
        f"peak below the outputs' own size: allocations escaped the tracking allocator; {summary}")
    assert r["peak_extra_bytes"] <= 1.10 * r["unavoidable_bytes"], f"more than 10% over the unavoidable; {summary}"
    assert math.isfinite(r["ratio"])
