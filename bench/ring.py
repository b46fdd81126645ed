"""Ring attention on 2 GPUs (NCCL) against single-GPU cuflash: correctness, then timing.

Usage (repo root, PYTHONPATH=repo): python3 bench/ring.py --json OUT.json [--world 2] [--reps 5]

One process per GPU (multiprocessing, spawn). The parent makes the NCCL unique id; each rank builds
its NcclCommunicator, makes the same inputs from the same seed, keeps its zig-zag shard, runs ring
forward + backward and sends its result shards back; the parent checks them on GPU 0 against
single-GPU cuflash on the whole sequence: max|ring - ref64| <= 2 * max|single - ref64| + 1e-2 * max(1,
max|ref64|) for bf16 (per-block outputs are rounded to bf16 before the float32 merge; the same rule
as the test suite's accuracy rule, with a bf16-sized atol). Timing: CUDA events, 2 warm-ups, median
of --reps; B=1, H=16, d=128, bf16, causal; total N in (32768, 65536) on 1 vs 2 GPUs, and 32768 per
GPU. "compute only" runs the same per-rank schedule with communication skipped (each rank attends
its own blocks); "comm only" times the schedule's transfers alone; hidden = 1 - max(0, ring -
compute) / comm.
NCCL NVLink multicast (NVLS) is kept off: NCCL_NVLS_ENABLE=0 is set here before NCCL starts.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before anything imports NCCL

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

B, H, D = 1, 16, 128
DTYPE = "bfloat16"
CHECK_N, CHECK_H, CHECK_D = 2048, 8, 128
SEED = 1234


def flops(n, causal=True, bwd=False):
    f = 4 * B * H * n * n * D / (2 if causal else 1)
    return f * 3.5 if bwd else f


def make_inputs(n, h, d, seed):
    """q, k, v, do on the current GPU, bf16 (through bits), the same on every rank."""
    import cupy as cp

    from cuflash._merge import from_acc

    rs = cp.random.RandomState(seed)
    return [from_acc(rs.standard_normal((B, n, h, d), dtype=cp.float32), DTYPE, cp) for _ in range(4)]


def time_fn(fn, reps, warmup=2):
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)


class _SkipComm:
    """The ring schedule with no data moved: every rank gets its own payload back."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def sendrecv(self, arrays, dst, src):
        return list(arrays)


