"""Results of `cuflash bench`: the JSON document, its validator, ratio columns, and every table.

Tables are built once (`tables`) and printed to the console (`render`, rich) or as Markdown for
bench/RESULTS.md and the README (`markdown`; `python3 -m cuflash.benchmark.report FILE.json`).

JSON schema ("cuflash-bench/1")
===============================

Top level::

    {
      "schema": "cuflash-bench/1",
      "meta": {...},
      "suites": {"<suite>": {...}, ...}
    }

meta (all keys present; a value is null where it cannot be known)::

    cuflash_version   str
    git_commit        str | null     `git rev-parse HEAD` of the checkout cuflash runs from
    date_utc          str            ISO 8601, e.g. "2026-11-20T10:31:02+00:00"
    command           str            the exact command line (shell-quoted argv)
    options           object         every option after parsing (suites, dtype, causal, ...)
    platform          "gpu" | "cpu"  "cpu": no CUDA GPU, NumPy backend vs materialized NumPy
    platform_reason   str | null     why "cpu" (no GPU visible, or --cpu)
    gpu               object | null  name, compute_capability ("9.0"), multiprocessors, l2_bytes,
                                     memory_bytes, driver_version (NVIDIA driver, from NVML),
                                     cuda_driver, cuda_runtime
    versions          object         python, numpy, cupy, torch, ml_dtypes, matplotlib (null if absent); on a
                                     GPU nvrtc (cuda-bindings', the Hopper kernels) and cupy_nvrtc (the rest)
    notes             [str]          anything a reader must know (fallbacks taken, precompile time)

suites[name] (name in seqlen, headdim, memory, launch, accuracy, energy, variants, train, decode)::

    platform   "gpu" | "cpu"
    status     "ok" | "partial" (some rows not ok) | "skipped" | "error"
    reason     str | null
    seconds    float            wall time the suite took
    params     object           the sweep: batch, nheads, head_dim, seqlens, modes, dtypes, ...
    rows       [row]
    plus, per suite: seqlen/headdim: "impl_notes" {impl: {...}} (e.g. how the conventional baseline
                     multiplies: cupy.matmul, or torch.matmul where CuPy has no bf16 matmul);
                     memory: "ratio_by_n" {mode: [{"seqlen", "ratio"}]}, "loglog_slope" {mode: float|null},
                     "ratio_growth" {mode: float|null}, "ratio_of";  accuracy: "matmul" {dtype: note},
                     "atol" {dtype: float};  energy: "idle_w" float|null;  launch: "host_timing" str;
                     train: "model" {vocab, seqlen, layers, width, nheads}, "flops_per_step";
                     "error" suites: "traceback". A suite that cannot run on this platform (train and
                     decode on the CPU, train without torch with CUDA) is "skipped" with no rows and says
                     why in reason.

Every row has these keys (values null where they do not apply)::

    shape            {"batch", "nheads", "seqlen_q", "seqlen_k", "head_dim"} (ints)
    dtype            "bfloat16" | "float16" | "float32" | "float64"
    causal           bool
    implementation   "cuflash", "conventional", "torch-flash", "torch-efficient", "torch-cudnn",
                     "torch-math", "cuflash-cupy", "cuflash-torch", "cuflash-graph" (launch),
                     "copy" (decode), "cuflash-numpy", "materialized-numpy" (cpu)
    family           the kernel family that ran (written on every row; absent from files before it):
                     "mma" (cuflash fp16/bf16, tensor-core mma.sync), "simt" (cuflash fp32/fp64),
                     "numpy" (the NumPy backend), "conventional" (materialized baselines), "memcpy" (the
                     decode suite's copy), or the torch SDPA backend: "torch-flash", "torch-efficient",
                     "cudnn", "torch-math"
    mode             "fwd" | "bwd" | "fwd_bwd"
    status           "ok" | "unavailable" | "OOM" | "skipped" | "error"
    reason           str | null   why not ok
    ms_median, ms_min, ms_max    float | null   device time per call (CUDA events), ms
    tflops           float | null   reference.flops(...) / ms_median

Row keys by suite (on status "ok" rows):

    seqlen, headdim  n_runs (>= 10), n_input_sets (rotated so one pass exceeds 2x the L2), flops,
                     host_enqueue_ms_est; ratio columns: a cuflash row has
                     "speedup_vs_<impl>" = ms_median(impl) / ms_median(cuflash) for every other
                     implementation timed at the same shape, dtype, causal and mode; every other
                     row has "cuflash_speedup" (the same number seen from its side).
    memory           peak_bytes (above the inputs' baseline), allocator ("cupy", "cupy+torch": the sum of
                     cupy_peak_bytes and torch_peak_bytes, "torch", "tracemalloc" on the CPU); a cuflash
                     row has "mem_ratio_vs_<impl>" = peak(impl) / peak(cuflash); other rows
                     "mem_ratio_to_cuflash".
    launch           ms_* = device time per call, host_ms_median / host_ms_min / host_ms_max and
                     host_us_median = host time per cached call (calls back to back behind a spin
                     kernel, no sync between them), n_runs, host_n_runs, host_over_device, method (how).
                     "cuflash-cupy" / "cuflash-torch": cuflash on CuPy arrays / torch tensors;
                     "torch-flash" / "torch-cudnn": SDPA forward, and backward through the aten op
                     with the saved forward outputs; "cuflash-graph": a CUDA-graph replay of the
                     cuflash-cupy call. cuflash-cupy / cuflash-torch rows have
                     "host_ratio_vs_<torch impl>" = host time of cuflash / host time of torch.
                     params: dtype, causal, modes, shapes [{batch, nheads, seqlen, head_dim}], host_timing.
    accuracy         output ("o" | "dq" | "dk" | "dv"), max_abs_err (vs float64), and on cuflash rows
                     err_ratio_vs_conventional, within_rule (err <= 2 * err(conventional) + atol), atol.
                     Reproducibility rows: output "all", bitwise_reproducible (bool), repeats.
    energy           calls, window_s, ms_per_call, joules_per_call, joules_per_call_above_idle,
                     avg_power_w, avg_power_above_idle_w.
    train            one row per implementation of attention ("cuflash", "torch-flash", "torch-cudnn") in a
                     GPT training step, mode "fwd_bwd", shape = the attention's (B, H, N, N, d), dtype
                     "bfloat16" (autocast). ms_* = step time (CUDA events around each timed step, behind a spin
                     kernel), n_runs (timed steps, >= 10), host_enqueue_ms_est, tokens_per_s, flops (nominal
                     per step: 6 per weight per token for every Linear, reference.flops for attention),
                     tflops, peak_bytes = torch_peak_bytes (max_memory_allocated from the last warm-up step
                     on, above what was allocated before this implementation's model copy) + cupy_pool_bytes (bytes
                     CuPy's pool holds: an upper bound of cuflash's allocations there, null without CuPy),
                     loss (of the last timed step), loss_first_step, steps_run (the same for every row),
                     optimizer; from torch.profiler over profiled_steps more steps: attention_share (device
                     time of attention kernels over all kernels'; null where not profiled, with
                     profile_reason), attention_ms_per_step, kernel_ms_per_step, kernels_per_step,
                     attention_kernels and other_kernels ([{"name", "ms_per_step"}], the top few by time:
                     how train.is_attention_kernel classified them), profile_seconds. The cuflash row has
                     speedup_vs_<impl> = step ms of impl / step ms of cuflash; the others cuflash_speedup.
    decode           one row per (cell, implementation): "cuflash" (flash_attn_with_kvcache, no append),
                     "cuflash-append" (the same after writing one new row per entry: a decoding step),
                     "torch-flash", "torch-cudnn" (SDPA on the same values, dense bhsd), "copy" (a
                     device-to-device cudaMemcpyAsync of the K + V bytes); mode "fwd", shape (B, H, 1, len, d),
                     causal false. Every row: nheads_k, page_size (null: dense), cache ("dense" | "paged <n>"),
                     kv_bytes (2 B len H_kv d itemsize). ok rows: ms_*, n_runs, host_ms_*, host_us_median,
                     host_n_runs, host_over_device, method (timing.time_call), n_input_sets, layout,
                     bytes_per_call (kv_bytes; the copy's 2 x kv_bytes, read and written), tb_per_s =
                     bytes_per_call / ms_median, copy_fraction = tb_per_s / the cell's copy tb_per_s; torch rows
                     gqa ("enable_gqa", "expanded K/V heads ..." with why, or "none (H_kv = H)"); cuflash rows
                     kernel ("flash_decode", or the forward's) and with flash_decode num_splits (the splits
                     num_splits=0 chose on this GPU).
                     params: dtype, causal, seqlen_q, modes, cells [{batch, nheads, nheads_k, seqlen_k, head_dim,
                     page_size}], implementations, method.

A "ok" row of a timing suite (seqlen, headdim, launch) must have numbers with
ms_min <= ms_median <= ms_max and n_runs >= 10. `validate(doc)` checks all of this.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform as _platform
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ..config import DTYPES, TENSOR_CORE_DTYPES
from . import SUITES

SCHEMA = "cuflash-bench/1"
META_KEYS = ("cuflash_version", "git_commit", "date_utc", "command", "options", "platform", "platform_reason",
             "gpu", "versions", "notes")
SUITE_KEYS = ("platform", "status", "reason", "seconds", "params", "rows")
ROW_KEYS = ("shape", "dtype", "causal", "implementation", "mode", "status", "reason",
            "ms_median", "ms_min", "ms_max", "tflops")
SHAPE_KEYS = ("batch", "nheads", "seqlen_q", "seqlen_k", "head_dim")
ROW_STATUS = ("ok", "unavailable", "OOM", "skipped", "error")
SUITE_STATUS = ("ok", "partial", "skipped", "error")
MODES = ("fwd", "bwd", "fwd_bwd")
TIMING_SUITES = ("seqlen", "headdim", "launch", "variants", "decode", "train")


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------


# Kernel family of every implementation but cuflash's GPU ones, whose family depends on the dtype.
FAMILY = {"cuflash-numpy": "numpy", "conventional": "conventional", "materialized-numpy": "conventional",
          "torch-flash": "torch-flash", "torch-efficient": "torch-efficient", "torch-cudnn": "cudnn",
          "torch-math": "torch-math", "copy": "memcpy"}


def family(implementation: str, dtype: str) -> str:
    """The kernel family that runs: cuflash's tensor-core (mma.sync) kernels for 16-bit dtypes, its SIMT
    kernels otherwise; FAMILY for the others."""
    if implementation in FAMILY:
        return FAMILY[implementation]
    if implementation.startswith("cuflash"):
        return "mma" if dtype in TENSOR_CORE_DTYPES else "simt"
    return implementation


def make_row(shape: dict, dtype: str, causal: bool, implementation: str, mode: str, *, status: str = "ok",
             reason: str | None = None, **extra) -> dict:
    row = {"shape": dict(shape), "dtype": dtype, "causal": bool(causal), "implementation": implementation,
           "family": extra.pop("family", None) or family(implementation, dtype),
           "mode": mode, "status": status, "reason": reason,
           "ms_median": None, "ms_min": None, "ms_max": None, "tflops": None}
    row.update(extra)
    return row


def _groups(rows: list[dict]) -> list[list[dict]]:
    """Rows of the same shape, dtype, causal, mode (and accuracy output)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(tuple(r["shape"][k] for k in SHAPE_KEYS), r["dtype"], r["causal"], r["mode"],
                r.get("output"))].append(r)
    return list(groups.values())


