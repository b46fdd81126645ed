"""`cuflash bench`: option parsing, the no-GPU path end to end, JSON schema, plot, pure helpers.

CPU only and fast: the no-GPU path runs the NumPy backend at small N.
"""

from __future__ import annotations

import copy
import json

import click
import pytest
from click.testing import CliRunner

from cuflash import _compile
from cuflash.benchmark import SUITES, command, report, timing
from cuflash.benchmark.command import bench
from cuflash.benchmark.suites import Settings, cell_count, kernel_configs, suite_cases, suite_params, total_steps

FAST = ["--seqlens", "32,64", "--heads", "1", "--head-dim", "32"]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(command, "detect_gpu", lambda: (False, "test: GPU hidden"))


def group():
    @click.group()
    def main():
        pass

    main.add_command(bench)
    return main


def invoke(args, **kw):
    return CliRunner().invoke(group(), ["bench", *args], catch_exceptions=False, **kw)


def document_and_text(settings, suites):
    """A GPU run's document for `suites` (what a Runner returned): checked against the schema and as
    strict JSON, and rendered as the console shows it. Returns (document, text)."""
    from rich.console import Console

    doc = report.document(report.make_meta(settings.options(), "gpu", None), suites)
    assert report.validate(doc) == []
    json.dumps(doc, allow_nan=False)
    console = Console(record=True, width=250)
    report.render(console, doc["suites"])
    return doc, console.export_text()


