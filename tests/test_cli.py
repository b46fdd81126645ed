"""`cuflash --version`, `cuflash info`, `cuflash compile` (CPU paths)."""

import subprocess
import sys

from click.testing import CliRunner

import cuflash
from cuflash import cli
from cuflash._interop import gpu_status


def test_version():
    r = CliRunner().invoke(cli.main, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"cuflash, version {cuflash.__version__}"


def test_info_lists_backends_and_reasons():
    r = CliRunner().invoke(cli.main, ["info"])
    assert r.exit_code == 0, r.output
    assert "cupy" in r.output and "kernel_cache" in r.output
    for name in ("cuda", "numba", "numpy"):
        assert f"  {name}" in r.output
    if not gpu_status()[0]:
        assert "gpu" in r.output and "none (" in r.output
        assert "cuda   no: " in r.output  # and why
    assert "numpy  yes" in r.output


def test_compile_without_gpu_fails_clearly():
    if gpu_status()[0]:
        return
    r = CliRunner().invoke(cli.main, ["compile"])
    assert r.exit_code != 0 and "no GPU to compile for" in r.output


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "cuflash", "--version"], capture_output=True, text=True, check=True)
    assert cuflash.__version__ in out.stdout
