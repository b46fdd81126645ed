"""The decode suite (cuflash alone) twice in one process, every time_device call's per-call times kept."""
import json, runpy, sys
import cuflash.benchmark.timing as T

log = []
_orig = T.summarize
def keep(xs, *a, **k):
    if not k.get("prefix"):
        log.append([round(x * 1e3, 1) for x in xs])
    return _orig(xs, *a, **k)
T.summarize = keep
for run in range(2):
    sys.argv = ["cuflash", "bench", "--suite", "decode", "--backends", "cuflash", "--json", f"{sys.argv[1]}.{run}.json"]
    try:
        runpy.run_module("cuflash", run_name="__main__")
    except SystemExit:
        pass
    print("RUN", run, flush=True)
    for xs in log:
        print(xs, flush=True)
    log.clear()
