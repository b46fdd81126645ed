"""Shared by every test: the `gpu` marker, GPU detection, and the GPU test kit.

Tests that need a CUDA device are marked `gpu` (`pytestmark = pytest.mark.gpu`); where no device is
visible they are skipped at collection, so a CPU-only machine collects them and reports skips, never
errors. CuPy is imported lazily: nothing here touches the GPU unless a `gpu` test is collected.

The `gpu` fixture hands tests a `GpuKit`: random inputs, poisoned outputs, and the accuracy rule of
DESIGN.md ("Numbers that must hold") checked against cuflash.reference run on the GPU in float64.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest


# JAX, where a test imports it, must not take 75% of the GPU's memory at its first use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def gpu_available() -> tuple[bool, str]:
    """(a CUDA device is visible through CuPy, why not): the library's own answer."""
    from cuflash._interop import gpu_status

    return gpu_status()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def requires_gpu():
    """Skip the requesting test where no CUDA device is visible."""
    ok, why = gpu_available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")


@pytest.fixture(scope="session")
def gpu():
    """The GPU test kit (skips where no CUDA device is visible)."""
    ok, why = gpu_available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")
    return GpuKit()


def jax_gpu():
    """(jax, its first GPU device), or skip the test: JAX not installed, or without a GPU backend."""
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU device")


@pytest.fixture(scope="session", autouse=True)
def kernel_family():
    """CUFLASH_TEST_FAMILY=mma runs the whole session on the mma.sync kernels (cuflash.kernel_family): how a
    Hopper GPU tests the family every other GPU runs. Unset: each call's default family."""
    import cuflash

    with cuflash.kernel_family(os.environ.get("CUFLASH_TEST_FAMILY") or None):
        yield


# ------------------------------------------------------------------------------------------------
# Tolerances (DESIGN.md, "Numbers that must hold")
# ------------------------------------------------------------------------------------------------

# atol of the rule max|ours - ref64| <= 2 * max|same_precision - ref64| + atol, relative to
# max(1, max|ref64|) so that gradients of any magnitude get the same slack.
RULE_ATOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-6, "float64": 1e-12}
# LSE against the float64 LSE of the same (rounded) inputs: |err| <= tol * max(1, |lse_ref|).
# float32 holds lse ~ 9 to 1e-6 ulp, hence relative, not absolute.
LSE_TOL = {"float16": 1e-4, "bfloat16": 1e-4, "float32": 1e-6, "float64": 1e-12}


# float32 forward output against float64: the CUDA kernels are held to 1e-6 x max(1, max|o|) for any
# N up to 8192 (the kernels issue); the Numba prototypes, plain FMA loops without the SIMT kernel's
# blocked and compensated sums, to DESIGN.md's float32 rule, 2e-6 x the same. Relative above 1: a
# float32 o of 4 is itself rounded to 2.4e-7 (half an ulp), so two ulps there are 1e-6 (seen: max|o|
# 4.34 with 74 keys, error 1.03e-6).
FP32_FORWARD_ATOL = {"cuda": 1e-6, "numba": 2e-6}



def simulator_results(script: str, out_dir, timeout: int) -> dict:
    """Run `script --sim-worker OUT.npz` in a fresh interpreter with NUMBA_ENABLE_CUDASIM=1 (the
    simulator must be chosen before numba is imported, so not in this process) and return the arrays
    it saved. Skips where numba-cuda is not installed."""
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed (pip install cuflash[numba])")
    root = Path(__file__).resolve().parents[1]
    out = Path(out_dir) / "results.npz"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, script, "--sim-worker", str(out)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"simulator worker failed:\n{r.stdout}\n{r.stderr}"
    with np.load(out) as z:
        return {key: z[key] for key in z.files}


# The simulator's jobs, set in the worker before it forks (the pool's processes look them up by name).
_SIM_JOBS: dict = {}


