"""Energy per call from NVML's total-energy counter (mJ since the driver loaded).

The counter updates about every 100 ms, so each window starts and ends on an update (we poll
until the value changes) and lasts 2 s or more. Idle power is measured the same way with the GPU
doing nothing, and subtracted: J/call above idle = (E - P_idle * T) / calls.
"""

from __future__ import annotations

import time
from typing import Callable


class Nvml:
    def __init__(self):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = self._handle()
        # Fails here (NVMLError_NotSupported) where the board has no energy counter.
        pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def _handle(self):
        nv = self.nv
        try:  # the NVML device that is CuPy's current device (CUDA and NVML order may differ)
            import cupy

            bus = cupy.cuda.Device().pci_bus_id
            return nv.nvmlDeviceGetHandleByPciBusId(bus.encode() if isinstance(bus, str) else bus)
        except Exception:
            return nv.nvmlDeviceGetHandleByIndex(0)

    def energy_mj(self) -> int:
        return int(self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def driver_version(self) -> str:
        v = self.nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def _next_update(self, timeout_s: float = 0.5) -> tuple[int, float]:
        """(counter, time) at the counter's next change (or after timeout_s)."""
        e0 = self.energy_mj()
        t_end = time.perf_counter() + timeout_s
        while True:
            e = self.energy_mj()
            t = time.perf_counter()
            if e != e0 or t > t_end:
                return e, t
            time.sleep(0.001)

    def idle_watts(self, window_s: float = 2.0) -> float:
        e0, t0 = self._next_update()
        time.sleep(window_s)
        e1, t1 = self._next_update()
        return (e1 - e0) * 1e-3 / (t1 - t0)

    def measure(self, call: Callable[[int], object], sync: Callable[[], None], *, window_s: float,
                est_ms: float, idle_w: float) -> dict:
        """Run call(i) repeatedly for >= window_s, draining the queue every ~50 ms of work."""
        every = max(1, int(50.0 / max(est_ms, 1e-3)))
        sync()
        e0, t0 = self._next_update()
        n = 0
        while True:
            call(n)
            n += 1
            if n % every == 0:
                sync()
                if time.perf_counter() - t0 >= window_s:
                    break
        sync()
        t_busy = time.perf_counter() - t0
        e1, t1 = self._next_update()
        energy = (e1 - e0) * 1e-3
        total = t1 - t0
        above = energy - idle_w * total  # the idle tail after t_busy adds ~0 above idle
        return {
            "calls": n,
            "window_s": t_busy,
            "ms_per_call": t_busy * 1e3 / n,
            "joules_per_call_above_idle": above / n,
            "joules_per_call": (above + idle_w * t_busy) / n,
            "avg_power_above_idle_w": above / t_busy,
            "avg_power_w": above / t_busy + idle_w,
        }

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


def open_nvml() -> tuple[Nvml | None, str]:
    """(Nvml, "") or (None, why not)."""
    try:
        return Nvml(), ""
    except Exception as e:
        return None, f"NVML energy counter unavailable ({type(e).__name__}: {e})"
