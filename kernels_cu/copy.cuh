// Global <-> shared tile copies for the tensor-core kernels (16-bit elements, 16-byte chunks).
//
// Shared tiles are row-major with a row pitch of (columns + 8) elements: the 8 extra elements (16
// bytes) shift consecutive rows by one 16-byte bank group modulo 128 bytes, so the 8 row addresses of
// an ldmatrix (and the 8 rows an accumulator store touches) fall in distinct banks. config.py's
// smem_bytes uses the same pitch.
//
// Global rows must start on 16-byte boundaries: the base pointers and the batch / row / head strides
// are multiples of 8 elements (the host side checks this, or copies).
#pragma once
#include "common.cuh"

namespace cuflash {

// cp.async of 16 bytes; pred == false writes 16 zero bytes and reads nothing (src-size 0). L2::128B: a miss fetches
// the whole 128-byte line (flash_decode's stream +2-3 % on the H200, the prefill kernels unchanged: RESULTS (g)).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
                 ::"r"(dst), "l"(__cvta_generic_to_global(src)), "r"(src_size)
                 : "memory");
}

// cp.async of 4 bytes (through L1: .ca, the only form for 4); pred == false writes 4 zero bytes, reads nothing.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool pred) {
    const int src_size = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(__cvta_generic_to_global(src)),
                 "r"(src_size)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// How a tile of kRows x kCols 16-bit elements is split into 16-byte chunks over kNThreads threads:
// kThreadsPerRow consecutive threads share a row (a power of two dividing the row's chunk count), each
// taking chunks ct, ct + kThreadsPerRow, ...; kRowStep rows are covered per step. Keeping one pointer
// per thread and compile-time offsets keeps the copy's register cost to a few registers.
template <int kRows, int kCols, int kNThreads>
struct TileShape {
    static_assert(kCols % 8 == 0, "16-byte chunks");
    static constexpr int kChunksPerRow = kCols / 8;
    static constexpr int kThreadsPerRow = (kChunksPerRow % 32 == 0)   ? 32
                                          : (kChunksPerRow % 16 == 0) ? 16
                                          : (kChunksPerRow % 8 == 0)  ? 8
                                          : (kChunksPerRow % 4 == 0)  ? 4
                                          : (kChunksPerRow % 2 == 0)  ? 2
                                                                      : 1;
    static_assert(kNThreads % kThreadsPerRow == 0, "threads per row must divide the block");
    static constexpr int kColIters = kChunksPerRow / kThreadsPerRow;
    static constexpr int kRowStep = kNThreads / kThreadsPerRow;
    static constexpr int kRowIters = (kRows + kRowStep - 1) / kRowStep;
};

// Issue cp.async for a kRows x kCols tile, global rows gbase + r * row_stride, into the shared tile
// smem (pitch kPitch). Rows >= rows_valid and columns >= cols_valid (a multiple of 8) are zero-filled
// and read nothing: their source operand is gbase, the tile's first element, which every caller only
// uses for a tile whose first row lies inside the tensor. No address past a valid row is formed.
template <int kRows, int kCols, int kPitch, int kNThreads, typename T>
__device__ __forceinline__ void cp_async_tile(T* smem, const T* gbase, long long row_stride, int rows_valid,
                                              int cols_valid, int tid) {
    using S = TileShape<kRows, kCols, kNThreads>;
    const int row_t = tid / S::kThreadsPerRow;
    const int col_t = (tid % S::kThreadsPerRow) * 8;
    const unsigned dst = smem_u32(smem + row_t * kPitch + col_t);
#pragma unroll
    for (int j = 0; j < S::kRowIters; ++j) {
        const int row = row_t + j * S::kRowStep;
        if (kRows % S::kRowStep == 0 || row < kRows) {
            const bool row_ok = row < rows_valid;
            const T* src_row = row_ok ? gbase + row * row_stride + col_t : gbase;
#pragma unroll
            for (int c = 0; c < S::kColIters; ++c) {
                const int col = col_t + c * S::kThreadsPerRow * 8;
                const bool valid = row_ok && col < cols_valid;
                cp_async_16(dst + (j * S::kRowStep * kPitch + c * S::kThreadsPerRow * 8) * sizeof(T),
                            valid ? src_row + c * S::kThreadsPerRow * 8 : gbase, valid);
            }
        }
    }
}

