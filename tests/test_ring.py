"""cuflash.distributed: the simulated ring equals single-device attention, forward and backward."""

import numpy as np
import pytest

import cuflash
from cuflash import distributed as D

TOL = {"float64": 1e-10, "float32": 1e-5}


class _LoopbackComm:
    """world = 1 comm for the per-rank public entry points (never asked to send)."""
    rank, world = 0, 1

    def sendrecv(self, arrays, dst, src):  # pragma: no cover - world 1 never communicates
        raise AssertionError("world 1 sent something")


def _shard(x, world, causal, dim=1):
    if causal:
        return [D.zigzag_shard(x, r, world, dim=dim) for r in range(world)]
    n = x.shape[dim] // world
    return [x[(slice(None),) * dim + (slice(r * n, (r + 1) * n),)] for r in range(world)]


def _unshard(shards, causal, dim=1):
    if causal:
        return D.zigzag_unshard(shards, dim=dim)
    return D._concat(list(shards), dim, np if isinstance(shards[0], np.ndarray) else __import__("cupy"))


def _problem(rng, dtype, world, b=2, c=5, h=4, hk=2, d=16):
    n = 2 * world * c
    mk = lambda heads: rng.standard_normal((b, n, heads, d)).astype(dtype)  # noqa: E731
    return mk(h), mk(hk), mk(hk), mk(h)


def _run(q, k, v, do, world, causal, backend):
    o_sh, lse_sh = D.simulate_ring_forward(_shard(q, world, causal), _shard(k, world, causal),
                                           _shard(v, world, causal), causal=causal, backend=backend)
    grads = D.simulate_ring_backward(_shard(do, world, causal), _shard(q, world, causal), _shard(k, world, causal),
                                     _shard(v, world, causal), o_sh, lse_sh, causal=causal, backend=backend)
    return (_unshard(o_sh, causal), _unshard(lse_sh, causal, dim=2), *(_unshard(g, causal) for g in grads))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_simulated_ring_equals_single_device(world, causal, dtype, hk):
    rng = np.random.default_rng(world * 100 + causal * 10 + hk)
    q, k, v, do = _problem(rng, dtype, world, hk=hk)
    o_ref, lse_ref = cuflash.flash_attn_forward(q, k, v, causal=causal, backend="numpy")
    g_ref = cuflash.flash_attn_backward(do, q, k, v, o_ref, lse_ref, causal=causal, backend="numpy")
    o, lse, dq, dk, dv = _run(q, k, v, do, world, causal, "numpy")
    tol = TOL[dtype]
    for name, x, ref in (("o", o, o_ref), ("lse", lse, lse_ref), ("dq", dq, g_ref[0]), ("dk", dk, g_ref[1]),
                         ("dv", dv, g_ref[2])):
        assert x.dtype == ref.dtype and x.shape == ref.shape, name
        assert not np.isnan(x).any(), name
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(x.astype(np.float64) - ref.astype(np.float64)).max())
        assert err <= tol * scale, f"{name}: max err {err} (world={world} causal={causal} {dtype} hk={hk})"


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_and_batch1(causal):
    rng = np.random.default_rng(7)
    world = 3
    q, k, v, do = _problem(rng, "float64", world, b=1, c=4, h=2, hk=1, d=8)
    o_ref, lse_ref = cuflash.flash_attn_forward(q, k, v, causal=causal, softmax_scale=0.3, backend="numpy")
    g_ref = cuflash.flash_attn_backward(do, q, k, v, o_ref, lse_ref, causal=causal, softmax_scale=0.3,
                                        backend="numpy")
    o_sh, lse_sh = D.simulate_ring_forward(_shard(q, world, causal), _shard(k, world, causal),
                                           _shard(v, world, causal), causal=causal, softmax_scale=0.3,
                                           backend="numpy")
    grads = D.simulate_ring_backward(_shard(do, world, causal), _shard(q, world, causal), _shard(k, world, causal),
                                     _shard(v, world, causal), o_sh, lse_sh, causal=causal, softmax_scale=0.3,
                                     backend="numpy")
    np.testing.assert_allclose(_unshard(o_sh, causal), o_ref, atol=1e-10)
    np.testing.assert_allclose(_unshard(lse_sh, causal, dim=2), lse_ref, atol=1e-10)
    for g, r in zip(grads, g_ref):
        np.testing.assert_allclose(_unshard(g, causal), r, atol=1e-10)


