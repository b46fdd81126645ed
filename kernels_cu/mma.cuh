// Warp-level tensor-core MMA through PTX: mma.sync m16n8k16 (fp16 / bf16 in, fp32 accumulate) fed by
// ldmatrix. Layouts below are those of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating
// point type" and "ldmatrix"); every kernel index expression is written against them.
//
// Notation: lane = threadIdx.x % 32, g = lane >> 2 (groupID), t = lane & 3 (threadID_in_group).
//
//   A (16 x 16, row-major, 4 x .b32 = 8 x 16-bit):  a0: (row g,   cols 2t, 2t+1)
//                                                   a1: (row g+8, cols 2t, 2t+1)
//                                                   a2: (row g,   cols 2t+8, 2t+9)
//                                                   a3: (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, "col", 2 x .b32):                    b0: (k rows 2t, 2t+1,   col g)
//                                                   b1: (k rows 2t+8, 2t+9, col g)
//   C / D (16 x 8, fp32, 4 regs):                   c0, c1: (row g,   cols 2t, 2t+1)
//                                                   c2, c3: (row g+8, cols 2t, 2t+1)
// In every packed .b32 the lower column / k index sits in the low 16 bits.
//
//   ldmatrix.m8n8.x4: lane 8*j + r supplies the address of row r of 8x8 matrix j (16 contiguous bytes,
//   16-byte aligned); register j of lane l receives matrix j's (row l>>2, cols 2*(l&3), +1).
//   With .trans, register j of lane l receives matrix j's (rows 2*(l&3), +1; col l>>2).
#pragma once
#include "common.cuh"

namespace cuflash {

// d += a * b on one 16x8x16 tile (fp32 accumulate). d is both C and D.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Per-lane element offsets (row * stride + col) into a shared-memory tile for one ldmatrix.x4.
// `stride` is the tile's row pitch in elements.
//
// A operand, 16 x 16 block of a row-major [m][k] tile: matrices j = 0..3 are
// (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0, a1, a2, a3.
// Lane l addresses row (l & 15), column 8 * (l >> 4).
__device__ __forceinline__ int ldsm_a_offset(int lane, int stride) {
    return (lane & 15) * stride + (lane >> 4) * 8;
}

// B operand from an [n][k] tile (B[k][n] = tile[n][k], e.g. K in Q K^T), two n-tiles of 8 and 16 k:
// matrices j = 0..3 are (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15), so the
// result is {b0, b1} of n-tile 0 then {b0, b1} of n-tile 1 (non-transposed ldmatrix: lane l gets
// tile[n = l>>2][k = 2*(l&3), +1] = B[k][n], which is b's layout).
// Lane l addresses row n = (l & 7) + 8 * (l >> 4), column k = 8 * ((l >> 3) & 1) (ldsm_b_row, ldsm_b_chunk: that
// row and that column's 8-element chunk, for tiles whose chunks are swizzled).
__device__ __forceinline__ int ldsm_b_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ldsm_b_chunk(int lane) { return (lane >> 3) & 1; }
__device__ __forceinline__ int ldsm_b_offset(int lane, int stride) {
    return ldsm_b_row(lane) * stride + ldsm_b_chunk(lane) * 8;
}

// B operand from a [k][n] tile (B[k][n] = tile[k][n], e.g. V in P V), with ldmatrix .trans, two
// n-tiles of 8 and 16 k: matrices j = 0..3 are (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
// (k 8-15, n 8-15), so the result is {b0, b1} of n-tile 0 then {b0, b1} of n-tile 1 (.trans: lane l
// gets tile[k = 2*(l&3), +1][n = l>>2], which is b's layout).
// Lane l addresses row k = (l & 7) + 8 * ((l >> 3) & 1), column n = 8 * (l >> 4) (ldsm_bt_row, ldsm_bt_chunk).
__device__ __forceinline__ int ldsm_bt_row(int lane) { return (lane & 7) + (((lane >> 3) & 1) << 3); }
__device__ __forceinline__ int ldsm_bt_chunk(int lane) { return lane >> 4; }
__device__ __forceinline__ int ldsm_bt_offset(int lane, int stride) {
    return ldsm_bt_row(lane) * stride + ldsm_bt_chunk(lane) * 8;
}

// A operand from a [k][m] tile (A[m][k] = tile[k][m], e.g. dS from the backward's [key][query] dS^T),
// with ldmatrix .trans: matrices j = 0..3 are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
// (m 8-15, k 8-15) = a0..a3, matrix j stored at tile rows k = 8 * (j >> 1) + 0..7, columns m = 8 * (j & 1):
// lane l addresses row k = (l & 7) + 8 * (l >> 4), column m = 8 * ((l >> 3) & 1), ldsm_b_offset's map.
__device__ __forceinline__ int ldsm_at_offset(int lane, int stride) {
    return ldsm_b_offset(lane, stride);
}

// Accumulators of two adjacent n-tiles (16 columns) -> A fragment of a 16 x 16 k-slice, in registers.
// acc0 = columns 0-7 of the slice, acc1 = columns 8-15. acc c0,c1 = (row g, cols 2t,2t+1) and
// c2,c3 = (row g+8, cols 2t,2t+1); so a0 = acc0 c0c1, a1 = acc0 c2c3, a2 = acc1 c0c1, a3 = acc1 c2c3.
template <typename T>
__device__ __forceinline__ void acc_to_a(unsigned (&a)[4], const float (&acc0)[4], const float (&acc1)[4],
                                         bool relu = false) {
    // relu: negative entries as 0 (the backward keeps dropped P entries as -P)
    auto x = [relu](float v) { return relu ? fmaxf(v, 0.f) : v; };
    a[0] = pack2<T>(x(acc0[0]), x(acc0[1]));
    a[1] = pack2<T>(x(acc0[2]), x(acc0[3]));
    a[2] = pack2<T>(x(acc1[0]), x(acc1[1]));
    a[3] = pack2<T>(x(acc1[2]), x(acc1[3]));
}

// ---- Walks over a warp's score tile, for the element-wise variants (mask.cuh, dropout.cuh) ----
// f(x..., row, col) for each score a thread holds, with x the element of each array in `tiles`
// (score tiles of one shape: S, and what goes with it, such as the softcap derivative).
//
// S = Q K^T (forward): kMTiles x kNTiles accumulators of 16 x 8 in the C layout; tile[mi][ni][2h + e]
// is query row row0 + 16 mi + g + 8 h, key col0 + 8 ni + 2 t + e.
template <int kMTiles, int kNTiles, typename F, typename... Tiles>
__device__ __forceinline__ void for_each_score(int row0, int col0, int lane, F&& f, Tiles&... tiles) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                f(tiles[mi][ni][i]..., row0 + 16 * mi + g + 8 * (i >> 1), col0 + 8 * ni + 2 * t + (i & 1));
}

// S^T = K Q^T (dK/dV): kNTiles accumulators of 16 keys x 8 queries; tile[ni][2h + e] is key key0 + g + 8 h,
// query query0 + 8 ni + 2 t + e. f gets (x..., query, key): the same (row, col) order as for_each_score.
template <int kNTiles, typename F, typename... Tiles>
__device__ __forceinline__ void for_each_score_t(int key0, int query0, int lane, F&& f, Tiles&... tiles) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int i = 0; i < 4; ++i) f(tiles[ni][i]..., query0 + 8 * ni + 2 * t + (i & 1), key0 + g + 8 * (i >> 1));
}

}  // namespace cuflash