def _add_ratios(rows: list[dict], ref: str, key: str, ref_prefix: str, other_key: str) -> None:
    """Per group, the ref row gets <ref_prefix><impl> = row[key] of impl / row[key] of ref; the other
    rows get the same number as <other_key>."""
    for members in _groups(rows):
        base = [r for r in members if r["implementation"] == ref and r["status"] == "ok" and r.get(key)]
        for r in members if base else []:
            if r is not base[0] and r["status"] == "ok" and r.get(key) is not None:
                ratio = r[key] / base[0][key]
                base[0][ref_prefix + r["implementation"]] = ratio
                r[other_key] = ratio


def add_speedups(rows: list[dict], ref: str = "cuflash") -> None:
    """ref rows get speedup_vs_<impl> = ms(impl) / ms(ref); other rows cuflash_speedup."""
    _add_ratios(rows, ref, "ms_median", "speedup_vs_", "cuflash_speedup")


def add_memory_ratios(rows: list[dict], ref: str = "cuflash") -> None:
    """ref rows get mem_ratio_vs_<impl> = peak(impl) / peak(ref); other rows mem_ratio_to_cuflash."""
    _add_ratios(rows, ref, "peak_bytes", "mem_ratio_vs_", "mem_ratio_to_cuflash")


def add_host_ratios(rows: list[dict]) -> None:
    """Launch suite: cuflash-cupy and cuflash-torch rows get host_ratio_vs_<torch impl> = their host time
    per call over torch's (below 1: cuflash's call path costs the host less)."""
    for members in _groups(rows):
        ok = [r for r in members if r["status"] == "ok" and r.get("host_us_median")]
        for r in ok:
            if r["implementation"] in ("cuflash-cupy", "cuflash-torch"):
                for t in ok:
                    if t["implementation"].startswith("torch-"):
                        r[f"host_ratio_vs_{t['implementation']}"] = r["host_us_median"] / t["host_us_median"]


