"""cuflash: exact FlashAttention for NumPy/CuPy code, CUDA kernels JIT-compiled through CuPy.

    >>> import numpy as np, cuflash
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 128, 4, 64), dtype=np.float32)
    >>> o = cuflash.flash_attn(q, k, v, causal=True)   # NumPy in, NumPy out
"""

__version__ = "0.1.0"

from ._merge import merge_states, merge_states_list  # noqa: E402
from .config import kernel_family  # noqa: E402
from .api import (  # noqa: E402
    dropout_mask,
    flash_attn,
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_varlen,
    flash_attn_varlen_backward,
    flash_attn_varlen_forward,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn", "flash_attn_forward", "flash_attn_backward", "flash_attn_varlen",
           "flash_attn_varlen_forward", "flash_attn_varlen_backward", "flash_attn_with_kvcache", "dropout_mask", "merge_states",
           "merge_states_list", "kernel_family", "__version__"]
