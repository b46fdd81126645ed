"""DLPack producers on the host (torch CPU tensors) through the NumPy backend: the same kind out,
bfloat16 included (NumPy cannot take bf16 through DLPack: it crosses as its bit pattern).
torch is optional; tests/test_gpu_interop.py covers torch on CUDA."""

import ml_dtypes
import numpy as np
import pytest

import cuflash

torch = pytest.importorskip("torch", reason="torch not installed (optional)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_torch_cpu_in_torch_out(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 17, 4, 32, generator=g).to(dtype) for _ in range(3))
    o, lse = cuflash.flash_attn(q, k, v, causal=True, return_lse=True, backend="numpy")
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    np_dtype = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else None
    to_np = (lambda t: t.view(torch.int16).numpy().view(np_dtype)) if np_dtype else (lambda t: t.numpy())
    o_np = cuflash.flash_attn(to_np(q), to_np(k), to_np(v), causal=True, backend="numpy")
    np.testing.assert_array_equal(to_np(o), o_np)
    dq, dk, dv = cuflash.flash_attn_backward(torch.ones_like(o), q, k, v, o, lse, causal=True, backend="numpy")
    assert all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in (dq, dk, dv))


def test_torch_cpu_out_is_written_in_place():
    q = torch.randn(1, 8, 2, 16).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    o = cuflash.flash_attn(q, q, q, out=out, backend="numpy")
    assert o is out and bool(torch.isfinite(out.float()).all())