def loglog_slope(xs, ys) -> float | None:
    """Least-squares slope of log(y) against log(x): 0 for a constant ratio, 1 for one growing like N."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def memory_summary(rows: list[dict], ref: str, other: str) -> dict:
    """ratio_by_n, loglog_slope and ratio_growth of peak(other) / peak(ref), per mode."""
    by_n: dict[str, list[dict]] = {}
    slope: dict[str, float | None] = {}
    growth: dict[str, float | None] = {}
    for mode in MODES:
        pts = []
        for r in rows:
            if r["implementation"] == ref and r["mode"] == mode and r.get(f"mem_ratio_vs_{other}"):
                pts.append({"seqlen": r["shape"]["seqlen_q"], "ratio": r[f"mem_ratio_vs_{other}"]})
        if not pts:
            continue
        pts.sort(key=lambda p: p["seqlen"])
        by_n[mode] = pts
        slope[mode] = loglog_slope([p["seqlen"] for p in pts], [p["ratio"] for p in pts])
        growth[mode] = pts[-1]["ratio"] / pts[0]["ratio"] if len(pts) > 1 else None
    return {"ratio_by_n": by_n, "loglog_slope": slope, "ratio_growth": growth, "ratio_of": f"{other} / {ref}"}


def suite_status(rows: list[dict]) -> str:
    if not rows:
        return "skipped"
    if all(r["status"] == "ok" for r in rows):
        return "ok"
    return "partial"


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(doc) -> list[str]:
    """Every way `doc` departs from the schema above (empty list: valid)."""
    errs: list[str] = []
    if not isinstance(doc, dict):
        return ["document is not an object"]
    if doc.get("schema") != SCHEMA:
        errs.append(f"schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        errs.append("meta missing or not an object")
    else:
        errs += [f"meta.{k} missing" for k in META_KEYS if k not in meta]
        if meta.get("platform") not in ("gpu", "cpu"):
            errs.append(f"meta.platform must be 'gpu' or 'cpu', got {meta.get('platform')!r}")
        for k in ("cuflash_version", "date_utc", "command"):
            if k in meta and not isinstance(meta[k], str):
                errs.append(f"meta.{k} must be a string")
        if isinstance(meta.get("date_utc"), str):
            try:
                datetime.datetime.fromisoformat(meta["date_utc"])
            except ValueError:
                errs.append("meta.date_utc is not ISO 8601")
        if "options" in meta and not isinstance(meta["options"], dict):
            errs.append("meta.options must be an object")
        if "notes" in meta and not isinstance(meta["notes"], list):
            errs.append("meta.notes must be a list")
    suites = doc.get("suites")
    if not isinstance(suites, dict):
        return errs + ["suites missing or not an object"]
    for name, suite in suites.items():
        where = f"suites.{name}"
        if name not in SUITES:
            errs.append(f"{where}: unknown suite")
        if not isinstance(suite, dict):
            errs.append(f"{where} is not an object")
            continue
        errs += [f"{where}.{k} missing" for k in SUITE_KEYS if k not in suite]
        if suite.get("status") not in SUITE_STATUS:
            errs.append(f"{where}.status {suite.get('status')!r} not in {SUITE_STATUS}")
        rows = suite.get("rows")
        if not isinstance(rows, list):
            errs.append(f"{where}.rows is not a list")
            continue
        for i, row in enumerate(rows):
            errs += _validate_row(name, f"{where}.rows[{i}]", row)
    return errs


def _validate_row(suite: str, where: str, row) -> list[str]:
    if not isinstance(row, dict):
        return [f"{where} is not an object"]
    errs = [f"{where}.{k} missing" for k in ROW_KEYS if k not in row]
    if errs:
        return errs
    shape = row["shape"]
    if not isinstance(shape, dict) or any(not isinstance(shape.get(k), int) for k in SHAPE_KEYS):
        errs.append(f"{where}.shape must hold ints {SHAPE_KEYS}")
    if row["dtype"] not in DTYPES:
        errs.append(f"{where}.dtype {row['dtype']!r} not in {DTYPES}")
    if not isinstance(row["causal"], bool):
        errs.append(f"{where}.causal must be a bool")
    if not isinstance(row["implementation"], str) or not row["implementation"]:
        errs.append(f"{where}.implementation must be a non-empty string")
    if "family" in row and (not isinstance(row["family"], str) or not row["family"]):
        errs.append(f"{where}.family must be a non-empty string")
    if row["mode"] not in MODES:
        errs.append(f"{where}.mode {row['mode']!r} not in {MODES}")
    if row["status"] not in ROW_STATUS:
        errs.append(f"{where}.status {row['status']!r} not in {ROW_STATUS}")
    elif row["status"] != "ok" and not row["reason"]:
        errs.append(f"{where}: status {row['status']!r} needs a reason")
    for k in ("ms_median", "ms_min", "ms_max", "tflops"):
        if row[k] is not None and not _num(row[k]):
            errs.append(f"{where}.{k} must be a finite number or null")
    ok = row["status"] == "ok"
    if ok and suite in TIMING_SUITES:
        if not all(_num(row[k]) for k in ("ms_median", "ms_min", "ms_max")):
            errs.append(f"{where}: an ok timing row needs ms_median, ms_min, ms_max")
        elif not row["ms_min"] <= row["ms_median"] <= row["ms_max"]:
            errs.append(f"{where}: ms_min <= ms_median <= ms_max does not hold")
        if not isinstance(row.get("n_runs"), int) or row["n_runs"] < 10:
            errs.append(f"{where}.n_runs must be an int >= 10")
    if ok and suite in ("seqlen", "headdim") and not _num(row["tflops"]):
        errs.append(f"{where}.tflops must be a number")
    if ok and suite == "memory" and not (isinstance(row.get("peak_bytes"), int) and row["peak_bytes"] >= 0):
        errs.append(f"{where}.peak_bytes must be a non-negative int")
    if ok and suite == "launch":
        if not all(_num(row.get(k)) for k in ("host_ms_median", "host_ms_min", "host_ms_max")):
            errs.append(f"{where}: a launch row needs host_ms_median, host_ms_min, host_ms_max")
    if ok and suite == "accuracy":
        if "bitwise_reproducible" in row:
            if not isinstance(row["bitwise_reproducible"], bool):
                errs.append(f"{where}.bitwise_reproducible must be a bool")
        elif not _num(row.get("max_abs_err")):
            errs.append(f"{where}.max_abs_err must be a finite number")
    if ok and suite == "energy":
        for k in ("joules_per_call", "joules_per_call_above_idle", "avg_power_above_idle_w", "calls"):
            if not _num(row.get(k)):
                errs.append(f"{where}.{k} must be a number")
    if ok and suite == "decode":
        for k in ("tb_per_s", "kv_bytes", "bytes_per_call"):
            if not (_num(row.get(k)) and row[k] > 0):
                errs.append(f"{where}.{k} must be a positive number")
    if ok and suite == "train":
        if not _num(row.get("tokens_per_s")):
            errs.append(f"{where}.tokens_per_s must be a number")
        if not (isinstance(row.get("peak_bytes"), int) and row["peak_bytes"] >= 0):
            errs.append(f"{where}.peak_bytes must be a non-negative int")
        if row.get("loss") is not None and not _num(row["loss"]):
            errs.append(f"{where}.loss must be a finite number or null")
        share = row.get("attention_share")
        if share is not None and not (_num(share) and 0 <= share <= 1):
            errs.append(f"{where}.attention_share must be a number in [0, 1] or null")
        if not isinstance(row.get("attention_kernels", []), list):
            errs.append(f"{where}.attention_kernels must be a list")
    for k, v in row.items():
        if k.startswith(("speedup_vs_", "mem_ratio_vs_", "host_ratio_vs_")) and not _num(v):
            errs.append(f"{where}.{k} must be a finite number")
    return errs


def check(doc) -> None:
    errs = validate(doc)
    if errs:
        raise ValueError("benchmark JSON does not match the schema:\n  " + "\n  ".join(errs[:20]))


# ------------------------------------------------------------------------------------------------
# Meta and the file
# ------------------------------------------------------------------------------------------------


def _version(mod: str) -> str | None:
    if mod not in sys.modules:
        try:
            __import__(mod)
        except Exception:
            return None
    return getattr(sys.modules[mod], "__version__", None)


def nvrtc_versions() -> dict:
    """The NVRTCs that built the kernels: CuPy's (the mma.sync and SIMT kernels), cuda-bindings' (the Hopper ones).
    Another NVRTC is another binary: its registers, its spills, its speed."""
    from .. import _compile

    out = {"nvrtc": None, "cupy_nvrtc": None}
    major, minor = _compile.nvrtc_version()
    if major:
        out["nvrtc"] = f"{major}.{minor}"
    try:
        import cupy

        out["cupy_nvrtc"] = "{}.{}".format(*cupy.cuda.nvrtc.getVersion())
    except Exception:
        pass
    return out


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except Exception:
        return None
    out = r.stdout.strip()
    return out if r.returncode == 0 and out else None


def gpu_meta() -> dict | None:
    try:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        rt, drv = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
        out = {
            "name": name,
            "compute_capability": f"{props['major']}.{props['minor']}",
            "multiprocessors": int(props["multiProcessorCount"]),
            "l2_bytes": int(props["l2CacheSize"]),
            "memory_bytes": int(props["totalGlobalMem"]),
            "cuda_runtime": f"{rt // 1000}.{rt % 1000 // 10}",
            "cuda_driver": f"{drv // 1000}.{drv % 1000 // 10}",
            "driver_version": None,
        }
    except Exception:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        out["driver_version"] = v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    return out


def make_meta(options: dict, platform: str, platform_reason: str | None, argv: list[str] | None = None,
              notes: list[str] | None = None) -> dict:
    from .. import __version__

    argv = list(sys.argv if argv is None else argv)
    prog = argv.pop(0) if argv else ""
    if prog.endswith("__main__.py"):  # python3 -m <package>
        prog = f"python3 -m {Path(prog).parent.name}"
    else:
        prog = shlex.quote(prog) if prog else ""
    command = " ".join(x for x in (prog, shlex.join(argv)) if x)
    return {
        "cuflash_version": __version__,
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "options": options,
        "platform": platform,
        "platform_reason": platform_reason,
        "gpu": gpu_meta() if platform == "gpu" else None,
        "versions": {"python": _platform.python_version(), "numpy": _version("numpy"), "cupy": _version("cupy"),
                     "torch": _version("torch") if platform == "gpu" else None, "ml_dtypes": _version("ml_dtypes"),
                     "matplotlib": _version("matplotlib"), **(nvrtc_versions() if platform == "gpu" else {})},
        "notes": list(notes or []),
    }


def _clean(x):
    """JSON-safe: NaN/inf -> null, tuples -> lists, numpy scalars -> Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item"):
        return _clean(x.item())
    return str(x)


