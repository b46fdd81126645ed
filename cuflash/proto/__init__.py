"""Numba-CUDA mirrors of kernels_cu/: one module per .cu / .cuh, same names, same numbered steps.

They run on a GPU through numba-cuda and on the CPU under NUMBA_ENABLE_CUDASIM=1 (at tiny sizes:
the simulator runs every thread as a Python thread). Only shared memory and syncthreads are used
(the simulator has no warp shuffles). Importing this package imports numba: set
NUMBA_ENABLE_CUDASIM before the first import of numba in the process.
"""
