// What the tensor-core backward kernels (flash_bwd.cu, flash_bwd_sm90.cu) share: the LSE as exp2's offset,
// the order of a key block's pairs and the deterministic turns, and where the workspace
// (config.BackwardWorkspace) keeps the dQ accumulator and semaphores.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// LSE (natural log) -> the offset subtracted from S * scale_log2 in exp2; -inf (the row saw no key) gives
// +inf, so that P = exp2(finite or -inf - inf) = 0, never NaN.
__device__ __forceinline__ float lse_to_log2_offset(float lse) {
    return lse == neg_inf<float>() ? -neg_inf<float>() : lse * 1.4426950408889634f;
}

// The key block and batch entry of a flash_bwd or flash_bwd_sm90 block: the grid is config.backward_grid's,
// (nheads_k, key blocks, batch), or (nheads_k, batch, key blocks) when deterministic (key blocks slowest of all,
// so that every entry's turn chains run side by side).
template <bool kDeterministic>
__device__ __forceinline__ void backward_block(int& n_block, int& batch) {
    n_block = kDeterministic ? blockIdx.z : blockIdx.y;
    batch = kDeterministic ? blockIdx.y : blockIdx.z;
}

// The (query head of the group, query block) pairs a key block visits, in order: pair `it` is query head
// hq = it % group at the i-th query block (i = it / group) from the first, or (kDeterministic) from the last.
// kDeterministic: the key blocks add into each dQ tile first to last (dq_turn). A block's i-th pair is then
// a tile that every block before it in line visited at its i-th pair or earlier (masks end their query-block
// ranges in key order), so a block lags the one before it by about a pair, and the grid keeps its
// longest-first launch order.
template <bool kDeterministic>
__device__ __forceinline__ void backward_pair(int it, int head_k, int group, int m_block_first, int m_block_end,
                                              int& head, int& m_block) {
    head = head_k * group + it % group;
    m_block = kDeterministic ? m_block_end - 1 - it / group : m_block_first + it / group;
}

// kDeterministic: key block n_block's turn at dQ tile m_block, the count of key blocks before it in the
// tile's range (they add first; the tile's semaphore counts those that have)
template <int kBlockM, int kBlockN, class MaskT>
__device__ __forceinline__ int dq_turn(const MaskT& mask, int m_block, int n_block) {
    int n_first, n_end;
    mask.template n_block_range<kBlockM, kBlockN>(m_block, n_first, n_end);
    return n_block - n_first;
}

// The dQ accumulator's rows of (entry, head) and the entry's dQ semaphores of that head (workspace offsets
// in bytes from dsum; params.cuh).
template <class Seq>
__device__ __forceinline__ float* dq_accum_rows(const BwdParams& p, const Seq& seq, int batch, int head) {
    return reinterpret_cast<float*>(static_cast<char*>(p.dsum) + p.dq_accum_offset) +
           seq.q_offset(batch, p.dq_accum_batch_stride, p.dq_accum_row_stride) + head * p.dq_accum_head_stride;
}
// Where column col of the accumulator's row `row` (counted from the entry's first row) lies: its 8-float chunk
// trades places with chunk ^ (row & swizzle) (BwdParams::dq_accum_swizzle). flash_bwd_sm90's sDqAcc holds a tile
// as the accumulator does (one bulk reduce adds it), and unswizzled rows, a multiple of 32 floats long, all start
// in bank 0: the 8 rows of a warp's fragment stores would take 8-way bank conflicts, where kDqSwizzleSm90 spreads
// them over the 4 bank groups of a 128-byte line (2 wavefronts, the fewest). flash_bwd adds straight into global
// memory and keeps the plain layout (its 255 registers have none to spare for the swizzle). Rows being multiples
// of 32 floats, chunks stay in their row.
constexpr int kDqSwizzleSm90 = 3;
__device__ __forceinline__ int dq_accum_col(int row, int col, int swizzle) { return col ^ ((row & swizzle) << 3); }
__device__ __forceinline__ int* dq_semaphores(const BwdParams& p, int batch, int head) {
    return reinterpret_cast<int*>(static_cast<char*>(p.dsum) + p.dq_semaphore_offset) +
           batch * p.dq_semaphore_batch_stride + head * p.dq_semaphore_head_stride;
}

}  // namespace cuflash