def document(meta: dict, suites: dict) -> dict:
    return _clean({"schema": SCHEMA, "meta": meta, "suites": suites})


def write_json(doc: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


# ------------------------------------------------------------------------------------------------
# Tables: built once, printed by rich (console) or as Markdown (RESULTS.md, README)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    caption: str = ""
    text_cols: int = 1  # leading columns of text (left-aligned); the others hold numbers


def _fmt(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _bytes(x) -> str:
    if x is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x} B"


def _ok(r: dict | None) -> bool:
    return r is not None and r["status"] == "ok"


def _status(r: dict | None) -> str:
    return "" if r is None else r["status"]


def _family(r: dict) -> str:
    return r.get("family") or family(r["implementation"], r["dtype"])


def _impls(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["implementation"] for r in rows))


def _ours(impls: list[str]) -> str | None:
    return next((i for i in impls if i.startswith("cuflash")), None)


def _head(rows: list[dict], impl: str) -> str:
    """A column header naming an implementation and, where it says more, its kernel families (the forward's and
    the backward's may differ: "cuflash (sm90, mma)")."""
    fams = dict.fromkeys(f for r in rows if r["implementation"] == impl for f in _family(r).split("+"))
    return impl if list(fams) in ([], [impl]) else f"{impl} ({', '.join(fams)})"