def test_public_entry_points_world1():
    rng = np.random.default_rng(1)
    q, k, v, do = _problem(rng, "float64", 1)
    comm = _LoopbackComm()
    o, lse = D.ring_attention_forward(q, k, v, comm, causal=True, backend="numpy")
    o_ref, lse_ref = cuflash.flash_attn_forward(q, k, v, causal=True, backend="numpy")
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(D.ring_attention(q, k, v, comm, causal=True, backend="numpy"), o_ref, atol=1e-12)
    g = D.ring_attention_backward(do, q, k, v, o, lse, comm, causal=True, backend="numpy")
    g_ref = cuflash.flash_attn_backward(do, q, k, v, o_ref, lse_ref, causal=True, backend="numpy")
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-12)


class _ThreadRing:
    """A real per-rank comm (threads + a barrier) to run ring_attention_forward/backward, the NCCL
    path's driver, rank by rank."""

    def __init__(self, world):
        import threading

        self.world = world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world)

    def view(self, rank):
        ring = self

        class View:
            def __init__(self):
                self.rank, self.world = rank, ring.world

            def sendrecv(self, arrays, dst, src):
                assert dst == (rank + 1) % ring.world and src == (rank - 1) % ring.world
                ring.slots[rank] = [a.copy() for a in arrays]
                ring.barrier.wait()
                got = ring.slots[src]
                ring.barrier.wait()
                return got

        return View()


@pytest.mark.parametrize("causal", [False, True])
def test_per_rank_driver_with_threads(causal):
    import concurrent.futures

    world = 3
    rng = np.random.default_rng(5)
    q, k, v, do = _problem(rng, "float64", world)
    ring = _ThreadRing(world)
    qs, ks, vs, dos = (_shard(x, world, causal) for x in (q, k, v, do))

    def rank_job(r):
        comm = ring.view(r)
        o, lse = D.ring_attention_forward(qs[r], ks[r], vs[r], comm, causal=causal, backend="numpy")
        return (o, lse, *D.ring_attention_backward(dos[r], qs[r], ks[r], vs[r], o, lse, comm, causal=causal,
                                                   backend="numpy"))

    with concurrent.futures.ThreadPoolExecutor(world) as ex:
        res = list(ex.map(rank_job, range(world)))
    o_ref, lse_ref = cuflash.flash_attn_forward(q, k, v, causal=causal, backend="numpy")
    g_ref = cuflash.flash_attn_backward(do, q, k, v, o_ref, lse_ref, causal=causal, backend="numpy")
    np.testing.assert_allclose(_unshard([x[0] for x in res], causal), o_ref, atol=1e-10)
    np.testing.assert_allclose(_unshard([x[1] for x in res], causal, dim=2), lse_ref, atol=1e-10)
    for i in range(3):
        np.testing.assert_allclose(_unshard([x[2 + i] for x in res], causal), g_ref[i], atol=1e-10)


def test_zigzag_roundtrip_and_layout():
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    world = 3
    shards = [D.zigzag_shard(x, r, world) for r in range(world)]
    np.testing.assert_array_equal(shards[0][:, :4], x[:, 0:4])
    np.testing.assert_array_equal(shards[0][:, 4:], x[:, 20:24])
    np.testing.assert_array_equal(shards[2][:, :4], x[:, 8:12])
    np.testing.assert_array_equal(shards[2][:, 4:], x[:, 12:16])
    np.testing.assert_array_equal(D.zigzag_unshard(shards), x)
    with pytest.raises(ValueError):
        D.zigzag_shard(x, 0, 5)
    with pytest.raises(ValueError):
        D.zigzag_shard(x, 3, 3)


