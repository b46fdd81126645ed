"""cuflash.merge_states / merge_states_list on device arrays (CuPy, torch, JAX): attention over disjoint key
ranges, each by flash_attn_forward on the GPU, merged, against the float64 reference over all keys by
DESIGN.md's accuracy rule; the results are the caller's array kind on the caller's device; a part with no
keys (o = 0, lse = -inf) leaves the other bit for bit, and two such parts give 0 and -inf.
(tests/test_merge.py holds the NumPy cases: causal splits, stacks, every dtype.)"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FP32_FORWARD_ATOL, LSE_TOL, RULE_ATOL, jax_gpu

pytestmark = pytest.mark.gpu

CUTS = (0, 50, 90, 150)  # three key ranges of a 150-key sequence


def _kind(name):
    """(to the kind from CuPy, back to CuPy, the kind's array type) for one array kind."""
    import cupy as cp

    if name == "cupy":
        return (lambda x: x), (lambda x: x), cp.ndarray
    if name == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_dlpack, cp.from_dlpack, torch.Tensor
    jax, dev = jax_gpu()
    return (lambda x: jax.device_put(jax.dlpack.from_dlpack(x), dev)), cp.from_dlpack, jax.Array


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["cupy", "torch", "jax"])
def test_merge_states_on_device_arrays(gpu, kind, dtype):
    cp, cf, ref = gpu.cp, gpu.cuflash, gpu.ref
    to_kind, to_cupy, array_type = _kind(kind)
    rs = gpu.rng(f"merge {kind} {dtype}")
    q = gpu.randn(rs, (2, 70, 4, 64), dtype)
    k, v = (gpu.randn(rs, (2, CUTS[-1], 2, 64), dtype) for _ in range(2))
    # each key range contiguous: JAX takes only row-major arrays through DLPack
    parts = [cf.flash_attn_forward(*(to_kind(cp.ascontiguousarray(x)) for x in (q, k[:, a:b], v[:, a:b])),
                                   backend="cuda") for a, b in zip(CUTS, CUTS[1:])]
    two = cf.merge_states(*parts[0], *cf.merge_states(*parts[1], *parts[2]))
    stacked = cf.merge_states_list([p[0] for p in parts], [p[1] for p in parts])

    q64, k64, v64 = (x.astype(cp.float64) for x in (q, k, v))
    o64, lse64 = ref.forward(q64, k64, v64)
    mag = float(cp.max(cp.abs(o64)))
    if dtype == "float32":  # each part within the forward's fixed bound; weights that sum to 1 mix them
        bound = 2.0 * FP32_FORWARD_ATOL["cuda"] * max(1.0, mag)
    else:
        o_sp, _ = ref.forward(q64, k64, v64, precision=dtype)
        bound = 2.0 * float(cp.max(cp.abs(o_sp - o64))) + RULE_ATOL[dtype] * max(1.0, mag)
    for how, (o, lse) in (("merge_states", two), ("merge_states_list", stacked)):
        ctx = f"{how} {kind} {dtype}"
        for name, x in (("o", o), ("lse", lse)):
            assert isinstance(x, array_type), f"[{ctx}] {name}: {type(x).__name__}, not the caller's kind"
        o, lse = to_cupy(o), to_cupy(lse)
        assert o.dtype == q.dtype and lse.dtype == cp.float32, f"[{ctx}] dtypes {o.dtype}, {lse.dtype}"
        assert o.device.id == q.device.id, f"[{ctx}] o on device {o.device.id}"
        err = gpu._max_abs(o, o64)
        assert err <= bound, f"[{ctx}] o: error {err:.3e} > bound {bound:.3e}"
        lse_err = gpu._max_abs(lse, lse64)
        assert lse_err <= LSE_TOL[dtype] * max(1.0, float(cp.max(cp.abs(lse64)))), f"[{ctx}] lse: {lse_err:.3e}"

    # keys none of a part's rows see: that part is o = 0, lse = -inf, and changes nothing
    o_a, lse_a = parts[0]
    if kind == "jax":  # JAX arrays of no elements do not cross DLPack: the empty part as the forward gives it
        import jax.numpy as jnp

        o_e, lse_e = jnp.zeros(o_a.shape, o_a.dtype), jnp.full(lse_a.shape, -jnp.inf, lse_a.dtype)
    else:
        o_e, lse_e = cf.flash_attn_forward(*(to_kind(x) for x in (q, k[:, :0], v[:, :0])), backend="cuda")
    o, lse = cf.merge_states(o_a, lse_a, o_e, lse_e)
    assert gpu.same_bits(to_cupy(o), to_cupy(o_a)) == 0 and gpu.same_bits(to_cupy(lse), to_cupy(lse_a)) == 0, \
        f"[{kind} {dtype}] merging a part with no keys changed the other"
    o, lse = (to_cupy(x) for x in cf.merge_states(o_e, lse_e, o_e, lse_e))
    assert not int(cp.count_nonzero(o)) and bool(cp.isneginf(lse).all()), f"[{kind} {dtype}] two empty parts"