def _shape(r: dict) -> tuple:
    s = r["shape"]
    return s["batch"], s["nheads"], s["seqlen_q"], s["head_dim"]


def _caption(rows: list[dict]) -> str:
    shapes = sorted({_shape(r) for r in rows})  # numerically: N=512 before N=1024
    text = ", ".join("x".join(map(str, s)) for s in shapes[:6]) + (" ..." if len(shapes) > 6 else "")
    return f"shapes (B x H x N x d): {text}"


def _cells(rows: list[dict], key) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        out[key(r)][r["implementation"]] = r
    return out


def _speed_tables(name: str, rows: list[dict], title: str, caption: str) -> list[Table]:
    """Per mode: a row per N (or head dim); cuflash's ms and TFLOP/s, each other implementation's
    TFLOP/s and, in brackets, its time over cuflash's (above 1: cuflash is faster)."""
    impls = _impls(rows)
    ours = _ours(impls)
    keys = ["d", "H"] if name == "headdim" else ["N"]
    key = (lambda r: (r["shape"]["head_dim"], r["shape"]["nheads"])) if name == "headdim" else \
        (lambda r: (r["shape"]["seqlen_q"],))
    out = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
        sub = [r for r in rows if r["mode"] == mode]
        header = keys + ([f"{_head(sub, ours)} ms", f"{_head(sub, ours)} TFLOP/s"] if ours else [])
        header += [f"{_head(sub, i)} TFLOP/s (cuflash x)" for i in impls if i != ours]
        t = Table(f"{title}: {mode}", header, text_cols=0,
                  caption=f"{caption}; (cuflash x) = its time over cuflash's, above 1: cuflash is faster")
        cells = _cells(sub, key)
        for k in sorted(cells):
            line = [str(x) for x in k]
            if ours:
                r = cells[k].get(ours)
                line += [_fmt(r["ms_median"], ".3f"), _fmt(r["tflops"], ".0f")] if _ok(r) else [_status(r), ""]
            for i in impls:
                r = cells[k].get(i)
                if i != ours:
                    x = r and r.get("cuflash_speedup")
                    line.append(_status(r) if not _ok(r) else _fmt(r["tflops"], ".0f") + (f" ({x:.2f}x)" if x else ""))
            t.rows.append(line)
        out.append(t)
    return out


def _memory_tables(rows: list[dict], title: str, caption: str) -> list[Table]:
    """Peak bytes above the inputs per (mode, N); other implementations also as a multiple of cuflash's."""
    impls = _impls(rows)
    ours = _ours(impls)
    header = ["mode", "N"] + [f"{_head(rows, i)} peak" + ("" if i == ours else " (x cuflash)") for i in impls]
    t = Table(f"{title}: peak memory above the inputs", header, caption=caption)
    cells = _cells(rows, lambda r: (MODES.index(r["mode"]), r["shape"]["seqlen_q"]))
    for k in sorted(cells):
        line = [MODES[k[0]], str(k[1])]
        for i in impls:
            r = cells[k].get(i)
            x = r and r.get("mem_ratio_to_cuflash")
            line.append(_status(r) if not _ok(r) else _bytes(r["peak_bytes"]) + (f" ({x:.1f}x)" if x else ""))
        t.rows.append(line)
    return [t]


OUTPUTS = ("o", "dq", "dk", "dv")


