"""Timing: sample statistics, FLOP counts, and the GPU (CUDA event) and host (enqueue) timers.

Device time of one call is measured with a pair of events recorded on the current stream around
the call. A short spin kernel is queued ahead of the timed calls so that the GPU is still busy
while the host enqueues them: the events then bracket device work only, not host gaps (host time
is reported separately, by `time_host`, in the launch suite).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

MIN_RUNS = 10  # every reported figure is the median of at least this many timed runs


def summarize(samples_ms: Sequence[float], prefix: str = "ms") -> dict:
    """{"<prefix>_median", "<prefix>_min", "<prefix>_max", "n_runs"} of a list of times in ms."""
    xs = [float(x) for x in samples_ms]
    if not xs:
        raise ValueError("no samples")
    if any(math.isnan(x) for x in xs):
        raise ValueError("NaN in samples")
    return {
        f"{prefix}_median": statistics.median(xs),
        f"{prefix}_min": min(xs),
        f"{prefix}_max": max(xs),
        "n_runs": len(xs),
    }


def flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool, mode: str) -> int:
    """Nominal FLOPs of one call: cuflash.reference.flops (DESIGN's rule)."""
    from ..reference import flops as ref_flops

    return int(ref_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode))


def tflops(n_flops: float | None, ms: float | None) -> float | None:
    if not n_flops or not ms or ms <= 0:
        return None
    return n_flops / (ms * 1e-3) / 1e12


def repeats_for(estimate_ms: float, repeats: int, budget_s: float) -> int:
    """How many timed runs fit in budget_s, never fewer than MIN_RUNS nor more than `repeats`."""
    repeats = max(MIN_RUNS, repeats)
    if estimate_ms <= 0:
        return repeats
    fit = int(budget_s * 1e3 / estimate_ms)
    return max(MIN_RUNS, min(repeats, fit))


def input_sets_for(set_bytes: int, l2_bytes: int, max_sets: int = 16) -> int:
    """Input sets to rotate among so that one pass over them is at least twice the L2 size."""
    if set_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / set_bytes)))


# ------------------------------------------------------------------------------------------------
# Clocks: the same interface over CuPy and torch events
# ------------------------------------------------------------------------------------------------

_SPIN_SRC = r"""
extern "C" __global__ void cuflash_bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""
_spin_kernel = None


class CupyClock:
    """CUDA events on CuPy's current stream."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy

    def event(self):
        return self.cp.cuda.Event()

    def record(self, ev) -> None:
        ev.record()

    def elapsed_ms(self, a, b) -> float:
        return float(self.cp.cuda.get_elapsed_time(a, b))

    def sync(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def spin(self, ms: float) -> None:
        global _spin_kernel
        if ms <= 0:
            return
        if _spin_kernel is None:
            _spin_kernel = self.cp.RawKernel(_SPIN_SRC, "cuflash_bench_spin")
        _spin_kernel((1,), (1,), (self.cp.uint64(int(ms * 1e6)),))


class TorchClock:
    """torch.cuda.Event on torch's current stream."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def record(self, ev) -> None:
        ev.record()

    def elapsed_ms(self, a, b) -> float:
        return float(a.elapsed_time(b))

    def sync(self) -> None:
        self.torch.cuda.current_stream().synchronize()

    def spin(self, ms: float) -> None:
        if ms > 0:  # torch's own busy-wait kernel, in clock cycles (about 2 GHz on H100/H200)
            self.torch.cuda._sleep(int(ms * 2e6))


def clock(kind: str):
    return TorchClock() if kind == "torch" else CupyClock()


def time_device(calls: Sequence[Callable[[], object]], clk, *, warmup: int, repeats: int,
                budget_s: float, max_spin_ms: float = 200.0) -> dict:
    """Device time per call: median/min/max over >= MIN_RUNS event-timed runs after warm-up.

    calls[i % len(calls)] is run i (rotating input sets). Adapts the number of runs to budget_s.
    Returns summarize(...) plus "host_enqueue_ms_est" (the host time of one probe call).
    """
    n = len(calls)
    for i in range(max(1, warmup)):
        calls[i % n]()
    clk.sync()
    # Probe: one call for a device-time estimate and a host-enqueue estimate.
    a, b = clk.event(), clk.event()
    clk.record(a)
    t0 = time.perf_counter()
    calls[0]()
    host_ms = (time.perf_counter() - t0) * 1e3
    clk.record(b)
    clk.sync()
    est = clk.elapsed_ms(a, b)
    reps = repeats_for(max(est, host_ms), repeats, budget_s)
    starts = [clk.event() for _ in range(reps)]
    ends = [clk.event() for _ in range(reps)]
    # Keep the GPU busy while the host enqueues, so that the events see no host gaps.
    clk.spin(min(max_spin_ms, 1.5 * reps * host_ms + 1.0))
    for i in range(reps):
        clk.record(starts[i])
        calls[i % n]()
        clk.record(ends[i])
    clk.sync()
    out = summarize([clk.elapsed_ms(s, e) for s, e in zip(starts, ends)])
    out["host_enqueue_ms_est"] = host_ms
    return out


def time_host(calls: Sequence[Callable[[], object]], clk, *, warmup: int, runs: int, max_runs: int = 100,
              max_spin_ms: float = 200.0) -> dict:
    """Host enqueue time per call: perf_counter around each call, calls back to back behind a spin
    kernel, as in a loop that runs ahead of the GPU. The spin keeps the GPU busy, so no call waits
    on the device, and the queue stays far from full (at most max_runs calls are in it); nothing is
    synchronized between calls, so no call pays for waking up after a sync.
    """
    n = len(calls)
    for i in range(max(1, warmup)):
        calls[i % n]()
    clk.sync()
    t0 = time.perf_counter()
    calls[0]()
    est_ms = (time.perf_counter() - t0) * 1e3
    clk.sync()
    runs = max(MIN_RUNS, min(runs, max_runs))
    clk.spin(min(max_spin_ms, 3.0 * runs * est_ms + 2.0))
    xs = []
    for i in range(runs):
        t0 = time.perf_counter()
        calls[i % n]()
        xs.append((time.perf_counter() - t0) * 1e3)
    clk.sync()
    out = summarize(xs, prefix="host_ms")
    out["host_n_runs"] = out.pop("n_runs")
    return out


HOST_TIMING = ("host us: median time.perf_counter() around each cached call, the calls run back to back behind "
               "a spin kernel (the GPU busy, the queue far from full, no sync between calls); device ms: CUDA "
               "events around each of the same calls, run back to back behind a spin kernel")


def time_call(calls: Sequence[Callable[[], object]], clk, *, warmup: int, repeats: int, budget_s: float) -> dict:
    """Device time and host time per call of the same calls: what every launch-suite row reports."""
    dev = time_device(calls, clk, warmup=warmup, repeats=repeats, budget_s=budget_s)
    dev.pop("host_enqueue_ms_est")
    host = time_host(calls, clk, warmup=1, runs=dev["n_runs"])
    return {**dev, **host, "host_us_median": host["host_ms_median"] * 1e3,
            "host_over_device": host["host_ms_median"] / dev["ms_median"] if dev["ms_median"] > 0 else None,
            "method": HOST_TIMING}