def worker(rank, world, uid, args, barrier, out_q):
    try:
        import cupy as cp
        from cupy.cuda import nccl

        from cuflash import distributed as dist
        from cuflash import flash_attn_backward, flash_attn_forward

        cp.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(world, uid, rank)
        ring = dist.NcclRing(comm, rank, world)
        skip = _SkipComm(rank, world)
        kw = dict(causal=True, backend="cuda")

        # ---- correctness: small problem, zig-zag shards, results back to the parent
        q, k, v, do = make_inputs(CHECK_N, CHECK_H, CHECK_D, SEED)
        sh = [dist.zigzag_shard(x, rank, world) for x in (q, k, v, do)]
        o, lse = dist.ring_attention_forward(sh[0], sh[1], sh[2], ring, **kw)
        dq, dk, dv = dist.ring_attention_backward(sh[3], sh[0], sh[1], sh[2], o, lse, ring, **kw)
        cp.cuda.get_current_stream().synchronize()
        host = lambda x: cp.asnumpy(x.view(cp.uint16)) if x.dtype.itemsize == 2 else cp.asnumpy(x)  # noqa
        out_q.put(("check", rank, [host(x) for x in (o, lse, dq, dk, dv)]))
        del q, k, v, do, sh, o, lse, dq, dk, dv

        results = []
        ns = sorted(set(args.n) | {args.per_gpu * world})
        for n in ns:
            if n % (2 * world):
                continue
            q, k, v, do = make_inputs(n, H, D, SEED + n)
            # single GPU on the whole sequence (rank 0 only, the others wait)
            barrier.wait()
            if rank == 0 and n in set(args.n) | {args.per_gpu}:
                o1, l1 = flash_attn_forward(q, k, v, **kw)
                t_f = time_fn(lambda: flash_attn_forward(q, k, v, **kw), args.reps)
                t_fb = time_fn(lambda: flash_attn_backward(do, q, k, v, *flash_attn_forward(q, k, v, **kw), **kw),
                               args.reps)
                results.append({"gpus": 1, "N": n, "per_gpu_N": n, "fwd_ms": t_f, "fwd_bwd_ms": t_fb,
                                "fwd_tflops": flops(n) / t_f / 1e9, "fwd_bwd_tflops": flops(n, bwd=True) / t_fb / 1e9})
                del o1, l1
            barrier.wait()
            sh = [dist.zigzag_shard(x, rank, world) for x in (q, k, v, do)]
            del q, k, v, do
            cp.get_default_memory_pool().free_all_blocks()

            def fwd(c):
                return dist.ring_attention_forward(sh[0], sh[1], sh[2], c, **kw)

            def fwd_bwd(c):
                o, lse = fwd(c)
                return dist.ring_attention_backward(sh[3], sh[0], sh[1], sh[2], o, lse, c, **kw)

            def comm_only():  # the transfers of a forward + backward: K/V (world-1) x2, dK/dV (fp32) world x
                import numpy as np

                kv = [sh[1], sh[2]]
                dkv = [cp.zeros(sh[1].shape, np.float32), cp.zeros(sh[2].shape, np.float32)]
                dst, src = (rank + 1) % world, (rank - 1) % world
                for _ in range(2 * (world - 1)):
                    kv = ring.sendrecv(kv, dst, src)
                for _ in range(world):
                    dkv = ring.sendrecv(dkv, dst, src)

            def comm_only_fwd():
                kv = [sh[1], sh[2]]
                for _ in range(world - 1):
                    kv = ring.sendrecv(kv, (rank + 1) % world, (rank - 1) % world)

            row = {"gpus": world, "N": n, "per_gpu_N": n // world}
            for key, fn in (("fwd_ms", lambda: fwd(ring)), ("fwd_bwd_ms", lambda: fwd_bwd(ring)),
                            ("fwd_compute_only_ms", lambda: fwd(skip)),
                            ("fwd_bwd_compute_only_ms", lambda: fwd_bwd(skip)),
                            ("fwd_comm_only_ms", comm_only_fwd), ("fwd_bwd_comm_only_ms", comm_only)):
                barrier.wait()
                row[key] = time_fn(fn, args.reps)
            row["fwd_tflops"] = flops(n) / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = flops(n, bwd=True) / row["fwd_bwd_ms"] / 1e9
            for p in ("fwd", "fwd_bwd"):
                exposed = max(0.0, row[f"{p}_ms"] - row[f"{p}_compute_only_ms"])
                c = row[f"{p}_comm_only_ms"]
                row[f"{p}_comm_hidden"] = max(0.0, 1.0 - exposed / c) if c > 0 else None
            results.append(row)
            del sh
            cp.get_default_memory_pool().free_all_blocks()
        out_q.put(("timing", rank, results))
    except Exception:
        out_q.put(("error", rank, traceback.format_exc()))
        raise


def check(parts, world):
    """On GPU 0: the gathered ring results against single-GPU cuflash and the float64 reference."""
    import cupy as cp
    import numpy as np

    from cuflash import distributed as dist
    from cuflash import flash_attn_backward, flash_attn_forward, reference
    from cuflash._merge import to_acc
    from cuflash.config import numpy_dtype

    cp.cuda.Device(0).use()
    bf = numpy_dtype("bfloat16")
    dev = lambda a: cp.asarray(a).view(bf) if a.dtype == np.uint16 else cp.asarray(a)  # noqa: E731
    got = [dist.zigzag_unshard([dev(parts[r][i]) for r in range(world)], dim=2 if i == 1 else 1) for i in range(5)]
    q, k, v, do = make_inputs(CHECK_N, CHECK_H, CHECK_D, SEED)
    kw = dict(causal=True, backend="cuda")
    o1, l1 = flash_attn_forward(q, k, v, **kw)
    g1 = flash_attn_backward(do, q, k, v, o1, l1, **kw)
    f64 = lambda x: to_acc(x, cp).astype(cp.float64)  # noqa: E731
    o64, l64 = reference.forward(f64(q), f64(k), f64(v), causal=True)
    g64 = reference.backward(f64(do), f64(q), f64(k), f64(v), causal=True)
    rows, ok = [], True
    for name, ring_x, single, r64 in (("o", got[0], o1, o64), ("dq", got[2], g1[0], g64[0]),
                                      ("dk", got[3], g1[1], g64[1]), ("dv", got[4], g1[2], g64[2])):
        scale = max(1.0, float(cp.abs(r64).max()))
        e_single = float(cp.abs(f64(single) - r64).max())
        e_ring = float(cp.abs(f64(ring_x) - r64).max())
        bound = 2 * e_single + 1e-2 * scale
        rows.append({"name": name, "ring_err": e_ring, "single_err": e_single, "bound": bound, "ok": e_ring <= bound})
        ok &= e_ring <= bound
    e_lse = float(cp.abs(got[1] - l1).max())
    lse_bound = 1e-4 * max(1.0, float(cp.abs(l64).max()))
    rows.append({"name": "lse", "ring_vs_single_err": e_lse, "bound": lse_bound, "ok": e_lse <= lse_bound})
    ok &= e_lse <= lse_bound
    return ok, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--per-gpu", type=int, default=32768)
    args = ap.parse_args()
    t0 = time.time()
    from cupy.cuda import nccl

    world = args.world
    uid = nccl.get_unique_id()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    out_q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, uid, args, barrier, out_q)) for r in range(world)]
    for p in procs:
        p.start()
    parts, timing, errors = {}, {}, []
    pending = 2 * world
    while pending:
        try:
            kind, rank, payload = out_q.get(timeout=420)
        except Exception:
            errors.append("timed out waiting for the ranks")
            break
        if kind == "check":
            parts[rank] = payload
            pending -= 1
        elif kind == "timing":
            timing[rank] = payload
            pending -= 1
        else:
            errors.append(f"rank {rank}:\n{payload}")
            print(payload, file=sys.stderr)
            break
    for p in procs:
        p.join(timeout=10 if not errors else 1)
        if p.is_alive():
            p.terminate()
    report = {"schema": "cuflash-ring/1", "world": world, "B": B, "H": H, "d": D, "dtype": DTYPE, "causal": True,
              "reps": args.reps, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "errors": errors}
    ok = not errors
    if len(parts) == world:
        good, rows = check(parts, world)
        report["check"] = {"N": CHECK_N, "H": CHECK_H, "d": CHECK_D, "ok": good, "rows": rows,
                           "rule": "max|ring - ref64| <= 2 max|single - ref64| + 1e-2 max(1, max|ref64|); "
                                   "|lse_ring - lse_single| <= 1e-4 max(1, max|lse64|)"}
        ok &= good
        print(f"check (N={CHECK_N}, H={CHECK_H}, d={CHECK_D}, bf16, causal): {'PASS' if good else 'FAIL'}")
        for r in rows:
            print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    else:
        ok = False
    if timing:
        # rank 0's single-GPU rows; for the ring the slowest rank's time per case
        rows = [r for r in timing.get(0, []) if r["gpus"] == 1]
        for i, r0 in enumerate(x for x in timing.get(0, []) if x["gpus"] > 1):
            row = dict(r0)
            for rk, rs in timing.items():
                other = [x for x in rs if x["gpus"] > 1][i]
                for key in ("fwd_ms", "fwd_bwd_ms"):
                    row[key] = max(row[key], other[key])
            row["fwd_tflops"] = flops(row["N"]) / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = flops(row["N"], bwd=True) / row["fwd_bwd_ms"] / 1e9
            rows.append(row)
        report["timing"] = rows
        print(f"{'gpus':>4} {'N':>6} {'N/gpu':>6} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8} "
              f"{'hidden f':>8} {'hidden f+b':>10}")
        for r in sorted(rows, key=lambda r: (r["N"], r["gpus"])):
            hf = r.get("fwd_comm_hidden")
            hb = r.get("fwd_bwd_comm_hidden")
            print(f"{r['gpus']:>4} {r['N']:>6} {r['per_gpu_N']:>6} {r['fwd_ms']:>8.2f} {r['fwd_tflops']:>8.1f} "
                  f"{r['fwd_bwd_ms']:>8.2f} {r['fwd_bwd_tflops']:>8.1f} "
                  f"{'-' if hf is None else f'{hf:.2f}':>8} {'-' if hb is None else f'{hb:.2f}':>10}")
    report["ok"] = ok
    report["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.json} in {report['wall_s']:.0f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
