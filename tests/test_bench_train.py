"""The train suite of `cuflash bench`: its parameters, the attention-kernel classifier, the GPT and its
training step on the CPU (float32, torch's SDPA), the suite's GPU code path run on the CPU through a CPU
twin of train.CudaEnv, the skip line without a GPU, and the report table.

CPU only: torch (CPU build) is needed for the model tests, which skip without it.
"""

from __future__ import annotations

import contextlib
import math

import pytest

from cuflash.benchmark import report, train
from cuflash.benchmark.suites import (SKIPPED, Runner, Settings, cell_count, kernel_configs, suite_cases,
                                      suite_params, total_steps)
from cuflash.benchmark.timing import MIN_RUNS
from test_bench_cli import FakeClock, document_and_text, run_without_a_gpu


# ------------------------------------------------------------------------------------------------
# Parameters (pure)


def test_train_params_full_and_quick():
    p = suite_params("train", Settings(suites=("train",)), "gpu")
    assert (p["layers"], p["width"], p["nheads"], p["head_dim"], p["seqlen"], p["vocab"], p["batch"]) == \
        (12, 1024, 16, 64, 4096, 50304, 4)
    assert (p["dtype"], p["causal"], p["modes"], p["lr"]) == ("bfloat16", True, ["fwd_bwd"], 1e-4)
    assert "autocast" in p["precision"] and "AdamW" in p["optimizer"]
    assert p["implementations"] == ["cuflash", "torch-flash", "torch-cudnn"]
    assert (p["warmup_steps"], p["timed_steps"], p["profiled_steps"]) == (3, 20, 3)
    q = suite_params("train", Settings(quick=True, repeats=10, warmup=2), "gpu")
    assert (q["layers"], q["seqlen"], q["batch"], q["width"], q["nheads"]) == (2, 1024, 2, 1024, 16)
    assert (q["warmup_steps"], q["timed_steps"], q["profiled_steps"]) == (2, 10, 2)
    assert suite_params("train", Settings(repeats=3), "gpu")["timed_steps"] == MIN_RUNS
    (case,) = suite_cases("train", p)
    assert (case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.head_dim, case.dtype, case.causal) == \
        (4, 16, 4096, 4096, 64, "bfloat16", True)
    assert cell_count("train", p, 6) == 6  # timing and profiling, per implementation


def test_train_params_follow_the_options():
    def tp(**kw):
        p = suite_params("train", Settings(**kw), "gpu")
        return p["batch"], p["nheads"], p["head_dim"], p["width"], p["seqlen"]

    assert tp(head_dim=128) == (4, 8, 128, 1024, 4096)  # width stays 1024
    assert tp(heads=8) == (4, 8, 64, 512, 4096)
    assert tp(batch=1, seqlens=(2048, 8192)) == (1, 16, 64, 1024, 8192)  # the largest N
    assert tp(dtype="float32", causal=False)[:1] == (4,)
    p = suite_params("train", Settings(dtype="float32", causal=False), "gpu")
    assert (p["dtype"], p["causal"]) == ("bfloat16", True)  # a GPT: bf16 autocast, causal
    p = suite_params("train", Settings(backends=("cuflash", "conventional", "torch-cudnn")), "gpu")
    assert p["implementations"] == ["cuflash", "torch-cudnn"]
    assert cell_count("train", p, 3) == 4
    with pytest.raises(ValueError):
        suite_params("train", Settings(), "cpu")


def test_train_precompiles_the_kernels_cuflash_runs():
    cfgs = kernel_configs(Settings(suites=("train",)), ["train"])
    assert {c.kernel for c in cfgs} == {"flash_fwd", "flash_bwd_preprocess", "flash_bwd", "flash_bwd_postprocess"}
    assert {c.dtype for c in cfgs} == {"bfloat16"} and {c.head_dim for c in cfgs} - {0} == {64}
    assert kernel_configs(Settings(suites=("train",), backends=("torch-flash",)), ["train"]) == []


