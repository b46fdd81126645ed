"""What each suite runs, on a GPU and (memory, accuracy) on the CPU.

`suite_params` is pure: the sweep of each suite for the given options, GPU or CPU. `Runner` runs
suites and returns their JSON objects (see report.py for the schema). Every cell that fails is a
row with a status and a reason: one implementation's failure never stops the sweep.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from typing import Callable

from . import SUITES
from .baselines import (
    ACCURACY_ATOL,
    CPU_IMPLS,
    GPU_IMPLS,
    Case,
    CuflashNumpy,
    MaterializedNumpy,
    Unavailable,
    cpu_inputs,
    gpu_impls,
    is_oom,
    short_reason,
)
from .report import add_memory_ratios, add_speedups, make_row, memory_summary, suite_status

ACCURACY_DTYPES = ("float32", "float16", "bfloat16")


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
            return {**base, "dtypes": list(ACCURACY_DTYPES), "modes": ["fwd", "bwd"],
                    "seqlens": list(s.seqlens or ([64, 128] if q else [128, 256, 512])), "repro_repeats": 3}
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
                "seqlen": 2048 if q else 8192, "dtype": base["dtype"], "causal": s.causal, "modes": ["fwd"]}
    if name == "memory":
        return {**base, "modes": ["fwd", "fwd_bwd"],
                "seqlens": list(s.seqlens or ([512, 1024, 2048] if q else [1024, 2048, 4096, 8192, 16384]))}
    if name == "launch":
        return {**base, "modes": ["fwd", "bwd"],
                "seqlens": list(s.seqlens or ([128, 1024] if q else [128, 512, 2048, 8192]))}
    if name == "accuracy":
        return {"batch": s.batch or 1, "nheads": s.heads or 4, "head_dim": s.head_dim or 128, "causal": s.causal,
                "dtypes": list(ACCURACY_DTYPES), "modes": ["fwd", "bwd"],
                "seqlens": list(s.seqlens or ([256, 512] if q else [512, 1024, 2048, 4096, 8192])),
                "repro_repeats": 3 if q else 5}
    if name == "energy":
        n = max(s.seqlens) if s.seqlens else (4096 if q else 16384)
        return {**base, "seqlen": n, "modes": ["fwd"] if q else ["fwd", "fwd_bwd"], "window_s": s.energy_window,
                "idle_window_s": 2.0}
    raise ValueError(f"unknown suite {name!r}")


def cell_count(name: str, p: dict, n_impls: int) -> int:
    """Progress-bar steps of a suite."""
    if name == "headdim":
        return len(p["head_dims"]) * n_impls
    if name == "energy":
        return len(p["modes"]) * n_impls
    if name == "accuracy":
        return len(p["dtypes"]) * (len(p["seqlens"]) + 1)
    if name == "launch":
        return len(p["seqlens"]) * len(p["modes"])
    return len(p["seqlens"]) * n_impls


class Budget:
    """A suite's wall-time cap, and the whole run's deadline (time.perf_counter() value)."""

    def __init__(self, seconds: float, deadline: float = float("inf")):
        self.t0 = time.perf_counter()
        self.end = min(self.t0 + seconds, deadline)

    def expired(self) -> bool:
        return time.perf_counter() > self.end


SKIPPED = "the time budget (--max-suite-seconds / --max-seconds) ran out"


class Runner:
    """Runs suites; `advance(suite, text)` is called once per progress step."""

    def __init__(self, settings: Settings, advance: Callable[[str, str], None] | None = None):
        self.s = settings
        self.advance = advance or (lambda suite, text: None)
        self.notes: list[str] = []
        self.idle_w: float | None = None
        self.nvml = None
        self.nvml_reason = ""
        self.deadline = time.perf_counter() + settings.max_seconds

    # -------------------------------------------------------------------------------------------
    # shared helpers

    def _run_suite(self, name: str, platform: str, fn) -> dict:
        t0 = time.perf_counter()
        params = suite_params(name, self.s, platform)
        out = {"platform": platform, "status": "ok", "reason": None, "params": params, "rows": []}
        try:
            extra = fn(params, Budget(self.s.max_suite_seconds, self.deadline), out["rows"])
            out.update(extra or {})
            out["status"] = suite_status(out["rows"])
            if out["status"] == "skipped" and not out.get("reason"):
                out["reason"] = "nothing ran"
        except Exception as e:  # a bug: keep the other suites, say what broke
            out["status"] = "error"
            out["reason"] = short_reason(e, 500)
            out["traceback"] = traceback.format_exc(limit=8)
        out["seconds"] = time.perf_counter() - t0
        return out

    @staticmethod
    def _free():
        from .memory import free_gpu_caches

        free_gpu_caches()

    def _fail_row(self, case: Case, impl: str, mode: str, e: BaseException, torch_impl: bool) -> dict:
        if is_oom(e):
            return make_row(case.shape(), case.dtype, case.causal, impl, mode, status="OOM",
                            reason=short_reason(e))
        status = "unavailable" if (torch_impl or isinstance(e, Unavailable)) else "error"
        return make_row(case.shape(), case.dtype, case.causal, impl, mode, status=status, reason=short_reason(e))

    # -------------------------------------------------------------------------------------------
    # GPU

    def run_gpu(self) -> dict:
        from .memory import free_gpu_caches

        suites = {}
        order = [n for n in SUITES if n in self.s.suites]
        if "energy" in order:
            self._energy_setup()  # idle power first, before anything has warmed the GPU
        self._precompile(order)
        runners = {"seqlen": self._speed, "headdim": self._speed, "memory": self._memory_gpu,
                   "launch": self._launch, "accuracy": self._accuracy_gpu, "energy": self._energy}
        for name in order:
            fn = runners[name]
            suites[name] = self._run_suite(name, "gpu", lambda p, b, rows, fn=fn, name=name: fn(name, p, b, rows))
            free_gpu_caches()
        if self.nvml is not None:
            self.nvml.close()
        return suites

    def _precompile(self, order: list[str]) -> None:
        """Compile every cuflash kernel config the suites will use, in parallel, before timing."""
        if "cuflash" not in self.s.backends and "accuracy" not in order:
            return
        try:
            import os

            from .. import _compile, config

            cfgs = []
            for name in order:
                p = suite_params(name, self.s, "gpu")
                dtypes = p.get("dtypes") or [p["dtype"]]
                dims = p.get("head_dims") or [p["head_dim"]]
                for dt in dtypes:
                    for d in dims:
                        cfgs.append(config.choose_forward(dt, d, p["causal"]))
                        if name != "headdim":
                            cfgs.extend(config.choose_backward(dt, d, p["causal"]))
            cfgs = list(dict.fromkeys(cfgs))
            t0 = time.perf_counter()
            jobs = max(1, min(len(cfgs), os.cpu_count() or 1))
            _compile.precompile(cfgs, jobs=jobs)
            self.notes.append(f"precompiled {len(cfgs)} cuflash kernel configs in "
                              f"{time.perf_counter() - t0:.1f} s ({jobs} processes)")
        except Exception as e:
            self.notes.append(f"precompile failed, kernels compile at first call instead: {short_reason(e)}")

    def _impls(self):
        return gpu_impls(self.s.backends)

    def _l2_bytes(self) -> int:
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
        except Exception:
            return 60 * 2**20

    def _speed(self, name: str, p: dict, budget: Budget, rows: list) -> dict:
        """seqlen and headdim: device time per call, TFLOP/s, speedups."""
        from .baselines import gpu_inputs
        from .timing import clock, input_sets_for, tflops, time_device

        if name == "seqlen":
            cases = [Case(p["batch"], p["nheads"], n, n, p["head_dim"], p["dtype"], p["causal"]) for n in p["seqlens"]]
        else:
            cases = [Case(p["batch"], h, p["seqlen"], p["seqlen"], d, p["dtype"], p["causal"])
                     for d, h in zip(p["head_dims"], p["nheads"])]
        impls = self._impls()
        notes = {}
        l2 = self._l2_bytes()
        for case in cases:
            n_sets = input_sets_for(max(case.set_bytes(m) for m in p["modes"]), l2)
            sets = None
            for impl in impls:
                label = f"{name} N={case.seqlen_q} d={case.head_dim} {impl.name}"
                ok, why = impl.available()
                for mode in p["modes"]:
                    if budget.expired():
                        rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode,
                                             status="skipped", reason=SKIPPED))
                        continue
                    if not ok:
                        rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode,
                                             status="unavailable", reason=why))
                        continue
                    try:
                        if sets is None:
                            sets = gpu_inputs(case, n_sets, self.s.seed)
                        with impl.context():
                            calls = impl.calls(case, sets, mode)
                            st = time_device(calls, clock(impl.clock), warmup=self.s.warmup, repeats=self.s.repeats,
                                             budget_s=self.s.cell_seconds)
                        del calls
                        fl = case.flops(mode)
                        rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode, **st,
                                             flops=fl, tflops=tflops(fl, st["ms_median"]), n_input_sets=len(sets)))
                        if impl.notes:
                            notes[impl.name] = impl.notes
                    except Exception as e:
                        calls = None
                        rows.append(self._fail_row(case, impl.name, mode, e, impl.clock == "torch"))
                self._free()
                self.advance(name, label)
            sets = None
            self._free()
        add_speedups(rows, "cuflash")
        return {"impl_notes": notes}

    def _memory_gpu(self, name: str, p: dict, budget: Budget, rows: list) -> dict:
        from .baselines import gpu_inputs
        from .memory import gpu_peak, torch_peak

        impls = self._impls()
        for n in p["seqlens"]:
            case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], p["dtype"], p["causal"])
            sets = gpu_inputs(case, 1, self.s.seed)
            for impl in impls:
                ok, why = impl.available()
                for mode in p["modes"]:
                    if budget.expired() or not ok:
                        rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode,
                                             status="skipped" if ok else "unavailable", reason=SKIPPED if ok else why))
                        continue
                    try:
                        with impl.context():
                            fn = impl.calls(case, sets, mode)[0]
                            fn()  # warm: compile, library handles and workspaces stay out of the peak
                            self._free()
                            if impl.memory == "torch":
                                peak, extra = torch_peak(fn), {"allocator": "torch"}
                            else:
                                cpeak, tpeak = gpu_peak(fn)
                                peak = cpeak + tpeak
                                extra = {"allocator": "cupy+torch" if tpeak else "cupy", "cupy_peak_bytes": cpeak,
                                         "torch_peak_bytes": tpeak}
                        del fn
                        rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode, peak_bytes=peak,
                                             **extra))
                    except Exception as e:
                        fn = None
                        rows.append(self._fail_row(case, impl.name, mode, e, impl.clock == "torch"))
                    self._free()
                self.advance(name, f"memory N={n} {impl.name}")
            sets = None
            self._free()
        add_memory_ratios(rows, "cuflash")
        return memory_summary(rows, "cuflash", "conventional")

    def _launch(self, name: str, p: dict, budget: Budget, rows: list) -> dict:
        """Per call: device time vs host enqueue time; the same call replayed from a CUDA graph."""
        import cupy

        from .baselines import CuflashGPU, gpu_inputs
        from .timing import CupyClock, input_sets_for, time_device, time_host

        impl = CuflashGPU()
        ok, why = impl.available()
        l2 = self._l2_bytes()
        clk = CupyClock()
        for n in p["seqlens"]:
            case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], p["dtype"], p["causal"])
            sets = gpu_inputs(case, input_sets_for(case.set_bytes("bwd"), l2), self.s.seed) if ok else None
            for mode in p["modes"]:
                self.advance(name, f"launch N={n} {mode}")
                if budget.expired() or not ok:
                    for im in ("cuflash", "cuflash-graph"):
                        rows.append(make_row(case.shape(), case.dtype, case.causal, im, mode,
                                             status="skipped" if ok else "unavailable", reason=SKIPPED if ok else why))
                    continue
                try:
                    calls = impl.calls(case, sets, mode)
                    dev = time_device(calls, clk, warmup=self.s.warmup, repeats=self.s.repeats,
                                      budget_s=self.s.cell_seconds)
                    host = time_host(calls, clk, warmup=1, runs=dev["n_runs"])
                    dev.pop("host_enqueue_ms_est", None)
                    rows.append(make_row(case.shape(), case.dtype, case.causal, "cuflash", mode, **dev, **host,
                                         host_over_device=host["host_ms_median"] / dev["ms_median"]))
                except Exception as e:
                    calls = None
                    rows.append(self._fail_row(case, "cuflash", mode, e, False))
                    rows.append(make_row(case.shape(), case.dtype, case.causal, "cuflash-graph", mode,
                                         status="skipped", reason="the plain call failed"))
                    continue
                rows.append(self._graph_row(case, mode, calls[0], cupy))
                calls = None
            sets = None
            self._free()
        return {}

    def _graph_row(self, case: Case, mode: str, fn, cupy) -> dict:
        """Capture fn into a CUDA graph on a side stream and time its replay (device and host)."""
        from .timing import CupyClock, time_device, time_host

        stream = cupy.cuda.Stream(non_blocking=True)
        graph = None
        keep = None
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
                replay = [lambda: graph.launch(stream)]
                clk = CupyClock()
                dev = time_device(replay, clk, warmup=self.s.warmup, repeats=self.s.repeats,
                                  budget_s=self.s.cell_seconds)
                host = time_host(replay, clk, warmup=1, runs=dev["n_runs"])
            dev.pop("host_enqueue_ms_est", None)
            row = make_row(case.shape(), case.dtype, case.causal, "cuflash-graph", mode, **dev, **host,
                           host_over_device=host["host_ms_median"] / dev["ms_median"])
        except Exception as e:
            row = make_row(case.shape(), case.dtype, case.causal, "cuflash-graph", mode, status="unavailable",
                           reason=f"CUDA graph capture of the call failed: {short_reason(e)}")
        finally:
            try:
                stream.synchronize()
            except Exception:
                pass
            keep = graph = None  # release the captured outputs
        return row

    def _accuracy_gpu(self, name: str, p: dict, budget: Budget, rows: list) -> dict:
        import cupy

        from .. import reference
        from ..api import flash_attn_backward, flash_attn_forward
        from .baselines import (conventional_backward, conventional_forward, conventional_matmul_mode,
                                gpu_inputs, gpu_to_f64)

        outputs = ("o", "dq", "dk", "dv")
        notes = {}
        for dt in p["dtypes"]:
            mm_mode, note = conventional_matmul_mode(dt)
            notes[dt] = note
            for n in p["seqlens"]:
                self.advance(name, f"accuracy {dt} N={n}")
                case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
                if budget.expired():
                    for impl in ("cuflash", "conventional"):
                        for mode, outs in (("fwd", ["o"]), ("bwd", ["dq", "dk", "dv"])):
                            for o_name in outs:
                                rows.append(make_row(case.shape(), dt, case.causal, impl, mode, status="skipped",
                                                     reason=SKIPPED, output=o_name))
                    continue
                s = gpu_inputs(case, 1, self.s.seed + n)[0]
                kw = dict(causal=case.causal, softmax_scale=case.scale)
                q64, k64, v64, do64 = (gpu_to_f64(x) for x in (s.q, s.k, s.v, s.do))
                ref = {"o": reference.forward(q64, k64, v64, **kw)[0]}
                ref.update(zip(("dq", "dk", "dv"), reference.backward(do64, q64, k64, v64, **kw)))
                del q64, k64, v64, do64
                got: dict[str, dict] = {}
                try:
                    o, lse = flash_attn_forward(s.q, s.k, s.v, backend="cuda", **kw)
                    g = flash_attn_backward(s.do, s.q, s.k, s.v, o, lse, backend="cuda", **kw)
                    got["cuflash"] = dict(zip(outputs, (o, *g)))
                except Exception as e:
                    got["cuflash"] = e
                try:
                    o, pm = conventional_forward(s.q, s.k, s.v, causal=case.causal, scale=case.scale, mode=mm_mode)
                    g = conventional_backward(s.do, s.q, s.k, s.v, pm, scale=case.scale, mode=mm_mode)
                    del pm
                    got["conventional"] = dict(zip(outputs, (o, *g)))
                except Exception as e:
                    got["conventional"] = e
                self._accuracy_rows(rows, case, got, ref, lambda x, r: reference.max_abs_error(gpu_to_f64(x), r))
                del got, ref
                self._free()
            # Bitwise reproducibility over repeated calls, at a mid-sized N.
            self.advance(name, f"accuracy {dt} reproducibility")
            n = p["seqlens"][min(2, len(p["seqlens"]) - 1)]
            case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
            s = gpu_inputs(case, 1, self.s.seed)[0]
            kw = dict(causal=case.causal, softmax_scale=case.scale)
            ckw = dict(causal=case.causal, scale=case.scale, mode=mm_mode)

            def cu_fwd(_):
                return flash_attn_forward(s.q, s.k, s.v, backend="cuda", **kw)

            def cu_bwd(st):
                return flash_attn_backward(s.do, s.q, s.k, s.v, *st, backend="cuda", **kw)

            def cv_fwd(_):
                return conventional_forward(s.q, s.k, s.v, **ckw)

            def cv_bwd(st):
                return conventional_backward(s.do, s.q, s.k, s.v, st[1], scale=case.scale, mode=mm_mode)

            for impl, mode, prep, fn in (("cuflash", "fwd", None, cu_fwd), ("cuflash", "bwd", cu_fwd, cu_bwd),
                                         ("conventional", "fwd", None, cv_fwd),
                                         ("conventional", "bwd", cv_fwd, cv_bwd)):
                try:
                    st = prep(None) if prep else None
                    reps = p["repro_repeats"]
                    first = [cupy.ascontiguousarray(x) for x in fn(st)]
                    equal = True
                    for _ in range(reps - 1):
                        again = [cupy.ascontiguousarray(x) for x in fn(st)]
                        equal &= all(bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))
                                     for a, b in zip(first, again))
                    rows.append(make_row(case.shape(), dt, case.causal, impl, mode, output="all",
                                         bitwise_reproducible=bool(equal), repeats=reps))
                except Exception as e:
                    r = self._fail_row(case, impl, mode, e, False)
                    r["output"] = "all"
                    rows.append(r)
                st = first = again = None
            s = None
            self._free()
        return {"matmul": notes, "atol": {dt: ACCURACY_ATOL[dt] for dt in p["dtypes"]}}

    @staticmethod
    def _accuracy_rows(rows, case: Case, got: dict, ref: dict, err_fn) -> None:
        """One row per (implementation, output); cuflash rows carry the accuracy rule's verdict."""
        new: list[dict] = []
        errs: dict[str, dict[str, float]] = {}
        for impl, res in got.items():
            for o_name in ("o", "dq", "dk", "dv"):
                mode = "fwd" if o_name == "o" else "bwd"
                if isinstance(res, Exception):
                    status = "OOM" if is_oom(res) else "error"
                    new.append(make_row(case.shape(), case.dtype, case.causal, impl, mode, status=status,
                                        reason=short_reason(res), output=o_name))
                    continue
                err = float(err_fn(res[o_name], ref[o_name]))
                errs.setdefault(impl, {})[o_name] = err
                new.append(make_row(case.shape(), case.dtype, case.causal, impl, mode, output=o_name,
                                    max_abs_err=err))
        base_name = "conventional" if "conventional" in got else "materialized-numpy"
        ours_name = "cuflash" if "cuflash" in got else "cuflash-numpy"
        atol = ACCURACY_ATOL[case.dtype]
        for r in new:
            base = errs.get(base_name, {}).get(r["output"])
            if r["implementation"] != ours_name or r["status"] != "ok" or base is None:
                continue
            r["err_ratio_vs_conventional"] = r["max_abs_err"] / base if base > 0 else None
            r["within_rule"] = bool(r["max_abs_err"] <= 2 * base + atol)
            r["atol"] = atol
        rows.extend(new)

    def _energy_setup(self) -> None:
        from .energy import open_nvml

        self.nvml, self.nvml_reason = open_nvml()
        if self.nvml is not None:
            try:
                self.idle_w = self.nvml.idle_watts(suite_params("energy", self.s, "gpu")["idle_window_s"])
            except Exception as e:
                self.nvml_reason = f"idle power could not be read ({short_reason(e)})"
                self.nvml = None

    def _energy(self, name: str, p: dict, budget: Budget, rows: list) -> dict:
        from .baselines import gpu_inputs
        from .timing import clock

        impls = self._impls()
        case = Case(p["batch"], p["nheads"], p["seqlen"], p["seqlen"], p["head_dim"], p["dtype"], p["causal"])
        if self.nvml is None:
            for mode in p["modes"]:
                for impl in impls:
                    rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode,
                                         status="unavailable", reason=self.nvml_reason))
            return {"idle_w": None, "reason": self.nvml_reason}
        sets = gpu_inputs(case, 1, self.s.seed)
        for mode in p["modes"]:
            for impl in impls:
                self.advance(name, f"energy {mode} {impl.name}")
                ok, why = impl.available()
                if budget.expired() or not ok:
                    rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode,
                                         status="skipped" if ok else "unavailable", reason=SKIPPED if ok else why))
                    continue
                try:
                    clk = clock(impl.clock)
                    with impl.context():
                        calls = impl.calls(case, sets, mode)
                        for i in range(self.s.warmup):
                            calls[i % len(calls)]()
                        a, b = clk.event(), clk.event()
                        clk.record(a)
                        calls[0]()
                        clk.record(b)
                        clk.sync()
                        est = clk.elapsed_ms(a, b)
                        res = self.nvml.measure(lambda i: calls[i % len(calls)](), clk.sync, window_s=p["window_s"],
                                                est_ms=est, idle_w=self.idle_w)
                    calls = None
                    rows.append(make_row(case.shape(), case.dtype, case.causal, impl.name, mode, **res))
                except Exception as e:
                    calls = None
                    rows.append(self._fail_row(case, impl.name, mode, e, impl.clock == "torch"))
                self._free()
        return {"idle_w": self.idle_w}

    # -------------------------------------------------------------------------------------------
    # CPU: the NumPy backend against materialized NumPy

    def run_cpu(self) -> dict:
        return {
            "memory": self._run_suite("memory", "cpu", self._memory_cpu),
            "accuracy": self._run_suite("accuracy", "cpu", self._accuracy_cpu),
        }

    def _memory_cpu(self, p: dict, budget: Budget, rows: list) -> dict:
        from .memory import host_peak, tracing

        ours, theirs = CuflashNumpy(), MaterializedNumpy()
        ok, why = ours.available()
        with tracing():
            for n in p["seqlens"]:
                case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], p["dtype"], p["causal"])
                s = cpu_inputs(case, self.s.seed)
                kw = dict(causal=case.causal, scale=case.scale)
                fns = {
                    ("cuflash-numpy", "fwd"): lambda: ours.forward(s.q, s.k, s.v, **kw),
                    ("cuflash-numpy", "fwd_bwd"): lambda: ours.backward(s.do, s.q, s.k, s.v,
                                                                        *ours.forward(s.q, s.k, s.v, **kw), **kw),
                    ("materialized-numpy", "fwd"): lambda: theirs.forward(s.q, s.k, s.v, **kw),
                    ("materialized-numpy", "fwd_bwd"): lambda: theirs.backward(s.do, s.q, s.k, s.v, **kw),
                }
                for impl in CPU_IMPLS:
                    for mode in p["modes"]:
                        if impl == "cuflash-numpy" and not ok:
                            rows.append(make_row(case.shape(), case.dtype, case.causal, impl, mode,
                                                 status="unavailable", reason=why))
                            continue
                        if budget.expired():
                            rows.append(make_row(case.shape(), case.dtype, case.causal, impl, mode,
                                                 status="skipped", reason=SKIPPED))
                            continue
                        try:
                            peak = host_peak(fns[(impl, mode)])
                            rows.append(make_row(case.shape(), case.dtype, case.causal, impl, mode, peak_bytes=peak,
                                                 allocator="tracemalloc"))
                        except Exception as e:
                            rows.append(self._fail_row(case, impl, mode, e, False))
                    self.advance("memory", f"memory N={n} {impl}")
                gc.collect()
        add_memory_ratios(rows, "cuflash-numpy")
        return memory_summary(rows, "cuflash-numpy", "materialized-numpy")

    def _accuracy_cpu(self, p: dict, budget: Budget, rows: list) -> dict:
        import numpy as np

        from .. import reference

        ours, theirs = CuflashNumpy(), MaterializedNumpy()
        for dt in p["dtypes"]:
            for n in p["seqlens"]:
                self.advance("accuracy", f"accuracy {dt} N={n}")
                case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
                if budget.expired():
                    for impl in CPU_IMPLS:
                        for mode, outs in (("fwd", ["o"]), ("bwd", ["dq", "dk", "dv"])):
                            for o_name in outs:
                                rows.append(make_row(case.shape(), dt, case.causal, impl, mode, status="skipped",
                                                     reason=SKIPPED, output=o_name))
                    continue
                s = cpu_inputs(case, self.s.seed + n)
                kw = dict(causal=case.causal, scale=case.scale)
                q64, k64, v64, do64 = (x.astype(np.float64) for x in (s.q, s.k, s.v, s.do))
                rkw = dict(causal=case.causal, softmax_scale=case.scale)
                ref = {"o": reference.forward(q64, k64, v64, **rkw)[0]}
                ref.update(zip(("dq", "dk", "dv"), reference.backward(do64, q64, k64, v64, **rkw)))
                got: dict = {}
                try:
                    o, lse = ours.forward(s.q, s.k, s.v, **kw)
                    got["cuflash-numpy"] = dict(zip(("o", "dq", "dk", "dv"),
                                                    (o, *ours.backward(s.do, s.q, s.k, s.v, o, lse, **kw))))
                except Exception as e:
                    got["cuflash-numpy"] = e
                try:
                    o = theirs.forward(s.q, s.k, s.v, **kw)[0]
                    got["materialized-numpy"] = dict(zip(("o", "dq", "dk", "dv"),
                                                         (o, *theirs.backward(s.do, s.q, s.k, s.v, **kw))))
                except Exception as e:
                    got["materialized-numpy"] = e
                self._accuracy_rows(rows, case, got, ref,
                                    lambda x, r: reference.max_abs_error(np.asarray(x).astype(np.float64), r))
            # Bitwise reproducibility of the NumPy backend.
            self.advance("accuracy", f"accuracy {dt} reproducibility")
            n = p["seqlens"][-1]
            case = Case(p["batch"], p["nheads"], n, n, p["head_dim"], dt, p["causal"])
            s = cpu_inputs(case, self.s.seed)
            kw = dict(causal=case.causal, scale=case.scale)
            try:
                o, lse = ours.forward(s.q, s.k, s.v, **kw)
                for mode, fn in (("fwd", lambda: ours.forward(s.q, s.k, s.v, **kw)),
                                 ("bwd", lambda: ours.backward(s.do, s.q, s.k, s.v, o, lse, **kw))):
                    first = [np.ascontiguousarray(x) for x in fn()]
                    equal = all(all(a.tobytes() == np.ascontiguousarray(b).tobytes() for a, b in zip(first, fn()))
                                for _ in range(p["repro_repeats"] - 1))
                    rows.append(make_row(case.shape(), dt, case.causal, "cuflash-numpy", mode, output="all",
                                         bitwise_reproducible=equal, repeats=p["repro_repeats"]))
            except Exception as e:
                r = self._fail_row(case, "cuflash-numpy", "fwd", e, False)
                r["output"] = "all"
                rows.append(r)
        return {"atol": {dt: ACCURACY_ATOL[dt] for dt in p["dtypes"]}}

