"""Results of `cuflash bench`: the JSON document, its validator, ratio columns, and tables.

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
    versions          object         python, numpy, cupy, torch, ml_dtypes, matplotlib (null if absent)
    notes             [str]          anything a reader must know (fallbacks taken, precompile time)

suites[name] (name in seqlen, headdim, memory, launch, accuracy, energy)::

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
                     "atol" {dtype: float};  energy: "idle_w" float|null;  "error" suites: "traceback".

Every row has these keys (values null where they do not apply)::

    shape            {"batch", "nheads", "seqlen_q", "seqlen_k", "head_dim"} (ints)
    dtype            "bfloat16" | "float16" | "float32" | "float64"
    causal           bool
    implementation   "cuflash", "conventional", "torch-flash", "torch-efficient", "torch-cudnn",
                     "torch-math", "cuflash-graph" (launch), "cuflash-numpy", "materialized-numpy" (cpu)
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
    launch           ms_* = device time, host_ms_median / host_ms_min / host_ms_max = host enqueue
                     time (no synchronization inside the timed region), n_runs, host_n_runs,
                     host_over_device.
                     "cuflash-graph" rows: one CUDA-graph replay of the same call.
    accuracy         output ("o" | "dq" | "dk" | "dv"), max_abs_err (vs float64), and on cuflash rows
                     err_ratio_vs_conventional, within_rule (err <= 2 * err(conventional) + atol), atol.
                     Reproducibility rows: output "all", bitwise_reproducible (bool), repeats.
    energy           calls, window_s, ms_per_call, joules_per_call, joules_per_call_above_idle,
                     avg_power_w, avg_power_above_idle_w.

A "ok" row of a timing suite (seqlen, headdim, launch) must have numbers with
ms_min <= ms_median <= ms_max and n_runs >= 10. `validate(doc)` checks all of this.
"""

from __future__ import annotations

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

from ..config import DTYPES

SCHEMA = "cuflash-bench/1"
SUITE_NAMES = ("seqlen", "headdim", "memory", "launch", "accuracy", "energy")
META_KEYS = ("cuflash_version", "git_commit", "date_utc", "command", "options", "platform", "platform_reason",
             "gpu", "versions", "notes")
SUITE_KEYS = ("platform", "status", "reason", "seconds", "params", "rows")
ROW_KEYS = ("shape", "dtype", "causal", "implementation", "mode", "status", "reason",
            "ms_median", "ms_min", "ms_max", "tflops")
SHAPE_KEYS = ("batch", "nheads", "seqlen_q", "seqlen_k", "head_dim")
ROW_STATUS = ("ok", "unavailable", "OOM", "skipped", "error")
SUITE_STATUS = ("ok", "partial", "skipped", "error")
MODES = ("fwd", "bwd", "fwd_bwd")
TIMING_SUITES = ("seqlen", "headdim", "launch")


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------


def make_row(shape: dict, dtype: str, causal: bool, implementation: str, mode: str, *, status: str = "ok",
             reason: str | None = None, **extra) -> dict:
    row = {"shape": dict(shape), "dtype": dtype, "causal": bool(causal), "implementation": implementation,
           "mode": mode, "status": status, "reason": reason,
           "ms_median": None, "ms_min": None, "ms_max": None, "tflops": None}
    row.update(extra)
    return row


def _group_key(row: dict) -> tuple:
    return (tuple(row["shape"][k] for k in SHAPE_KEYS), row["dtype"], row["causal"], row["mode"],
            row.get("output"))


def add_speedups(rows: list[dict], ref: str = "cuflash", key: str = "ms_median") -> None:
    """Ratio columns: ref rows get speedup_vs_<impl> = impl / ref; other rows get cuflash_speedup."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_group_key(r)].append(r)
    for members in groups.values():
        base = [r for r in members if r["implementation"] == ref and r["status"] == "ok" and r.get(key)]
        if not base:
            continue
        b = base[0]
        for r in members:
            if r is b or r["status"] != "ok" or not r.get(key):
                continue
            ratio = r[key] / b[key]
            b[f"speedup_vs_{r['implementation']}"] = ratio
            r["cuflash_speedup"] = ratio


def add_memory_ratios(rows: list[dict], ref: str = "cuflash") -> None:
    """ref rows get mem_ratio_vs_<impl> = peak(impl) / peak(ref); other rows mem_ratio_to_cuflash."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_group_key(r)].append(r)
    for members in groups.values():
        base = [r for r in members if r["implementation"] == ref and r["status"] == "ok" and r.get("peak_bytes")]
        if not base:
            continue
        b = base[0]
        for r in members:
            if r is b or r["status"] != "ok" or r.get("peak_bytes") is None:
                continue
            ratio = r["peak_bytes"] / b["peak_bytes"]
            b[f"mem_ratio_vs_{r['implementation']}"] = ratio
            r["mem_ratio_to_cuflash"] = ratio


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
        if name not in SUITE_NAMES:
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
    for k, v in row.items():
        if k.startswith(("speedup_vs_", "mem_ratio_vs_")) and not _num(v):
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
                     "matplotlib": _version("matplotlib")},
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
# Tables
# ------------------------------------------------------------------------------------------------


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


