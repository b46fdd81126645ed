"""The train suite's instrument (cuflash/benchmark/train.py): the attention-kernel classifier, and the GPT
and its training step on the CPU (float32, torch's SDPA).

CPU only: torch (CPU build) is needed for the model tests, which skip without it.
"""

from __future__ import annotations

import contextlib
import math
import time

import pytest

from cuflash.benchmark import train


# ------------------------------------------------------------------------------------------------
# Pure helpers


def test_step_flops():
    p = {"batch": 2, "seqlen": 8, "width": 16, "layers": 3, "vocab": 100, "nheads": 2, "head_dim": 8}
    linear = 6 * 16 * (3 * 12 * 16 * 16 + 16 * 100)
    attn = 3 * int(3.5 * 4 * 2 * 2 * 8 * 8 * 8 / 2)  # fwd 4 B H N^2 d, halved causal; fwd_bwd 3.5x
    assert train.step_flops(p) == linear + attn
    full = {"batch": 4, "seqlen": 4096, "width": 1024, "layers": 12, "vocab": 50304, "nheads": 16, "head_dim": 64}
    assert 20e12 < train.step_flops(full) < 30e12  # ~26 TFLOP a step: ~50-100 ms on an H200


# ------------------------------------------------------------------------------------------------
# The attention-kernel classifier (pure)

ATTENTION_NAMES = [
    # cuflash (kernels_cu/*.cu, config.SOURCES), as CUPTI demangles them
    "void cuflash::flash_fwd<__nv_bfloat16, 64, 128, 64, 4, 1>(cuflash::FwdParams)",
    "void cuflash::flash_bwd_preprocess<__nv_bfloat16, 64, 4, 1>(cuflash::BwdParams)",
    "void cuflash::flash_bwd_dkdv<__nv_bfloat16, 64, 64, 128, 8, 1>(cuflash::BwdParams)",
    "void cuflash::flash_bwd_dq<__nv_bfloat16, 64, 128, 64, 8, 1>(cuflash::BwdParams)",
    "void cuflash::flash_fwd_simt<float, 64, 64, 64, 4, 1>(cuflash::FwdParams)",
    "cuflash::flash_bwd_dkdv_simt<float, 64, 64, 64, 4, 1>",
    # torch's flash backend
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
    "false>(pytorch_flash::Flash_fwd_params)",
    "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, 8, 2, 4, 2, false, "
    "false, cutlass::bfloat16_t> >(pytorch_flash::Flash_bwd_params)",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<...>, true>(...)",
    "void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<...> >(pytorch_flash::Flash_bwd_params)",
    # cuDNN's fused attention, and the memory-efficient backend
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x64_4x1x1_cga1x1x1_kernel0_0",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
    "sm90_fmha_fprop_bf16_128x64",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
]
OTHER_NAMES = [
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, ...)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(...)::{lambda(...)#1}, ...>",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, ...> >(...)",
    "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(...)",
    "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, long>(...)",
    "void at::native::elementwise_kernel<128, 2, ...>",
    "cuflash_bench_spin",  # the timer's spin kernel: its name holds "flash", it is no attention
    "void at::native::(anonymous namespace)::spin_kernel(long)",  # torch.cuda._sleep
    "Memset (Device)",
]


def test_attention_kernel_classifier():
    assert [n for n in ATTENTION_NAMES if not train.is_attention_kernel(n)] == []
    assert [n for n in OTHER_NAMES if train.is_attention_kernel(n)] == []
    assert train.is_attention_kernel("FLASH_FWD") and not train.is_attention_kernel("")


def test_attention_breakdown():
    kernels = [("cuflash::flash_fwd<bf16>", 30.0), ("nvjet_gemm", 100.0), ("cuflash::flash_bwd_dq<bf16>", 50.0),
               ("ln", 20.0)] * 2 + [("x" * 300 + "sdpa", 4.0)]
    b = train.attention_breakdown(kernels, steps=2)
    assert b["attention_share"] == pytest.approx(164 / 404)
    assert b["attention_ms_per_step"] == pytest.approx(0.082) and b["kernel_ms_per_step"] == pytest.approx(0.202)
    assert (b["profiled_steps"], b["kernels_per_step"]) == (2, 4.5)
    assert [x["name"] for x in b["attention_kernels"]] == ["cuflash::flash_bwd_dq<bf16>", "cuflash::flash_fwd<bf16>",
                                                           "x" * train.NAME_CHARS]
    assert b["attention_kernels"][0]["ms_per_step"] == pytest.approx(0.05)
    assert [x["name"] for x in b["other_kernels"]] == ["nvjet_gemm", "ln"]
    none = train.attention_breakdown([], steps=3)
    assert none["attention_share"] is None and none["attention_kernels"] == []


