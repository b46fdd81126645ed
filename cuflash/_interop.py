"""Any array in, the same kind out.

NumPy arrays are used as they are by the CPU backends and copied to the GPU for the device ones;
CuPy arrays are used as they are; any other DLPack producer (torch, JAX, ...) is imported zero-copy
with `cupy.from_dlpack` (device) or `numpy.from_dlpack` (host), and the results are handed back
through the producer's own `from_dlpack`, so a torch tensor in gives a torch tensor out.

Streams: DLPack's stream handshake orders the import and export against the producer's stream. For
torch, the call runs on torch's current stream itself (Stream.from_external), which needs no handshake
and also avoids torch refusing CuPy's per-thread default stream value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np


# CUDA runtime error codes that gpu_status turns into plain words.
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
_CUDA_ERROR_NO_DEVICE = 100  # cudaErrorNoDevice


def _driver_library() -> str:
    """The NVIDIA driver's CUDA library, as the CUDA runtime itself loads it."""
    import sys

    return "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


def _driver_load_error() -> str | None:
    """None when the NVIDIA driver's CUDA library loads, else the loader's reason."""
    import ctypes

    lib = _driver_library()
    try:
        ctypes.CDLL(lib)
    except OSError as e:
        reason = str(e) or type(e).__name__
        return reason[len(lib) + 2:] if reason.startswith(lib + ": ") else reason  # dlerror repeats the name
    return None


def _cuda_version(v: int) -> str:
    """A CUDA version number (12040) as text ("12.4")."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _driver_too_old(driver: int | None, runtime) -> str:
    """The reason for cudaErrorInsufficientDriver: what the driver supports, what CuPy needs."""
    try:
        rt = int(runtime.runtimeGetVersion())
    except Exception:
        rt = None
    has = f"CUDA {_cuda_version(driver)}" if driver else "an unknown CUDA version"
    if rt is None:
        needs = "a newer CUDA"
    elif driver and driver // 1000 == rt // 1000:
        needs = f"CUDA {_cuda_version(rt)}"
    else:  # CUDA's minor version compatibility: any driver of the runtime's major version will do
        needs = f"CUDA {rt // 1000}.0 or newer (its runtime is {_cuda_version(rt)})"
    why = f"driver too old for this CuPy (driver supports {has}, CuPy needs {needs})"
    if driver and rt is not None and driver // 1000 in (12, 13) and driver // 1000 < rt // 1000:
        why += f"; update the NVIDIA driver or install cuflash[cuda{driver // 1000}]"
    return why


def _no_device() -> str:
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})"
    return "no CUDA device visible (the NVIDIA driver is loaded but reports no GPU)"


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(a CUDA GPU is usable through CuPy, why not).

    The reasons, checked in this order: "no NVIDIA driver found (...)" when the driver's CUDA
    library (libcuda.so.1) cannot be loaded; "CuPy is not importable (...)"; "no NVIDIA driver
    found (...)" again when the CUDA runtime reports driver version 0; "driver too old for this CuPy (driver supports
    CUDA X, CuPy needs Y)" for cudaErrorInsufficientDriver; "no CUDA device visible (...)" for cudaErrorNoDevice or a
    device count of 0; any other CUDA error as "CUDA cannot be initialized (...)".
    """
    load_error = _driver_load_error()
    if load_error is not None:
        return False, f"no NVIDIA driver found (cannot load {_driver_library()}: {load_error})"
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install
        return False, f"CuPy is not importable ({type(e).__name__}: {e}); install cuflash[cuda12] or cuflash[cuda13]"
    runtime = cupy.cuda.runtime
    try:
        driver = int(runtime.driverGetVersion())
    except Exception:
        driver = None
    if driver == 0:  # cudaDriverGetVersion's answer when no driver is installed
        return False, "no NVIDIA driver found (the CUDA runtime reports driver version 0)"
    try:
        n = runtime.getDeviceCount()
    except Exception as e:
        status = getattr(e, "status", None)
        if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
            return False, _driver_too_old(driver, runtime)
        if status == _CUDA_ERROR_NO_DEVICE:
            return False, _no_device()
        return False, f"CUDA cannot be initialized ({type(e).__name__}: {e})"
    if n == 0:
        return False, _no_device()
    return True, ""


def _module_name(x) -> str:
    return type(x).__module__.split(".")[0]


def is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


def is_cupy(x) -> bool:
    return _module_name(x) == "cupy"


def is_torch(x) -> bool:
    return _module_name(x) == "torch"


