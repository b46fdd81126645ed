"""`cuflash --version`, `cuflash info`, `cuflash compile`.

Every test asserts on a machine with a GPU and on one without: the no-GPU paths hide the GPU by
monkeypatching `cli.gpu_status`, and precompile's progress callback runs on fakes.
"""

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import cuflash
from cuflash import _compile, cli, config
from cuflash._interop import gpu_status


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli, "gpu_status", lambda: (False, "test: GPU hidden"))


def test_version():
    r = CliRunner().invoke(cli.main, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"cuflash, version {cuflash.__version__}"


def test_info_lists_backends_and_reasons():
    r = CliRunner().invoke(cli.main, ["info"])
    assert r.exit_code == 0, r.output
    assert "cupy" in r.output and "kernel_cache" in r.output
    for name in ("cuda", "numba", "numpy"):
        assert re.search(rf"^  {name} +(yes|no: \S)", r.output, re.M), name  # available, or why not
    assert "numpy  yes" in r.output
    if gpu_status()[0]:
        assert re.search(r"^compute_capability +\d+\.\d+$", r.output, re.M) and "cuda   yes" in r.output
    else:
        assert re.search(r"^gpu +none \(.+\)$", r.output, re.M) and "cuda   no: " in r.output


def test_info_without_gpu_says_why(no_gpu):
    r = CliRunner().invoke(cli.main, ["info"])
    assert r.exit_code == 0, r.output
    assert re.search(r"^gpu +none \(test: GPU hidden\)$", r.output, re.M)
    assert "compute_capability" not in r.output


def test_compile_without_gpu_fails_clearly(no_gpu):
    r = CliRunner().invoke(cli.main, ["compile"])
    assert r.exit_code != 0
    assert r.output.strip() == "Error: no GPU to compile for: test: GPU hidden"


def test_compile_reports_and_shows_no_progress_off_a_terminal(monkeypatch):
    """With output not a terminal (CliRunner), `cuflash compile` prints its one result line only."""
    calls = []

    def fake_precompile(cfgs, jobs, progress):
        calls.append((len(cfgs), jobs))
        for i, cfg in enumerate(cfgs, 1):
            progress(cfg, i, len(cfgs))
        return len(cfgs)

    monkeypatch.setattr(cli, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(_compile, "precompile", fake_precompile)
    r = CliRunner().invoke(cli.main, ["compile", "-j", "3", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    n = len([c for c in config.all_configs() if c.dtype == "float32"])
    assert calls == [(n, 3)]
    assert re.fullmatch(rf"compiled {n} kernel configs in \d+\.\d s \(3 jobs\)\n", r.output), r.output
    # the dtype names `cuflash bench` takes, aliases too; a wrong one is a usage error
    r = CliRunner().invoke(cli.main, ["compile", "--dtype", "bf16", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert calls[-1][0] == len([c for c in config.all_configs() if c.dtype in ("bfloat16", "float32")])
    r = CliRunner().invoke(cli.main, ["compile", "--dtype", "int8"])
    assert r.exit_code == 2 and "'int8' is not a dtype" in r.output


class FakeDevice:
    # between the smallest sm_90a config's shared memory and the largest other's: some configs drop out by
    # size, and the sm_90a kernels, some of which would fit, by compute capability
    attributes = {"MaxSharedMemoryPerBlockOptin": 150_000}
    compute_capability = "86"


@pytest.mark.parametrize("jobs", [1, 4])
def test_precompile_calls_progress_once_per_config(monkeypatch, jobs):
    """precompile's callback, without a GPU: the kernel build and the process pool are faked."""
    import concurrent.futures

    cupy = pytest.importorskip("cupy")

    class ThreadPool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers, mp_context=None):
            super().__init__(max_workers)

    built = []
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(_compile, "kernel", built.append)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", ThreadPool)
    cfgs = config.all_configs()
    fits = [c for c in cfgs if c.smem_bytes <= FakeDevice.attributes["MaxSharedMemoryPerBlockOptin"] and c.arch is None]
    assert any(c.arch and c.smem_bytes <= FakeDevice.attributes["MaxSharedMemoryPerBlockOptin"] for c in cfgs)
    assert 0 < len(fits) < len(cfgs)
    seen = []
    n = _compile.precompile(cfgs, jobs=jobs, progress=lambda cfg, done, total: seen.append((cfg, done, total)))
    assert n == len(fits)
    assert sorted(map(repr, (c for c, _, _ in seen))) == sorted(map(repr, fits))  # each config once
    assert [d for _, d, _ in seen] == list(range(1, n + 1)) and {t for _, _, t in seen} == {n}
    assert len(built) == n if jobs == 1 else len(built) == 2 * n  # built in the pool, then loaded here
    assert _compile.precompile(cfgs[:2], jobs=jobs) == 2  # and the callback stays optional


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "cuflash", "--version"], capture_output=True, text=True, check=True)
    assert cuflash.__version__ in out.stdout