def test_step_tasks_balance():
    """Causal zig-zag: every non-diagonal step does the same work (2c x c pairs) on every rank."""
    world, s = 4, 8
    c = s // 2
    for r in range(world):
        for step in range(world):
            src = (r - step) % world
            tasks = D.step_tasks(r, src, world, s, True)
            if step == 0:
                assert tasks == [(slice(None), slice(None), True)]
                continue
            assert len(tasks) == 1 and tasks[0][2] is False
            qs, ks, _ = tasks[0]
            qn = s if qs == slice(None) else qs.stop - qs.start
            kn = s if ks == slice(None) else ks.stop - ks.start
            assert qn * kn == 2 * c * c


def test_errors():
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError):
        D.simulate_ring_forward([q], [q.astype(np.float32)], [q], backend="numpy")
    with pytest.raises(ValueError):
        D.simulate_ring_forward([q, q], [q], [q, q], backend="numpy")
    with pytest.raises(ValueError):
        D.simulate_ring_forward([np.zeros((1, 3, 2, 8))], [np.zeros((1, 3, 2, 8))], [np.zeros((1, 3, 2, 8))],
                                causal=True, backend="numpy")
    with pytest.raises(TypeError):
        D.simulate_ring_forward([q], [q], [q], causal="yes", backend="numpy")
    with pytest.raises(TypeError):
        D.simulate_ring_forward([[1.0]], [q], [q], backend="numpy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_cuda(dtype, causal):
    """The simulated ring on one GPU with CuPy arrays and the CUDA backend, against single-device
    cuflash: 16-bit dtypes within 2x single-device's error vs float64 + 1e-2 (bf16) or 2e-3 (fp16)
    (per-block outputs are rounded before merging), fp32 within 2x + 1e-5, fp64 within 2x + 1e-12."""
    import cupy as cp

    from cuflash import reference
    from cuflash._merge import from_acc, to_acc

    world, b, c, h, hk, d = 2, 1, 64, 4, 2, 64
    n = 2 * world * c
    rs = cp.random.RandomState(11)
    mk = lambda heads: from_acc(rs.standard_normal((b, n, heads, d), dtype=cp.float32), dtype, cp)  # noqa
    q, k, v, do = mk(h), mk(hk), mk(hk), mk(h)
    o_ref, lse_ref = cuflash.flash_attn_forward(q, k, v, causal=causal, backend="cuda")
    g_ref = cuflash.flash_attn_backward(do, q, k, v, o_ref, lse_ref, causal=causal, backend="cuda")
    f64 = lambda x: to_acc(x, cp).astype(cp.float64)  # noqa: E731 (bf16 through its bits)
    o64, _ = reference.forward(f64(q), f64(k), f64(v), causal=causal)
    g64 = reference.backward(f64(do), f64(q), f64(k), f64(v), causal=causal)
    o, lse, dq, dk, dv = _run(q, k, v, do, world, causal, "cuda")
    atol = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
    for name, x, ref, r64 in (("o", o, o_ref, o64), ("dq", dq, g_ref[0], g64[0]), ("dk", dk, g_ref[1], g64[1]),
                              ("dv", dv, g_ref[2], g64[2])):
        assert x.dtype == ref.dtype and x.shape == ref.shape
        scale = max(1.0, float(cp.abs(r64).max()))
        single = float(cp.abs(f64(ref) - r64).max())
        err = float(cp.abs(f64(x) - r64).max())
        assert err <= 2 * single + atol * scale, f"{name}: ring err {err}, single-device err {single}"
    fin = cp.isfinite(lse_ref)
    assert float(cp.abs(lse[fin] - lse_ref[fin]).max()) <= (1e-4 if dtype in ("bfloat16", "float16") else 1e-5) * max(
        1.0, float(cp.abs(lse_ref[fin]).max()))
