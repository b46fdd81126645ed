"""Mirror of kernels_cu/mask.cuh: which (query row, key column) pairs take part, and what becomes of a score.

Query row i sits at key position i' = i + shift, shift = seqlen_k - seqlen_q (the diagonal aligned
bottom-right). With is_local (config.LOCAL: causal and / or a window) row i sees keys i' - left ..
i' + right; an unbounded side is UNBOUNDED (1 << 30, what cuflash/_params.py writes for -1), causal
is right = 0. Without is_local every key below seqlen_k is visible.

mask.cuh's struct Mask holds (params, seqlen_q, seqlen_k); here its values are the leading arguments
of each rule: (is_local, left, right, seqlen_q, seqlen_k, ...). The kernels pass is_local as a closure
constant, so the branches fold after compilation as the C++ template's do. ScoreMod becomes
score_mod_init (its constructor) and score_mod, with its template bits (is_softcap, is_alibi) and
values (tanh_in, bias, shift) leading likewise.

n_block_range and needs_mask take a query block's rows; key_block_range and tile_needs_mask, which they
call as in mask.cuh, take any rows [row0, row1) (and keys [col0, col1)): flash_decode's packed GQA tiles.

mask.cuh's fragment walks (mma.cuh for_each_score / for_each_score_t) have no counterpart: the
prototypes test `visible` per element of their own (rows, strided columns) layout.
"""

import math

from numba import cuda

UNBOUNDED = 1 << 30  # kUnbounded of mask.cuh: a window bound of -1


@cuda.jit(device=True)
def ceil_div(a, b):
    # common.cuh's ceil_div (a >= 0 at every call site, so floor and truncation agree).
    return (a + b - 1) // b


@cuda.jit(device=True)
def col_lo(is_local, left, right, seqlen_q, seqlen_k, row):
    # [1] Keys a row sees: [col_lo(row), col_hi(row)), inside the sequence and the window
    if is_local:
        return max(0, row + seqlen_k - seqlen_q - left)
    return 0


@cuda.jit(device=True)
def col_hi(is_local, left, right, seqlen_q, seqlen_k, row):
    # (step [1]) the end of the row's keys; <= col_lo: the row sees no key
    if is_local:
        return min(seqlen_k, row + seqlen_k - seqlen_q + right + 1)
    return seqlen_k


@cuda.jit(device=True)
def visible(is_local, left, right, seqlen_q, seqlen_k, row, col):
    return (col >= col_lo(is_local, left, right, seqlen_q, seqlen_k, row)
            and col < col_hi(is_local, left, right, seqlen_q, seqlen_k, row))


@cuda.jit(device=True)
def n_block_range(is_local, left, right, seqlen_q, seqlen_k, block_m, block_n, m_block):
    # [2] Key blocks a query block visits: [lo, hi), those some row of the block sees (lo >= hi: none)
    row0 = m_block * block_m
    return key_block_range(is_local, left, right, seqlen_q, seqlen_k, block_n, row0, min(row0 + block_m, seqlen_q))


@cuda.jit(device=True)
def key_block_range(is_local, left, right, seqlen_q, seqlen_k, block_n, row0, row1):
    # The same for query rows [row0, row1) (flash_decode: the rows of a packed GQA tile)
    c0 = col_lo(is_local, left, right, seqlen_q, seqlen_k, row0)
    c1 = col_hi(is_local, left, right, seqlen_q, seqlen_k, row1 - 1)
    lo = c0 // block_n
    hi = ceil_div(c1, block_n) if c1 > c0 else lo
    return lo, hi


@cuda.jit(device=True)
def m_block_range(is_local, left, right, seqlen_q, seqlen_k, block_m, block_n, n_block):
    # [3] Query blocks that see a key block: [lo, hi) (the backward's loop)
    shift = seqlen_k - seqlen_q
    col0 = n_block * block_n
    col1 = min(col0 + block_n, seqlen_k)
    r0 = max(0, col0 - right - shift) if is_local else 0
    r1 = min(seqlen_q, col1 - 1 + left - shift + 1) if is_local else seqlen_q
    lo = r0 // block_m
    hi = ceil_div(r1, block_m) if r1 > r0 else lo
    return lo, hi


@cuda.jit(device=True)
def needs_mask(is_local, left, right, seqlen_q, seqlen_k, block_m, block_n, m_block, n_block):
    # [4] Does a tile hold a score some row must not see? (it crosses seqlen_k, or a window edge)
    row0 = m_block * block_m
    return tile_needs_mask(is_local, left, right, seqlen_q, seqlen_k, row0, min(row0 + block_m, seqlen_q),
                           n_block * block_n, (n_block + 1) * block_n)


@cuda.jit(device=True)
def tile_needs_mask(is_local, left, right, seqlen_q, seqlen_k, row0, row1, col0, col1):
    # The same for query rows [row0, row1) and keys [col0, col1)
    if col1 > seqlen_k:
        return True
    if not is_local:
        return False
    shift = seqlen_k - seqlen_q
    return col1 - 1 > row0 + shift + right or col0 < row1 - 1 + shift - left


@cuda.jit(device=True)
def score_mod_init(is_softcap, scale, softcap, slope, scale_log2, log2e):
    # ScoreMod's constructor: (unit, tanh_in, bias, score_log2) of one (batch, head). The kernels hold
    # scores in units of logit / unit (unit = softcap with a softcap, else scale: q.k, as plain
    # attention), so that unit rides on exp2's scale (score_log2) and the LSE's factor (unit) rather than
    # costing a multiply per score. log2e: LOG2E as acc_t (a Python float would promote to float64).
    # (The CUDA ScoreMod also clamps bias to a finite value and, for kTanhExp2, folds 2 log2(e) into tanh_in.)
    unit = softcap if is_softcap else scale
    tanh_in = scale / unit
    bias = slope / unit
    score_log2 = unit * log2e if is_softcap else scale_log2
    return unit, tanh_in, bias, score_log2


@cuda.jit(device=True)
def score_mod(is_softcap, is_alibi, tanh_in, bias, shift, s, row, col):
    # [5] Score modifiers: q.k -> softcap * tanh(scale * q.k / softcap) - slope * |i' - j|.
    # In held units (score_mod_init): t = tanh(scale * q.k / softcap) (else q.k), minus bias * |i' - j|.
    # Returns (the held score, dcap = d logit / d(scale * q.k) = 1 - t^2, 1 without a softcap). Only
    # called when is_softcap or is_alibi (mask.cuh's kTransform): plain scores stay as they are.
    # tanh: the library's (ScoreMod's kTanhLibrary, as the SIMT kernels; the tensor-core ones take tanh_approx
    # forward and tanh_exp2 backward).
    dcap = 1.0
    x = s
    if is_softcap:
        x = math.tanh(s * tanh_in)
        dcap = 1.0 - x * x
    if is_alibi:
        x -= bias * abs(row + shift - col)
    return x, dcap


@cuda.jit(device=True)
def dcap_of(is_alibi, bias, shift, x, row, col):
    # score_mod's dcap again from its held score x (what a kernel can recover from P instead of keeping
    # dcap): ALiBi's bias undone, then 1 - t^2
    if is_alibi:
        x += bias * abs(row + shift - col)
    return 1.0 - x * x
