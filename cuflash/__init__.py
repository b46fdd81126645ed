"""cuflash: exact FlashAttention for NumPy/CuPy code, CUDA kernels JIT-compiled through CuPy."""
__version__ = "0.1.0"