def run_without_a_gpu(monkeypatch, suite: str, json_path):
    """`cuflash bench --suite <suite> --quick` with the GPU hidden, and what every GPU-only suite's skip
    shares: one line for it, a valid JSON document, the line in the Markdown too (RESULTS files say
    it). Returns (output lines, document)."""
    monkeypatch.setattr(command, "detect_gpu", lambda: (False, "test: GPU hidden"))
    r = invoke(["--suite", suite, "--quick", *FAST, "--json", str(json_path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("no CUDA GPU visible (test: GPU hidden)")
    assert sum(x.startswith(suite) for x in lines) == 1
    doc = json.loads(json_path.read_text())
    assert report.validate(doc) == []
    assert lines[1] in report.markdown(doc["suites"]).splitlines()
    return lines, doc


# ------------------------------------------------------------------------------------------------
# Options


def test_help_lists_every_option():
    r = invoke(["--help"])
    assert r.exit_code == 0
    for opt in ("--suite", "--dtype", "--causal", "--no-causal", "--batch", "--heads", "--head-dim", "--seqlens",
                "--backends", "--json", "--plot", "--quick", "--repeats", "--warmup", "--cell-seconds",
                "--max-suite-seconds", "--max-seconds", "--energy-window", "--seed", "--cpu"):
        assert opt in r.output, opt
    for suite in SUITES:
        assert suite in r.output


@pytest.mark.parametrize("args,message", [
    (["--suite", "bogus"], "unknown suite 'bogus'"),
    (["--suite", "seqlen,nope"], "unknown suite 'nope'"),
    (["--dtype", "int8"], "is not a dtype"),
    (["--seqlens", "512,abc"], "'abc' is not an integer"),
    (["--seqlens", "0"], "must be positive"),
    (["--head-dim", "100"], "multiple of 8"),
    (["--head-dim", "512"], "multiple of 8"),
    (["--backends", "triton"], "unknown backend 'triton'"),
    (["--plot", "out.jpg"], "ending in .png"),
    (["--repeats", "5"], "5 is not in the range x>=10"),
    (["--energy-window", "1"], "x>=2.0"),
    (["--batch", "0"], "x>=1"),
    (["--seed", "-5"], "x>=0"),
])
def test_bad_values_fail_clearly(args, message):
    r = CliRunner().invoke(group(), ["bench", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output


def test_parsers():
    assert command.parse_suites(None, None, ()) == ("seqlen",)
    assert command.parse_suites(None, None, ("memory,seqlen", "memory")) == ("seqlen", "memory")
    assert command.parse_suites(None, None, ("all",)) == SUITES
    assert command.parse_seqlens(None, None, "2048, 512,512") == (512, 2048)
    assert command.parse_backends(None, None, "torch,cuflash") == (
        "cuflash", "torch-flash", "torch-efficient", "torch-cudnn", "torch-math")
    assert command.parse_backends(None, None, "flash") == ("torch-flash",)
    assert command.parse_dtype(None, None, "BF16") == "bfloat16"


def test_suite_params_defaults_match_the_issue():
    s = Settings(suites=SUITES)
    p = suite_params("seqlen", s, "gpu")
    assert (p["batch"], p["nheads"], p["head_dim"], p["dtype"], p["causal"]) == (2, 8, 128, "bfloat16", True)
    assert p["seqlens"] == [512, 1024, 2048, 4096, 8192, 16384] and p["modes"] == ["fwd", "bwd", "fwd_bwd"]
    h = suite_params("headdim", s, "gpu")
    assert h["seqlen"] == 8192 and h["batch"] == 1 and h["head_dims"] == [32, 64, 128, 256]
    assert h["modes"] == ["fwd", "bwd", "fwd_bwd"]
    assert all(d * n == 1024 for d, n in zip(h["head_dims"], h["nheads"]))
    assert suite_params("energy", s, "gpu")["seqlen"] == 16384
    assert suite_params("accuracy", s, "gpu")["seqlens"] == [512, 1024, 2048, 4096, 8192]
    assert suite_params("accuracy", s, "gpu")["dtypes"] == ["float32", "float16", "bfloat16"]
    q = Settings(suites=SUITES, quick=True, seqlens=(256, 1024))
    assert suite_params("seqlen", q, "gpu")["seqlens"] == [256, 1024]
    assert suite_params("energy", q, "gpu")["seqlen"] == 1024
    assert suite_params("memory", Settings(), "cpu")["seqlens"] == [128, 256, 512, 1024]
    for name in SUITES:
        assert cell_count(name, suite_params(name, s, "gpu"), 6) > 0
    with pytest.raises(ValueError):
        suite_params("seqlen", s, "cpu")


def shapes(p):
    return [(x["batch"], x["nheads"], x["seqlen"], x["head_dim"]) for x in p["shapes"]]


def test_launch_params():
    p = suite_params("launch", Settings(), "gpu")
    assert shapes(p) == [(1, 8, 128, 64), (2, 8, 4096, 128), (4, 16, 8192, 128)]
    assert (p["dtype"], p["causal"], p["modes"]) == ("bfloat16", True, ["fwd", "bwd"])
    assert "back to back behind a spin kernel" in p["host_timing"]
    assert shapes(suite_params("launch", Settings(quick=True), "gpu")) == [(1, 8, 128, 64), (2, 8, 4096, 128)]
    assert shapes(suite_params("launch", Settings(seqlens=(256, 1024)), "gpu")) == [(2, 8, 256, 128),
                                                                                     (2, 8, 1024, 128)]
    assert shapes(suite_params("launch", Settings(batch=3), "gpu")) == [(3, 8, 128, 128), (3, 8, 4096, 128),
                                                                         (3, 8, 8192, 128)]
    cases = suite_cases("launch", p)
    assert [c.label for c in cases][0] == "B=1 H=8 N=128 d=64" and cell_count("launch", p, 6) == 6
    cfgs = kernel_configs(Settings(suites=("launch",), backends=()), ["launch"])
    # flash_bwd_preprocess and flash_bwd_postprocess take no head dim (head_dim 0): one config per dtype
    assert {(c.dtype, c.head_dim) for c in cfgs if c.head_dim} == {("bfloat16", 64),
                                                                                           ("bfloat16", 128)}
    assert {c.kernel for c in cfgs} == {"flash_fwd", "flash_bwd_preprocess", "flash_bwd", "flash_bwd_postprocess"}
    assert kernel_configs(Settings(suites=("seqlen",), backends=("conventional",)), ["seqlen"]) == []
    acc = suite_params("accuracy", Settings(), "gpu")
    assert acc["repro_seqlen"] == 2048 and suite_params("accuracy", Settings(), "cpu")["repro_seqlen"] == 512
    assert total_steps(Settings(suites=("launch",)), "gpu") == 6 + len(kernel_configs(Settings(), ["launch"]))


def test_families():
    assert report.family("cuflash", "bfloat16") == "mma" and report.family("cuflash-torch", "float16") == "mma"
    assert report.family("cuflash", "float32") == "simt" and report.family("cuflash-graph", "float64") == "simt"
    assert report.family("cuflash-numpy", "float16") == "numpy"
    assert report.family("torch-flash", "bfloat16") == "torch-flash"
    assert report.family("torch-cudnn", "bfloat16") == "cudnn"
    assert report.family("conventional", "float32") == "conventional"
    r = report.make_row(_row("x", 1)["shape"], "float32", True, "cuflash", "fwd", status="OOM", reason="x")
    assert r["family"] == "simt"  # rows that did not run say it too


# ------------------------------------------------------------------------------------------------
# The no-GPU path end to end


def test_no_gpu_quick_json_and_plot(no_gpu, tmp_path):
    js, png = tmp_path / "out" / "r.json", tmp_path / "r.png"
    r = invoke(["--quick", *FAST, "--json", str(js), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("no CUDA GPU visible (test: GPU hidden): running the NumPy backend")
    doc = json.loads(js.read_text())
    assert report.validate(doc) == []
    assert doc["meta"]["platform"] == "cpu" and doc["meta"]["gpu"] is None
    assert doc["meta"]["options"]["seqlens"] == [32, 64]
    assert isinstance(doc["meta"]["command"], str)  # (pytest's own argv here)
    assert set(doc["suites"]) == {"memory", "accuracy"}
    mem = doc["suites"]["memory"]
    assert mem["status"] == "ok", mem
    ours = [x for x in mem["rows"] if x["implementation"] == "cuflash-numpy"]
    assert ours and all(x["peak_bytes"] > 0 and "mem_ratio_vs_materialized-numpy" in x for x in ours)
    assert set(mem["ratio_by_n"]) == {"fwd", "fwd_bwd"}
    acc = doc["suites"]["accuracy"]
    assert acc["status"] == "ok", acc
    rule = [x for x in acc["rows"] if "within_rule" in x]
    assert rule and all(x["within_rule"] for x in rule)
    rep = [x for x in acc["rows"] if x.get("output") == "all"]
    ours_rep = [x for x in rep if x["implementation"] == "cuflash-numpy"]
    assert len(ours_rep) == 6 and all(x["bitwise_reproducible"] for x in ours_rep)
    assert len(rep) == 12 and all(x["status"] == "ok" for x in rep)  # materialized-numpy's too: one suite
    rows = mem["rows"] + acc["rows"]
    assert {x["family"] for x in rows if x["implementation"] == "cuflash-numpy"} == {"numpy"}
    assert {x["family"] for x in rows if x["implementation"] == "materialized-numpy"} == {"conventional"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max abs error vs float64" in r.output and "log-log slope" in r.output
    assert "cuflash-numpy (numpy)" in r.output  # tables name the kernel family
    # stdout is not a terminal here: no progress output at all
    assert r.stderr == ""
    assert not any(x in r.output for x in ("[bench]", "steps", " left", "memory: B=", "accuracy: float"))


def test_memory_ratio_grows_with_n(no_gpu, tmp_path):
    js = tmp_path / "m.json"
    r = invoke(["--seqlens", "64,256,1024", "--heads", "1", "--head-dim", "32", "--json", str(js)])
    assert r.exit_code == 0, r.output
    mem = json.loads(js.read_text())["suites"]["memory"]
    pts = mem["ratio_by_n"]["fwd"]
    assert [p["seqlen"] for p in pts] == [64, 256, 1024]
    assert pts[-1]["ratio"] > 2 * pts[0]["ratio"]  # a slope, not a constant
    assert mem["loglog_slope"]["fwd"] > 0.3


def test_cpu_flag_forces_the_cpu_path(tmp_path):
    r = invoke(["--cpu", "--quick", *FAST, "--suite", "seqlen"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("--cpu: running the NumPy backend")


# ------------------------------------------------------------------------------------------------
# Pure helpers


def test_summarize():
    st = timing.summarize([3.0, 1.0, 2.0, 10.0])
    assert st == {"ms_median": 2.5, "ms_min": 1.0, "ms_max": 10.0, "n_runs": 4}
    assert timing.summarize([5.0], prefix="host_ms")["host_ms_median"] == 5.0
    with pytest.raises(ValueError):
        timing.summarize([])


def test_repeats_and_input_sets():
    assert timing.repeats_for(1.0, 20, 0.5) == 20
    assert timing.repeats_for(100.0, 20, 0.5) == 10  # never under 10
    assert timing.repeats_for(30.0, 50, 0.6) == 20
    assert timing.input_sets_for(6 * 2**20, 60 * 2**20) == 16  # capped
    assert timing.input_sets_for(48 * 2**20, 60 * 2**20) == 3
    assert timing.input_sets_for(2**30, 60 * 2**20) == 1


def test_flops_and_tflops():
    f = timing.flops(2, 8, 1024, 1024, 128, False, "fwd")
    assert f == 4 * 2 * 8 * 1024 * 1024 * 128
    assert timing.flops(2, 8, 1024, 1024, 128, True, "fwd") == f // 2
    assert timing.flops(2, 8, 1024, 1024, 128, False, "bwd") == f * 5 // 2
    assert timing.flops(2, 8, 1024, 1024, 128, False, "fwd_bwd") == f * 7 // 2
    assert timing.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert timing.tflops(None, 1.0) is None and timing.tflops(1e12, 0) is None


def _row(impl, ms, mode="fwd", n=1024, **kw):
    shape = {"batch": 2, "nheads": 8, "seqlen_q": n, "seqlen_k": n, "head_dim": 128}
    r = report.make_row(shape, "bfloat16", True, impl, mode, ms_median=ms, ms_min=ms * 0.9, ms_max=ms * 1.2,
                        n_runs=10, tflops=1.0, **kw)
    return r


def test_ratio_columns():
    rows = [_row("cuflash", 1.0), _row("conventional", 3.0), _row("torch-flash", 0.8),
            report.make_row(_row("x", 1)["shape"], "bfloat16", True, "torch-cudnn", "fwd", status="unavailable",
                            reason="no"),
            _row("cuflash", 2.0, mode="bwd"), _row("conventional", 8.0, mode="bwd")]
    report.add_speedups(rows)
    assert rows[0]["speedup_vs_conventional"] == pytest.approx(3.0)
    assert rows[0]["speedup_vs_torch-flash"] == pytest.approx(0.8)
    assert "speedup_vs_torch-cudnn" not in rows[0]
    assert rows[1]["cuflash_speedup"] == pytest.approx(3.0)
    assert rows[4]["speedup_vs_conventional"] == pytest.approx(4.0)  # grouped by mode


def test_memory_ratios_and_slope():
    rows = []
    for n in (1024, 2048, 4096):
        for impl, peak in (("cuflash", 10 * n), ("conventional", n * n)):
            rows.append(report.make_row(_row("x", 1, n=n)["shape"], "bfloat16", True, impl, "fwd", peak_bytes=peak))
    report.add_memory_ratios(rows)
    s = report.memory_summary(rows, "cuflash", "conventional")
    assert [p["ratio"] for p in s["ratio_by_n"]["fwd"]] == pytest.approx([102.4, 204.8, 409.6])
    assert s["loglog_slope"]["fwd"] == pytest.approx(1.0)
    assert s["ratio_growth"]["fwd"] == pytest.approx(4.0)
    assert report.loglog_slope([1, 2, 4], [3, 3, 3]) == pytest.approx(0.0)
    assert report.loglog_slope([1], [1]) is None


def _gpu_doc():
    rows = [_row("cuflash", 1.0), _row("conventional", 3.0)]
    report.add_speedups(rows)
    launch = [_row("cuflash", 0.1, host_ms_median=0.05, host_ms_min=0.04, host_ms_max=0.09, host_over_device=0.5)]
    meta = report.make_meta({"suites": ["seqlen"]}, "gpu", None, argv=["cuflash", "bench"])
    suites = {
        "seqlen": {"platform": "gpu", "status": "ok", "reason": None, "seconds": 1.0, "params": {}, "rows": rows},
        "launch": {"platform": "gpu", "status": "ok", "reason": None, "seconds": 1.0, "params": {}, "rows": launch},
    }
    return report.document(meta, suites)


def test_schema_validator_accepts_and_rejects():
    doc = _gpu_doc()
    assert report.validate(doc) == []
    assert doc["meta"]["command"] == "cuflash bench"
    meta = report.make_meta({}, "cpu", "x", argv=["/x/cuflash/__main__.py", "bench", "--json", "a b.json"])
    assert meta["command"] == "python3 -m cuflash bench --json 'a b.json'"
    # a GPU run names the NVRTCs that built its kernels (cuda-bindings' for the Hopper ones, CuPy's for the rest)
    major, minor = _compile.nvrtc_version()
    assert doc["meta"]["versions"]["nvrtc"] == (f"{major}.{minor}" if major else None)
    assert "cupy_nvrtc" in doc["meta"]["versions"] and "nvrtc" not in meta["versions"]

    def broken(fn):
        d = copy.deepcopy(doc)
        fn(d)
        return report.validate(d)

    assert any("schema" in e for e in broken(lambda d: d.update(schema="x")))
    assert any("meta.git_commit missing" in e for e in broken(lambda d: d["meta"].pop("git_commit")))
    assert any("ms_median missing" in e for e in broken(lambda d: d["suites"]["seqlen"]["rows"][0].pop("ms_median")))
    assert any("ms_min <= ms_median" in e for e in
               broken(lambda d: d["suites"]["seqlen"]["rows"][0].update(ms_min=5.0)))
    assert any("n_runs" in e for e in broken(lambda d: d["suites"]["seqlen"]["rows"][0].update(n_runs=3)))
    assert any("needs a reason" in e for e in
               broken(lambda d: d["suites"]["seqlen"]["rows"][1].update(status="OOM", reason=None)))
    assert any("mode" in e for e in broken(lambda d: d["suites"]["seqlen"]["rows"][0].update(mode="both")))
    assert any("host_ms" in e for e in broken(lambda d: d["suites"]["launch"]["rows"][0].pop("host_ms_median")))
    assert any("unknown suite" in e for e in broken(lambda d: d["suites"].update(other=d["suites"]["seqlen"])))
    with pytest.raises(ValueError, match="does not match the schema"):
        report.check({"schema": "x"})


def test_json_is_strict(tmp_path):
    doc = _gpu_doc()
    doc["suites"]["seqlen"]["rows"][0]["tflops"] = float("nan")
    clean = report.document(doc["meta"], doc["suites"])
    assert clean["suites"]["seqlen"]["rows"][0]["tflops"] is None
    report.write_json(clean, tmp_path / "x.json")
    json.loads((tmp_path / "x.json").read_text())


def test_tables_and_plot_from_gpu_rows(tmp_path):
    """The GPU code paths of the table and plot, fed synthetic rows."""
    from rich.console import Console

    from cuflash.benchmark.plots import plot

    rows, mem = [], []
    for n in (512, 1024, 2048):
        for mode in ("fwd", "bwd", "fwd_bwd"):
            rows += [_row("cuflash", n / 512, mode, n), _row("conventional", n / 128, mode, n),
                     report.make_row(_row("x", 1, n=n)["shape"], "bfloat16", True, "torch-math", mode, status="OOM",
                                     reason="CUDA out of memory")]
        for impl, peak in (("cuflash", 1000 * n), ("conventional", n * n)):
            mem.append(report.make_row(_row("x", 1, n=n)["shape"], "bfloat16", True, impl, "fwd", peak_bytes=peak))
    report.add_speedups(rows)
    report.add_memory_ratios(mem)
    suites = {
        "seqlen": {"platform": "gpu", "status": "partial", "reason": None, "seconds": 3.0, "params": {}, "rows": rows},
        "memory": {"platform": "gpu", "status": "ok", "reason": None, "seconds": 1.0, "params": {}, "rows": mem,
                   **report.memory_summary(mem, "cuflash", "conventional")},
    }
    console = Console(record=True, width=250)
    report.render(console, suites)
    text = console.export_text()
    assert "seqlen (gpu, partial" in text and "(4.00x)" in text and "OOM" in text
    assert "log-log slope 1.00" in text
    assert "cuflash (mma) TFLOP/s" in text and "torch-math TFLOP/s (cuflash x)" in text
    md = report.markdown(suites)  # the same tables as Markdown (RESULTS.md, README)
    assert "#### TFLOP/s" in md and "| cuflash (mma) ms |" in md and "| 1024 | 2.000 | 1 |" in md
    assert "| fwd | 2048 | 2.0 MiB | 4.0 MiB (2.0x) |" in md
    panels = plot(suites, tmp_path / "g.png", title="test")
    assert len(panels) == 3 and (tmp_path / "g.png").stat().st_size > 10_000


def test_baseline_kernels_compile_for_sm90():
    """The conventional baseline's softmax kernels and the timer's spin kernel compile (NVRTC needs no GPU)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from cuflash._compile import _cuda_include_dirs
    from cuflash.benchmark.baselines import CONV_NAMES, CONV_SRC
    from cuflash.benchmark.timing import _SPIN_SRC

    if not _cuda_include_dirs():
        pytest.skip("no CUDA headers (cuda_fp16.h) found")
    for src, names in ((CONV_SRC, CONV_NAMES), (_SPIN_SRC, ())):
        err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"bench.cu", 0, [], [])
        for n in names:
            nvrtc.nvrtcAddNameExpression(prog, n.encode())
        opts = ["-std=c++17", "-arch=sm_90"] + [f"-I{d}" for d in _cuda_include_dirs()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        nvrtc.nvrtcDestroyProgram(prog)


def test_conventional_mask_comes_from_the_reference():
    """The baseline's kernels hold no copy of the mask rule: per-row key counts from reference._visible."""
    import numpy as np

    from cuflash import reference
    from cuflash.benchmark.baselines import CONV_SRC

    assert "causal" not in CONV_SRC and "seqlen_k - seqlen_q" not in CONV_SRC
    for sq, sk in ((6, 6), (4, 9), (9, 4)):
        vis = reference._visible(sq, sk, True, np)
        counts = vis.sum(axis=1)
        assert (vis == (np.arange(sk)[None, :] < counts[:, None])).all()  # a prefix: the count says it all


class FakeClock:
    """Events as host timestamps: lets the timers run on the CPU."""

    name = "fake"

    def event(self):
        return [0.0]

    def record(self, ev):
        import time

        ev[0] = time.perf_counter()

    def elapsed_ms(self, a, b):
        return (b[0] - a[0]) * 1e3

    def sync(self):
        pass

    def spin(self, ms):
        pass


def test_device_and_host_timers_with_a_fake_clock():
    calls = [lambda: sum(range(2000)), lambda: sum(range(2000))]
    dev = timing.time_device(calls, FakeClock(), warmup=2, repeats=12, budget_s=1.0)
    assert dev["n_runs"] == 12 and dev["ms_min"] <= dev["ms_median"] <= dev["ms_max"]
    host = timing.time_host(calls, FakeClock(), warmup=1, runs=dev["n_runs"])
    assert host["host_n_runs"] == 12 and host["host_ms_min"] <= host["host_ms_median"] <= host["host_ms_max"]
    dev.pop("host_enqueue_ms_est")
    assert not set(dev) & set(host)  # the launch suite merges both into one row
    row = report.make_row(_row("x", 1)["shape"], "bfloat16", True, "cuflash", "fwd", **dev, **host)
    doc = _gpu_doc()
    doc["suites"]["launch"]["rows"] = [row]
    assert report.validate(doc) == []


# ------------------------------------------------------------------------------------------------
# --plot without matplotlib, captions, progress


def test_plot_without_matplotlib_fails_at_once(no_gpu, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    js = tmp_path / "r.json"
    r = invoke(["--quick", *FAST, "--json", str(js), "--plot", str(tmp_path / "r.png")])
    assert r.exit_code != 0
    assert r.output.strip().splitlines() == ['Error: --plot needs matplotlib, which the bench extra installs: '
                                            'pip install "cuflash[bench]"']
    assert "Traceback" not in r.output and not js.exists()  # before any suite ran


@pytest.mark.parametrize("option,name", [("--json", "r.json"), ("--plot", "r.png")])
def test_unwritable_output_fails_before_running(no_gpu, tmp_path, option, name):
    """A --json / --plot path that cannot be written fails at once, not after the whole run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = invoke(["--quick", *FAST, option, str(blocker / name)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1].startswith(f"Error: {option} {blocker / name}: cannot be written")
    assert "no CUDA GPU visible" not in r.output  # nothing ran


def test_gpu_only_options_are_named_on_the_cpu_path(no_gpu):
    r = invoke(["--quick", *FAST, "--family", "mma", "--backends", "torch-flash"])
    assert r.exit_code == 0, r.output
    assert "--family and --backends apply to GPU runs: not used here" in r.output
    assert "apply to GPU runs" not in invoke(["--quick", *FAST]).output


def test_captions_sort_shapes_numerically():
    from rich.console import Console

    rows = [_row("cuflash", 1.0, n=n) for n in (1024, 512, 1024, 4096)]
    for r, d in zip(rows, (128, 128, 64, 64)):
        r["shape"]["head_dim"] = d
    text = report._caption(rows)
    assert text == "shapes (B x H x N x d): 2x8x512x128, 2x8x1024x64, 2x8x1024x128, 2x8x4096x64"
    console = Console(record=True, width=200)
    report.render(console, {"seqlen": {"platform": "gpu", "status": "ok", "seconds": 1.0, "rows": rows}})
    assert "2x8x512x128, 2x8x1024x64, 2x8x1024x128" in " ".join(console.export_text().split())
    assert report._caption([_row("x", 1, n=n) for n in (16384, 2048, 512)]).endswith("512x128, 2x8x2048x128, "
                                                                                     "2x8x16384x128")


def test_progress_bar_only_on_a_terminal():
    import io

    from rich.console import Console

    quiet = io.StringIO()
    with command.ProgressBar(Console(file=quiet, force_terminal=False), 3) as bar:
        bar.advance("seqlen", "B=2 H=8 N=512 d=128 cuflash")
    assert bar.bar is None and quiet.getvalue() == ""
    live = io.StringIO()
    with command.ProgressBar(Console(file=live, force_terminal=True, width=150), 3) as bar:
        bar.advance("seqlen", "B=2 H=8 N=512 d=128 cuflash")
        bar.bar.refresh()
    out = live.getvalue()
    assert "seqlen: B=2 H=8 N=512 d=128 cuflash" in out and "0/3" in out and "left" in out


# ------------------------------------------------------------------------------------------------
# The GPU code paths of every suite, run on the CPU with fake implementations and clocks


class FakeImpl:
    """Stands in for Cuflash, Conventional, TorchSDPA: the same interface, host arrays, no work."""

    clock = "fake"
    memory = "fake"

    def __init__(self, name="cuflash", backend="cuda", layout="bshd", torch_inputs=False, raw_backward=False,
                 **variant):
        self.name = name

    def available(self):
        return True, ""

    def context(self):
        import contextlib

        return contextlib.nullcontext()

    def notes(self, dtype):
        return {"matmul": "fake"} if self.name == "conventional" else {}

    def forward(self, case, s):
        return s.q, s.q

    def backward(self, case, s, state):
        return s.q, s.k, s.v

    def calls(self, case, sets, mode):
        return [lambda s=s: self.forward(case, s) for s in sets]


class FakeNvml:
    def measure(self, call, sync, *, window_s, est_ms, idle_w):
        for i in range(3):
            call(i)
        return {"calls": 3, "window_s": 0.01, "ms_per_call": 1.0, "joules_per_call_above_idle": 1.0,
                "joules_per_call": 1.2, "avg_power_above_idle_w": 500.0, "avg_power_w": 600.0}

    def close(self):
        pass


def test_every_gpu_suite_with_fakes(monkeypatch):
    from rich.console import Console

    from cuflash import _compile
    from cuflash.backends import cuda
    from cuflash.benchmark import baselines, memory, suites

    monkeypatch.setattr(suites, "gpu_impls", lambda names: [FakeImpl(n) for n in names])
    monkeypatch.setattr(suites, "Cuflash", FakeImpl)
    monkeypatch.setattr(suites, "TorchSDPA", FakeImpl)
    monkeypatch.setattr(suites, "Conventional", lambda: FakeImpl("conventional"))
    monkeypatch.setattr(suites.Runner, "_inputs",
                        lambda self, case, n_sets=1, seed=None: [baselines.cpu_inputs(case, 0)] * n_sets)
    monkeypatch.setattr(suites.Runner, "_l2_bytes", lambda self: 2**20)
    monkeypatch.setattr(suites.Runner, "_graph_row", lambda self, case, mode, fn: suites.row(
        case, "cuflash-graph", mode, **timing.time_call([fn], FakeClock(), warmup=1, repeats=10, budget_s=0.1)))

    def energy_setup(self):
        self.nvml, self.idle_w = FakeNvml(), 100.0

    monkeypatch.setattr(suites.Runner, "_energy_setup", energy_setup)
    monkeypatch.setattr(timing, "clock", lambda kind: FakeClock())
    monkeypatch.setattr(memory, "measure_peak", lambda allocator, fn: {"peak_bytes": 1000, "allocator": "fake"}
                        if fn() is not None else None)
    monkeypatch.setattr(memory, "free_gpu_caches", lambda: None)
    monkeypatch.setattr(baselines, "bhsd", lambda s: s)
    compiled = []
    monkeypatch.setattr(cuda, "compute_capability", lambda: 90)  # a Hopper GPU: the forward's family is sm90
    monkeypatch.setattr(_compile, "precompile", lambda cfgs, jobs, progress: [
        (compiled.append(c), progress(c, i, len(cfgs))) for i, c in enumerate(cfgs, 1)])

    steps = []
    # the GPU paths of train and decode on the CPU: tests/test_bench_train.py, tests/test_bench_decode.py
    names = tuple(n for n in SUITES if n not in ("train", "decode"))
    s = Settings(suites=names, quick=True, seqlens=(16, 32), batch=1, heads=1, head_dim=16, repeats=10,
                 cell_seconds=0.05)
    runner = suites.Runner(s, advance=lambda suite, text: steps.append(suite))
    out = runner.run("gpu")
    assert len(steps) == suites.total_steps(s, "gpu", 90) and compiled and steps[0] == "precompile"
    doc = report.document(report.make_meta(s.options(), "gpu", None, notes=runner.notes), out)
    assert report.validate(doc) == []
    assert {n: x["status"] for n, x in doc["suites"].items()} == {n: "ok" for n in names}, \
        "\n".join(x.get("traceback") or "" for x in doc["suites"].values())
    rows = [r for x in doc["suites"].values() for r in x["rows"]]
    fam = {(r["implementation"], r["dtype"], r["mode"]): r["family"] for r in doc["suites"]["seqlen"]["rows"]}
    assert fam[("cuflash", "bfloat16", "fwd")] == "sm90" and fam[("cuflash", "bfloat16", "fwd_bwd")] == "sm90"
    variants = {r["variant"]: r["family"] for r in doc["suites"]["variants"]["rows"]
                if r["implementation"] == "cuflash" and r["mode"] == "fwd"}
    assert variants["plain"] == "sm90" and variants["varlen"] == "sm90"
    fam = {(r["implementation"], r["dtype"]): r["family"] for r in rows}
    assert fam[("cuflash", "float32")] == "simt"
    assert any(c.family == "sm90" for c in compiled)
    assert fam[("torch-cudnn", "bfloat16")] == "cudnn" and fam[("conventional", "bfloat16")] == "conventional"
    assert doc["suites"]["accuracy"]["matmul"] == {dt: "fake" for dt in ("float32", "float16", "bfloat16")}

    launch = doc["suites"]["launch"]
    assert [x["seqlen"] for x in launch["params"]["shapes"]] == [16, 32]
    impls = ["cuflash-cupy", "cuflash-torch", "torch-flash", "torch-cudnn", "cuflash-graph"]
    assert [r["implementation"] for r in launch["rows"]] == impls * 4  # 2 shapes x (fwd, bwd)
    for r in launch["rows"]:
        assert r["host_us_median"] == pytest.approx(r["host_ms_median"] * 1e3) and r["n_runs"] >= 10
        assert "back to back behind a spin kernel" in r["method"] and r["family"] in ("sm90", "mma", "torch-flash", "cudnn")
    ct = [r for r in launch["rows"] if r["implementation"] == "cuflash-torch"]
    assert all(r["host_ratio_vs_torch-flash"] > 0 and r["host_ratio_vs_torch-cudnn"] > 0 for r in ct)

    console = Console(record=True, width=250)
    report.render(console, doc["suites"])
    text = console.export_text()
    assert "launch (gpu, ok" in text and "host us per cached call" in text and "device ms per call" in text
    assert "cuflash-torch / torch-cudnn" in text and "torch-cudnn (cudnn)" in text and "cuflash-cupy (sm90)" in text
    assert "no sync between calls" in text
    assert "energy: idle power 100 W subtracted" in text
    md = report.markdown(doc["suites"])
    assert "| B x H x N x d | mode | cuflash-cupy (sm90) | cuflash-torch (sm90) | torch-flash |" in md


def test_refusals_as_unavailable():
    """A baseline that raises becomes Unavailable with its error and warnings; out of memory does not."""
    import warnings

    from cuflash.benchmark.baselines import Unavailable, refusals_as_unavailable

    with pytest.raises(Unavailable, match=r"ValueError: no kernel; backend declined: head dim"):
        with refusals_as_unavailable():
            warnings.warn("backend declined: head dim\nmore detail")
            raise ValueError("no kernel")

    class OutOfMemoryError(RuntimeError):
        pass

    with pytest.raises(OutOfMemoryError):
        with refusals_as_unavailable():
            raise OutOfMemoryError("CUDA out of memory")


def test_variant_tiles_count_the_mask_alone():
    # softcap, ALiBi and dropout pick other tiles than plain attention: tiles / plain must still read 1 for them,
    # and a window's count must fall with its width
    from cuflash.benchmark.suites import Case, tiles_visited

    case = Case(2, 8, 8192, 8192, 128, "bfloat16", True)
    plain = tiles_visited("plain", case)
    for name in ("softcap", "alibi", "dropout", "gqa", "varlen"):
        assert tiles_visited(name, case) == plain, name
    narrow, wide = tiles_visited("window-1024", case), tiles_visited("window-4096", case)
    assert narrow < wide < plain
    assert abs(narrow / plain - 0.26) < 0.03  # 1024 of about 4096 keys a causal row sees on average
