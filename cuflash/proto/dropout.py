"""Mirror of kernels_cu/dropout.cuh: dropout's keep mask, Philox4x32-10 as specified in cuflash/_philox.py.

dropout.cuh's struct Dropout holds (key0, key1, bh, offset, threshold); here they are the leading
arguments of draws / keep / keep_tile. Every 32-bit word is held in a uint64 (values < 2**32): the
32 x 32 -> 64-bit products of a Philox round are then exact, their high and low words are a shift and
a mask, and the key bumps are reduced mod 2**32 with a mask (Numba has no __umulhi, and its uint32
arithmetic would promote or wrap differently on the GPU and in the simulator).

The prototypes' threads do not hold their scores in the mma.sync C layout, so the kernels take one
keep flag per score (keep, a whole Philox call per draw, as the SIMT kernels do). keep_tile is the
tensor-core kernels' walk (one call per 16 x 16 tile and lane), on a plain (rows, cols) array.
"""

import numpy as np
from numba import cuda, uint64

M0 = np.uint64(0xD2511F53)
M1 = np.uint64(0xCD9E8D57)
W0 = np.uint64(0x9E3779B9)
W1 = np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
MASK16 = np.uint64(0xFFFF)
SHIFT32 = np.uint64(32)
SHIFT16 = np.uint64(16)


@cuda.jit(device=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    # Counter (c0, c1, c2, c3) and key (k0, k1): uint64 holding 32-bit words; returns the 4 output words.
    for r in range(10):
        if r > 0:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        p0 = M0 * c0
        p1 = M1 * c2
        n0 = (p1 >> SHIFT32) ^ c1 ^ k0
        n2 = (p0 >> SHIFT32) ^ c3 ^ k1
        c1 = p1 & MASK32
        c3 = p0 & MASK32
        c0 = n0
        c2 = n2
    return c0, c1, c2, c3


@cuda.jit(device=True)
def draws(key0, key1, bh, offset, row16, col16, g, t):
    # key0, key1: the seed's low and high words; bh = batch * nheads + head; all uint64.
    # [1] Draws: the 4 words of one Philox call, tile (row / 16, col / 16), lane (g, t)
    return philox4x32_10(uint64(col16 * 4 + t), uint64(row16 * 8 + g), bh, offset, key0, key1)


@cuda.jit(device=True)
def kept(threshold, word, half):
    # The 16-bit draw `half` (0: low) of a word against floor(dropout_p * 65536).
    if half:
        return (word >> SHIFT16) >= threshold
    return (word & MASK16) >= threshold


@cuda.jit(device=True)
def pick(w0, w1, w2, w3, word):
    # word `word` of a Philox call's four (a register array's element in CUDA)
    if word == 0:
        return w0
    if word == 1:
        return w1
    if word == 2:
        return w2
    return w3


@cuda.jit(device=True)
def keep(key0, key1, bh, offset, threshold, row, col):
    # [2] Keep flag of one score (SIMT kernels): a whole Philox call for one draw
    w0, w1, w2, w3 = draws(key0, key1, bh, offset, row // 16, col // 16, row % 8, col % 8 // 2)
    return kept(threshold, pick(w0, w1, w2, w3, 2 * (row % 16 // 8) + col % 16 // 8), col % 2)


@cuda.jit(device=True)
def keep_tile(key0, key1, bh, offset, threshold, flags, row0, col0):
    # flags (rows, cols), multiples of 16: flags[i, j] is the keep flag of score (row0 + i, col0 + j);
    # row0 and col0 are multiples of 16.
    # [3] Keep flags of a warp's tile in the mma.sync C layout, one call per 16 x 16 (forward)
    for mi in range(flags.shape[0] // 16):
        for np_ in range(flags.shape[1] // 16):
            for lane in range(32):  # the warp's lanes, each holding 8 scores of the 16 x 16 tile
                g = lane >> 2
                t = lane & 3
                w0, w1, w2, w3 = draws(key0, key1, bh, offset, row0 // 16 + mi, col0 // 16 + np_, g, t)
                for hc in range(2):  # column 8 hc + 2t + e
                    for i in range(4):  # i = 2h + e: row g + 8h
                        h = i >> 1
                        e = i & 1
                        w = pick(w0, w1, w2, w3, 2 * h + hc)
                        flags[16 * mi + g + 8 * h, 16 * np_ + 8 * hc + 2 * t + e] = kept(threshold, w, e)
