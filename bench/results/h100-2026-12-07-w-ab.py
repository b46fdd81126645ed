"""Times per shape, in turns: the backward (plain, atomic dQ) and the forward (sm90; mma at d = 128).
python3 ab.py OUT.json [bwd]"""
import json, sys
sys.path.insert(0, "bench")
from deterministic import inputs, ms_in_turns
import cuflash
from cuflash import config
BWD = ((2, 8, 1024, 128), (2, 8, 8192, 128), (2, 16, 8192, 64), (2, 4, 8192, 256))
FWD = (("sm90", 16, 16, 1024, 64), ("sm90", 2, 16, 4096, 64), ("sm90", 2, 16, 8192, 64), ("sm90", 2, 8, 2048, 128),
       ("sm90", 2, 8, 8192, 128), ("mma", 2, 8, 8192, 128))
fs, keys = [], []
for b, h, n, d in BWD:
    q, k, v, do = inputs(b, h, n, d)
    for causal in (True, False):
        o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal)
        fs.append(lambda do=do, q=q, k=k, v=v, o=o, lse=lse, causal=causal:
                  cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal))
        keys.append(("bwd", "auto", [b, h, n, d], causal))
def forward(family, q, k, v, causal):
    with config.kernel_family(family):
        return cuflash.flash_attn_forward(q, k, v, causal=causal)
for family, b, h, n, d in FWD if sys.argv[2:] != ["bwd"] else ():
    q, k, v, _ = inputs(b, h, n, d)
    for causal in (True, False):
        fs.append(lambda family=family, q=q, k=k, v=v, causal=causal: forward(family, q, k, v, causal))
        keys.append(("fwd", family, [b, h, n, d], causal))
rows = []
for (mode, family, shape, causal), ms in zip(keys, ms_in_turns(fs)):
    rows.append({"mode": mode, "family": family, "shape": shape, "causal": causal, "ms": round(ms, 4)})
    print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
