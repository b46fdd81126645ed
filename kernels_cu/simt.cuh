// SIMT building blocks shared by the fp32 / fp64 kernels (flash_fwd_simt.cu, flash_bwd_simt.cu):
// the CUDA-core counterpart of mma.cuh and copy.cuh. Accumulation helpers (FMA, the compensated
// fold of a key block's partial sums), 16-byte shared-memory vector loads, cp.async tile loads that
// zero-fill past seqlen and head_dim, and the S = Q K^T tile product in blocked partial sums.
#pragma once
#include "common.cuh"

namespace cuflash {
namespace simt {

__device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }

// acc = acc * alpha + part, compensated for float (comp carries minus the lost low-order part;
// the intrinsics keep the compiler from contracting the compensation away).
__device__ __forceinline__ void fold(float& acc, float& comp, float alpha, float part) {
    const float a = __fmul_rn(acc, alpha);
    const float y = __fsub_rn(part, __fmul_rn(comp, alpha));
    const float t = __fadd_rn(a, y);
    comp = __fsub_rn(__fsub_rn(t, a), y);
    acc = t;
}
__device__ __forceinline__ void fold(double& acc, double& /*comp*/, double alpha, double part) {
    acc = __fma_rn(acc, alpha, part);
}
__device__ __forceinline__ float resolve(float acc, float comp) { return __fsub_rn(acc, comp); }
__device__ __forceinline__ double resolve(double acc, double /*comp*/) { return acc; }

// 16-byte vectors.
template <typename T> struct Vec16;
template <> struct Vec16<float> { using type = float4; };
template <> struct Vec16<double> { using type = double2; };
__device__ __forceinline__ void unpack(const float4& v, float* d) { d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w; }
__device__ __forceinline__ void unpack(const double2& v, double* d) { d[0] = v.x; d[1] = v.y; }
__device__ __forceinline__ float4 pack16(const float* s) { return make_float4(s[0], s[1], s[2], s[3]); }
__device__ __forceinline__ double2 pack16(const double* s) { return make_double2(s[0], s[1]); }

// kN contiguous elements of shared memory into registers; src must be aligned to the access
// width used (16 bytes when kN * sizeof(T) is a multiple of 16, else 8, else the element).
template <int kN, typename T>
__device__ __forceinline__ void lds(T* dst, const T* src) {
    constexpr int kBytes = kN * int(sizeof(T));
    if constexpr (kBytes % 16 == 0) {
        constexpr int kPer = 16 / int(sizeof(T));
        using V = typename Vec16<T>::type;
#pragma unroll
        for (int v = 0; v < kN / kPer; ++v) unpack(reinterpret_cast<const V*>(src)[v], dst + v * kPer);
    } else if constexpr (kBytes % 8 == 0 && sizeof(T) == 4) {
#pragma unroll
        for (int v = 0; v < kN / 2; ++v) {
            const float2 x = reinterpret_cast<const float2*>(src)[v];
            dst[2 * v] = x.x;
            dst[2 * v + 1] = x.y;
        }
    } else {
#pragma unroll
        for (int v = 0; v < kN; ++v) dst[v] = src[v];
    }
}

__device__ __forceinline__ bool aligned16(const void* ptr, long long row_stride, int elem_bytes) {
    return ((reinterpret_cast<unsigned long long>(ptr) |
             static_cast<unsigned long long>(row_stride) * static_cast<unsigned long long>(elem_bytes)) & 15ull) == 0;
}

// cp.async (sm_80+): global -> shared without staging registers. With src_bytes = 0 nothing is
// read and the destination is zero-filled (the source address is then only a placeholder, and we
// pass one inside the tensor).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
template <int kBytes>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(src), "n"(kBytes), "r"(valid ? kBytes : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

// Issue (not wait for) the copy of rows [0, kRows) x columns [0, kHeadDim) of a [row][dim] slab
// (g: its row 0, which must be a valid row; row_stride in elements) into s (row stride kStride).
// Rows >= nrows and columns >= head_dim are zero-filled and never read from global memory.
template <typename T, int kRows, int kHeadDim, int kStride, int kNThreads>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long row_stride, int nrows, int head_dim) {
    constexpr int kVec = 16 / int(sizeof(T));
    const int tid = threadIdx.x;
    if (aligned16(g, row_stride, sizeof(T)) && head_dim % kVec == 0) {
        // Not unrolled: the copies are asynchronous anyway, and unrolled address arithmetic would
        // be hoisted out of the callers' loops into registers the accumulators need.
        constexpr int kPerRow = kHeadDim / kVec;
        constexpr int kTotal = kRows * kPerRow;
#pragma unroll 1
        for (int idx = tid; idx < kTotal; idx += kNThreads) {
            const int r = idx / kPerRow, c = (idx % kPerRow) * kVec;
            const bool valid = r < nrows && c < head_dim;
            cp_async_16(s + r * kStride + c, valid ? g + r * row_stride + c : g, valid);
        }
    } else {
        // Rows not 16-byte aligned (a strided view): element by element.
        constexpr int kTotal = kRows * kHeadDim;
#pragma unroll 1
        for (int idx = tid; idx < kTotal; idx += kNThreads) {
            const int r = idx / kHeadDim, c = idx % kHeadDim;
            const bool valid = r < nrows && c < head_dim;
            cp_async_small<int(sizeof(T))>(s + r * kStride + c, valid ? g + r * row_stride + c : g, valid);
        }
    }
}

// load_tile for key rows [key0, key0 + kRows) of one entry through KeyRows (seqinfo.cuh): a dense entry
// is one slab (load_tile itself); a paged one looks each row's page up, and a row without a page
// (outside the pool) is zero-filled like a row past nrows. rows.base is the zero-fill operand.
template <typename T, int kRows, int kHeadDim, int kStride, int kNThreads, class Rows>
__device__ __forceinline__ void load_keys(T* s, const Rows& rows, int key0, int nrows, int head_dim) {
    if constexpr (!Rows::kPaged) {
        load_tile<T, kRows, kHeadDim, kStride, kNThreads>(s, rows.base + key0 * rows.row_stride, rows.row_stride,
                                                         nrows, head_dim);
    } else {
        constexpr int kVec = 16 / int(sizeof(T));
        const int tid = threadIdx.x;
        const bool vec = aligned16(rows.base, rows.row_stride, sizeof(T)) &&
                         aligned16(nullptr, rows.page_stride, sizeof(T)) && head_dim % kVec == 0;
        const int width = vec ? kVec : 1;  // elements per copy
        const int per_row = kHeadDim / width;
#pragma unroll 1
        for (int idx = tid; idx < kRows * per_row; idx += kNThreads) {
            const int r = idx / per_row, c = (idx % per_row) * width;
            const T* src = rows.base;
            const bool valid = r < nrows && c < head_dim && rows.row(key0 + r, src);
            if (vec) cp_async_16(s + r * kStride + c, valid ? src + c : rows.base, valid);
            else cp_async_small<int(sizeof(T))>(s + r * kStride + c, valid ? src + c : rows.base, valid);
        }
    }
}

// acc[i][j] = sum_{k < head_dim} a_s[row i][k] * b_s[row j][k] for this thread's rows
// ty + i * kThreadsM of a_s and rows tx + 8 * j of b_s. Two-level: a fresh FMA partial per 8 floats
// (4 doubles) of k, added to acc. Against one FMA chain over k this cuts the fp32 dot product's
// rounding error about 2.4x at head_dim 192 (S errors dominate fp32 output errors at small N; the
// emulated fp32 forward error at d = 192, N = 40 fell from 1.1e-6 to 4.3e-7) for one extra add per
// 8 FMAs. head_dim is a multiple of 8 (else zero-filled columns up to the next multiple are read).
template <typename A, int kRows, int kCols, int kThreadsM, int kStride>
__device__ __forceinline__ void dot_tile(A (&acc)[kRows][kCols], const A* a_s, const A* b_s, int ty, int tx,
                                         int head_dim) {
    constexpr int kVec = 16 / int(sizeof(A));
    constexpr int kBlockK = 2 * kVec;  // 8 floats or 4 doubles: divides head_dim (a multiple of 8)
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[i][j] = A(0);
    const A* a = a_s + ty * kStride;
    const A* b = b_s + tx * kStride;
#pragma unroll 1
    for (int k0 = 0; k0 < head_dim; k0 += kBlockK) {
        A part[kRows][kCols];
#pragma unroll
        for (int kk = 0; kk < kBlockK; kk += kVec) {
            A av[kRows][kVec], bv[kCols][kVec];
#pragma unroll
            for (int i = 0; i < kRows; ++i) lds<kVec>(av[i], a + i * kThreadsM * kStride + k0 + kk);
#pragma unroll
            for (int j = 0; j < kCols; ++j) lds<kVec>(bv[j], b + j * 8 * kStride + k0 + kk);
#pragma unroll
            for (int e = 0; e < kVec; ++e)
#pragma unroll
                for (int i = 0; i < kRows; ++i)
#pragma unroll
                    for (int j = 0; j < kCols; ++j)
                        part[i][j] = kk + e == 0 ? av[i][e] * bv[j][e] : fma_acc(av[i][e], bv[j][e], part[i][j]);
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int j = 0; j < kCols; ++j) acc[i][j] += part[i][j];
    }
}

// Largest divisor c of groups with c * bytes_per_group <= budget (at least 1).
__host__ __device__ constexpr int pick_chunk(int groups, int bytes_per_group, int budget) {
    int best = 1;
    for (int c = 1; c <= groups; ++c)
        if (groups % c == 0 && c * bytes_per_group <= budget) best = c;
    return best;
}

}  // namespace simt
}  // namespace cuflash