def _accuracy_tables(rows: list[dict], title: str, caption: str) -> list[Table]:
    """max abs error against float64 per (dtype, output, N): cuflash against the materialized baseline."""
    errs = [r for r in rows if r.get("output") != "all"]
    impls = _impls(errs)
    ours = _ours(impls)
    t = Table(f"{title}: max abs error vs float64", ["dtype", "family", "out", "N", *impls, "ratio", "within rule"],
              caption=caption, text_cols=3)
    cells = _cells(errs, lambda r: (DTYPES.index(r["dtype"]), r["shape"]["seqlen_q"], OUTPUTS.index(r["output"])))
    for k in sorted(cells):
        members = cells[k]
        line = [DTYPES[k[0]], family(ours or "cuflash", DTYPES[k[0]]), OUTPUTS[k[2]], str(k[1])]
        for i in impls:
            r = members.get(i)
            line.append(_fmt(r.get("max_abs_err"), ".2e") if _ok(r) else _status(r))
        r = members.get(ours) or {}
        line += [_fmt(r.get("err_ratio_vs_conventional"), ".2f"), _fmt(r.get("within_rule"))]
        t.rows.append(line)
    out = [t]
    rep = [r for r in rows if r.get("output") == "all"]
    if rep:
        t2 = Table("bitwise reproducibility over repeated calls", ["dtype", "N", "impl", "mode", "result"],
                   text_cols=5)
        for r in rep:
            res = (("identical" if r["bitwise_reproducible"] else "DIFFERS") + f" over {r.get('repeats')} calls") \
                if _ok(r) else f"{r['status']}: {(r['reason'] or '')[:60]}"
            t2.rows.append([r["dtype"], str(r["shape"]["seqlen_q"]), r["implementation"], r["mode"], res])
        out.append(t2)
    return out


def _host_us(r: dict) -> float | None:
    return r.get("host_us_median") or (r["host_ms_median"] * 1e3 if r.get("host_ms_median") else None)


def _launch_tables(rows: list[dict], title: str, caption: str, how: str) -> list[Table]:
    """Host time per cached call side by side, cuflash-torch over each torch SDPA backend, then device time."""
    impls = _impls(rows)
    torch_impls = [i for i in impls if i.startswith("torch-")] if "cuflash-torch" in impls else []
    cells = _cells(rows, lambda r: (_shape(r), MODES.index(r["mode"])))
    out = []
    for what, cell in (("host us per cached call", lambda r: _fmt(_host_us(r), ".1f")),
                       ("device ms per call", lambda r: _fmt(r["ms_median"], ".4f"))):
        ratios = torch_impls if what.startswith("host") else []
        header = ["B x H x N x d", "mode", *(_head(rows, i) for i in impls), *(f"cuflash-torch / {i}" for i in ratios)]
        t = Table(f"{title}: {what}", header, caption=f"{caption}. {how}" if how else caption, text_cols=2)
        for k in sorted(cells):
            line = ["x".join(map(str, k[0])), MODES[k[1]]]
            line += [cell(cells[k][i]) if _ok(cells[k].get(i)) else _status(cells[k].get(i)) for i in impls]
            ct = cells[k].get("cuflash-torch") or {}
            line += [_fmt(ct.get(f"host_ratio_vs_{i}"), ".2f") for i in ratios]
            t.rows.append(line)
        out.append(t)
    return out


def _energy_tables(rows: list[dict], title: str, caption: str) -> list[Table]:
    t = Table(f"{title}: energy per call", ["mode", "impl", "ms / call", "J / call", "J / call above idle",
                                            "W above idle"], caption=caption, text_cols=2)
    for r in rows:
        line = [r["mode"], _head([r], r["implementation"])]
        if _ok(r):
            line += [_fmt(r.get("ms_per_call")), _fmt(r.get("joules_per_call"), ".2f"),
                     _fmt(r.get("joules_per_call_above_idle"), ".2f"), _fmt(r.get("avg_power_above_idle_w"), ".0f")]
        else:
            line += [r["status"], "", "", ""]
        t.rows.append(line)
    return [t]


def _variants_tables(rows: list[dict], title: str, caption: str) -> list[Table]:
    """Per variant and mode: cuflash's time, over plain attention's (and the tiles it visits, over plain's),
    and torch SDPA's time where it has the operation."""
    impls = [i for i in _impls(rows) if i != "cuflash"]
    header = ["variant", "mode", "cuflash ms", "time / plain", "tiles / plain",
              *(f"{_head(rows, i)} ms" for i in impls), *(f"{i} / cuflash" for i in impls)]
    t = Table(f"{title}: variants against plain attention", header, caption=caption, text_cols=2)
    cells = _cells(rows, lambda r: (r["variant"], r["mode"]))
    for (variant, mode), c in cells.items():
        ours = c.get("cuflash")
        line = [variant, mode, _fmt(ours["ms_median"], ".3f") if _ok(ours) else _status(ours),
                _fmt((ours or {}).get("time_vs_plain"), ".2f"), _fmt((ours or {}).get("tiles_vs_plain"), ".2f")]
        line += [_fmt(c[i]["ms_median"], ".3f") if _ok(c.get(i)) else "" for i in impls]
        line += [_fmt(c[i]["ms_median"] / ours["ms_median"], ".2f") if _ok(c.get(i)) and _ok(ours) else ""
                 for i in impls]
        t.rows.append(line)
    return [t]


