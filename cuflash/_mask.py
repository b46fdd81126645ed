"""Score modifiers and masks, vectorized: the Python counterpart of kernels_cu/mask.cuh.

Shared by the float64 reference (cuflash/reference.py, NumPy or CuPy arrays: every function that
builds arrays takes an `xp` namespace) and the tiled NumPy backend. FlashAttention 2's semantics:

* Query row i sits at key position i' = i + seqlen_k - seqlen_q (per sequence with varlen).
* window=(left, right), -1 unbounded: row i sees key j iff i' - left <= j <= i' + right.
  causal=True is right = 0 (whatever window[1] says). `effective_window` folds the two.
* softcap c > 0: a score s (already multiplied by softmax_scale) becomes c * tanh(s / c); its
  derivative is 1 - tanh(s / c)**2.
* ALiBi: the bias -slope * |i' - j| is added after the softcap.

The block rules give, for a query block, the key columns any of its rows can see (and for a key
block the query rows that can see any of its columns), so that tiles wholly outside the causal
diagonal or the window are skipped rather than masked.
"""

from __future__ import annotations

import numpy as np

NO_WINDOW = (-1, -1)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def effective_window(causal: bool, window=NO_WINDOW) -> tuple[int, int]:
    """(left, right) with causal folded in: right = 0 when causal; -1 stands for unbounded."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    return left, (0 if causal else right)


def is_plain(left: int, right: int) -> bool:
    return left < 0 and right < 0


def visible(rows, cols, seqlen_q: int, seqlen_k: int, left: int, right: int, xp=np):
    """(len(rows), len(cols)) bool: row i sees key j (rows, cols: 1-D indices within the sequence)."""
    ip = rows[:, None] + (seqlen_k - seqlen_q)
    j = cols[None, :]
    ok = j < seqlen_k
    if left >= 0:
        ok = ok & (j >= ip - left)
    if right >= 0:
        ok = ok & (j <= ip + right)
    return xp.broadcast_to(ok, (rows.shape[0], cols.shape[0]))


def col_range(row0: int, row1: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """[lo, hi): the key columns that some row of [row0, row1) sees (lo >= hi: none)."""
    shift = seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, row0 + shift - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, row1 - 1 + shift + right + 1)
    return lo, hi


def row_range(col0: int, col1: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """[lo, hi): the query rows that see some column of [col0, col1) (lo >= hi: none)."""
    shift = seqlen_k - seqlen_q
    lo = 0 if right < 0 else max(0, col0 - right - shift)
    hi = seqlen_q if left < 0 else min(seqlen_q, col1 - 1 + left - shift + 1)
    return lo, hi


def n_block_range(m_block, block_m, block_n, seqlen_q, seqlen_k, left, right) -> tuple[int, int]:
    """[n_block_min, n_block_max): the key blocks query block m_block must visit."""
    row0, row1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)
    lo, hi = col_range(row0, row1, seqlen_q, seqlen_k, left, right)
    if hi <= lo:
        return 0, 0
    return lo // block_n, ceil_div(hi, block_n)


def m_block_range(n_block, block_m, block_n, seqlen_q, seqlen_k, left, right) -> tuple[int, int]:
    """[m_block_min, m_block_max): the query blocks that see key block n_block."""
    col0, col1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
    lo, hi = row_range(col0, col1, seqlen_q, seqlen_k, left, right)
    if hi <= lo:
        return 0, 0
    return lo // block_m, ceil_div(hi, block_m)


def block_needs_mask(row0, row1, col0, col1, seqlen_q, seqlen_k, left, right) -> bool:
    """Does a tile hold a score that some row must not see? rows [row0, row1), cols [col0, col1), col1
    the block's full end (a tile that crosses seqlen_k needs the mask, as in the kernels)."""
    shift = seqlen_k - seqlen_q
    if col1 > seqlen_k:
        return True
    if right >= 0 and col1 - 1 > row0 + shift + right:
        return True
    return left >= 0 and col0 < row1 - 1 + shift - left


def apply_softcap(s, cap: float, xp=np):
    """(cap * tanh(s / cap), tanh(s / cap)): the capped scores and what the derivative needs."""
    t = xp.tanh(s / s.dtype.type(cap))
    return t * s.dtype.type(cap), t


def softcap_grad(t):
    """d(cap * tanh(s / cap)) / ds = 1 - tanh(s / cap)**2, from t = tanh(s / cap)."""
    return 1 - t * t


def alibi_bias(slopes, rows, cols, seqlen_q: int, seqlen_k: int, xp=np):
    """-slope * |i' - j|: slopes of any shape (...), result (..., len(rows), len(cols))."""
    dist = xp.abs(rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :])
    return -slopes[..., None, None] * dist.astype(slopes.dtype)