@dataclasses.dataclass
class Caller:
    """What the caller handed in: how to give results back, and the stream to run on."""

    kind: str  # "numpy" | "cupy" | "torch" (CUDA tensors) | "dlpack" (any other producer, host torch too)
    namespace: object = None  # the producer's array namespace, for "dlpack"
    device_id: int | None = None  # CUDA device of device arrays
    stream: object = None  # a cupy stream to run on (torch's current stream), or None

    def stream_context(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def new(self, shape, dtype, on_device: bool):
        """A new result array from the caller's allocator: (what the caller gets back, the NumPy or
        CuPy view a backend writes). torch callers get tensors from torch's caching allocator; the
        others get CuPy's pool (or NumPy), converted in `result`."""
        if self.kind == "torch" and on_device:
            import cupy
            import torch

            t = torch.empty(tuple(shape), dtype=getattr(torch, np.dtype(dtype).name),
                            device=torch.device("cuda", self.device_id))
            return t, cupy.from_dlpack(t)
        if on_device:
            import cupy

            w = cupy.empty(shape, dtype=dtype)
        else:
            w = np.empty(shape, dtype=dtype)
        return w, w

    def result(self, y):
        """A result of `new` (or an array the backend made) as the caller's kind."""
        return y if self.kind == "torch" and is_torch(y) else from_working(y, self)


def _is_device_dlpack(x) -> bool:
    dev_type, _ = x.__dlpack_device__()
    return int(dev_type) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def classify(x) -> Caller:
    """How to hand results back to the owner of `x` (q)."""
    if is_numpy(x):
        return Caller("numpy")
    if is_cupy(x):
        return Caller("cupy", device_id=x.device.id)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"q: expected a NumPy or CuPy array or a DLPack producer (torch, JAX...), got {type(x).__name__}")
    if is_torch(x) and x.is_cuda:
        import cupy
        import torch

        device_id = x.get_device()
        return Caller("torch", device_id=device_id,
                      stream=cupy.cuda.Stream.from_external(torch.cuda.current_stream(device_id)))
    from array_api_compat import array_namespace

    ns = array_namespace(x)
    if _is_device_dlpack(x):
        return Caller("dlpack", ns, int(x.__dlpack_device__()[1]))
    return Caller("dlpack", ns)


def to_working(name: str, x, on_device: bool):
    """`x` as a NumPy (host backends) or CuPy (device backends) array, zero-copy where possible."""
    if x is None:
        return None
    if is_torch(x) and x.requires_grad:
        x = x.detach()  # DLPack refuses tensors that require grad; the kernels only read them
    if is_numpy(x):
        if not on_device:
            return x
        import cupy

        if x.dtype.name == "bfloat16":  # host-to-device copy of the raw bits
            return cupy.asarray(x.view(np.uint16)).view(x.dtype)
        return cupy.asarray(x)
    if is_cupy(x):
        if on_device:
            return x
        return to_host(x)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name}: expected a NumPy or CuPy array or a DLPack producer, got {type(x).__name__}")
    if _is_device_dlpack(x):
        import cupy

        arr = cupy.from_dlpack(x)
        return arr if on_device else to_host(arr)
    arr = _host_from_dlpack(name, x)
    if on_device:
        return to_working(name, arr, True)
    return arr


def _host_from_dlpack(name: str, x):
    """A host DLPack producer as a NumPy array. NumPy cannot import bfloat16 through DLPack, so a
    bf16 torch tensor crosses as its 16-bit pattern and other producers through __array__."""
    if "bfloat16" not in str(getattr(x, "dtype", "")):
        return np.from_dlpack(x)
    import ml_dtypes

    if is_torch(x):
        import torch

        return np.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)
    try:
        return np.asarray(x).view(ml_dtypes.bfloat16)
    except Exception as e:
        raise TypeError(f"{name}: a bfloat16 host array of {type(x).__name__} cannot be read without a copy "
                        f"through DLPack ({type(e).__name__}: {e}); pass it on the GPU or as float32") from None


def _host_to_caller(y, namespace):
    """A NumPy result for a host DLPack caller, bfloat16 as its 16-bit pattern (see above)."""
    if y.dtype.name != "bfloat16":
        return namespace.from_dlpack(y)
    bits = namespace.from_dlpack(y.view(np.int16))
    if hasattr(bits, "view") and _module_name(bits) == "torch":
        import torch

        return bits.view(torch.bfloat16)
    return namespace.asarray(y)


def to_host(x):
    import cupy

    if x.dtype.name == "bfloat16":
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype)
    return cupy.asnumpy(x)


def check_devices(**arrays) -> None:
    """Every array on the same device (all host, or all on one GPU)."""
    where = {}
    for name, x in arrays.items():
        if x is None:
            continue
        if is_numpy(x):
            where[name] = "host"
        elif is_cupy(x):
            where[name] = f"cuda:{x.device.id}"
        elif hasattr(x, "__dlpack_device__"):
            try:
                t, i = x.__dlpack_device__()
            except Exception as e:  # a torch meta tensor, say: no memory to hand over
                raise TypeError(f"{name}: its memory cannot be handed over by DLPack "
                                f"({type(e).__name__}: {e})") from None
            where[name] = f"cuda:{int(i)}" if int(t) in (2, 3, 13) else "host"
        else:
            where[name] = "host"
    places = set(where.values())
    if len(places) > 1:
        desc = ", ".join(f"{n} on {w}" for n, w in where.items())
        raise ValueError(f"arrays are on different devices: {desc}")


def from_working(y, caller: Caller):
    """A result array (NumPy or CuPy) as the caller's kind."""
    if y is None:
        return None
    if caller.kind == "numpy":
        return y if is_numpy(y) else to_host(y)
    if caller.kind in ("cupy", "torch"):
        if is_numpy(y):
            y = to_working("result", y, True)
        if caller.kind == "cupy":
            return y
        import torch

        return torch.from_dlpack(y)
    if caller.namespace is not None and hasattr(caller.namespace, "from_dlpack"):
        if caller.device_id is None:
            return _host_to_caller(y if is_numpy(y) else to_host(y), caller.namespace)
        if is_numpy(y):
            y = to_working("result", y, True)
        return caller.namespace.from_dlpack(y)
    return y