def _note(r: dict) -> str:
    if r["status"] == "ok":
        return ""
    why = r.get("reason") or ""
    return f"{r['status']}: {why[:70]}" if r["status"] != "OOM" else "OOM"


def _shape_str(s: dict) -> str:
    return f"{s['batch']}x{s['nheads']}x{s['seqlen_q']}x{s['head_dim']}"


# (header, function of row -> str) per suite
def _columns(suite: str, rows: list[dict]) -> list[tuple[str, object]]:
    n = ("N", lambda r: str(r["shape"]["seqlen_q"]))
    impl = ("impl", lambda r: r["implementation"])
    mode = ("mode", lambda r: r["mode"])
    note = ("note", _note)
    if suite in ("seqlen", "headdim"):
        first = [("d", lambda r: str(r["shape"]["head_dim"])), ("H", lambda r: str(r["shape"]["nheads"]))] \
            if suite == "headdim" else [n]
        return [mode, *first, impl, ("ms", lambda r: _fmt(r["ms_median"])),
                ("min", lambda r: _fmt(r["ms_min"])), ("max", lambda r: _fmt(r["ms_max"])),
                ("TFLOP/s", lambda r: _fmt(r["tflops"], ".1f")),
                ("cuflash x", lambda r: _fmt(r.get("cuflash_speedup"), ".2f")), note]
    if suite == "memory":
        return [mode, n, impl, ("peak", lambda r: _bytes(r.get("peak_bytes"))),
                ("ratio to cuflash", lambda r: _fmt(r.get("mem_ratio_to_cuflash"), ".1f")), note]
    if suite == "launch":
        return [mode, n, impl, ("device ms", lambda r: _fmt(r["ms_median"])),
                ("host ms", lambda r: _fmt(r.get("host_ms_median"))),
                ("host/device", lambda r: _fmt(r.get("host_over_device"), ".2f")), note]
    if suite == "accuracy":
        return [("dtype", lambda r: r["dtype"]), mode, n, impl, ("out", lambda r: str(r.get("output", ""))),
                ("max abs err", lambda r: _fmt(r.get("max_abs_err"), ".2e") if "max_abs_err" in r
                 else ("bitwise same" if r.get("bitwise_reproducible") else
                       ("DIFFERS" if "bitwise_reproducible" in r else "-"))),
                ("vs conventional", lambda r: _fmt(r.get("err_ratio_vs_conventional"), ".2f")),
                ("rule", lambda r: _fmt(r.get("within_rule"))), note]
    if suite == "energy":
        return [mode, n, impl, ("ms/call", lambda r: _fmt(r.get("ms_per_call"))),
                ("J/call", lambda r: _fmt(r.get("joules_per_call"))),
                ("J/call above idle", lambda r: _fmt(r.get("joules_per_call_above_idle"))),
                ("W above idle", lambda r: _fmt(r.get("avg_power_above_idle_w"), ".0f")), note]
    return [mode, n, impl, note]


def render(console, suites: dict) -> None:
    """Tables per suite (pivoted for seqlen, headdim and accuracy), then the suite's summary lines."""
    from rich.table import Table

    for name, suite in suites.items():
        rows = suite.get("rows", [])
        title = f"{name} ({suite.get('platform')}, {suite.get('status')}, {suite.get('seconds', 0):.0f} s)"
        if not rows:
            console.print(f"[bold]{title}[/bold]: no rows" + (f" ({suite['reason']})" if suite.get("reason") else ""))
            continue
        shapes = sorted({_shape_str(r["shape"]) for r in rows})
        caption = f"shapes (B x H x N x d): {', '.join(shapes[:6])}" + (" ..." if len(shapes) > 6 else "")
        if name in ("seqlen", "headdim"):
            tables = _speed_tables(Table, name, rows, title, caption)
        elif name == "accuracy":
            tables = _accuracy_tables(Table, rows, title, caption)
        else:
            table = Table(title=title, caption=caption)
            cols = _columns(name, rows)
            for header, _ in cols:
                table.add_column(header, overflow="fold")
            for r in rows:
                table.add_row(*(f(r) for _, f in cols))
            tables = [table]
        for t in tables:
            console.print(t)
        for line in summary_lines(name, suite):
            console.print(line)