def test_device_kernels_keeps_kernels_only():
    class Ev:
        def __init__(self, name, dev, kind, us):
            self.name, self.activity_type = name, kind
            self.device_type = type("D", (), {"name": dev})()
            self.time_range = type("T", (), {"elapsed_us": lambda self, us=us: us})()

    evs = [Ev("aten::mm", "CPU", "cpu_op", 9.0), Ev("cuflash::flash_fwd", "CUDA", "kernel", 3.0),
           Ev("Memset (Device)", "CUDA", "gpu_memset", 1.0), Ev("nvjet", "CUDA", None, 2.0)]
    assert train.device_kernels(evs) == [("cuflash::flash_fwd", 3.0), ("nvjet", 2.0)]


# ------------------------------------------------------------------------------------------------
# The model on the CPU, float32, torch's SDPA

TINY = train.GPTConfig(vocab=64, seqlen=16, layers=2, width=32, nheads=2)


def manual_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v on (B, N, H, d), materialized."""
    import torch

    d = q.shape[-1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_sdpa_attention_is_causal_attention_in_bshd():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 8, generator=g) for _ in range(3))
    out = train.sdpa_attention(q, k, v)
    assert out.shape == (2, 7, 3, 8)
    assert torch.allclose(out, manual_attention(q, k, v), atol=1e-5)


def test_model_forward_backward_on_the_cpu():
    torch = pytest.importorskip("torch")
    model = train.build_model(TINY, "cpu", seed=0)
    idx, tgt = train.make_batches(TINY, batch=2, n=1, seed=0, period=4)[0]
    seen = []

    def attention(q, k, v):  # the natural layout: (B, N, H, d) views of the qkv projection's output
        seen.append((q.shape, q.stride(), q.data_ptr() - k.data_ptr()))
        return manual_attention(q, k, v)

    loss = train.loss_fn(model, idx, tgt, attention)
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(TINY.vocab)) < 0.3  # GPT-2 init: ~uniform
    w, h, d = TINY.width, TINY.nheads, TINY.head_dim
    assert seen == [((2, 16, h, d), (16 * 3 * w, 3 * w, d, 1), -w * 4)] * TINY.layers
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model["wte"].weight.grad.abs().sum() > 0
    assert not any(n.endswith("bias") and "ln" not in n for n, _ in model.named_parameters())  # Linears: no bias
    # the head is tied: no separate output matrix
    mats = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert len(mats) == 2 + 4 * TINY.layers
    # the same loss through torch's SDPA (the torch-* rows' function)
    assert torch.allclose(train.loss_fn(model, idx, tgt, train.sdpa_attention), loss, atol=1e-5)


def test_model_is_causal():
    torch = pytest.importorskip("torch")
    model = train.build_model(TINY, "cpu", seed=1)
    idx = train.make_batches(TINY, batch=1, n=1, seed=1)[0][0]
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab
    with torch.no_grad():
        a, b = (train.logits(model, x, train.sdpa_attention) for x in (idx, changed))
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])


def test_batches_and_training_steps():
    torch = pytest.importorskip("torch")
    batches = train.make_batches(TINY, batch=2, n=3, seed=5, period=4)
    again = train.make_batches(TINY, batch=2, n=3, seed=5, period=4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    idx, tgt = batches[0]
    assert idx.shape == tgt.shape == (2, 16) and idx.dtype == torch.int64
    assert torch.equal(idx[:, 1:], tgt[:, :-1]) and torch.equal(idx[:, 4:], idx[:, :-4])  # shifted; repeats
    model0 = train.build_model(TINY, "cpu")
    t = train.Trainer(model0, batches, train.sdpa_attention, 1e-2, CpuEnv())
    losses = [t.step().item() for _ in range(15)]
    assert t.steps == 15 and losses[-1] < losses[0] - 0.5 and t.first_loss.item() == losses[0]
    assert t.optimizer.startswith("AdamW")
    assert all(torch.equal(a, b) for a, b in zip(model0.parameters(), train.build_model(TINY).parameters()))


# ------------------------------------------------------------------------------------------------
# A CPU twin of train.CudaEnv


class HostClock:
    """train.CudaEnv's clock, on the host."""

    def event(self):
        return [0.0]

    def record(self, ev):
        ev[0] = time.perf_counter()

    def elapsed_ms(self, a, b):
        return (b[0] - a[0]) * 1e3

    def sync(self):
        pass

    def spin(self, ms):
        pass


class CpuEnv(train.CudaEnv):
    """train.CudaEnv on the CPU: float32 (no autocast), host clock, made-up memory and kernel times."""

    device = "cpu"

    def clock(self):
        return HostClock()

    def sync(self):
        pass

    def autocast(self):
        return contextlib.nullcontext()

    def allocated(self):
        return 100

    def reset_peak(self):
        pass

    def peak(self):
        return 2**30 + 100

    def cupy_pool_bytes(self):
        return None

    def kernels(self, step, steps):
        for _ in range(steps):
            step()
        return [("void cuflash::flash_fwd<__nv_bfloat16, 64>", 25.0), ("nvjet_gemm", 75.0)] * steps
