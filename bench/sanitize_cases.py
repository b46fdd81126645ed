"""A tiny sweep of the CUDA kernels for compute-sanitizer (bench/sanitize.sh runs it under memcheck
and racecheck): odd lengths, seqlen_k of 0 and 1, causal rows that see no key, every dtype, head
dims 40 / 64 / 128 / 256, GQA, two grids wide enough for the mma.sync backward's main tile, forward and
backward (non-causal cases deterministic=True: the dQ semaphores; causal ones atomic, which on sm_90 is
the Hopper backward up to d = 128), through the public API with backend="cuda"; then the attention
variants (window, softcap, ALiBi, dropout) on packed varlen batches with an empty sequence, every dtype
(the backward's atomic dQ adds); then flash_attn_with_kvcache, dense and paged caches: the decode
kernel, split and not, and query chunks past its rows (on sm_90 the Hopper forward).

    python3 bench/sanitize_cases.py [--quick] [--family mma|sm90]

Sizes are tiny (a few seconds without the sanitizer): the sanitizer multiplies run time. CuPy's
memory pool is switched off, so every array is its own cudaMalloc of its exact size and memcheck
sees any access past an array's end (inside a pooled chunk it would not). Inputs are contiguous
for the same reason. Each result is also checked, loosely, against the float64 reference on the
host, so a case that runs clean but computes garbage still fails. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np

DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (40, 64, 128, 256)
# (seqlen_q, seqlen_k): odd tails, no keys, one key, causal rows with no key (sq > sk), sq < sk.
SEQLENS = ((1, 1), (17, 0), (33, 1), (65, 47), (3, 130), (130, 3), (64, 64), (71, 200))
# Max |ours - ref64| / max(1, max|ref64|): loose, this is a smoke check (the tests hold the real rule).
TOL = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-4, "float64": 1e-9}


def cases(quick: bool = False):
    """One case per (dtype, head_dim, causal); the seqlen pair rotates so that every pair meets
    every dtype and both causal settings, and the head layout alternates between MHA and GQA."""
    out = []
    for i, (dtype, d, causal) in enumerate(itertools.product(DTYPES, HEAD_DIMS, (False, True))):
        sq, sk = SEQLENS[(i // 2 + 4 * (i % 2)) % len(SEQLENS)]
        b, h, hk = (2, 2, 1) if (i // 2) % 2 else (1, 3, 3)
        out.append((dtype, b, sq, sk, h, hk, d, causal))
    return (out[::3] if quick else out) + WIDE_GRID


# Grids of at least 66 key blocks (half an H200's SMs), so that the mma.sync backward takes its main tile, not
# the small-grid one (config.choose_backward): at d = 128 64 x 128, P^T in dS^T's shared tile.
WIDE_GRID = [("bfloat16", 1, 97, 200, 40, 40, 128, False), ("float16", 1, 200, 200, 80, 40, 128, True)]


# Variant cases: (dtype, head_dim, sequence lengths q, sequence lengths k, heads, kv heads, keywords).
VARIANT_CASES = [
    ("float16", 64, (37, 0, 70), (50, 9, 70), 2, 1, dict(causal=True, window=(20, 0), softcap=2.0, dropout_p=0.2)),
    ("bfloat16", 128, (65, 3), (65, 0), 4, 2, dict(window=(8, 16), alibi_slopes=True, dropout_p=0.3)),
    ("float32", 40, (33, 17, 0), (20, 17, 5), 2, 2, dict(causal=True, softcap=1.5, alibi_slopes=True, dropout_p=0.1)),
    ("float64", 256, (19, 40), (40, 19), 2, 1, dict(window=(5, -1), softcap=3.0, alibi_slopes=True, dropout_p=0.4)),
]


def run_variant_case(dtype, d, lq, lk, h, hk, kw, seed) -> list[str]:
    """Forward and backward of one packed batch through flash_attn_varlen_*, against the reference
    given the specified keep mask."""
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(seed)
    npdt = _np_dtype(dtype)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
    q_h, do_h = (rng.standard_normal((cu_q[-1], h, d)).astype(npdt) for _ in range(2))
    k_h, v_h = (rng.standard_normal((cu_k[-1], hk, d)).astype(npdt) for _ in range(2))
    kw = dict(kw, seed=seed)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = rng.uniform(0.1, 0.5, (len(lq), h)).astype(np.float32)
    dev = {n: _to_device(x) for n, x in (("q", q_h), ("k", k_h), ("v", v_h), ("do", do_h))}
    dkw = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    lens = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lq), max(lk))
    o, lse = cuflash.flash_attn_varlen_forward(dev["q"], dev["k"], dev["v"], *lens, backend="cuda", **dkw)
    grads = cuflash.flash_attn_varlen_backward(dev["do"], dev["q"], dev["k"], dev["v"], o, lse, *lens,
                                               backend="cuda", **dkw)
    cupy.cuda.runtime.deviceSynchronize()
    ours = dict(zip(("o", "lse", "dq", "dk", "dv"), (_to_host64(x) for x in (o, lse, *grads))))
    rk = {n: x for n, x in kw.items() if n != "seed"}
    rk["dropout_mask"] = cuflash.dropout_mask(len(lq), h, max(lq), max(lk), dropout_p=kw["dropout_p"], seed=seed)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q_h, k_h, v_h, do_h))
    ref = dict(zip(("o", "lse"), reference.forward(q64, k64, v64, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rk)))
    ref.update(zip(("dq", "dk", "dv"), reference.backward(do64, q64, k64, v64, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                          **rk)))
    return _compare(dtype, ours, ref)


# KV-cache cases for flash_decode (and its combine when num_splits > 1): (dtype, head_dim, batch, seqlen_q, heads,
# kv heads, cache_seqlens, capacity, page_size or None, num_splits, keywords); entries with no key among them.
DECODE_CASES = [
    ("float16", 64, 3, 1, 8, 2, (0, 130, 64), 192, None, 3, {}),
    ("bfloat16", 128, 2, 3, 4, 1, (200, 1), 256, 64, 5, dict(causal=True)),
    ("float16", 256, 2, 2, 2, 2, (77, 0), 128, 16, 1, dict(window=(20, 0), softcap=3.0)),
    ("bfloat16", 40, 1, 5, 16, 2, (300,), 320, 64, 0, dict(causal=True, window=(50, -1))),
    # query chunks past the decode kernel's rows: flash_fwd_sm90 on Hopper (kSeqused, kPaged in boxes of 16)
    ("float16", 64, 3, 70, 4, 1, (0, 130, 190), 256, None, 1, dict(causal=True)),
    ("bfloat16", 128, 2, 100, 4, 2, (300, 37), 384, 48, 1, {}),
]


def run_decode_case(dtype, d, b, sq, h, hk, lens, cap, page, num_splits, kw, seed) -> list[str]:
    """flash_attn_with_kvcache over a dense or paged cache (no append), against the reference over each entry's
    keys; called twice (the general path, then a plan's launches where the call has no variant), bitwise alike."""
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(seed)
    npdt = _np_dtype(dtype)
    q_h = rng.standard_normal((b, sq, h, d)).astype(npdt)
    k_h, v_h = (rng.standard_normal((b, cap, hk, d)).astype(npdt) for _ in range(2))
    q, k, v = (_to_device(x) for x in (q_h, k_h, v_h))
    table = None
    if page:
        pages = b * cap // page
        perm = rng.permutation(pages).astype(np.int32)
        k, v = (cupy.empty((pages, page, hk, d), dtype=x.dtype) for x in (k, v))
        for pool, x in ((k, k_h), (v, v_h)):
            pool[cupy.asarray(perm)] = _to_device(x.reshape(pages, page, hk, d))
        table = cupy.asarray(perm.reshape(b, cap // page))
    def call(check_inputs):
        return cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=cupy.asarray(np.array(lens, dtype=np.int32)),
                                               block_table=table, num_splits=num_splits, return_lse=True,
                                               backend="cuda", check_inputs=check_inputs, **kw)

    o, lse = call(True)  # the general path (check_inputs=True takes no plan); without variants, from a plan:
    o2, lse2 = call(False)
    cupy.cuda.runtime.deviceSynchronize()
    planned = [f"{n}: the plan's differs from the general path's" for n, x, y in (("o", o, o2), ("lse", lse, lse2))
               if bool((x.view(cupy.uint8) != y.view(cupy.uint8)).any())]
    cu_q = (np.arange(b + 1) * sq).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k64, v64 = (np.concatenate([x[i, :n] for i, n in enumerate(lens)]).astype(np.float64) for x in (k_h, v_h))
    ro, rl = reference.forward(q_h.reshape(b * sq, h, d).astype(np.float64), k64, v64, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, **kw)
    ours = {"o": _to_host64(o), "lse": _to_host64(lse)}
    ref = {"o": ro.reshape(b, sq, h, d), "lse": rl.reshape(h, b, sq).transpose(1, 0, 2)}
    return _compare(dtype, ours, ref, names=("o", "lse")) + planned


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _to_device(x):
    import cupy

    if x.dtype.name == "bfloat16":  # raw bits across, then reinterpret
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)
    return cupy.asarray(x)


def _to_host64(x):
    import cupy

    if x.dtype.name == "bfloat16":
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype).astype(np.float64)
    return cupy.asnumpy(x).astype(np.float64)


