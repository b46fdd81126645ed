"""Peak memory of one call, above what was already allocated before it (the inputs' baseline).

GPU, CuPy: `CupyPeakTracker` installs an allocator that forwards to CuPy's default memory pool and
reads the pool's live bytes after every allocation. Live bytes only grow at an allocation, so the
largest value seen after one is the exact peak. GPU, torch: torch's own peak counters.
CPU: tracemalloc (NumPy reports its data buffers to it).
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Callable


class CupyPeakTracker:
    def __init__(self):
        import cupy

        self.cp = cupy
        self.pool = cupy.get_default_memory_pool()
        self.peak = 0
        self._prev = None

    def malloc(self, size: int):
        mem = self.pool.malloc(size)
        used = self.pool.used_bytes()
        if used > self.peak:
            self.peak = used
        return mem

    def __enter__(self):
        self._prev = self.cp.cuda.get_allocator()
        self.cp.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *exc):
        self.cp.cuda.set_allocator(self._prev)
        return False

    def measure(self, fn: Callable[[], object]) -> int:
        """Peak bytes allocated during fn() above the bytes live before it; fn's result is freed."""
        self.cp.cuda.Device().synchronize()
        gc.collect()
        base = self.pool.used_bytes()
        self.peak = base
        out = fn()
        self.cp.cuda.Device().synchronize()
        del out
        gc.collect()
        return int(self.peak - base)


def _torch_if_loaded():
    import sys

    torch = sys.modules.get("torch")
    try:
        return torch if torch is not None and torch.cuda.is_available() else None
    except Exception:
        return None


def gpu_peak(fn: Callable[[], object]) -> tuple[int, int]:
    """(CuPy pool peak, torch allocator peak) of one call, each above its own baseline.

    Both are read because a call may allocate through both (the conventional baseline multiplies
    bf16 through torch where CuPy cannot); their sum bounds the call's true peak from above and
    equals it when the two peaks coincide.
    """
    torch = _torch_if_loaded()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tbase = torch.cuda.memory_allocated()
    with CupyPeakTracker() as tracker:
        cpeak = tracker.measure(fn)
    tpeak = 0
    if torch is not None:
        torch.cuda.synchronize()
        tpeak = max(0, torch.cuda.max_memory_allocated() - tbase)
    return int(cpeak), int(tpeak)


def torch_peak(fn: Callable[[], object]) -> int:
    """Peak bytes torch's caching allocator handed out during fn(), above those live before it."""
    import torch

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def free_gpu_caches() -> None:
    """Return cached blocks of CuPy's pool and torch's allocator, so one does not starve the other."""
    gc.collect()
    try:
        import cupy

        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:
        pass
    try:
        import sys

        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    except Exception:
        pass


def measure_peak(allocator: str, fn: Callable[[], object]) -> dict:
    """Row fields for the peak of one call: peak_bytes and which allocator saw it ("host", "torch", "cupy")."""
    if allocator == "host":  # tracemalloc, left on or off as it was found
        was = tracemalloc.is_tracing()
        if not was:
            tracemalloc.start()
        try:
            gc.collect()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            fn()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if not was:
                tracemalloc.stop()
        return {"peak_bytes": int(peak), "allocator": "tracemalloc"}
    fn()  # warm: compile, library handles and workspaces stay out of the peak
    free_gpu_caches()
    if allocator == "torch":
        return {"peak_bytes": torch_peak(fn), "allocator": "torch"}
    cpeak, tpeak = gpu_peak(fn)
    return {"peak_bytes": cpeak + tpeak, "allocator": "cupy+torch" if tpeak else "cupy", "cupy_peak_bytes": cpeak,
            "torch_peak_bytes": tpeak}
