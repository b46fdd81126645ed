"""The train suite's instrument: a small GPT in torch whose attention is pluggable, one training step,
and the share of the step's device time that attention kernels take.

The model: token embedding + learned positions, `layers` pre-LayerNorm blocks (causal self-attention
through a fused qkv Linear and an output Linear; a 4x MLP with GELU), a final LayerNorm, an LM head tied
to the token embedding, cross-entropy. Linears have no bias. `attention(q, k, v)` takes and returns
(batch, seqlen, nheads, head_dim) tensors; q, k, v are views of the qkv projection's output
(`qkv.view(B, N, 3, H, d).unbind(2)`), the layout a GPT produces.

Implementations (the same weights, the same batches, the same number of steps each): "cuflash"
(`cuflash.torch.flash_attn_func(q, k, v, causal=True)`), "torch-flash" and "torch-cudnn"
(F.scaled_dot_product_attention on (B, H, N, d) transposed views, its backend forced by
baselines.TorchSDPA's context).

Pure parts (no torch at import): TRAIN_IMPLS, is_attention_kernel, attention_breakdown, step_flops.
torch is imported inside functions: `cuflash bench` must run without it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from typing import Callable

TRAIN_IMPLS = ("cuflash", "torch-flash", "torch-cudnn")
# A kernel is attention's when its name holds one of these (lower case): cuflash's kernels are
# flash_fwd*, flash_bwd* (config.SOURCES: flash_fwd, flash_bwd_preprocess, flash_bwd, flash_bwd_postprocess and
# the _simt kernels), torch's flash backend's flash_fwd_kernel, flash_bwd_*; cuDNN's fused attention kernels
# carry "cudnn" and "sdpa" (cudnn_generated_fort_native_sdpa_*), the memory-efficient backend's "fmha".
# The model runs cuDNN for attention only, so "cudnn" alone names an attention kernel here.
ATTENTION_MARKS = ("flash", "cudnn", "sdpa", "fmha")
NOT_ATTENTION = ("cuflash_bench_spin",)  # the bench timer's spin kernel (its name holds "flash")
TOP_KERNELS = 5  # kernel names kept per row, by device time
NAME_CHARS = 160  # kernel names are cut to this length in the JSON


# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------


def is_attention_kernel(name: str) -> bool:
    """Whether a device kernel's name (as the profiler reports it, demangled) is an attention kernel."""
    n = name.lower()
    return any(m in n for m in ATTENTION_MARKS) and not any(x in n for x in NOT_ATTENTION)


def _top(times: dict[str, float], steps: int) -> list[dict]:
    best = sorted(times.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return [{"name": k[:NAME_CHARS], "ms_per_step": us / steps / 1e3} for k, us in best]


def attention_breakdown(kernels: list[tuple[str, float]], steps: int) -> dict:
    """Row fields from the device kernels of `steps` profiled steps, [(name, microseconds)]: attention's
    share of the kernels' device time, both per step, and the top attention and other kernels by time."""
    attn: dict[str, float] = {}
    other: dict[str, float] = {}
    for name, us in kernels:
        d = attn if is_attention_kernel(name) else other
        d[name] = d.get(name, 0.0) + float(us)
    a, o = sum(attn.values()), sum(other.values())
    return {"attention_share": a / (a + o) if a + o > 0 else None,
            "attention_ms_per_step": a / steps / 1e3, "kernel_ms_per_step": (a + o) / steps / 1e3,
            "profiled_steps": steps, "kernels_per_step": len(kernels) / steps,
            "attention_kernels": _top(attn, steps), "other_kernels": _top(other, steps)[:3]}


def step_flops(p: dict) -> int:
    """Nominal FLOPs of one training step (forward and backward): 6 per multiply-add weight per token for
    every Linear (qkv, output, MLP, the tied head), and reference.flops of causal attention, fwd_bwd."""
    from .timing import flops

    w, tokens = p["width"], p["batch"] * p["seqlen"]
    linear = 6 * tokens * (p["layers"] * 12 * w * w + w * p["vocab"])
    attn = p["layers"] * flops(p["batch"], p["nheads"], p["seqlen"], p["seqlen"], p["head_dim"], True, "fwd_bwd")
    return int(linear + attn)


# ------------------------------------------------------------------------------------------------
# The model (torch imported here, not at module import)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50304
    seqlen: int = 4096
    layers: int = 12
    width: int = 1024
    nheads: int = 16

    @property
    def head_dim(self) -> int:
        return self.width // self.nheads

    @classmethod
    def of(cls, p: dict) -> "GPTConfig":
        return cls(p["vocab"], p["seqlen"], p["layers"], p["nheads"] * p["head_dim"], p["nheads"])


def build_model(cfg: GPTConfig, device="cpu", seed: int = 0):
    """An nn.ModuleDict of the model's layers (its forward is `logits`), float32, GPT-2's init."""
    import torch
    from torch import nn

    if cfg.width % cfg.nheads:
        raise ValueError(f"width {cfg.width} is not a multiple of nheads {cfg.nheads}")
    torch.manual_seed(seed)
    w = cfg.width
    blocks = nn.ModuleList(nn.ModuleDict({
        "ln1": nn.LayerNorm(w), "qkv": nn.Linear(w, 3 * w, bias=False), "proj": nn.Linear(w, w, bias=False),
        "ln2": nn.LayerNorm(w), "fc": nn.Linear(w, 4 * w, bias=False), "out": nn.Linear(4 * w, w, bias=False),
    }) for _ in range(cfg.layers))
    model = nn.ModuleDict({"wte": nn.Embedding(cfg.vocab, w), "wpe": nn.Embedding(cfg.seqlen, w),
                           "blocks": blocks, "ln_f": nn.LayerNorm(w)})
    for name, prm in model.named_parameters():
        if prm.dim() == 2:  # the residual branches' last Linear scaled by 1 / sqrt(2 layers)
            std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(prm, 0.0, std)
    model.nheads = cfg.nheads  # a plain attribute: read by logits, kept by deepcopy
    return model.to(device)


def logits(model, idx, attention: Callable):
    """(B, N) token ids -> (B, N, vocab) logits; attention(q, k, v) on (B, N, H, d) views of qkv."""
    import torch
    import torch.nn.functional as F

    b, n = idx.shape
    w, h = model["wte"].embedding_dim, model.nheads
    x = model["wte"](idx) + model["wpe"](torch.arange(n, device=idx.device))
    for blk in model["blocks"]:
        qkv = blk["qkv"](blk["ln1"](x))
        q, k, v = qkv.view(b, n, 3, h, w // h).unbind(2)
        x = x + blk["proj"](attention(q, k, v).reshape(b, n, w))
        x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x)), approximate="tanh"))
    return F.linear(model["ln_f"](x), model["wte"].weight)


