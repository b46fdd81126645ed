"""cuflash._interop.gpu_status: why no GPU can be used, in plain words (monkeypatched driver and CuPy).

gpu_status is cached (lru_cache): these tests call the undecorated function, gpu_status.__wrapped__, so
that nothing they fake leaks into the cached answer the rest of the suite uses.
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from cuflash import _interop

status = _interop.gpu_status.__wrapped__


class FakeCudaError(RuntimeError):
    """What CuPy raises for a failing runtime call: the CUDA error code in `.status`."""

    def __init__(self, code: int, name: str):
        super().__init__(f"{name}: some CUDA text")
        self.status = code


def fake_cupy(*, driver=13000, runtime=13020, count=1, error=None):
    """A stand-in for `cupy` with just the runtime calls gpu_status makes."""

    def get_device_count():
        if error is not None:
            raise error
        return count

    rt = types.SimpleNamespace(driverGetVersion=lambda: driver, runtimeGetVersion=lambda: runtime,
                               getDeviceCount=get_device_count)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))


@pytest.fixture
def driver_loads(monkeypatch):
    """ctypes.CDLL succeeds for every library (the driver is there); records what was loaded."""
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **kw: loaded.append(name) or object())
    return loaded


@pytest.fixture
def no_driver(monkeypatch):
    def refuse(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", refuse)


def use_cupy(monkeypatch, cupy):
    monkeypatch.setitem(sys.modules, "cupy", cupy)


def test_no_driver_library(monkeypatch, no_driver):
    use_cupy(monkeypatch, fake_cupy(driver=0, error=FakeCudaError(35, "cudaErrorInsufficientDriver")))
    ok, why = status()
    assert not ok
    assert why == ("no NVIDIA driver found (cannot load libcuda.so.1: cannot open shared object file: "
                   "No such file or directory)")


def test_no_driver_is_said_before_cupy_problems(monkeypatch, no_driver):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    ok, why = status()
    assert not ok and why.startswith("no NVIDIA driver found (")


def test_driver_version_zero_means_no_driver(monkeypatch, driver_loads):
    use_cupy(monkeypatch, fake_cupy(driver=0, error=FakeCudaError(35, "cudaErrorInsufficientDriver")))
    ok, why = status()
    assert not ok
    assert why == "no NVIDIA driver found (the CUDA runtime reports driver version 0)"
    assert driver_loads == ["libcuda.so.1"]


def test_cupy_not_importable(monkeypatch, driver_loads):
    monkeypatch.setitem(sys.modules, "cupy", None)
    ok, why = status()
    assert not ok
    assert why.startswith("CuPy is not importable (ModuleNotFoundError: ") and "cuflash[cuda13]" in why


def test_driver_older_major_than_cupy(monkeypatch, driver_loads):
    use_cupy(monkeypatch, fake_cupy(driver=12040, runtime=13020, error=FakeCudaError(35, "cudaErrorInsufficientDriver")))
    ok, why = status()
    assert not ok
    assert why == ("driver too old for this CuPy (driver supports CUDA 12.4, CuPy needs CUDA 13.0 or newer "
                   "(its runtime is 13.2)); update the NVIDIA driver or install cuflash[cuda12]")


def test_driver_too_old_same_major(monkeypatch, driver_loads):
    use_cupy(monkeypatch, fake_cupy(driver=12000, runtime=12080, error=FakeCudaError(35, "cudaErrorInsufficientDriver")))
    ok, why = status()
    assert not ok
    assert why == "driver too old for this CuPy (driver supports CUDA 12.0, CuPy needs CUDA 12.8)"


def test_driver_too_old_unknown_versions(monkeypatch, driver_loads):
    def boom():
        raise FakeCudaError(35, "cudaErrorInsufficientDriver")

    cupy = fake_cupy(error=FakeCudaError(35, "cudaErrorInsufficientDriver"))
    cupy.cuda.runtime.driverGetVersion = boom
    cupy.cuda.runtime.runtimeGetVersion = boom
    use_cupy(monkeypatch, cupy)
    ok, why = status()
    assert not ok
    assert why == "driver too old for this CuPy (driver supports an unknown CUDA version, CuPy needs a newer CUDA)"


def test_no_device_error(monkeypatch, driver_loads):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    use_cupy(monkeypatch, fake_cupy(error=FakeCudaError(100, "cudaErrorNoDevice")))
    ok, why = status()
    assert not ok
    assert why == "no CUDA device visible (the NVIDIA driver is loaded but reports no GPU)"


@pytest.mark.parametrize("visible", ["", "-1"])
def test_no_device_names_cuda_visible_devices(monkeypatch, driver_loads, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    use_cupy(monkeypatch, fake_cupy(error=FakeCudaError(100, "cudaErrorNoDevice")))
    assert status() == (False, f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})")
    use_cupy(monkeypatch, fake_cupy(count=0))
    assert status() == (False, f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})")


def test_other_cuda_error(monkeypatch, driver_loads):
    use_cupy(monkeypatch, fake_cupy(error=FakeCudaError(999, "cudaErrorUnknown")))
    ok, why = status()
    assert not ok
    assert why == "CUDA cannot be initialized (FakeCudaError: cudaErrorUnknown: some CUDA text)"


def test_gpu_present(monkeypatch, driver_loads):
    use_cupy(monkeypatch, fake_cupy(count=2))
    assert status() == (True, "")


def test_this_machine():
    """The real answer: where libcuda.so.1 cannot be loaded, it is 'no NVIDIA driver found'."""
    try:
        ctypes.CDLL(_interop._driver_library())
        driver = True
    except OSError:
        driver = False
    ok, why = _interop.gpu_status()
    if not driver:
        assert not ok and why.startswith("no NVIDIA driver found (cannot load "), why
    else:
        assert not why.startswith("no NVIDIA driver found (cannot load"), why
        assert ok == (why == "")