// cp_async_tile for key rows [key0, key0 + kRows) of one entry through KeyRows (seqinfo.cuh): a dense
// entry is one slab (cp_async_tile itself); a paged one looks each row's page up, and a row without a
// page (outside the pool) is zero-filled like a row past rows_valid. rows.base is the zero-fill operand.
// The paged loop repeats cp_async_tile's on purpose: one loop for both (a row-source functor) changed
// the register allocation of the dense kernels, whose code stays as measured.
template <int kRows, int kCols, int kPitch, int kNThreads, typename T, class Rows>
__device__ __forceinline__ void cp_async_keys(T* smem, const Rows& rows, int key0, int rows_valid, int cols_valid,
                                              int tid) {
    if constexpr (!Rows::kPaged) {
        cp_async_tile<kRows, kCols, kPitch, kNThreads>(smem, rows.base + key0 * rows.row_stride, rows.row_stride,
                                                       rows_valid, cols_valid, tid);
    } else {
        using S = TileShape<kRows, kCols, kNThreads>;
        const int row_t = tid / S::kThreadsPerRow;
        const int col_t = (tid % S::kThreadsPerRow) * 8;
        const unsigned dst = smem_u32(smem + row_t * kPitch + col_t);
#pragma unroll
        for (int j = 0; j < S::kRowIters; ++j) {
            const int row = row_t + j * S::kRowStep;
            if (kRows % S::kRowStep == 0 || row < kRows) {
                const T* src = rows.base;
                const bool row_ok = row < rows_valid && rows.row(key0 + row, src);
                const T* src_row = row_ok ? src + col_t : rows.base;
#pragma unroll
                for (int c = 0; c < S::kColIters; ++c) {
                    const int col = col_t + c * S::kThreadsPerRow * 8;
                    const bool valid = row_ok && col < cols_valid;
                    cp_async_16(dst + (j * S::kRowStep * kPitch + c * S::kThreadsPerRow * 8) * sizeof(T),
                                valid ? src_row + c * S::kThreadsPerRow * 8 : rows.base, valid);
                }
            }
        }
    }
}

// Copy a kRows x kCols shared tile (pitch kPitch) to global rows gbase + r * row_stride, 16 bytes at a
// time, writing only rows < rows_valid and columns < cols_valid.
template <int kRows, int kCols, int kPitch, int kNThreads, typename T>
__device__ __forceinline__ void store_tile(T* gbase, long long row_stride, const T* smem, int rows_valid,
                                           int cols_valid, int tid) {
    using S = TileShape<kRows, kCols, kNThreads>;
    const int row_t = tid / S::kThreadsPerRow;
    const int col_t = (tid % S::kThreadsPerRow) * 8;
#pragma unroll
    for (int j = 0; j < S::kRowIters; ++j) {
        const int row = row_t + j * S::kRowStep;
        if ((kRows % S::kRowStep == 0 || row < kRows) && row < rows_valid) {
#pragma unroll
            for (int c = 0; c < S::kColIters; ++c) {
                const int col = col_t + c * S::kThreadsPerRow * 8;
                if (col < cols_valid) {
                    *reinterpret_cast<uint4*>(gbase + row * row_stride + col) =
                        *reinterpret_cast<const uint4*>(smem + row * kPitch + col);
                }
            }
        }
    }
}

// Write one warp's 16 x (8 * kNTiles) fp32 accumulator block (mma C layout: c0,c1 = row g, cols 2t,2t+1;
// c2,c3 = row g+8) times `scale` into a 16-bit shared tile (pitch kPitch) at (row0, col0).
template <typename T, int kNTiles, int kPitch>
__device__ __forceinline__ void acc_to_smem(T* smem, const float (&acc)[kNTiles][4], int row0, int col0, int lane,
                                            float scale, bool relu = false) {
    // relu: negative entries as 0 (the backward keeps dropped P entries as -P)
    auto x = [scale, relu](float v) { return (relu ? fmaxf(v, 0.f) : v) * scale; };
    const int g = lane >> 2, t = lane & 3;
    T* r0 = smem + (row0 + g) * kPitch + col0 + 2 * t;
    T* r8 = r0 + 8 * kPitch;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
        *reinterpret_cast<unsigned*>(r0 + nt * 8) = pack2<T>(x(acc[nt][0]), x(acc[nt][1]));
        *reinterpret_cast<unsigned*>(r8 + nt * 8) = pack2<T>(x(acc[nt][2]), x(acc[nt][3]));
    }
}

}  // namespace cuflash