def loss_fn(model, idx, targets, attention: Callable):
    import torch.nn.functional as F

    out = logits(model, idx, attention)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def make_batches(cfg: GPTConfig, batch: int, n: int, device="cpu", seed: int = 0, period: int = 256) -> list:
    """n (ids, targets) pairs of (batch, seqlen) int64: each sequence a random segment of `period` tokens
    repeated, so that from the second repeat on the next token is a copy attention can learn."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    period = min(period, cfg.seqlen)
    reps = -(-(cfg.seqlen + 1) // period)
    out = []
    for _ in range(n):
        seg = torch.randint(0, cfg.vocab, (batch, period), generator=g)
        t = seg.repeat(1, reps)[:, :cfg.seqlen + 1].to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def sdpa_attention(q, k, v):
    """torch's SDPA on (B, H, N, d) transposed views of bshd q, k, v, causal; the output back as bshd."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def make_optimizer(model, lr: float):
    """AdamW, fused where this torch and device support it (else foreach); and which one it is."""
    import torch

    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True), "AdamW(fused=True)"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(model.parameters(), lr=lr), "AdamW"


# ------------------------------------------------------------------------------------------------
# Implementations of attention
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Attention:
    """One implementation of attention(q, k, v): the Impl interface the Runner's cells use (name,
    available, context) and `fn()`, the function itself (resolved once it is known to be available)."""

    name: str
    fn: Callable[[], Callable]
    available: Callable[[], tuple[bool, str]]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _cuflash_torch():
    import importlib

    return importlib.import_module("..torch", __package__)


def cuflash_available() -> tuple[bool, str]:
    from .baselines import Cuflash, short_reason, torch_cuda

    try:
        mod = _cuflash_torch()
    except Exception as e:
        return False, f"cuflash.torch is not importable ({short_reason(e)})"
    if not hasattr(mod, "flash_attn_func"):
        return False, "cuflash.torch has no flash_attn_func"
    ok, why = torch_cuda()
    return Cuflash().available() if ok else (ok, why)


def cuflash_attention():
    f = _cuflash_torch().flash_attn_func

    def attention(q, k, v):
        return f(q, k, v, causal=True)

    return attention


def implementation(name: str) -> Attention:
    """cuflash through cuflash.torch; torch-flash / torch-cudnn through SDPA under baselines.TorchSDPA's
    backend context (the one mapping of names to SDPBackend members)."""
    if name == "cuflash":
        return Attention(name, cuflash_attention, cuflash_available)
    from .baselines import TorchSDPA

    sdpa = TorchSDPA(name)
    return Attention(name, lambda: sdpa_attention, sdpa.available, sdpa.context)


