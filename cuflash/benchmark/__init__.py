"""`cuflash bench`: latency, throughput, memory, launch overhead, accuracy and energy of cuflash
against a conventional materialized attention and PyTorch's SDPA backends, decoding over a KV cache
(decode), and the end-to-end step of a small GPT trained with each (train).

Modules: timing (statistics, CUDA-event and host timers), memory (peak-allocation trackers),
energy (NVML), baselines (the implementations being compared), suites (what each suite runs),
report (JSON schema, meta, ratio columns, tables), plots (matplotlib), command (the click command),
train (the train suite's GPT, its training step and the attention-kernel classifier), decode (the
decode suite's cells, inputs and bandwidth columns).
Nothing here imports CuPy, torch or NVML at module import time: the command must run without a GPU.
"""

SUITES = ("seqlen", "headdim", "memory", "launch", "accuracy", "energy", "variants", "train", "decode")

__all__ = ["SUITES"]
