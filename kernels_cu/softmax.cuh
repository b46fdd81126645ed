// Online softmax on mma.sync accumulators, all in registers.
//
// A warp's score tile is kMTiles x kNTiles accumulators of 16 x 8 (C layout: c0,c1 = row g, cols 2t,2t+1;
// c2,c3 = row g+8, same cols; g = lane >> 2, t = lane & 3). A thread therefore holds 2 rows per m-tile
// (index r = 2 * mi + h: row 16 * mi + g + 8 * h, elements c[2h], c[2h+1]), and the 4 lanes of a
// quad (same g, t = 0..3) hold the rest of each row: row reductions are __shfl_xor over lane bits 0-1.
//
// row_max is the running max of the raw scores S (unscaled); row_sum is this thread's partial sum of
// P over its own columns, rescaled whenever row_max moves, and reduced over the quad once at finalize.
//
// kBounded (mask.cuh kBounded: a softcap of at most config.BOUNDED_SOFTCAP = 50 bounds every logit): row_max
// stays 0. P = e^logit then lies in [e^-softcap, e^softcap], inside fp32's and bf16's range, so no row max, no
// shuffles and no rescale of acc_o are needed: a score's softmax is a multiply, the exp2 and an add, which
// pays for the two instructions the softcap's tanh adds.
#pragma once
#include "common.cuh"

namespace cuflash {

template <int kMTiles, bool kBounded = false>
struct OnlineSoftmax {
    static constexpr int kRows = 2 * kMTiles;
    float row_max[kRows];
    float row_sum[kRows];

    __device__ __forceinline__ void init() {
        // [1] Start every row with row_max = -inf and row_sum = 0
        // (kBounded: 0, for good)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = kBounded ? 0.f : neg_inf<float>();
            row_sum[r] = 0.f;
        }
    }

    // acc_s: raw scores of one key block, masked entries -inf; replaced by P = exp2(S * scale_log2 -
    // row_max * scale_log2). acc_o rows and row_sum are rescaled by exp2((old_max - new_max) * scale_log2).
    // A row with no visible key so far keeps row_max = -inf: its exp2 offset is taken as 0 so that
    // -inf scores give P = 0 and the correction 1 (acc_o and row_sum are 0 anyway).
    template <int kNTiles, int kNTilesO>
    __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTiles][4], float (&acc_o)[kMTiles][kNTilesO][4],
                                           float scale_log2) {
        float correction[kRows];
        update(acc_s, scale_log2, correction);
        rescale(acc_o, correction);
    }

    // update() without touching acc_o: its rescale factors go to `correction`, and the caller applies them
    // (rescale) once the P V product still accumulating into acc_o has completed (flash_fwd_sm90.cu).
    template <int kNTiles>
    __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTiles][4], float scale_log2,
                                           float (&correction)[kRows]) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mi + h;
                if constexpr (kBounded) {  // step 5 alone: P = exp2(S * scale_log2), no offset, nothing to rescale
                    correction[r] = 1.f;
                    float sum = row_sum[r];
#pragma unroll
                    for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float pv = exp2f(acc_s[mi][ni][2 * h + e] * scale_log2);
                            acc_s[mi][ni][2 * h + e] = pv;
                            sum += pv;
                        }
                    }
                    row_sum[r] = sum;
                    continue;
                }
                // [2] Row max of the key block, reduced over the row's threads: m = max(row_max, max_j S)
                float m = row_max[r];
#pragma unroll
                for (int ni = 0; ni < kNTiles; ++ni) m = fmaxf(m, fmaxf(acc_s[mi][ni][2 * h], acc_s[mi][ni][2 * h + 1]));
                m = warp_allreduce_max<4>(m);
                // [3] Offset m * scale_log2 for exp2, or 0 for a row that has seen no key (its P is 0, never NaN)
                const float m_scaled = (m == neg_inf<float>()) ? 0.f : m * scale_log2;
                // [4] Rescale acc_o and row_sum by exp2((old row_max - new row_max) * scale_log2), difference first
                // (old - new) first: exactly 1 when the max did not move (an FMA of the two products
                // would not be, and its error would pile up over key blocks).
                correction[r] = (m == neg_inf<float>()) ? 1.f : exp2f((row_max[r] - m) * scale_log2);
                row_max[r] = m;
                float sum = row_sum[r] * correction[r];
                // [5] P = exp2(S * scale_log2 - offset) in place of S; add the row sums of P to row_sum
#pragma unroll
                for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = exp2f(acc_s[mi][ni][2 * h + e] * scale_log2 - m_scaled);
                        acc_s[mi][ni][2 * h + e] = pv;
                        sum += pv;
                    }
                }
                row_sum[r] = sum;
            }
        }
    }

    template <int kNTilesO>
    __device__ __forceinline__ void rescale(float (&acc_o)[kMTiles][kNTilesO][4], const float (&correction)[kRows]) {
        if constexpr (kBounded) return;
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int no = 0; no < kNTilesO; ++no)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[mi][no][e] *= correction[2 * mi + e / 2];
    }

    // O /= row_sum; lse[r] = row_max * softmax_scale + log(row_sum) (natural log). A row that saw no key
    // has row_sum = 0 (every P was 0): O = 0 and LSE = -inf, no division by zero.
    template <int kNTilesO>
    __device__ __forceinline__ void finalize(float (&acc_o)[kMTiles][kNTilesO][4], float softmax_scale,
                                             float (&lse)[kRows]) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mi + h;
                // [6] Reduce row_sum over the row's threads
                const float sum = warp_allreduce_sum<4>(row_sum[r]);
                // [7] O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); row_sum = 0 gives O = 0, LSE = -inf
                const bool empty = sum == 0.f;  // NaN inputs stay NaN
                const float inv = empty ? 0.f : 1.f / sum;
                lse[r] = empty ? neg_inf<float>() : row_max[r] * softmax_scale + logf(sum);
#pragma unroll
                for (int no = 0; no < kNTilesO; ++no) {
                    acc_o[mi][no][2 * h] *= inv;
                    acc_o[mi][no][2 * h + 1] *= inv;
                }
            }
        }
    }
};

}  // namespace cuflash