# ------------------------------------------------------------------------------------------------
# Where it runs: device, autocast, clock, memory counters, profiler
# ------------------------------------------------------------------------------------------------


def torch_cuda_status() -> tuple[bool, str]:
    """(torch can run the model on a CUDA device, why not)."""
    from .baselines import torch_cuda

    return torch_cuda()


class CudaEnv:
    """The GPU the suite runs on, through torch. Tests substitute a CPU twin."""

    device = "cuda"
    amp_dtype = "bfloat16"  # autocast dtype; parameters stay float32 (the optimizer's master weights)

    def clock(self):
        from .timing import TorchClock

        return TorchClock()

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def autocast(self):
        import torch

        return torch.autocast(device_type="cuda", dtype=getattr(torch, self.amp_dtype))

    def allocated(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated())

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated())

    def cupy_pool_bytes(self) -> int | None:
        """Bytes CuPy's pool holds (cuflash's own allocations go there): an upper bound of its peak."""
        import sys

        cupy = sys.modules.get("cupy")
        return int(cupy.get_default_memory_pool().total_bytes()) if cupy is not None else None

    def kernels(self, step: Callable, steps: int) -> list[tuple[str, float]]:
        """[(name, microseconds)] of every device kernel `steps` calls of step() ran (torch.profiler, CUDA
        activity: every kernel in the process, CuPy's launches included)."""
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            self.sync()
        return device_kernels(prof.events())


def device_kernels(events) -> list[tuple[str, float]]:
    """(name, microseconds) of the device kernels among profiler FunctionEvents (memcpy and memset left out)."""
    out = []
    for e in events:
        if getattr(e.device_type, "name", str(e.device_type)) != "CUDA":
            continue
        kind = getattr(e, "activity_type", None)
        if kind and kind != "kernel":
            continue
        out.append((e.name, float(e.time_range.elapsed_us())))
    return out


# ------------------------------------------------------------------------------------------------
# One implementation's run
# ------------------------------------------------------------------------------------------------


class Trainer:
    """A copy of the model, its optimizer, and step(): one training step on the next batch."""

    def __init__(self, model0, batches: list, attention: Callable, lr: float, env):
        self.env = env
        self.model = copy.deepcopy(model0)
        self.model.train()
        self.opt, self.optimizer = make_optimizer(self.model, lr)
        self.batches, self.attention = batches, attention
        self.steps = 0
        self.first_loss = self.last_loss = None

    def step(self):
        idx, tgt = self.batches[self.steps % len(self.batches)]
        with self.env.autocast():
            loss = loss_fn(self.model, idx, tgt, self.attention)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.last_loss = loss.detach()
        if self.first_loss is None:
            self.first_loss = self.last_loss
        return self.last_loss


def time_steps(trainer: Trainer, p: dict, base_bytes: int) -> dict:
    """Warm-up, then `timed_steps` steps each between CUDA events (timing.time_device: behind a spin kernel,
    median of >= MIN_RUNS, no fewer for a slow step: every implementation runs the same steps on the same
    batches, warmup_steps + 1 probe + timed_steps), the peak memory of the last warm-up step on, and the
    loss of the last timed step."""
    from .timing import tflops, time_device

    env = trainer.env
    for _ in range(p["warmup_steps"] - 1):  # time_device runs the last one
        trainer.step()
    env.sync()
    env.reset_peak()
    st = time_device([trainer.step], env.clock(), warmup=1, repeats=p["timed_steps"], budget_s=1e9)
    env.sync()
    torch_peak = max(0, env.peak() - base_bytes)
    pool = env.cupy_pool_bytes()
    tokens = p["batch"] * p["seqlen"]
    fl = step_flops(p)
    return {**st, "tokens_per_s": tokens / (st["ms_median"] * 1e-3) if st["ms_median"] > 0 else None,
            "flops": fl, "tflops": tflops(fl, st["ms_median"]),
            "peak_bytes": torch_peak + (pool or 0), "torch_peak_bytes": torch_peak, "cupy_pool_bytes": pool,
            "loss": float(trainer.last_loss), "loss_first_step": float(trainer.first_loss),
            "steps_run": trainer.steps, "optimizer": trainer.optimizer}


def profile_steps(trainer: Trainer, steps: int) -> dict:
    """attention_breakdown of `steps` more profiled steps."""
    t0 = time.perf_counter()
    kernels = trainer.env.kernels(trainer.step, steps)
    out = attention_breakdown(kernels, steps)
    out["profile_seconds"] = time.perf_counter() - t0
    return out
