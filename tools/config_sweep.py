"""Compiles every kernel config the dispatcher can return for one family and dtype, not only the compile gate's
sample (config.all_configs: no variant, causal, and every variant at once), and prints ptxas' spills and wgmma
serialization for each. Register pressure is not monotonic in the variant bits, so the sample does not bound the
rest (bench/RESULTS.md, 2026-12-07 (y)). CPU only (NVRTC from cuda-bindings); the Hopper family is about 570
configs a dtype, the mma.sync family about 1,540 (sm_80), at 2-10 s each.

    python3 tools/config_sweep.py sm90|mma [DTYPE [JOBS]]

A line a config: `BAD` (spills, a stack frame or serialized wgmmas) or `ok`, `G` where the gate checks it, then
(config, registers, spill stores, spill loads, stack bytes, serialized). Exit status 1 if any config is BAD.
"""

import itertools
import sys
from concurrent.futures import ProcessPoolExecutor

from cuflash import _compile, config as C

FORWARD_FLAGS = ("local", "window", "softcap", "alibi", "dropout", "varlen", "seqused", "paged", "bounded")
BACKWARD_FLAGS = ("local", "window", "softcap", "alibi", "dropout", "varlen", "deterministic")


def variants(flags):
    """Every variant a call can ask for, by config.variant_bits (its implications: a window is local, pages have
    counts, bounded is a softcap); a KV cache takes no dropout or varlen (api.py rejects those)."""
    out = set()
    for on in itertools.product((False, True), repeat=len(flags)):
        kw = dict(zip(flags, on))
        if kw.get("bounded") and kw.get("alibi"):
            continue  # variant_bits refuses it: ALiBi's bias has no lower bound
        v = C.variant_bits(**kw)
        if not (v & C.SEQUSED and v & (C.DROPOUT | C.VARLEN)):
            out.add(v)
    return sorted(out)


def configs(family: str, dtype: str) -> list:
    cc = 90 if family == "sm90" else 0
    out = set()
    for d in C.HEAD_DIMS:
        for v in variants(FORWARD_FLAGS):
            for keys in (0, *C._KEY_STEPS):  # _TILES_BY_KEYS' tiles
                out.add(C.choose_forward(dtype, d, v, seqlen_k=keys, compute_capability=cc))
        for v in variants(BACKWARD_FLAGS):
            for small_grid in ({}, {"key_slabs": 1, "seqlen_k": 1, "sms": 1 << 20}):  # QUERY_SPLIT, small tiles
                out.add(C.choose_backward(dtype, d, v, compute_capability=cc, **small_grid)[1])
    return sorted((c for c in out if c.family == family),
                  key=lambda c: (c.kernel, c.head_dim, c.variant, c.block_m, c.block_n, c.warps))


def report(cfg):
    r = _compile.ptxas_reports([cfg], cfg.arch or "80")[0]
    return r.registers, r.spill_stores, r.spill_loads, r.stack_bytes, r.serialized


def main(family: str, dtype: str = "bfloat16", jobs: int = 2) -> int:
    cfgs, gated = configs(family, dtype), set(C.all_configs())
    print(f"{len(cfgs)} {family} configs ({dtype}), {sum(c in gated for c in cfgs)} of them in the gate", flush=True)
    bad = 0
    with ProcessPoolExecutor(jobs) as pool:
        for cfg, (regs, stores, loads, stack, serialized) in zip(cfgs, pool.map(report, cfgs)):
            is_bad = bool(stores or loads or stack or serialized)
            bad += is_bad
            print("BAD" if is_bad else "ok ", "G" if cfg in gated else "-", cfg, regs, stores, loads, stack,
                  serialized, flush=True)
    print(f"{bad} of {len(cfgs)} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in ("sm90", "mma"):
        sys.exit(__doc__)
    sys.exit(main(args[0], *args[1:2], *map(int, args[2:3])))
