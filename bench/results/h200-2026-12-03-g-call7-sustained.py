"""Rested against sustained: each implementation runs back to back for 1.2 s after a 1 s rest (CUDA events around
every batch of calls); the first batch is the rested GPU's rate, the median of the last half the power-capped
steady state. NVML samples SM clock, power and throttle reasons every 10 ms. bf16, seqlen-suite shapes."""
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
threading.Thread(target=sampler, daemon=True).start()
CELLS = [(2, 8, n, 128, c) for c in (False, True) for n in (4096, 8192, 16384)] + [(2, 16, 8192, 64, False)]
out = []
for b, h, n, d, causal in CELLS:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)
    fl = 4 * b * h * n * n * d / (2 if causal else 1)
    def dnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    def dnn_fb():
        return torch.autograd.grad(dnn(), (qt, kt, vt), dot)
    def cf_fb():
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        return cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal)
    impls = {("fwd", "cuflash"): lambda: cuflash.flash_attn_forward(q, k, v, causal=causal), ("fwd", "cudnn"): dnn,
             ("fwd_bwd", "cuflash"): cf_fb, ("fwd_bwd", "cudnn"): dnn_fb}
    for (mode, name), f in impls.items():
        for _ in range(3): f()
        torch.cuda.synchronize(); time.sleep(1.0)
        series = []; t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.2:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5): f()
            e1.record(); e1.synchronize()
            series.append(e0.elapsed_time(e1) / 5)
        t1 = time.perf_counter()
        sm = [s for s in samples if t0 + 0.6 <= s[0] <= t1]
        half = sorted(series[len(series) // 2:])
        row = {"b": b, "h": h, "n": n, "d": d, "causal": causal, "mode": mode, "impl": name,
               "ms_rested": series[0], "ms_steady": half[len(half) // 2], "batches": len(series),
               "clock_steady_mean": sum(s[1] for s in sm) / max(1, len(sm)),
               "power_steady_max": max((s[2] for s in sm), default=0), "reasons": sorted({s[3] for s in sm})}
        mult = 3.5 if mode == "fwd_bwd" else 1.0
        row["tflops_steady"] = mult * fl / row["ms_steady"] / 1e9
        print(json.dumps(row), flush=True); out.append(row)
stop.set()
json.dump(out, open(sys.argv[1], "w"), indent=1)
