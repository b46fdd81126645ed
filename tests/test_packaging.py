"""kernels_cu/ is found from the source tree / an editable install and from an installed wheel."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cuflash import _compile

ROOT = Path(__file__).resolve().parent.parent


def test_found_from_source_tree():
    d = _compile.kernels_dir()
    assert (d / "params.cuh").is_file()
    assert d == ROOT / "kernels_cu"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources, so that setuptools' build/ lands there, not here."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("cuflash", "kernels_cu"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    build_before = (ROOT / "build").exists()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (ROOT / "build").exists() == build_before, "building the wheel left build/ in the source tree"
    (whl,) = out.glob("cuflash-*.whl")
    return whl


def test_wheel_ships_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (ROOT / "kernels_cu").iterdir():
        assert f"cuflash/kernels_cu/{f.name}" in names, f"{f.name} missing from the wheel"


def test_found_from_installed_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import cuflash._compile as c; d = c.kernels_dir(); print(d);"
        "assert (d / 'params.cuh').is_file(); assert 'site' in str(d);"
        "assert 'flash_fwd' in c.source_text('flash_fwd.cu')"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