def _cores() -> list[int]:
    """The cores this process may run on (all of them where the OS cannot say: no affinity calls on macOS)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pin_to_one_core(core: int | None = None) -> None:
    """Keep this simulator process on one core (the first it may use where None; nothing where the OS has no
    affinity calls): the simulator runs a Python thread per CUDA thread, and with the GIL handed between cores a
    384-thread case took 17 s to 409 s from run to run, on one core 16 s."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {_cores()[0] if core is None else core})


def _pin_to_a_free_core(cores) -> None:
    pin_to_one_core(cores.get())


def _sim_job(name):
    t0 = time.perf_counter()
    try:
        arrays, failure = _SIM_JOBS[name](), ""
    except Exception:
        arrays, failure = {}, traceback.format_exc()
    return name, arrays, failure, time.perf_counter() - t0


def run_simulator_jobs(jobs: dict, out_path: str) -> None:
    """A simulator worker's body: jobs (name -> a function returning that case's arrays, raising on failure), in
    the order given, in one forked process per core, each pinned to its core (pin_to_one_core). Saves
    name/key, name/failure ("" or the traceback) and name/seconds."""
    import multiprocessing

    _SIM_JOBS.update(jobs)
    ctx = multiprocessing.get_context("fork")
    cores = _cores()
    free = ctx.Queue()
    for c in cores:
        free.put(c)
    arrays = {}
    with ctx.Pool(len(cores), initializer=_pin_to_a_free_core, initargs=(free,)) as pool:
        for name, res, failure, seconds in pool.imap_unordered(_sim_job, jobs):
            for key, x in res.items():
                # bf16 travels as its bit pattern (npz cannot hold ml_dtypes arrays)
                arrays[f"{name}/{key}"] = x.view(np.uint16) if x.dtype.name == "bfloat16" else x
            arrays[f"{name}/failure"], arrays[f"{name}/seconds"] = np.array(failure), np.array(seconds)
    np.savez(out_path, **arrays)


