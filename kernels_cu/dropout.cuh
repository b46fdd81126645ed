// Dropout's keep mask: Philox4x32-10, specified in cuflash/_philox.py (which the NumPy backend and
// cuflash.dropout_mask use), reproduced here bit for bit.
//
// One Philox call gives 4 words = 8 draws of 16 bits, for the 8 scores of a 16 x 16 tile that one
// thread holds in the mma.sync C layout: rows g, g + 8 and columns 2t, 2t + 1, 2t + 8, 2t + 9
// (g = row % 8, t = (col % 8) / 2). Score (row, col) of (batch b, head h), row and col counted
// within the sequence, takes:
//   counter (col / 16 * 4 + t, row / 16 * 8 + g, b * nheads + h, offset), key (seed lo, seed hi),
//   word 2 * (row % 16 / 8) + col % 16 / 8, half col % 2 (0: low 16 bits),
// and is kept iff that draw >= floor(dropout_p * 65536); kept scores are scaled by 1 / (1 - p).
#pragma once
#include "params.cuh"

namespace cuflash {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

struct Dropout {
    unsigned key0, key1, bh, offset, threshold;

    __device__ __forceinline__ Dropout(const FwdParams& p, int batch, int head)
        : key0(static_cast<unsigned>(p.seed)), key1(static_cast<unsigned>(p.seed >> 32)),
          bh(static_cast<unsigned>(batch * p.nheads + head)), offset(p.offset), threshold(p.dropout_threshold) {}

    // [1] Draws: the 4 words of one Philox call, tile (row / 16, col / 16), lane (g, t)
    __device__ __forceinline__ uint4 draws(int row16, int col16, int g, int t) const {
        return philox4x32_10(make_uint4(static_cast<unsigned>(col16 * 4 + t), static_cast<unsigned>(row16 * 8 + g),
                                        bh, offset),
                             key0, key1);
    }
    __device__ __forceinline__ bool kept(unsigned word, int half) const {
        return (half ? word >> 16 : word & 0xFFFFu) >= threshold;
    }
    // [2] Keep flag of one score (SIMT kernels): a whole Philox call for one draw
    __device__ __forceinline__ bool keep(int row, int col) const {
        const uint4 w = draws(row / 16, col / 16, row % 8, col % 8 / 2);
        const int word = 2 * (row % 16 / 8) + col % 16 / 8;
        return kept(word == 0 ? w.x : word == 1 ? w.y : word == 2 ? w.z : w.w, col % 2);
    }

    // [3] Keep flags of a warp's tile in the mma.sync C layout, one call per 16 x 16 (forward)
    // mma.cuh's for_each_score order: f(x, kept) per score. row0 and col0 are multiples of 16; one call per 16 x 16.
    template <int kMTiles, int kNTiles, typename F>
    __device__ __forceinline__ void for_each_keep(float (&acc)[kMTiles][kNTiles][4], int row0, int col0, int lane,
                                                  F&& f) const {
        static_assert(kNTiles % 2 == 0, "16-column tiles");
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int np = 0; np < kNTiles / 2; ++np) {
                const uint4 w4 = draws(row0 / 16 + mi, col0 / 16 + np, g, t);
                const unsigned w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                for (int hc = 0; hc < 2; ++hc)
#pragma unroll
                    for (int i = 0; i < 4; ++i)  // i = 2h + e: row g + 8h, column 8 hc + 2t + e
                        f(acc[mi][2 * np + hc][i], kept(w[2 * (i >> 1) + hc], i & 1));
            }
    }

    // The same on the backward's S^T tile (for_each_score_t): a thread holds queries 2t + e (+8)
    // and keys g (+8) of each 16 x 16 tile, so it needs the draws of lanes (g', t') = (2t + e, g / 2),
    // 4 words from each (half g % 2 of every word). Each lane makes its own call, as in
    // for_each_keep, and takes those 8 words by shuffles: one Philox call per tile, not two.
    template <int kNTiles, typename F>
    __device__ __forceinline__ void for_each_keep_t(float (&acc)[kNTiles][4], int key0, int query0, int lane,
                                                    F&& f) const {
        static_assert(kNTiles % 2 == 0, "16-query tiles");
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            const uint4 own = draws(query0 / 16 + np, key0 / 16, g, t);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int src = (2 * t + e) * 4 + g / 2;  // lane (2t + e, g / 2)
                const unsigned w[4] = {__shfl_sync(0xFFFFFFFFu, own.x, src), __shfl_sync(0xFFFFFFFFu, own.y, src),
                                       __shfl_sync(0xFFFFFFFFu, own.z, src), __shfl_sync(0xFFFFFFFFu, own.w, src)};
#pragma unroll
                for (int hc = 0; hc < 2; ++hc)  // query 8 hc + 2t + e
#pragma unroll
                    for (int h = 0; h < 2; ++h)  // key g + 8h
                        f(acc[2 * np + hc][2 * h + e], kept(w[2 * hc + h], g & 1));
            }
        }
    }
};

}  // namespace cuflash
