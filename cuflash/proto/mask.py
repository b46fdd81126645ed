"""Mirror of kernels_cu/mask.cuh: which (query row, key column) pairs take part.

One rule, the same as every kernel's: a key column is visible when it is inside seqlen_k and, if
causal, when col <= row + seqlen_k - seqlen_q (the diagonal aligned bottom-right). The C++ template
arguments (kIsCausal, kBlockM, kBlockN) become the leading arguments here; the kernels pass their
closure constants, so the branches fold the same way after compilation.

mask.cuh's mask_scores works on mma.sync fragments; mask_scores here works on the prototypes'
(rows, strided columns) layout. The backward prototypes test col_limit per element instead of
mask.cuh's mask_scores_t (they compute S, not S^T).
"""

import math

from numba import cuda


@cuda.jit(device=True)
def ceil_div(a, b):
    # common.cuh's ceil_div (a >= 0 at every call site, so floor and truncation agree).
    return (a + b - 1) // b


@cuda.jit(device=True)
def col_limit(is_causal, row, seqlen_q, seqlen_k):
    # Largest visible key column + 1 for a query row (may be <= 0: the row sees no key).
    # [1] col_limit: seqlen_k, or if causal min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    if is_causal:
        return min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    return seqlen_k


@cuda.jit(device=True)
def n_block_max(is_causal, block_m, block_n, m_block, seqlen_q, seqlen_k):
    # Number of key blocks query block m_block must visit; causal skips the blocks wholly above the
    # diagonal. <= 0 when every row of the block sees no key.
    # [2] Key blocks to visit: ceil_div(max(col_limit of the block's last row, 0), block_n)
    limit = col_limit(is_causal, min((m_block + 1) * block_m, seqlen_q) - 1, seqlen_q, seqlen_k)
    return ceil_div(max(limit, 0), block_n)


@cuda.jit(device=True)
def m_block_min(is_causal, block_m, block_n, n_block, seqlen_q, seqlen_k):
    # First query block that sees any column of key block n_block (dK/dV skips the earlier ones).
    # [3] First query block to visit: 0, or if causal max(n_block * block_n - (seqlen_k - seqlen_q), 0) / block_m
    if not is_causal:
        return 0
    first_row = max(n_block * block_n - (seqlen_k - seqlen_q), 0)
    return first_row // block_m


@cuda.jit(device=True)
def block_needs_mask(is_causal, block_m, block_n, m_block, n_block, seqlen_q, seqlen_k):
    # Does key block n_block need per-element masking for query block m_block? (tail or diagonal)
    # [4] Mask a tile that crosses seqlen_k or, if causal, whose last column its first row cannot see
    if (n_block + 1) * block_n > seqlen_k:
        return True
    if not is_causal:
        return False
    # The block's last column must be visible from its first row.
    return (n_block + 1) * block_n - 1 > m_block * block_m + seqlen_k - seqlen_q


@cuda.jit(device=True)
def mask_scores(is_causal, acc_s, row0, row_stride, col0, col_stride, seqlen_q, seqlen_k):
    # Per-element mask on a thread's scores (mask.cuh mask_scores, for the prototypes' layout):
    # acc_s[i, j] is query row row0 + i * row_stride, key column col0 + j * col_stride (global
    # indices). Hidden scores become -inf.
    # [5] Scores at or past their row's col_limit become -inf
    for i in range(acc_s.shape[0]):
        limit = col_limit(is_causal, row0 + i * row_stride, seqlen_q, seqlen_k)
        for j in range(acc_s.shape[1]):
            if col0 + j * col_stride >= limit:
                acc_s[i, j] = -math.inf