class GpuKit:
    """Helpers shared by the GPU tests. Every array here is a CuPy array."""

    DTYPES = ("float16", "bfloat16", "float32", "float64")

    def __init__(self):
        import cupy
        import ml_dtypes

        import cuflash
        from cuflash import reference

        self.cp = cupy
        self.cuflash = cuflash
        self.ref = reference
        self._np_dtypes = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                           "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}

    @staticmethod
    def ctx(dtype, b, sq, sk, h, hk, d, causal, scale=None, layout="bshd", extra="") -> str:
        """The context string of a case: printed in every failure message."""
        s = f"{dtype} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} causal={causal}"
        if scale is not None:
            s += f" scale={scale}"
        if layout != "bshd":
            s += f" layout={layout}"
        return s + (f" {extra}" if extra else "")

    # --- arrays --------------------------------------------------------------------------------

    def np_dtype(self, name: str):
        return self._np_dtypes[name]

    def rng(self, key: str):
        """A CuPy RandomState seeded from a test's own key: fresh inputs per case, reproducible."""
        return self.cp.random.RandomState(zlib.crc32(key.encode()))

    def randn(self, rs, shape, dtype: str):
        """Standard normal values rounded to `dtype` (never zeros: they hide unwritten outputs)."""
        gen = self.cp.float64 if dtype == "float64" else self.cp.float32
        return rs.standard_normal(tuple(shape), dtype=gen).astype(self.np_dtype(dtype))

    def nan_like(self, x):
        return self.cp.full(x.shape, math.nan, dtype=x.dtype)

    def bits(self, x):
        """The raw bits of x (for bitwise comparisons that NaN cannot fool)."""
        return x.view({2: self.cp.uint16, 4: self.cp.uint32, 8: self.cp.uint64}[x.itemsize])

    def same_bits(self, a, b) -> int:
        """How many elements of a and b differ bitwise (a and b of one shape and dtype)."""
        return int(self.cp.count_nonzero(self.bits(a) != self.bits(b)))

    def count_nan(self, x) -> int:
        return int(self.cp.count_nonzero(self.cp.isnan(x))) if x.size else 0

    def poison(self, nbytes: int) -> None:
        """Make the next allocations of the current stream's pool come back filled with NaN bits.

        Frees the pool's cached blocks, then allocates one chunk of `nbytes` (+ slack), fills it
        with 0xFF (a NaN in every float dtype) and frees it: later allocations on this stream are
        carved from that chunk, so an output element the kernels never write reads back as NaN.
        """
        cp = self.cp
        cp.get_default_memory_pool().free_all_blocks()
        chunk = cp.empty(int(nbytes * 1.25) + (4 << 20), dtype=cp.uint8)
        chunk.fill(255)
        del chunk

    def output_bytes(self, q, k, lse_itemsize: int) -> int:
        """Bytes of everything one forward + backward allocates (o, lse, dq, dk, dv, the workspace)."""
        from cuflash.config import backward_workspace

        b, sq, h, d = q.shape
        workspace = backward_workspace(q.dtype.name, d, h, b, sq, b, sq, True).nbytes
        return 2 * q.size * q.itemsize + 2 * k.size * k.itemsize + b * h * sq * lse_itemsize + workspace

    # --- one forward + backward through the public API -----------------------------------------

    def run(self, ctx: str, dtype: str, q, k, v, do, *, causal: bool, scale=None, layout: str = "bshd",
            backend: str = "cuda", deterministic: bool = False, entry: str = "forward", o_view=None):
        """Forward (into a NaN-filled out=) and backward through the public API, then `check`.

        Returns (o, lse, dq, dk, dv) as the API gave them (in `layout`). `o_view(o)` may return
        another view of o's values to pass to the backward (a strided copy, say).
        """
        cf = self.cuflash
        bshd = (lambda x: x.swapaxes(1, 2)) if layout == "bhsd" else (lambda x: x)
        lse_isz = 8 if dtype == "float64" else 4
        out = self.nan_like(q)
        self.poison(self.output_bytes(bshd(q), bshd(k), lse_isz))
        if entry == "flash_attn":
            o, lse = cf.flash_attn(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, layout=layout,
                                   backend=backend, out=out)
        else:
            o, lse = cf.flash_attn_forward(q, k, v, causal=causal, softmax_scale=scale, layout=layout,
                                           backend=backend, out=out)
        assert o is out, f"forward with out=: expected the out array back, got a {type(o).__name__} [{ctx}]"
        o_bwd = o if o_view is None else o_view(o)
        self.poison(self.output_bytes(bshd(q), bshd(k), lse_isz))
        dq, dk, dv = cf.flash_attn_backward(do, q, k, v, o_bwd, lse, causal=causal, softmax_scale=scale,
                                            layout=layout, backend=backend, deterministic=deterministic)
        self.check(ctx, dtype, causal, scale, *(bshd(x) for x in (q, k, v, do, o)), lse,
                   *(bshd(x) for x in (dq, dk, dv)), backend=backend)
        return o, lse, dq, dk, dv

    # --- the accuracy rule -----------------------------------------------------------------------

    def references(self, dtype, causal, scale, q, k, v, do, forward_sp=True):
        """(ref64, same_precision) dicts of o, lse, dq, dk, dv, computed on the GPU from the
        (rounded) inputs upcast to float64. same_precision is ref64 itself for float64 inputs."""
        cp, ref = self.cp, self.ref
        q64, k64, v64, do64 = (x.astype(cp.float64) for x in (q, k, v, do))
        kw = {"causal": causal, "softmax_scale": scale}
        o, lse = ref.forward(q64, k64, v64, **kw)
        dq, dk, dv = ref.backward(do64, q64, k64, v64, **kw)
        r64 = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        if dtype == "float64":
            return r64, r64
        sp = {}
        if forward_sp:
            sp["o"], _ = ref.forward(q64, k64, v64, precision=dtype, **kw)
        sp["dq"], sp["dk"], sp["dv"] = ref.backward(do64, q64, k64, v64, precision=dtype, **kw)
        return r64, sp

    def _max_abs(self, x, y) -> float:
        """max|x - y| in float64; NaN anywhere gives inf (so it can never pass); empty gives 0."""
        cp = self.cp
        if x.size == 0:
            return 0.0
        e = float(cp.max(cp.abs(x.astype(cp.float64) - y.astype(cp.float64))))
        return math.inf if math.isnan(e) else e

    def check(self, ctx, dtype, causal, scale, q, k, v, do, o, lse, dq, dk, dv, backend="cuda"):
        """Assert shapes, dtypes, no NaN, exact zeros / -inf on rows that see no key, and the
        accuracy rule on o, lse, dq, dk, dv. All arrays CuPy, "bshd" views, any strides."""
        cp = self.cp
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        fails: list[str] = []
        lse_dt = "float64" if dtype == "float64" else "float32"
        want = {"o": (q.shape, dtype), "lse": ((b, h, sq), lse_dt), "dq": (q.shape, dtype),
                "dk": (k.shape, dtype), "dv": (v.shape, dtype)}
        got = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        for name, (shape, dt) in want.items():
            x = got[name]
            if tuple(x.shape) != tuple(shape) or x.dtype != self.np_dtype(dt):
                fails.append(f"{name}: expected shape {tuple(shape)} {dt}, got {tuple(x.shape)} {x.dtype}")
        if fails:
            raise AssertionError(f"[{ctx}]\n  " + "\n  ".join(fails))
        for name, x in got.items():
            n = self.count_nan(x)
            if n:
                fails.append(f"{name}: {n} NaN of {x.size} elements (unwritten output, or 0/0)")

        # Rows that see no key: o = 0, lse = -inf, dq = 0 exactly.
        first = sq if sk == 0 else (max(0, sq - sk) if causal else 0)
        f64 = lambda x: x.astype(cp.float64)  # compare in float64: any dtype
        if first:
            n = int(cp.count_nonzero(f64(o[:, :first])))
            if n:
                fails.append(f"o: {n} nonzero elements in the {first} rows that see no key (must be 0)")
            n = int(cp.count_nonzero(f64(lse[:, :, :first]) != -math.inf))
            if n:
                fails.append(f"lse: {n} elements other than -inf in the {first} rows that see no key")
            n = int(cp.count_nonzero(f64(dq[:, :first])))
            if n:
                fails.append(f"dq: {n} nonzero elements in the {first} rows that see no key (must be 0)")
        if first < sq:
            n = int(cp.count_nonzero(~cp.isfinite(f64(lse[:, :, first:]))))
            if n:
                fails.append(f"lse: {n} non-finite values in rows that see keys")

        if sk > 0 and sq > 0:
            r64, sp = self.references(dtype, causal, scale, q, k, v, do, forward_sp=dtype != "float32")
            # LSE: against the float64 LSE of the same rounded inputs, rows that see keys.
            lr = r64["lse"][:, :, first:]
            lo = f64(lse[:, :, first:])
            if lr.size:
                excess = cp.abs(lo - lr) - LSE_TOL[dtype] * cp.maximum(1.0, cp.abs(lr))
                worst = float(cp.max(excess))
                if not worst <= 0:
                    err = self._max_abs(lo, lr)
                    fails.append(f"lse: max error {err:.3e} over tolerance {LSE_TOL[dtype]:.0e} * max(1, |lse|)")
            for name, ours in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                ref64 = r64[name]
                mag = float(cp.max(cp.abs(ref64))) if ref64.size else 0.0
                err = self._max_abs(ours, ref64)
                if dtype == "float32" and name == "o":
                    bound = FP32_FORWARD_ATOL[backend] * max(1.0, mag)
                    detail = f"float32 forward bound for backend {backend} x max(1, max|ref| {mag:.3g})"
                else:
                    atol = RULE_ATOL[dtype] * max(1.0, mag)
                    sp_err = 0.0 if dtype == "float64" else self._max_abs(sp[name], ref64)
                    bound = 2.0 * sp_err + atol
                    detail = f"2 * same-precision error {sp_err:.3e} + atol {atol:.1e}"
                if not err <= bound:
                    fails.append(f"{name}: error {err:.3e} > bound {bound:.3e} ({detail}; max|ref| {mag:.3e})")
        if fails:
            raise AssertionError(f"[{ctx}]\n  " + "\n  ".join(fails))
