"""What each suite runs, on a GPU and (memory, accuracy) on the CPU (train, decode: GPU only, skipped on the CPU).

`suite_params` and `suite_cases` are pure: the sweep of each suite for the given options, GPU or
CPU. `Runner` runs suites and returns their JSON objects (see report.py for the schema). Every cell
that does not run is a row with a status and a reason: one implementation's failure never stops
the sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import time
import traceback
from typing import Callable

from . import SUITES, decode
from .baselines import (
    ACCURACY_ATOL,
    GPU_IMPLS,
    Case,
    Conventional,
    Cuflash,
    MaterializedNumpy,
    TorchSDPA,
    Unavailable,
    cpu_inputs,
    gpu_impls,
    is_oom,
    same_bits,
    short_reason,
    upcast,
)
from .report import (
    add_host_ratios,
    add_memory_ratios,
    add_speedups,
    make_row,
    memory_summary,
    suite_status,
)
from .timing import MIN_RUNS
from .train import TRAIN_IMPLS

ACCURACY_DTYPES = ("float32", "float16", "bfloat16")
CPU_SUITES = ("memory", "accuracy")
TRAIN_ON_CPU = "it times a torch training step on a CUDA GPU (torch with CUDA); this run is on the CPU"
# no CPU stand-in: on the CPU a suite object says it was skipped, and why
GPU_ONLY = {"train": TRAIN_ON_CPU, "decode": decode.ON_CPU}
# launch: (batch, nheads, seqlen, head_dim) when no --seqlens / --batch / --heads is given
LAUNCH_SHAPES = ((1, 8, 128, 64), (2, 8, 4096, 128), (4, 16, 8192, 128))
OUTPUTS = {"o": "fwd", "dq": "bwd", "dk": "bwd", "dv": "bwd"}  # accuracy: each output and the call giving it
SKIPPED = "the time budget (--max-suite-seconds / --max-seconds) ran out"
# variants: name -> (cuflash keywords, torch SDPA keywords or None where SDPA has no such operation).
# "window-<w>" sees w keys per row (left w, right 0 when causal; w / 2 each side otherwise); "gqa" reads
# nheads / 4 kv heads; "varlen" packs the batch as equal-length sequences. "h" slopes: 2**(-8 (h + 1) / H).
VARIANTS = {
    "plain": ({}, {}),
    "softcap": ({"softcap": 30.0}, None),
    "alibi": ({"alibi_slopes": "h"}, None),
    "dropout": ({"dropout_p": 0.1, "seed": 1}, {"dropout_p": 0.1}),
    "window-1024": ({"window": 1024}, None),
    "window-4096": ({"window": 4096}, None),
    "gqa": ({}, {}),
    "varlen": ({}, None),
}


@dataclasses.dataclass
class Settings:
    suites: tuple[str, ...] = ("seqlen",)
    dtype: str | None = None  # None: bfloat16 on the GPU, float32 on the CPU
    causal: bool = True
    batch: int | None = None
    heads: int | None = None
    head_dim: int | None = None
    seqlens: tuple[int, ...] | None = None
    backends: tuple[str, ...] = GPU_IMPLS
    quick: bool = False
    repeats: int = 20
    warmup: int = 3
    max_suite_seconds: float = 120.0
    max_seconds: float = 300.0  # the whole run, precompile included
    cell_seconds: float = 0.5
    energy_window: float = 2.0
    seed: int = 0
    force_cpu: bool = False
    family: str | None = None  # config.kernel_family for the whole run

    def options(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def suite_params(name: str, s: Settings, platform: str) -> dict:
    """The sweep a suite runs for these settings (pure: no GPU, no imports)."""
    q = s.quick
    if platform == "cpu":
        base = {"batch": s.batch or 1, "nheads": s.heads or 2, "head_dim": s.head_dim or 64, "causal": s.causal}
        if name == "memory":
            return {**base, "dtype": s.dtype or "float32", "modes": ["fwd", "fwd_bwd"],
                    "seqlens": list(s.seqlens or ([128, 256, 512] if q else [128, 256, 512, 1024]))}
        if name == "accuracy":
            seqlens = list(s.seqlens or ([64, 128] if q else [128, 256, 512]))
            return {**base, "dtypes": list(ACCURACY_DTYPES), "modes": ["fwd", "bwd"], "seqlens": seqlens,
                    "repro_repeats": 3, "repro_seqlen": seqlens[-1]}
        raise ValueError(f"suite {name!r} does not run on the CPU")
    base = {"batch": s.batch or 2, "nheads": s.heads or 8, "head_dim": s.head_dim or 128,
            "dtype": s.dtype or "bfloat16", "causal": s.causal}
    if name == "seqlen":
        return {**base, "modes": ["fwd", "bwd", "fwd_bwd"],
                "seqlens": list(s.seqlens or ([512, 2048] if q else [512, 1024, 2048, 4096, 8192, 16384]))}
    if name == "headdim":
        hidden = 1024  # nheads * head_dim, fixed
        dims = [64, 128] if q else [32, 64, 128, 256]
        return {"batch": 1, "hidden": hidden, "head_dims": dims, "nheads": [hidden // d for d in dims],
                "seqlen": 2048 if q else 8192, "dtype": base["dtype"], "causal": s.causal,
                "modes": ["fwd", "bwd", "fwd_bwd"]}
    if name == "memory":
        return {**base, "modes": ["fwd", "fwd_bwd"],
                "seqlens": list(s.seqlens or ([512, 1024, 2048] if q else [1024, 2048, 4096, 8192, 16384]))}
    if name == "launch":
        from .timing import HOST_TIMING

        default = LAUNCH_SHAPES[:2] if q else LAUNCH_SHAPES
        if s.seqlens or s.batch or s.heads:
            shapes = [(base["batch"], base["nheads"], n, base["head_dim"])
                      for n in (s.seqlens or [n for _, _, n, _ in default])]
        else:
            shapes = [(b, h, n, s.head_dim or d) for b, h, n, d in default]
        return {"dtype": base["dtype"], "causal": s.causal, "modes": ["fwd", "bwd"],
                "shapes": [{"batch": b, "nheads": h, "seqlen": n, "head_dim": d} for b, h, n, d in shapes],
                "host_timing": HOST_TIMING}
    if name == "accuracy":
        seqlens = list(s.seqlens or ([256, 512] if q else [512, 1024, 2048, 4096, 8192]))
        return {"batch": s.batch or 1, "nheads": s.heads or 4, "head_dim": s.head_dim or 128, "causal": s.causal,
                "dtypes": list(ACCURACY_DTYPES), "modes": ["fwd", "bwd"], "seqlens": seqlens,
                "repro_repeats": 3 if q else 5, "repro_seqlen": seqlens[min(2, len(seqlens) - 1)]}
    if name == "energy":
        n = max(s.seqlens) if s.seqlens else (4096 if q else 16384)
        return {**base, "seqlen": n, "modes": ["fwd"] if q else ["fwd", "fwd_bwd"], "window_s": s.energy_window,
                "idle_window_s": 2.0}
    if name == "variants":
        return {**base, "seqlen": max(s.seqlens) if s.seqlens else (2048 if q else 8192), "modes": ["fwd", "fwd_bwd"],
                "variants": list(VARIANTS)}
    if name == "train":
        return train_params(s)
    if name == "decode":
        return decode.params(s)
    raise ValueError(f"unknown suite {name!r}")


def train_params(s: Settings) -> dict:
    """The train suite's GPT and run (pure). Default: 12 layers, width 1024, 16 heads of 64, N 4096, vocab
    50304, batch 4; quick: 2 layers, N 1024, batch 2. --head-dim sets head_dim, --heads nheads (default
    1024 // head_dim: width nheads * head_dim), --batch the batch, --seqlens the sequence (the largest);
    --backends picks among cuflash, torch-flash, torch-cudnn. Always bf16 autocast and causal."""
    q = s.quick
    d = s.head_dim or 64
    h = s.heads or max(1, 1024 // d)
    return {"batch": s.batch or (2 if q else 4), "nheads": h, "head_dim": d, "width": h * d,
            "layers": 2 if q else 12, "seqlen": max(s.seqlens) if s.seqlens else (1024 if q else 4096),
            "vocab": 50304, "dtype": "bfloat16", "causal": True, "modes": ["fwd_bwd"],
            "precision": "bf16 autocast, fp32 parameters (the optimizer's master weights)",
            "optimizer": "AdamW, lr 1e-4 (fused=True where torch supports it)", "lr": 1e-4,
            "data": "4 batches rotated; each sequence a random 256-token segment repeated",
            "warmup_steps": max(1, s.warmup), "timed_steps": max(MIN_RUNS, s.repeats), "profiled_steps": 2 if q else 3,
            "implementations": [i for i in TRAIN_IMPLS if i in s.backends]}


def variant_call(name: str, case: Case) -> tuple[dict, dict | None, int | None, bool]:
    """(cuflash keywords, torch keywords or None, kv heads or None, varlen) of one variants-suite row (pure:
    Cuflash.prepare makes the "h" ALiBi slopes)."""
    kw, torch_kw = (dict(x) if x is not None else None for x in VARIANTS[name])
    if "window" in kw:
        w = kw["window"]
        kw["window"] = (w, 0) if case.causal else (w // 2, w // 2)
    return kw, torch_kw, (case.nheads // 4 if name == "gqa" else None), name == "varlen"


def variant_bits(name: str, case: Case) -> int:
    """The kernels' kVariant of one variants-suite row (pure): the rule a call's arguments go through."""
    from .. import _params

    kw, _, _, varlen = variant_call(name, case)
    return _params.variant(case.causal, True if varlen else None, **kw)


def tiles_visited(name: str, case: Case) -> int:
    """Tiles of S the forward visits for a variants-suite row (the window's prediction of its time), counted on
    plain attention's tiles for every row, so that only the mask changes the count (the variants' own configs
    may tile S otherwise)."""
    from .. import _mask, config

    cfg = config.choose_forward(case.dtype, case.head_dim, variant_bits("plain", case))
    left, right = _mask.effective_window(case.causal, variant_call(name, case)[0].get("window", _mask.NO_WINDOW))
    n = case.seqlen_q
    return sum(hi - lo for lo, hi in (_mask.n_block_range(m, cfg.block_m, cfg.block_n, n, n, left, right)
                                      for m in range(-(-n // cfg.block_m))))


def suite_cases(name: str, p: dict) -> list[Case]:
    """The shapes a suite runs, in order (accuracy: every dtype, then its reproducibility case)."""
    if name == "headdim":
        return [Case(p["batch"], h, p["seqlen"], p["seqlen"], d, p["dtype"], p["causal"])
                for d, h in zip(p["head_dims"], p["nheads"])]
    if name == "launch":
        return [Case(x["batch"], x["nheads"], x["seqlen"], x["seqlen"], x["head_dim"], p["dtype"], p["causal"])
                for x in p["shapes"]]
    if name == "decode":
        return [c.case for c in decode.cells(p)]
    if name in ("energy", "variants", "train"):
        return [Case(p["batch"], p["nheads"], p["seqlen"], p["seqlen"], p["head_dim"], p["dtype"], p["causal"])]
    if name == "accuracy":
        return [Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
                for dt in p["dtypes"] for n in [*p["seqlens"], p["repro_seqlen"]]]
    return [Case(p["batch"], p["nheads"], n, n, p["head_dim"], p["dtype"], p["causal"]) for n in p["seqlens"]]


def cell_count(name: str, p: dict, n_impls: int) -> int:
    """Progress-bar steps of a suite."""
    cases = len(suite_cases(name, p))
    if name == "energy":
        return len(p["modes"]) * n_impls
    if name == "accuracy":
        return cases
    if name == "launch":
        return cases * len(p["modes"])
    if name == "variants":
        return len(p["variants"])
    if name == "train":  # timing, then profiling, each implementation
        return 2 * len(p["implementations"])
    if name == "decode":
        return cases * len(p["implementations"]) * p["rounds"]
    return cases * n_impls


def kernel_configs(s: Settings, names: list[str], compute_capability: int = 0) -> list:
    """Every cuflash kernel config the GPU suites `names` will launch on a GPU of this compute capability,
    without duplicates (pure)."""
    from .. import config

    forward = functools.partial(config.choose_forward, compute_capability=compute_capability, family=s.family)
    backward = functools.partial(config.choose_backward, compute_capability=compute_capability, family=s.family)
    out = []
    for name in names:
        if "cuflash" not in s.backends and name not in ("accuracy", "launch"):
            continue
        p = suite_params(name, s, "gpu")
        if name == "decode":
            out.extend(k for c in decode.cells(p) for k in decode.kernels(c, compute_capability, s.family))
            continue
        for c in suite_cases(name, p):
            for bits in ([variant_bits(v, c) for v in p["variants"]] if name == "variants"
                         else [config.variant_bits(local=c.causal)]):
                out.append(forward(c.dtype, c.head_dim, bits, seqlen_k=c.seqlen_k))
                if set(p["modes"]) - {"fwd"}:
                    out.extend(backward(c.dtype, c.head_dim, bits))
    return list(dict.fromkeys(out))


def suite_names(s: Settings, platform: str) -> list[str]:
    return [n for n in SUITES if n in s.suites] if platform == "gpu" else list(CPU_SUITES)


def total_steps(s: Settings, platform: str, compute_capability: int = 0) -> int:
    """Progress-bar steps of a whole run: every suite's, and one per kernel config to precompile (for a GPU
    of this compute capability)."""
    names = suite_names(s, platform)
    n_impls = len(s.backends) if platform == "gpu" else 2
    steps = sum(cell_count(n, suite_params(n, s, platform), n_impls) for n in names)
    return steps + (len(kernel_configs(s, names, compute_capability)) if platform == "gpu" else 0)


class Budget:
    """A suite's wall-time cap, and the whole run's deadline (time.perf_counter() value)."""

    def __init__(self, seconds: float, deadline: float = float("inf")):
        self.end = min(time.perf_counter() + seconds, deadline)

    def expired(self) -> bool:
        return time.perf_counter() > self.end


# cuflash's GPU implementations: their rows name the kernel family that ran (kernel_family)
CUFLASH_GPU = ("cuflash", "cuflash-cupy", "cuflash-torch", "cuflash-graph")


def kernel_family(case: Case, mode: str, bits: int | None = None) -> str:
    """The kernel family a cuflash GPU cell runs on this GPU: the forward's (fwd), the backward's (bwd), or
    both, "sm90+mma" where they differ (fwd_bwd). bits: its kVariant (default: plain, causal or not)."""
    from .. import config

    bits = config.variant_bits(local=case.causal) if bits is None else bits
    fwd = config.choose_forward(case.dtype, case.head_dim, bits, compute_capability=compute_capability(),
                                family=config.forced_family()).family
    bwd = config.choose_backward(case.dtype, case.head_dim, bits, compute_capability=compute_capability(),
                                 family=config.forced_family())[1].family
    families = {"fwd": [fwd], "bwd": [bwd]}.get(mode, [fwd, bwd])
    return "+".join(dict.fromkeys(families))


def compute_capability() -> int:
    """The current GPU's, or 0 where none can be queried (the kernels' choice is then the mma family's)."""
    from ..backends import cuda

    try:
        return cuda.compute_capability()
    except Exception:
        return 0