def test_step_flops():
    p = {"batch": 2, "seqlen": 8, "width": 16, "layers": 3, "vocab": 100, "nheads": 2, "head_dim": 8}
    linear = 6 * 16 * (3 * 12 * 16 * 16 + 16 * 100)
    attn = 3 * int(3.5 * 4 * 2 * 2 * 8 * 8 * 8 / 2)  # fwd 4 B H N^2 d, halved causal; fwd_bwd 3.5x
    assert train.step_flops(p) == linear + attn
    full = suite_params("train", Settings(), "gpu")
    assert 20e12 < train.step_flops(full) < 30e12  # ~26 TFLOP a step: ~50-100 ms on an H200


# ------------------------------------------------------------------------------------------------
# The attention-kernel classifier (pure)

ATTENTION_NAMES = [
    # cuflash (kernels_cu/*.cu, config.SOURCES), as CUPTI demangles them
    "void cuflash::flash_fwd<__nv_bfloat16, 64, 128, 64, 4, 1>(cuflash::FwdParams)",
    "void cuflash::flash_bwd_preprocess<__nv_bfloat16, 64, 16, 1>(cuflash::BwdParams)",
    "void cuflash::flash_bwd<__nv_bfloat16, 64, 128, 128, 8, 1>(cuflash::BwdParams)",
    "void cuflash::flash_bwd_postprocess<__nv_bfloat16, 64, 16, 0>(cuflash::BwdParams)",
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
    kernels = [("cuflash::flash_fwd<bf16>", 30.0), ("nvjet_gemm", 100.0), ("cuflash::flash_bwd<bf16>", 50.0),
               ("ln", 20.0)] * 2 + [("x" * 300 + "sdpa", 4.0)]
    b = train.attention_breakdown(kernels, steps=2)
    assert b["attention_share"] == pytest.approx(164 / 404)
    assert b["attention_ms_per_step"] == pytest.approx(0.082) and b["kernel_ms_per_step"] == pytest.approx(0.202)
    assert (b["profiled_steps"], b["kernels_per_step"]) == (2, 4.5)
    assert [x["name"] for x in b["attention_kernels"]] == ["cuflash::flash_bwd<bf16>", "cuflash::flash_fwd<bf16>",
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
# The suite's GPU code path, run on the CPU


class CpuEnv(train.CudaEnv):
    """train.CudaEnv on the CPU: float32 (no autocast), host clock, made-up memory and kernel times."""

    device = "cpu"

    def clock(self):
        return FakeClock()

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


def cpu_impl(name):
    return train.Attention(name, lambda: train.sdpa_attention, lambda: (True, ""))


@pytest.fixture
def on_cpu(monkeypatch):
    pytest.importorskip("torch")
    from cuflash import _compile
    from cuflash.benchmark import memory

    monkeypatch.setattr(train, "torch_cuda_status", lambda: (True, ""))
    monkeypatch.setattr(train, "CudaEnv", CpuEnv)
    monkeypatch.setattr(train, "implementation", cpu_impl)
    monkeypatch.setattr(memory, "free_gpu_caches", lambda: None)
    monkeypatch.setattr(_compile, "precompile", lambda cfgs, jobs, progress: None)


def small(**kw):
    return Settings(suites=("train",), quick=True, seqlens=(32,), batch=2, heads=2, head_dim=8, repeats=10,
                    warmup=2, **kw)


def test_train_suite_on_the_cpu(on_cpu):
    steps = []
    s = small()
    runner = Runner(s, advance=lambda suite, text: steps.append((suite, text)))
    out = runner.run("gpu")
    suite = out["train"]
    assert suite["status"] == "ok", suite.get("traceback")
    assert [x for x, _ in steps] == ["train"] * 6  # precompile (a no-op here) steps none
    assert total_steps(s, "gpu") == 6 + len(kernel_configs(s, ["train"]))
    assert suite["model"] == {"vocab": 50304, "seqlen": 32, "layers": 2, "width": 16, "nheads": 2}
    rows = suite["rows"]
    assert [r["implementation"] for r in rows] == ["cuflash", "torch-flash", "torch-cudnn"]
    assert [r["family"] for r in rows] == ["mma", "torch-flash", "cudnn"]
    for r in rows:
        assert (r["mode"], r["dtype"], r["causal"], r["n_runs"]) == ("fwd_bwd", "bfloat16", True, 10)
        assert r["steps_run"] == 2 + 1 + 10 and r["ms_min"] <= r["ms_median"] <= r["ms_max"]
        assert r["tokens_per_s"] == pytest.approx(64 / (r["ms_median"] * 1e-3))
        assert r["peak_bytes"] == r["torch_peak_bytes"] == 2**30 and r["cupy_pool_bytes"] is None
        assert r["attention_share"] == pytest.approx(0.25) and r["profiled_steps"] == 2
        assert r["attention_kernels"][0]["name"].startswith("void cuflash::flash_fwd")
        assert r["flops"] == train.step_flops(suite["params"]) and r["tflops"] > 0
    # the same weights, batches and steps (and here the same attention): the same loss
    assert len({r["loss"] for r in rows}) == 1 and len({r["loss_first_step"] for r in rows}) == 1
    assert rows[0]["loss"] < rows[0]["loss_first_step"]
    assert set(rows[0]) >= {"speedup_vs_torch-flash", "speedup_vs_torch-cudnn"} and "cuflash_speedup" in rows[1]
    doc, text = document_and_text(s, out)
    assert "train (gpu, ok" in text and "GPT training step" in text and "cuflash (mma)" in text
    assert "torch-cudnn (cudnn)" in text and "25.0%" in text and "kernels counted as attention" in text
    assert "train: cuflash step" in text


def test_train_suite_unavailable_cuflash_and_budget(on_cpu, monkeypatch):
    spent = Runner(small(max_suite_seconds=0.0)).run("gpu")["train"]
    assert spent["status"] == "partial" and {r["status"] for r in spent["rows"]} == {"skipped"}
    assert {r["reason"] for r in spent["rows"]} == {SKIPPED}

    def no_module():
        raise ModuleNotFoundError("No module named 'cuflash.torch'")

    monkeypatch.setattr(train, "_cuflash_torch", no_module)
    ok, why = train.cuflash_available()
    assert not ok and why == "cuflash.torch is not importable (ModuleNotFoundError: No module named 'cuflash.torch')"
    monkeypatch.setattr(train, "implementation", lambda name: train.Attention(
        name, train.cuflash_attention, train.cuflash_available) if name == "cuflash" else cpu_impl(name))
    out = Runner(small(backends=("cuflash", "torch-flash"))).run("gpu")["train"]
    assert out["status"] == "partial"
    cu, fl = out["rows"]
    assert (cu["status"], cu["family"]) == ("unavailable", "mma") and "cuflash.torch is not importable" in cu["reason"]
    assert fl["status"] == "ok" and "cuflash_speedup" not in fl


def test_train_suite_without_torch_cuda(monkeypatch):
    from cuflash import _compile
    from rich.console import Console

    monkeypatch.setattr(train, "torch_cuda_status", lambda: (False, "torch sees no CUDA device"))
    monkeypatch.setattr(_compile, "precompile", lambda cfgs, jobs, progress: None)
    out = Runner(small()).run("gpu")
    assert out["train"]["status"] == "skipped" and out["train"]["rows"] == []
    assert out["train"]["reason"] == "it needs torch with CUDA (torch sees no CUDA device)"
    console = Console(record=True, width=200)
    report.render(console, out)
    assert console.export_text().strip() == "train (gpu, skipped): it needs torch with CUDA (torch sees no CUDA device)"


def test_cli_skips_train_without_a_gpu(monkeypatch, tmp_path):
    lines, doc = run_without_a_gpu(monkeypatch, "train", tmp_path / "t.json")
    assert lines[1] == ("train (cpu, skipped): it times a torch training step on a CUDA GPU (torch with CUDA); "
                        "this run is on the CPU")
    t = doc["suites"]["train"]
    assert (t["status"], t["rows"], t["params"]["seqlen"]) == ("skipped", [], 64)
    assert set(doc["suites"]) == {"train", "memory", "accuracy"}


# ------------------------------------------------------------------------------------------------
# The report table, from made-up rows


def _train_row(impl, ms, share, **kw):
    shape = {"batch": 4, "nheads": 16, "seqlen_q": 4096, "seqlen_k": 4096, "head_dim": 64}
    if ms is None:
        return report.make_row(shape, "bfloat16", True, impl, "fwd_bwd", **kw)
    return report.make_row(shape, "bfloat16", True, impl, "fwd_bwd", ms_median=ms, ms_min=ms * 0.98,
                            ms_max=ms * 1.05, n_runs=20, tokens_per_s=16384 / (ms * 1e-3), tflops=26e12 / ms / 1e9,
                            peak_bytes=int(21.5 * 2**30), loss=10.8123, attention_share=share,
                            attention_ms_per_step=share * ms if share is not None else None,
                            attention_kernels=[{"name": f"{impl}_flash_kernel", "ms_per_step": share * ms}]
                            if share is not None else [], **kw)


def test_train_table_from_rows():
    from rich.console import Console

    rows = [_train_row("cuflash", 80.0, 0.2), _train_row("torch-flash", 100.0, 0.36),
            _train_row("torch-cudnn", 90.0, 0.29), _train_row("torch-efficient", None, None, status="unavailable",
                                                               reason="not wired")]
    report.add_speedups(rows)
    params = suite_params("train", Settings(), "gpu")
    suites = {"train": {"platform": "gpu", "status": "partial", "reason": None, "seconds": 42.0, "params": params,
                        "rows": rows}}
    doc = report.document(report.make_meta({}, "gpu", None, argv=["cuflash", "bench"]), suites)
    assert report.validate(doc) == []
    t, k, not_run = report.tables("train", suites["train"])
    assert t.header == ["implementation", "step ms", "tokens/s", "TFLOP/s", "attention ms", "attention share",
                        "peak GiB", "loss", "torch-cudnn ms / this", "torch-flash ms / this"]
    assert t.rows[0] == ["cuflash (mma)", "80.0", "204,800", "325", "16.0", "20.0%", "21.50", "10.8123", "1.12",
                         "1.25"]
    assert t.rows[2][-2:] == ["1.00", "1.11"] and t.rows[3][:2] == ["torch-efficient", "unavailable"]
    assert "GPT 12 layers, width 1024, 16 heads of 64, N=4096, vocab 50304, batch 4" in t.caption
    assert k.rows[0] == ["cuflash", "cuflash_flash_kernel", "16.00"]
    assert not_run.rows == [["torch-efficient: unavailable: not wired"]]
    lines = report.summary_lines("train", suites["train"])
    assert lines[0] == ("train: cuflash step 80.0 ms, torch-cudnn 90.0 ms (1.12x); attention 16.0 against 26.1 ms "
                        "per step (20% and 29% of the kernels' time); loss 10.8123 against 10.8123")
    assert lines[1].startswith("train: cuflash step 80.0 ms, torch-flash 100.0 ms (1.25x)")
    console = Console(record=True, width=250)
    report.render(console, suites)
    text = console.export_text()
    assert "train (gpu, partial, 42 s): GPT training step" in text and "torch-efficient: unavailable: not wired" in text
    md = report.markdown(suites)
    assert "| cuflash (mma) | 80.0 | 204,800 | 325 | 16.0 | 20.0% | 21.50 | 10.8123 | 1.12 | 1.25 |" in md
    # a row the profiler did not reach, and the validator's train rules
    rows[1].update(attention_share=None, profile_reason="RuntimeError: CUPTI")
    assert "train: torch-flash not profiled: RuntimeError: CUPTI" in report.summary_lines("train", suites["train"])
    assert report.tables("train", suites["train"])[0].rows[1][4:6] == ["-", "-"]
    rows[0]["attention_share"] = 1.5
    rows[2]["tokens_per_s"] = None
    errs = report.validate(report.document(doc["meta"], suites))
    assert any("attention_share" in e for e in errs) and any("tokens_per_s" in e for e in errs)
