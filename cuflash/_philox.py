"""The dropout generator: Philox4x32-10, vectorized, NumPy or CuPy (an `xp` namespace argument).

Specification (what the CUDA kernels must reproduce bit for bit):

* Philox4x32-10 (Salmon et al., SC11; Random123): a 128-bit counter (c0, c1, c2, c3) and a 64-bit
  key (k0, k1), all uint32 words. One round, with M0 = 0xD2511F53 and M1 = 0xCD9E8D57::

      hi0:lo0 = M0 * c0 (64-bit product)      hi1:lo1 = M1 * c2
      (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

  Ten rounds; between consecutive rounds the key is bumped, k0 += 0x9E3779B9, k1 += 0xBB67AE85
  (mod 2**32). The output is the counter after round 10.
* Key: (seed & 0xFFFFFFFF, seed >> 32), for 0 <= seed < 2**64.
* One call serves the 8 scores of a 16 x 16 tile that one thread holds in the mma.sync C layout
  (rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9, with g = row % 8 and t = (col % 8) // 2).
  Score (batch b, head h, row, col), row and col counted from the start of the sequence (with
  varlen, b is the sequence index), takes the call with counter
  (col // 16 * 4 + t, row // 16 * 8 + g, b * nheads + h, offset), output word
  2 * (row % 16 // 8) + col % 16 // 8, and of that word the 16-bit half col % 2 (0: the low half).
* It is kept iff that 16-bit draw >= threshold = floor(dropout_p * 2**16), so the drop probability
  is dropout_p rounded down to a multiple of 2**-16. Kept scores are scaled by 1 / (1 - dropout_p).
"""

from __future__ import annotations

import math

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def philox4x32(c0, c1, c2, c3, k0, k1, xp=np, rounds: int = ROUNDS):
    """Philox4x32-`rounds` of broadcastable uint32 counter words and an integer key: four uint32 arrays.

    Products are taken in uint64 (a 32 x 32 -> 64-bit multiply); every result is reduced to uint32."""
    u32, u64 = xp.uint32, xp.uint64
    c0, c1, c2, c3 = (xp.asarray(c, dtype=u32) for c in (c0, c1, c2, c3))
    c0, c1, c2, c3 = xp.broadcast_arrays(c0, c1, c2, c3)
    k0, k1 = int(k0) & _MASK32, int(k1) & _MASK32  # the key: Python ints, bumped mod 2**32
    m0, m1 = u64(M0), u64(M1)
    shift, low = u64(32), u64(_MASK32)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
        p0 = c0.astype(u64) * m0
        p1 = c2.astype(u64) * m1
        hi0, lo0 = (p0 >> shift).astype(u32), (p0 & low).astype(u32)
        hi1, lo1 = (p1 >> shift).astype(u32), (p1 & low).astype(u32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ u32(k0), lo1, hi0 ^ c3 ^ u32(k1), lo0
    return c0, c1, c2, c3


def threshold(dropout_p: float) -> int:
    """floor(dropout_p * 2**16): a score is kept iff its 16-bit draw is >= this."""
    return int(math.floor(float(dropout_p) * 2.0**16))


def keep(dropout_p, seed, offset, bh, rows, cols, xp=np):
    """The keep mask of a tile: bool of shape broadcast(bh[..., None, None], rows[:, None], cols[None, :]).

    bh: the b * nheads + h indices (any shape); rows and cols: contiguous 1-D index ranges within the
    sequence. One Philox call per (16-row group, 16-column group, g, t), as the kernels make them."""
    bh = xp.asarray(bh, dtype=xp.int64)
    rows = xp.asarray(rows, dtype=xp.int64)
    cols = xp.asarray(cols, dtype=xp.int64)
    out_shape = tuple(bh.shape) + (int(rows.shape[0]), int(cols.shape[0]))
    if 0 in out_shape:
        return xp.ones(out_shape, dtype=bool)
    r16_0, c16_0 = int(rows[0]) // 16, int(cols[0]) // 16
    r16 = xp.arange(r16_0, int(rows[-1]) // 16 + 1, dtype=xp.int64)
    c16 = xp.arange(c16_0, int(cols[-1]) // 16 + 1, dtype=xp.int64)
    lanes_g, lanes_t = xp.arange(8, dtype=xp.int64), xp.arange(4, dtype=xp.int64)
    # calls indexed (..., row16, g, col16, t)
    c0 = (c16[:, None] * 4 + lanes_t[None, :])[None, None, :, :]
    c1 = (r16[:, None] * 8 + lanes_g[None, :])[:, :, None, None]
    seed, offset = int(seed), int(offset)
    words = philox4x32(c0, c1, bh[..., None, None, None, None], offset & _MASK32, seed & _MASK32, seed >> 32, xp=xp)
    words = xp.stack(words, axis=-1)  # (..., row16, g, col16, t, 4)
    ri, ci = rows[:, None], cols[None, :]
    word = 2 * (ri % 16 // 8) + ci % 16 // 8
    w = words[..., ri // 16 - r16_0, ri % 8, ci // 16 - c16_0, ci % 8 // 2, word]
    draw = xp.where(ci % 2 == 1, w >> xp.uint32(16), w & xp.uint32(0xFFFF))
    return draw >= xp.uint32(threshold(dropout_p))
def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, *, dropout_p: float, seed: int,
                 offset: int = 0, xp=np):
    """The boolean keep mask (batch, nheads, seqlen_q, seqlen_k) that every backend uses for these
    arguments (True: kept, scaled by 1 / (1 - dropout_p); False: dropped)."""
    bh = xp.arange(batch * nheads, dtype=xp.int64).reshape(batch, nheads)
    return keep(dropout_p, seed, offset, bh, xp.arange(seqlen_q), xp.arange(seqlen_k), xp=xp)
