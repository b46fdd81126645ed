"""`cuflash bench`: latency, throughput, memory, launch overhead, accuracy and energy of cuflash
against a conventional materialized attention and PyTorch's SDPA backends.

Modules: timing (statistics, CUDA-event and host timers), memory (peak-allocation trackers),
energy (NVML), baselines (the implementations being compared), suites (what each suite runs),
report (JSON schema, meta, ratio columns, tables), plots (matplotlib), command (the click command).
Nothing here imports CuPy, torch or NVML at module import time: the command must run without a GPU.
"""

SUITES = ("seqlen", "headdim", "memory", "launch", "accuracy", "energy", "variants")

__all__ = ["SUITES"]