def run_case(dtype, b, sq, sk, h, hk, d, causal, seed) -> list[str]:
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(seed)
    npdt = _np_dtype(dtype)
    q_h, do_h = (rng.standard_normal((b, sq, h, d)).astype(npdt) for _ in range(2))
    k_h, v_h = (rng.standard_normal((b, sk, hk, d)).astype(npdt) for _ in range(2))
    q, k, v, do = (_to_device(x) for x in (q_h, k_h, v_h, do_h))
    o, lse = cuflash.flash_attn_forward(q, k, v, causal=causal, backend="cuda")
    dq, dk, dv = cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="cuda",
                                             deterministic=not causal)
    cupy.cuda.runtime.deviceSynchronize()  # surfaces a kernel fault here, attributed to this case

    ours = dict(zip(("o", "lse", "dq", "dk", "dv"), (_to_host64(x) for x in (o, lse, dq, dk, dv))))
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q_h, k_h, v_h, do_h))
    ref = dict(zip(("o", "lse"), reference.forward(q64, k64, v64, causal=causal)))
    ref.update(zip(("dq", "dk", "dv"), reference.backward(do64, q64, k64, v64, causal=causal)))
    return _compare(dtype, ours, ref)


def _compare(dtype, ours: dict, ref: dict, names=("o", "lse", "dq", "dk", "dv")) -> list[str]:
    """What is wrong with ours against the float64 reference: shapes, NaN, -inf rows, loose error."""
    fails = []
    for name in names:
        x, r = ours[name], ref[name]
        if x.shape != r.shape:
            fails.append(f"{name}: shape {x.shape}, expected {r.shape}")
            continue
        if np.isnan(x).any():
            fails.append(f"{name}: {int(np.isnan(x).sum())} NaN")
            continue
        if name == "lse":
            masked = np.isneginf(r)
            if (np.isneginf(x) != masked).any():
                fails.append("lse: -inf where the reference has a finite value, or the reverse")
                continue
            x, r = x[~masked], r[~masked]
        if x.size == 0:
            continue
        err = float(np.max(np.abs(x - r))) / max(1.0, float(np.max(np.abs(r))))
        if not err <= TOL[dtype]:
            fails.append(f"{name}: relative error {err:.3e} > {TOL[dtype]:.0e}")
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every third case only")
    ap.add_argument("--family", choices=("mma", "sm90"), help="the 16-bit calls' kernel family (cuflash.kernel_family)")
    args = ap.parse_args(argv)

    import cuflash

    with cuflash.kernel_family(args.family):
        return sweep(args.quick, args.family)