def _decode_tables(rows: list[dict], title: str, method: str) -> list[Table]:
    """Per cell: the copy's TB/s, then each implementation's ms and KV TB/s (and its fraction of the copy's); then
    each implementation's host time per call."""
    from .decode import COPY

    impls = [i for i in _impls(rows) if i != COPY]
    header = ["B x H x H_kv x len x d", "cache", "splits", "K + V", "copy TB/s"]
    for i in impls:
        header += [f"{_head(rows, i)} ms", f"{i} TB/s (of copy)"]
    t = Table(f"{title}: one query row over a KV cache", header, caption=method, text_cols=3)
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)  # in run order
    for r in rows:
        s = r["shape"]
        cells[(s["batch"], s["nheads"], r.get("nheads_k"), s["seqlen_k"], s["head_dim"], r.get("cache"))][
            r["implementation"]] = r
    for k, c in cells.items():
        cp = c.get(COPY)
        splits = (c.get("cuflash") or {}).get("num_splits")
        line = ["x".join(map(str, k[:5])), str(k[5]), "" if splits is None else str(splits),
                _bytes(next(iter(c.values())).get("kv_bytes")),
                _fmt(cp["tb_per_s"], ".2f") if _ok(cp) else _status(cp)]
        for i in impls:
            r = c.get(i)
            if _ok(r):
                f = r.get("copy_fraction")
                line += [_fmt(r["ms_median"], ".3f"), _fmt(r["tb_per_s"], ".2f") + (f" ({f:.0%})" if f else "")]
            else:
                line += [_status(r), ""]
        t.rows.append(line)
    host = Table(f"{title}: host µs per call", ["B x H x H_kv x len x d", "cache", *impls], caption=method,
                 text_cols=2)
    host.rows = [["x".join(map(str, k[:5])), str(k[5]),
                  *(_fmt(c[i].get("host_us_median"), ".1f") if _ok(c.get(i)) else _status(c.get(i)) for i in impls)]
                 for k, c in cells.items()]
    return [t, host]


def _decode_lines(suite: dict) -> list[str]:
    """Each implementation's TB/s range (and fraction of the copy's), and how torch took GQA."""
    rows = [r for r in suite.get("rows", []) if _ok(r) and r.get("tb_per_s")]
    out = []
    for i in _impls(rows):
        mine = [r for r in rows if r["implementation"] == i]
        tb = [r["tb_per_s"] for r in mine]
        line = f"decode: {i} {min(tb):.2f}-{max(tb):.2f} TB/s"
        fr = [r["copy_fraction"] for r in mine if r.get("copy_fraction") and i != "copy"]
        out.append(line + (f", {min(fr):.0%}-{max(fr):.0%} of the copy's" if fr else "")
                   + (" (read + written)" if i == "copy" else " (K and V read)"))
        gqa = list(dict.fromkeys(r["gqa"] for r in mine if r.get("gqa") and not r["gqa"].startswith("none")))
        if gqa:
            out.append(f"decode: {i} GQA through " + "; ".join(gqa))
    return out


TRAIN_REFS = ("torch-cudnn", "torch-flash")  # the train table's ratio columns: their step time over each row's


def _train_tables(rows: list[dict], title: str, p: dict) -> list[Table]:
    """One row per implementation: step time, tokens/s, attention's time and share of the step, peak memory,
    loss, and each torch backend's step time over this row's; then the kernels counted as attention."""
    refs = [i for i in TRAIN_REFS if any(r["implementation"] == i and _ok(r) for r in rows)]
    header = ["implementation", "step ms", "tokens/s", "TFLOP/s", "attention ms", "attention share", "peak GiB",
              "loss", *(f"{i} ms / this" for i in refs)]
    model = (f"GPT {p.get('layers')} layers, width {p.get('width')}, {p.get('nheads')} heads of {p.get('head_dim')}, "
             f"N={p.get('seqlen')}, vocab {p.get('vocab')}, batch {p.get('batch')}; {p.get('precision')}; "
             f"{p.get('optimizer')}")
    how = (f"step ms: median of {p.get('timed_steps')} steps (CUDA events); attention: device time of attention "
           f"kernels per step and its share of all kernels' (torch.profiler, {p.get('profiled_steps')} steps); loss "
           f"after the same steps from the same weights and batches; <impl> ms / this above 1: this step is faster")
    t = Table(f"{title}: GPT training step", header, caption=f"{model}. {how}", text_cols=1)
    ms = {r["implementation"]: r["ms_median"] for r in rows if _ok(r)}
    for r in rows:
        line = [_head([r], r["implementation"])]
        if _ok(r):
            share = r.get("attention_share")
            peak = r.get("peak_bytes")
            line += [_fmt(r["ms_median"], ".1f"), _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r["tflops"], ".0f"),
                     _fmt(r.get("attention_ms_per_step") if share is not None else None, ".1f"),
                     "-" if share is None else f"{share:.1%}", "-" if peak is None else f"{peak / 2**30:.2f}",
                     _fmt(r.get("loss"), ".4f")]
            line += [_fmt(ms[i] / r["ms_median"], ".2f") if r["ms_median"] else "-" for i in refs]
        else:
            line += [r["status"]] + [""] * (len(header) - 2)
        t.rows.append(line)
    k = Table(f"{title}: kernels counted as attention (top by device time)", ["implementation", "kernel", "ms / step"],
              caption="train.is_attention_kernel: a kernel name holding flash, cudnn, sdpa or fmha", text_cols=2)
    for r in rows:
        for x in (r.get("attention_kernels") or [])[:3]:
            k.rows.append([r["implementation"], x["name"][:90], _fmt(x["ms_per_step"], ".2f")])
    return [t] + ([k] if k.rows else [])


def _train_lines(suite: dict) -> list[str]:
    """What a faster attention kernel buys end to end: cuflash's step and attention time against each torch's."""
    ok = {r["implementation"]: r for r in suite.get("rows", []) if _ok(r)}
    out = [f"train: {r['implementation']} not profiled: {r['profile_reason']}" for r in ok.values()
           if r.get("profile_reason")]
    ours = ok.get("cuflash")
    for ref in TRAIN_REFS if ours else ():
        if ref not in ok:
            continue
        b = ok[ref]
        line = (f"train: cuflash step {ours['ms_median']:.1f} ms, {ref} {b['ms_median']:.1f} ms "
                f"({b['ms_median'] / ours['ms_median']:.2f}x)")
        if ours.get("attention_share") is not None and b.get("attention_share") is not None:
            line += (f"; attention {ours['attention_ms_per_step']:.1f} against {b['attention_ms_per_step']:.1f} ms "
                     f"per step ({ours['attention_share']:.0%} and {b['attention_share']:.0%} of the kernels' time)")
        if ours.get("loss") is not None and b.get("loss") is not None:
            line += f"; loss {ours['loss']:.4f} against {b['loss']:.4f}"
        out.append(line)
    return out


