// Which (query row, key column) pairs take part. One rule, used by every kernel and mirrored in
// cuflash/proto/mask.py: a key column is visible when it is inside seqlen_k and, if causal, when
// col <= row + seqlen_k - seqlen_q (the diagonal aligned bottom-right, as in FlashAttention 2.1+).
#pragma once
#include "common.cuh"

namespace cuflash {

// Largest visible key column + 1 for a query row (may be <= 0: the row sees no key).
template <bool kIsCausal>
__device__ __forceinline__ int col_limit(int row, int seqlen_q, int seqlen_k) {
    if (kIsCausal) return min(seqlen_k, row + 1 + seqlen_k - seqlen_q);
    return seqlen_k;
}

// Number of key blocks a query block [m_block * kBlockM, +kBlockM) must visit; causal skips the
// blocks wholly above the diagonal. Can be <= 0 when every row of the block sees no key.
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
    int limit = col_limit<kIsCausal>(min((m_block + 1) * kBlockM, seqlen_q) - 1, seqlen_q, seqlen_k);
    return ceil_div(max(limit, 0), kBlockN);
}

// First query block that sees any column of key block n_block (backward dK/dV: earlier query
// blocks lie wholly above the diagonal and are skipped).
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int m_block_min(int n_block, int seqlen_q, int seqlen_k) {
    if (!kIsCausal) return 0;
    int first_row = max(n_block * kBlockN - (seqlen_k - seqlen_q), 0);
    return first_row / kBlockM;
}

// Does key block n_block need per-element masking for query block m_block? (tail or diagonal)
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ bool block_needs_mask(int m_block, int n_block, int seqlen_q, int seqlen_k) {
    if ((n_block + 1) * kBlockN > seqlen_k) return true;
    if (!kIsCausal) return false;
    // The block's last column must be visible from its first row.
    return (n_block + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q;
}

}  // namespace cuflash