def sweep(quick: bool, family=None) -> int:
    import cupy

    from cuflash import _params, config

    # Exact-size allocations, so memcheck sees out-of-bounds accesses (a pool hides them).
    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)

    t0 = time.perf_counter()
    failed = 0
    todo = cases(quick)
    for i, (dtype, b, sq, sk, h, hk, d, causal) in enumerate(todo):
        name = f"{dtype:8s} b={b} sq={sq:3d} sk={sk:3d} h={h} hk={hk} d={d:3d} causal={int(causal)}"
        try:
            fails = run_case(dtype, b, sq, sk, h, hk, d, causal, seed=i)
        except Exception as e:  # noqa: BLE001  (a launch error poisons the context: report and stop)
            print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
            return 1
        failed += bool(fails)
        status = "ok  " if not fails else "FAIL"
        print(f"{status} {name}" + "".join(f"\n       {f}" for f in fails), flush=True)
    skipped = 0
    for i, (dtype, d, lq, lk, h, hk, kw) in enumerate(VARIANT_CASES):
        name = f"{dtype:8s} varlen q={lq} k={lk} h={h} hk={hk} d={d:3d} {kw}"
        bits = _params.variant(varlen=True, **{"causal": False, **kw})
        if family == "sm90" and dtype in ("float16", "bfloat16") and not config.sm90_serves_backward(d, bits):
            print(f"skip {name}: not a backward the sm90 family serves", flush=True)  # forced, it would raise
            skipped += 1
            continue
        try:
            fails = run_variant_case(dtype, d, lq, lk, h, hk, kw, seed=100 + i)
        except Exception as e:  # noqa: BLE001
            print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
            return 1
        failed += bool(fails)
        print(("ok   " if not fails else "FAIL ") + name + "".join(f"\n       {f}" for f in fails), flush=True)
    for i, (dtype, d, b, sq, h, hk, lens, cap, page, splits, kw) in enumerate(DECODE_CASES):
        name = f"{dtype:8s} kvcache b={b} sq={sq} h={h} hk={hk} d={d:3d} lens={lens} page={page} splits={splits} {kw}"
        try:
            fails = run_decode_case(dtype, d, b, sq, h, hk, lens, cap, page, splits, kw, seed=200 + i)
        except Exception as e:  # noqa: BLE001
            print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
            return 1
        failed += bool(fails)
        print(("ok   " if not fails else "FAIL ") + name + "".join(f"\n       {f}" for f in fails), flush=True)
    dt = time.perf_counter() - t0
    total = len(todo) + len(VARIANT_CASES) + len(DECODE_CASES) - skipped
    print(f"{total - failed}/{total} cases passed in {dt:.1f} s" + (f", {skipped} skipped" if skipped else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
