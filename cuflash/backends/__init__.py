"""Backends: cuda (RawModule kernels), numba (the prototypes), numpy (tiled CPU). Same interface each."""