def row(case: Case, impl: str, mode: str, **kw) -> dict:
    if impl in CUFLASH_GPU and "family" not in kw:
        kw["family"] = kernel_family(case, mode)
    return make_row(case.shape(), case.dtype, case.causal, impl, mode, **kw)


def blocked(budget: Budget, available: tuple[bool, str] = (True, "")) -> dict | None:
    """Status and reason of a cell that cannot run (implementation unavailable, time budget spent), else None."""
    ok, why = available
    if not ok:
        return {"status": "unavailable", "reason": why}
    if budget.expired():
        return {"status": "skipped", "reason": SKIPPED}
    return None


def fail_row(case: Case, impl: str, mode: str, e: BaseException, **kw) -> dict:
    """A cell that raised: OOM; unavailable (a torch backend refusing the case); else error."""
    if is_oom(e):
        status = "OOM"
    elif isinstance(e, Unavailable) or impl.startswith("torch-"):
        status = "unavailable"
    else:
        status = "error"
    return row(case, impl, mode, status=status, reason=short_reason(e), **kw)


class Runner:
    """Runs suites; `advance(suite, text)` is called as each progress step starts."""

    def __init__(self, settings: Settings, advance: Callable[[str, str], None] | None = None):
        self.s = settings
        self.advance = advance or (lambda suite, text: None)
        self.notes: list[str] = []
        self.idle_w: float | None = None
        self.nvml = None
        self.nvml_reason = ""
        self.deadline = time.perf_counter() + settings.max_seconds
        self.platform = "gpu"
        self.suite = ""

    def run(self, platform: str) -> dict:
        """{suite name: suite object} of every suite this platform runs."""
        from ..config import kernel_family as forced

        with forced(self.s.family):
            return self._run(platform)

    def _run(self, platform: str) -> dict:
        self.platform = platform
        names = suite_names(self.s, platform)
        if platform == "gpu":
            if "energy" in names:
                self._energy_setup()  # idle power first, before anything has warmed the GPU
            self._precompile(names)
        suites = {}
        if platform == "cpu":  # first, so that its line is printed before the CPU suites' tables
            for name in (n for n in SUITES if n in GPU_ONLY and n in self.s.suites):
                suites[name] = {"platform": "cpu", "status": "skipped", "reason": GPU_ONLY[name], "seconds": 0.0,
                                "params": suite_params(name, self.s, "gpu"), "rows": []}
        for name in names:
            fn = self._speed if name in ("seqlen", "headdim") else getattr(self, "_" + name)
            suites[name] = self._run_suite(name, fn)
            self._free()
        if self.nvml is not None:
            self.nvml.close()
        return suites

    # -------------------------------------------------------------------------------------------
    # shared helpers

    def step(self, text: str) -> None:
        self.advance(self.suite, text)

    def _run_suite(self, name: str, fn) -> dict:
        t0 = time.perf_counter()
        self.suite = name
        params = suite_params(name, self.s, self.platform)
        out = {"platform": self.platform, "status": "ok", "reason": None, "params": params, "rows": []}
        try:
            out.update(fn(params, Budget(self.s.max_suite_seconds, self.deadline), out["rows"]) or {})
            out["status"] = suite_status(out["rows"])
            if out["status"] == "skipped" and not out.get("reason"):
                out["reason"] = "nothing ran"
        except Exception as e:  # a bug: keep the other suites, say what broke
            out["status"] = "error"
            out["reason"] = short_reason(e, 500)
            out["traceback"] = traceback.format_exc(limit=8)
        out["seconds"] = time.perf_counter() - t0
        return out

    def _free(self) -> None:
        if self.platform == "gpu":
            from .memory import free_gpu_caches

            free_gpu_caches()
        else:
            gc.collect()

    def _inputs(self, case: Case, n_sets: int = 1, seed: int | None = None) -> list:
        seed = self.s.seed if seed is None else seed
        if self.platform == "cpu":
            return [cpu_inputs(case, seed)]
        from .baselines import gpu_inputs

        return gpu_inputs(case, n_sets, seed)

    def _impls(self) -> list:
        return gpu_impls(self.s.backends) if self.platform == "gpu" else [Cuflash("cuflash-numpy", backend="numpy"), MaterializedNumpy()]

    def _timer(self) -> dict:
        return dict(warmup=self.s.warmup, repeats=self.s.repeats, budget_s=self.s.cell_seconds)

    def _cell(self, rows: list, budget: Budget, case: Case, impl, mode: str, measure: Callable[[], dict],
              available: tuple[bool, str] | None = None) -> None:
        """One row: why the cell did not run, what measure() returned (in impl's context), or how it failed."""
        if nr := blocked(budget, impl.available() if available is None else available):
            rows.append(row(case, impl.name, mode, **nr))
            return
        try:
            with impl.context():
                rows.append(row(case, impl.name, mode, **measure()))
        except Exception as e:
            rows.append(fail_row(case, impl.name, mode, e))
        self._free()

    def _precompile(self, names: list[str]) -> None:
        """Compile every cuflash kernel config the suites will use, in parallel, before timing."""
        cfgs = kernel_configs(self.s, names, compute_capability())
        if not cfgs:
            return
        self.suite = "precompile"

        def done(cfg, k, n):
            self.step(f"{k}/{n} kernel configs ({cfg.label})")

        try:
            from .. import _compile

            t0 = time.perf_counter()
            jobs = max(1, min(len(cfgs), os.cpu_count() or 1))
            _compile.precompile(cfgs, jobs=jobs, progress=done)
            self.notes.append(f"precompiled {len(cfgs)} cuflash kernel configs in "
                              f"{time.perf_counter() - t0:.1f} s ({jobs} processes)")
        except Exception as e:
            self.notes.append(f"precompile failed, kernels compile at first call instead: {short_reason(e)}")

    def _l2_bytes(self) -> int:
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
        except Exception:
            return 60 * 2**20

    # -------------------------------------------------------------------------------------------
    # suites

    def _speed(self, p: dict, budget: Budget, rows: list) -> dict:
        """seqlen and headdim (GPU): device time per call, TFLOP/s, speedups."""
        from .timing import clock, input_sets_for, tflops, time_device

        impls, l2 = self._impls(), self._l2_bytes()
        for case in suite_cases(self.suite, p):
            sets = functools.cache(lambda: self._inputs(case, input_sets_for(
                max(case.set_bytes(m) for m in p["modes"]), l2)))  # made at first use
            for impl in impls:
                self.step(f"{case.label} {impl.name}")
                for mode in p["modes"]:
                    def measure():
                        st = time_device(impl.calls(case, sets(), mode), clock(impl.clock), **self._timer())
                        fl = case.flops(mode)
                        return {**st, "flops": fl, "tflops": tflops(fl, st["ms_median"]), "n_input_sets": len(sets())}

                    self._cell(rows, budget, case, impl, mode, measure)
            sets = None
        add_speedups(rows, "cuflash")
        ran = {r["implementation"] for r in rows if r["status"] == "ok"}
        return {"impl_notes": {i.name: i.notes(p["dtype"]) for i in impls if i.name in ran and i.notes(p["dtype"])}}

    def _memory(self, p: dict, budget: Budget, rows: list) -> dict:
        """Peak memory of one call above its inputs, against N (GPU: allocator pools; CPU: tracemalloc)."""
        from .memory import measure_peak

        impls = self._impls()
        for case in suite_cases("memory", p):
            sets = functools.cache(lambda: self._inputs(case))
            for impl in impls:
                self.step(f"{case.label} {impl.name}")
                for mode in p["modes"]:
                    self._cell(rows, budget, case, impl, mode,
                               lambda: measure_peak(impl.memory, impl.calls(case, sets(), mode)[0]))
            sets = None
        ours, base = ("cuflash", "conventional") if self.platform == "gpu" else ("cuflash-numpy", "materialized-numpy")
        add_memory_ratios(rows, ours)
        return memory_summary(rows, ours, base)

    def _accuracy(self, p: dict, budget: Budget, rows: list) -> dict:
        """Max abs error of every output against float64, cuflash beside materialized attention in the
        input dtype (the accuracy rule); then bitwise reproducibility over repeated calls."""
        gpu = self.platform == "gpu"
        pair = [Cuflash(), Conventional()] if gpu else [Cuflash("cuflash-numpy", backend="numpy"), MaterializedNumpy()]
        for dt in p["dtypes"]:
            for n in p["seqlens"]:
                self.step(f"{dt} N={n}")
                case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
                rows += self._errors(case, pair, budget)
                self._free()
            self.step(f"{dt} reproducibility")
            n = p["repro_seqlen"]
            self._reproducibility(Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"]), pair,
                                  p["repro_repeats"], budget, rows)
        out = {"atol": {dt: ACCURACY_ATOL[dt] for dt in p["dtypes"]}}
        if gpu:
            out["matmul"] = {dt: pair[1].notes(dt)["matmul"] for dt in p["dtypes"]}
        return out

    def _errors(self, case: Case, pair: list, budget: Budget) -> list[dict]:
        """One row per (implementation, output); the first implementation's rows carry the rule's verdict
        against the second's error: max|ours - ref64| <= 2 max|materialized - ref64| + atol."""
        from .. import reference

        if nr := blocked(budget):
            return [row(case, impl.name, mode, output=o, **nr) for impl in pair for o, mode in OUTPUTS.items()]
        try:
            s = self._inputs(case, seed=self.s.seed + case.seqlen_q)[0]
            kw = dict(causal=case.causal, softmax_scale=case.scale)
            q, k, v, do = (upcast(x) for x in (s.q, s.k, s.v, s.do))
            ref = dict(zip(OUTPUTS, (reference.forward(q, k, v, **kw)[0], *reference.backward(do, q, k, v, **kw))))
            del q, k, v, do
        except Exception as e:  # inputs or the float64 reference did not fit
            return [fail_row(case, impl.name, mode, e, output=o) for impl in pair for o, mode in OUTPUTS.items()]
        new: dict[str, list[dict]] = {}
        for impl in pair:
            try:
                state = impl.forward(case, s)
                got = dict(zip(OUTPUTS, (state[0], *impl.backward(case, s, state))))
                new[impl.name] = [row(case, impl.name, mode, output=o,
                                      max_abs_err=float(reference.max_abs_error(upcast(got[o]), ref[o])))
                                  for o, mode in OUTPUTS.items()]
            except Exception as e:
                new[impl.name] = [fail_row(case, impl.name, mode, e, output=o) for o, mode in OUTPUTS.items()]
            state = got = None
        atol = ACCURACY_ATOL[case.dtype]
        for r, b in zip(new[pair[0].name], new[pair[1].name]):
            if r["status"] == "ok" and b["status"] == "ok":
                e, eb = r["max_abs_err"], b["max_abs_err"]
                r.update(err_ratio_vs_conventional=e / eb if eb > 0 else None, within_rule=bool(e <= 2 * eb + atol),
                         atol=atol)
        return new[pair[0].name] + new[pair[1].name]

    def _reproducibility(self, case: Case, pair: list, repeats: int, budget: Budget, rows: list) -> None:
        """Whether repeated calls on the same inputs return the same bits (forward, and backward)."""
        s = None
        for impl in pair:
            for mode in ("fwd", "bwd"):
                if nr := blocked(budget):
                    rows.append(row(case, impl.name, mode, output="all", **nr))
                    continue
                try:
                    s = s or self._inputs(case)
                    fn = impl.calls(case, s, mode)[0]
                    first = fn()
                    same = all(same_bits(first, fn()) for _ in range(repeats - 1))
                    rows.append(row(case, impl.name, mode, output="all", bitwise_reproducible=same, repeats=repeats))
                except Exception as e:
                    rows.append(fail_row(case, impl.name, mode, e, output="all"))
                fn = first = None
        self._free()

    def _launch(self, p: dict, budget: Budget, rows: list) -> dict:
        """Host time per cached call (and device time per call) of cuflash on CuPy and on torch inputs, of
        torch SDPA's flash and cuDNN backends, and of cuflash's call replayed from a CUDA graph. Every row
        goes through timing.time_call; all read the same (B, H, N, d) buffers."""
        from .baselines import bhsd
        from .timing import clock, input_sets_for, time_call

        impls = [Cuflash("cuflash-cupy", layout="bhsd"), Cuflash("cuflash-torch", layout="bhsd", torch_inputs=True)]
        impls += [TorchSDPA(n, layout="bhsd", raw_backward=True) for n in ("torch-flash", "torch-cudnn")
                  if n in self.s.backends]
        l2 = self._l2_bytes()
        for case in suite_cases("launch", p):
            sets = functools.cache(lambda: [bhsd(x) for x in self._inputs(case, input_sets_for(case.set_bytes("bwd"),
                                                                                               l2))])
            for mode in p["modes"]:
                self.step(f"{case.label} {mode}")
                plain = []  # the cuflash-cupy call, for the CUDA-graph row
                for impl in impls:
                    def measure():
                        calls = impl.calls(case, sets(), mode)
                        plain.extend(calls[:1] if impl.name == "cuflash-cupy" else [])
                        return time_call(calls, clock(impl.clock), **self._timer())

                    self._cell(rows, budget, case, impl, mode, measure)
                rows.append(self._graph_row(case, mode, plain[0]) if plain else row(
                    case, "cuflash-graph", mode, status="skipped", reason="the plain cuflash-cupy call did not run"))
                plain = None
            sets = None
            self._free()
        add_host_ratios(rows)
        return {"host_timing": p["host_timing"]}

    def _variants(self, p: dict, budget: Budget, rows: list) -> dict:
        """Each variant's device time against plain attention of the same shape (same implementation), and
        against torch SDPA where it has the same operation (dropout, GQA)."""
        from .timing import clock, input_sets_for, time_device

        (case,) = suite_cases("variants", p)
        sets = self._inputs(case, input_sets_for(case.set_bytes("fwd_bwd"), self._l2_bytes()))
        for name in p["variants"]:
            self.step(name)
            kw, torch_kw, kv_heads, varlen = variant_call(name, case)
            impls = [Cuflash(variant=kw, kv_heads=kv_heads, varlen=varlen)]
            if torch_kw is not None:
                impls += [TorchSDPA(n, variant=torch_kw, kv_heads=kv_heads) for n in ("torch-flash", "torch-cudnn")
                          if n in self.s.backends]
            for impl in impls:
                for mode in p["modes"]:
                    self._cell(rows, budget, case, impl, mode,
                               lambda: time_device(impl.calls(case, sets, mode), clock(impl.clock), **self._timer()))
                    rows[-1].update(variant=name, tiles=tiles_visited(name, case))
                    if impl.name == "cuflash":
                        rows[-1]["family"] = kernel_family(case, mode, variant_bits(name, case))
        for r in rows:  # time over plain attention's, same implementation and mode
            plain = next((x for x in rows if x["variant"] == "plain" and x["implementation"] == r["implementation"]
                          and x["mode"] == r["mode"] and x["status"] == "ok"), None)
            if r["status"] == "ok" and plain:
                r["time_vs_plain"] = r["ms_median"] / plain["ms_median"]
                r["tiles_vs_plain"] = r["tiles"] / plain["tiles"]
        return {}

    def _decode(self, p: dict, budget: Budget, rows: list) -> dict:
        """One query row over a long KV cache: device time and KV read bandwidth of flash_attn_with_kvcache
        (dense and paged caches), of torch SDPA's flash and cuDNN backends on the same values, and of a
        device-to-device copy of as many bytes (the bandwidth reference), cell by cell."""
        from .timing import clock, time_call

        impls = decode.implementations(p["implementations"])
        data = shape = None
        timed = []
        for cell in decode.cells(p):
            if cell.dense != shape:  # the paged cells share their dense cell's values
                data = None
                self._free()
                shape = cell.dense
                data = functools.cache(lambda c=shape: decode.Data(c, self.s.seed))  # made at first use
            for r in range(p["rounds"]):
                for impl in impls:
                    self.step(f"{cell.label} {impl.name} (round {r + 1} of {p['rounds']})")

                    def measure():
                        fns, extra = impl.calls(cell, data())
                        st = time_call(fns, clock(impl.clock), **self._timer())
                        return {**st, **extra, **decode.bandwidth(cell, impl.name, st["ms_median"]),
                                "n_input_sets": 1}

                    self._cell(timed, budget, cell.case, impl, "fwd", measure)
                    timed[-1].update(cell.extra())
                    if impl.name.startswith("cuflash"):
                        timed[-1]["family"] = decode.kernels(cell, compute_capability(), self.s.family)[0].family
        data = None
        rows.extend(decode.median_rounds(timed))
        decode.add_copy_fractions(rows)
        return {}

    def _train(self, p: dict, budget: Budget, rows: list) -> dict:
        """A GPT training step (bf16 autocast, AdamW) with each implementation of attention: step time (CUDA
        events, median of the timed steps), tokens/s, peak memory, the loss after the same steps from the same
        weights on the same batches; then attention kernels' share of the step's device time (torch.profiler).
        Every implementation is timed before any is profiled: a profiler session never precedes a timing."""
        from . import train

        ok, why = train.torch_cuda_status()
        if not ok:
            return {"reason": f"it needs torch with CUDA ({why})"}
        (case,) = suite_cases("train", p)
        env = train.CudaEnv()
        cfg = train.GPTConfig.of(p)
        setup = functools.cache(lambda: (train.build_model(cfg, env.device, self.s.seed),  # at first use
                                         train.make_batches(cfg, p["batch"], 4, env.device, self.s.seed)))
        trainers = {}
        for name in p["implementations"]:
            self.step(f"{name}: {p['warmup_steps']} + 1 + {p['timed_steps']} steps")
            impl = train.implementation(name)

            def measure():
                model0, batches = setup()
                env.sync()
                base = env.allocated()  # the other implementations' models stay out of this one's peak
                t = train.Trainer(model0, batches, impl.fn(), p["lr"], env)
                trainers[name] = (t, impl)
                return train.time_steps(t, p, base)

            self._cell(rows, budget, case, impl, "fwd_bwd", measure)
            if rows[-1]["status"] != "ok":
                trainers.pop(name, None)
                self._free()
        for r in rows:  # profile, in the same order
            self.step(f"{r['implementation']}: profile {p['profiled_steps']} steps")
            t, impl = trainers.pop(r["implementation"], (None, None))
            if t is None:
                continue
            if budget.expired():
                r.update(attention_share=None, profile_reason=SKIPPED)
                continue
            try:
                with impl.context():
                    r.update(train.profile_steps(t, p["profiled_steps"]))
            except Exception as e:
                r.update(attention_share=None, profile_reason=short_reason(e))
            t = None
            self._free()
        setup = None
        add_speedups(rows, "cuflash")
        return {"model": dataclasses.asdict(cfg), "flops_per_step": train.step_flops(p)}

    def _graph_row(self, case: Case, mode: str, fn) -> dict:
        """Capture fn into a CUDA graph on a side stream and time its replay (device and host)."""
        import cupy

        from .timing import CupyClock, time_call

        stream = cupy.cuda.Stream(non_blocking=True)
        graph = keep = None
        try:
            with stream:
                for _ in range(2):  # compile, and leave pool blocks cached on this stream
                    fn()
                stream.synchronize()
                stream.begin_capture()
                try:
                    keep = fn()  # outputs stay alive: the graph writes into their memory
                finally:
                    graph = stream.end_capture()
                graph.upload(stream)
                st = time_call([lambda: graph.launch(stream)], CupyClock(), **self._timer())
            return row(case, "cuflash-graph", mode, **st)
        except Exception as e:
            return row(case, "cuflash-graph", mode, status="unavailable",
                       reason=f"CUDA graph capture of the call failed: {short_reason(e)}")
        finally:
            try:
                stream.synchronize()
            except Exception:
                pass
            keep = graph = None  # noqa: F841  (release the captured outputs)

    def _energy_setup(self) -> None:
        from .energy import open_nvml

        self.nvml, self.nvml_reason = open_nvml()
        if self.nvml is not None:
            try:
                self.idle_w = self.nvml.idle_watts(suite_params("energy", self.s, "gpu")["idle_window_s"])
            except Exception as e:
                self.nvml_reason = f"idle power could not be read ({short_reason(e)})"
                self.nvml = None

    def _energy(self, p: dict, budget: Budget, rows: list) -> dict:
        """Joules per call from NVML's energy counter, above idle power."""
        from .timing import clock

        case = suite_cases("energy", p)[0]
        sets = functools.cache(lambda: self._inputs(case))
        for mode in p["modes"]:
            for impl in self._impls():
                self.step(f"{mode} {impl.name}")

                def measure():
                    clk, calls = clock(impl.clock), impl.calls(case, sets(), mode)
                    for i in range(self.s.warmup):
                        calls[i % len(calls)]()
                    a, b = clk.event(), clk.event()
                    clk.record(a)
                    calls[0]()
                    clk.record(b)
                    clk.sync()
                    return self.nvml.measure(lambda i: calls[i % len(calls)](), clk.sync, window_s=p["window_s"],
                                             est_ms=clk.elapsed_ms(a, b), idle_w=self.idle_w)

                self._cell(rows, budget, case, impl, mode, measure,
                           (False, self.nvml_reason) if self.nvml is None else None)
        return {"idle_w": self.idle_w} if self.nvml is not None else {"idle_w": None, "reason": self.nvml_reason}
