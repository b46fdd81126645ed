// Which (query row, key column) pairs take part. One rule, used by every kernel and mirrored in
// cuflash/proto/mask.py: a key column is visible when it is inside seqlen_k and, if causal, when
// col <= row + seqlen_k - seqlen_q (the diagonal aligned bottom-right, as in FlashAttention 2.1+).
#pragma once
#include "common.cuh"

namespace cuflash {

// Largest visible key column + 1 for a query row (may be <= 0: the row sees no key).
template <bool kIsCausal>
__device__ __forceinline__ int col_limit(int row, int seqlen_q, int seqlen_k) {
    // [1] col_limit: seqlen_k, or if causal min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    if (kIsCausal) return min(seqlen_k, row + 1 + seqlen_k - seqlen_q);
    return seqlen_k;
}

// Number of key blocks a query block [m_block * kBlockM, +kBlockM) must visit; causal skips the
// blocks wholly above the diagonal. Can be <= 0 when every row of the block sees no key.
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
    // [2] Key blocks to visit: ceil_div(max(col_limit of the block's last row, 0), block_n)
    int limit = col_limit<kIsCausal>(min((m_block + 1) * kBlockM, seqlen_q) - 1, seqlen_q, seqlen_k);
    return ceil_div(max(limit, 0), kBlockN);
}

// First query block that sees any column of key block n_block (backward dK/dV: earlier query
// blocks lie wholly above the diagonal and are skipped).
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ int m_block_min(int n_block, int seqlen_q, int seqlen_k) {
    // [3] First query block to visit: 0, or if causal max(n_block * block_n - (seqlen_k - seqlen_q), 0) / block_m
    if (!kIsCausal) return 0;
    int first_row = max(n_block * kBlockN - (seqlen_k - seqlen_q), 0);
    return first_row / kBlockM;
}

// Does key block n_block need per-element masking for query block m_block? (tail or diagonal)
template <bool kIsCausal, int kBlockM, int kBlockN>
__device__ __forceinline__ bool block_needs_mask(int m_block, int n_block, int seqlen_q, int seqlen_k) {
    // [4] Mask a tile that crosses seqlen_k or, if causal, whose last column its first row cannot see
    if ((n_block + 1) * kBlockN > seqlen_k) return true;
    if (!kIsCausal) return false;
    // The block's last column must be visible from its first row.
    return (n_block + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q;
}

// Per-element masks on one warp's mma.sync score accumulators (C layout: c0,c1 = row g, cols 2t,2t+1;
// c2,c3 = row g+8; g = lane >> 2, t = lane & 3). Hidden scores become -inf.
//
// S = Q K^T: kMTiles x kNTiles tiles of 16 query rows x 8 key columns; row0 is the global query row of
// the warp's first row, col0 the global key column of n-tile 0.
template <bool kIsCausal, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kMTiles][kNTiles][4], int row0, int col0, int lane,
                                            int seqlen_q, int seqlen_k) {
    // [5] Scores at or past their row's col_limit become -inf
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int limit = col_limit<kIsCausal>(row0 + 16 * mi + g + 8 * h, seqlen_q, seqlen_k);
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col0 + 8 * ni + 2 * t + e >= limit) acc_s[mi][ni][2 * h + e] = neg_inf<float>();
                }
            }
        }
    }
}

// S^T = K Q^T (the dK/dV kernel): kNTiles tiles of 16 key rows x 8 query columns; key0 is the global key
// row of the warp's first row, query0 the global query column of n-tile 0.
template <bool kIsCausal, int kNTiles>
__device__ __forceinline__ void mask_scores_t(float (&acc_s)[kNTiles][4], int key0, int query0, int lane,
                                              int seqlen_q, int seqlen_k) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int limit = col_limit<kIsCausal>(query0 + 8 * ni + 2 * t + e, seqlen_q, seqlen_k);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (key0 + g + 8 * h >= limit) acc_s[ni][2 * h + e] = neg_inf<float>();
            }
        }
    }
}

}  // namespace cuflash
