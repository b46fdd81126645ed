"""Is the tensor-bound forward power-limited? Each implementation runs back to back for ~1.5 s (after 1 s idle),
CUDA events around every batch of 10 calls; NVML samples SM clock, power and throttle reasons every 10 ms."""
import json, sys, threading, time
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import pynvml
import cuflash

pynvml.nvmlInit(); hnd = pynvml.nvmlDeviceGetHandleByIndex(0)
samples, stop = [], threading.Event()
def sampler():
    while not stop.is_set():
        samples.append((time.perf_counter(), pynvml.nvmlDeviceGetClockInfo(hnd, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(hnd) / 1000.0,
                        pynvml.nvmlDeviceGetCurrentClocksEventReasons(hnd)))
        time.sleep(0.01)
th = threading.Thread(target=sampler, daemon=True); th.start()
out = []
for b, h, d, causal in ((2, 8, 128, False), (2, 16, 64, False), (2, 8, 128, True)):
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fl = 4 * b * h * n * n * d / (2 if causal else 1)
    impls = {"cuflash": lambda: cuflash.flash_attn_forward(q, k, v, causal=causal)}
    def dnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    impls["cudnn"] = dnn
    for name in ("cuflash", "cudnn", "cuflash", "cudnn"):
        f = impls[name]
        for _ in range(3): f()
        torch.cuda.synchronize(); time.sleep(1.0)
        series = []; t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10): f()
            e1.record(); e1.synchronize()
            series.append((time.perf_counter() - t0, e0.elapsed_time(e1) / 10))
        t1 = time.perf_counter()
        sm = [s for s in samples if t0 <= s[0] <= t1]
        row = {"b": b, "h": h, "d": d, "causal": causal, "impl": name, "n_batches": len(series),
               "ms_first": series[0][1], "ms_median": sorted(x[1] for x in series)[len(series) // 2],
               "ms_last_third": sorted(x[1] for x in series[2 * len(series) // 3:])[len(series) // 6],
               "tflops_median": fl / sorted(x[1] for x in series)[len(series) // 2] / 1e9,
               "clock_mean": sum(s[1] for s in sm) / max(1, len(sm)), "clock_min": min((s[1] for s in sm), default=0),
               "power_mean": sum(s[2] for s in sm) / max(1, len(sm)), "power_max": max((s[2] for s in sm), default=0),
               "reasons": sorted({s[3] for s in sm}),
               "series": [(round(t, 4), round(m, 4)) for t, m in series][::5],
               "clock_series": [(round(s[0] - t0, 3), s[1], round(s[2])) for s in sm][::5]}
        print(json.dumps({k: v for k, v in row.items() if "series" not in k}), flush=True)
        out.append(row)
stop.set()
json.dump(out, open(sys.argv[1], "w"))