def _speed_tables(Table, name: str, rows: list[dict], title: str, caption: str) -> list:
    """One table per mode: a row per N (or head dim), a column per implementation.

    cuflash shows ms and TFLOP/s; every other implementation shows its ms and, in brackets, how
    many times faster cuflash is (its cuflash_speedup).
    """
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    key = (lambda r: (r["shape"]["head_dim"], r["shape"]["nheads"])) if name == "headdim" else \
        (lambda r: (r["shape"]["seqlen_q"],))
    tables = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in rows)]:
        t = Table(title=f"{title}: {mode}, ms per call (cuflash speedup)", caption=caption)
        for h in (["d", "H"] if name == "headdim" else ["N"]):
            t.add_column(h, justify="right")
        for impl in impls:
            t.add_column(impl + (" ms | TFLOP/s" if impl == "cuflash" else ""), justify="right", overflow="fold")
        cells: dict[tuple, dict] = defaultdict(dict)
        for r in rows:
            if r["mode"] == mode:
                cells[key(r)][r["implementation"]] = r
        for k in sorted(cells):
            out = [str(x) for x in k]
            for impl in impls:
                r = cells[k].get(impl)
                if r is None:
                    out.append("")
                elif r["status"] != "ok":
                    out.append(r["status"])
                elif impl == "cuflash":
                    out.append(f"{_fmt(r['ms_median'])} | {_fmt(r['tflops'], '.0f')}")
                else:
                    out.append(f"{_fmt(r['ms_median'])} ({_fmt(r.get('cuflash_speedup'), '.2f')}x)")
            t.add_row(*out)
        tables.append(t)
    bad = [r for r in rows if r["status"] not in ("ok", "skipped")]
    reasons = list(dict.fromkeys(f"{r['implementation']}: {r['status']}: {r['reason']}" for r in bad))
    if reasons:
        t = Table(title=f"{name}: not run", show_header=False)
        t.add_column("why", overflow="fold")
        for x in reasons[:12]:
            t.add_row(x[:200])
        tables.append(t)
    return tables


def _accuracy_tables(Table, rows: list[dict], title: str, caption: str) -> list:
    """max abs error against float64 per (dtype, N, output): cuflash vs the materialized baseline."""
    errs = [r for r in rows if r.get("output") != "all"]
    impls = list(dict.fromkeys(r["implementation"] for r in errs))
    ours = impls[0] if impls else "cuflash"
    t = Table(title=f"{title}: max abs error vs float64", caption=caption)
    for h in ("dtype", "N", "out", *impls, "ratio", "rule"):
        t.add_column(h, justify="right")
    cells: dict[tuple, dict] = defaultdict(dict)
    for r in errs:
        cells[(DTYPES.index(r["dtype"]), r["shape"]["seqlen_q"], r["output"])][r["implementation"]] = r
    order = {"o": 0, "dq": 1, "dk": 2, "dv": 3}
    for k in sorted(cells, key=lambda k: (k[0], k[1], order.get(k[2], 9))):
        members = cells[k]
        out = [DTYPES[k[0]], str(k[1]), k[2]]
        for impl in impls:
            r = members.get(impl)
            out.append("" if r is None else (_fmt(r.get("max_abs_err"), ".2e") if r["status"] == "ok" else r["status"]))
        r = members.get(ours, {})
        out += [_fmt(r.get("err_ratio_vs_conventional"), ".2f"), _fmt(r.get("within_rule"))]
        t.add_row(*out)
    tables = [t]
    rep = [r for r in rows if r.get("output") == "all"]
    if rep:
        t2 = Table(title="bitwise reproducibility over repeated calls")
        for h in ("dtype", "N", "impl", "mode", "result"):
            t2.add_column(h)
        for r in rep:
            res = (("identical" if r["bitwise_reproducible"] else "DIFFERS") + f" over {r.get('repeats')} calls") \
                if r["status"] == "ok" else f"{r['status']}: {(r['reason'] or '')[:60]}"
            t2.add_row(r["dtype"], str(r["shape"]["seqlen_q"]), r["implementation"], r["mode"], res)
        tables.append(t2)
    return tables


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
    if suite.get("notes"):
        out += [f"{name}: {n}" for n in suite["notes"]]
    return out