def _not_run_table(name: str, rows: list[dict]) -> list[Table]:
    bad = [r for r in rows if r["status"] not in ("ok", "skipped")]
    reasons = list(dict.fromkeys(f"{r['implementation']}: {r['status']}: {r['reason']}" for r in bad))
    return [Table(f"{name}: not run", ["why"], [[x[:200]] for x in reasons[:12]])] if reasons else []


def tables(name: str, suite: dict) -> list[Table]:
    """Every table of one suite."""
    rows = suite.get("rows", [])
    if not rows:
        return []
    title = f"{name} ({suite.get('platform')}, {suite.get('status')}, {suite.get('seconds', 0):.0f} s)"
    caption = _caption(rows)
    if name in ("seqlen", "headdim"):
        out = _speed_tables(name, rows, title, caption)
    elif name == "memory":
        out = _memory_tables(rows, title, caption)
    elif name == "accuracy":
        out = _accuracy_tables(rows, title, caption)
    elif name == "launch":
        out = _launch_tables(rows, title, caption, suite.get("host_timing") or "")
    elif name == "variants":
        out = _variants_tables(rows, title, caption)
    elif name == "train":
        out = _train_tables(rows, title, suite.get("params") or {})
    elif name == "decode":
        out = _decode_tables(rows, title, (suite.get("params") or {}).get("method", ""))
    else:
        out = _energy_tables(rows, title, caption)
    return out + _not_run_table(name, rows)


def headline(suites: dict) -> Table | None:
    """TFLOP/s against N of every implementation, forward and forward + backward (the README's table)."""
    rows = [r for r in suites.get("seqlen", {}).get("rows", []) if r["mode"] in ("fwd", "fwd_bwd")]
    if not rows:
        return None
    impls = _impls(rows)
    pairs = [(m, i) for m in ("fwd", "fwd_bwd") for i in impls]
    t = Table("TFLOP/s", ["N", *(f"{_head(rows, i)} {m.replace('_', '+')}" for m, i in pairs)],
              caption=_caption(rows), text_cols=0)
    cells = _cells(rows, lambda r: (r["shape"]["seqlen_q"], r["mode"]))
    for n in sorted({r["shape"]["seqlen_q"] for r in rows}):
        t.rows.append([str(n)] + [_fmt(r["tflops"], ".0f") if _ok(r := cells[(n, m)].get(i)) else _status(r)
                                  for m, i in pairs])
    return t


def summary_lines(name: str, suite: dict) -> list[str]:
    out = []
    if name == "memory" and suite.get("ratio_by_n"):
        for mode, pts in suite["ratio_by_n"].items():
            ratios = ", ".join(f"N={p['seqlen']}: {p['ratio']:.1f}x" for p in pts)
            slope = suite.get("loglog_slope", {}).get(mode)
            out.append(f"memory {mode}: {suite.get('ratio_of', 'ratio')} = {ratios}; "
                       f"log-log slope {_fmt(slope, '.2f')} (0 would be a constant ratio)")
    if name == "energy" and suite.get("idle_w") is not None:
        out.append(f"energy: idle power {suite['idle_w']:.0f} W subtracted")
    if name == "train":
        out += _train_lines(suite)
    if name == "decode":
        out += _decode_lines(suite)
    return out


def to_rich(t: Table):
    from rich.table import Table as RichTable
    from rich.text import Text

    rt = RichTable(title=Text(t.title, style="italic"), caption=Text(t.caption) if t.caption else None)
    for i, h in enumerate(t.header):
        rt.add_column(Text(h), justify="left" if i < t.text_cols else "right", overflow="fold")
    for line in t.rows:
        rt.add_row(*(Text(c) for c in line))
    return rt


def to_markdown(t: Table) -> str:
    def cells(xs):
        return "| " + " | ".join(x.replace("|", "\\|") for x in xs) + " |"

    align = "|" + "".join("---|" if i < t.text_cols else "---:|" for i in range(len(t.header)))
    lines = [f"#### {t.title}", "", cells(t.header), align, *(cells(r) for r in t.rows)]
    return "\n".join(lines + (["", t.caption] if t.caption else []))


def no_rows_line(name: str, suite: dict) -> str:
    """The one line that stands for a suite without rows (a skipped suite: why)."""
    if suite.get("status") == "skipped" and suite.get("reason"):
        return f"{name} ({suite.get('platform')}, skipped): {suite['reason']}"
    return f"{name} ({suite.get('platform')}, {suite.get('status')}): no rows" + (
        f" ({suite['reason']})" if suite.get("reason") else "")


def render(console, suites: dict) -> None:
    """Every suite's tables, then its summary lines."""
    for name, suite in suites.items():
        ts = tables(name, suite)
        if not ts:
            console.print(no_rows_line(name, suite), markup=False)
        for t in ts:
            console.print(to_rich(t))
        for line in summary_lines(name, suite):
            console.print(line, markup=False)


def markdown(suites: dict) -> str:
    """The headline table and every suite's tables and summary lines, as Markdown."""
    top = headline(suites)
    parts = [to_markdown(top)] if top else []
    for name, suite in suites.items():
        ts = tables(name, suite)
        parts += [to_markdown(t) for t in ts] if ts else [no_rows_line(name, suite)]
        parts += summary_lines(name, suite)
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    """python3 -m cuflash.benchmark.report RESULTS.json > tables.md"""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python3 -m cuflash.benchmark.report RESULTS.json")
    doc = json.loads(Path(args[0]).read_text())
    check(doc)
    sys.stdout.write(markdown(doc["suites"]))


if __name__ == "__main__":
    main()
