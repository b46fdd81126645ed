"""Times per shape, in turns, in one process: the backward (auto family: sm90 here) and the Hopper forward.
python3 ab.py OUT.json"""
import json, sys
sys.path.insert(0, "bench")
from deterministic import inputs, ms_in_turns
import cuflash
from cuflash import config
BWD = ((2, 8, 512, 128), (2, 8, 1024, 128), (2, 8, 2048, 128), (2, 8, 8192, 128), (2, 16, 8192, 64))
FWD = ((2, 8, 1024, 128), (2, 8, 2048, 128), (2, 16, 1024, 64))
fs, keys = [], []
for b, h, n, d in BWD:
    q, k, v, do = inputs(b, h, n, d)
    for causal in (True, False):
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        fs.append(lambda do=do, q=q, k=k, v=v, o=o, lse=lse, causal=causal:
                  cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal))
        keys.append(("bwd", [b, h, n, d], causal))
def forward(q, k, v, causal):
    with config.kernel_family("sm90"):
        return cuflash.flash_attn_forward(q, k, v, causal=causal)
for b, h, n, d in FWD:
    q, k, v, _ = inputs(b, h, n, d)
    for causal in (True, False):
        fs.append(lambda q=q, k=k, v=v, causal=causal: forward(q, k, v, causal))
        keys.append(("fwd", [b, h, n, d], causal))
rows = []
for (mode, shape, causal), ms in zip(keys, ms_in_turns(fs)):
    rows.append({"mode": mode, "shape": shape, "causal": causal, "ms": round(ms, 4)})
    print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
