// Forward attention on CUDA cores (FFMA / DFMA) for float32 and float64 inputs: the algorithm of
// flash_fwd.cu with per-thread FMA loops in place of mma.sync, accumulating in acc_t<T> (== T here).
//
// Thread layout (one block = kNWarps warps): tx = tid % 8 and ty = tid / 8. The 8 lanes of one ty
// share query rows ty + i * kThreadsM (i < kRows): in S they own key columns tx + 8 * j, in O the
// head-dim vectors (8 * g + tx) * kVec .. + kVec - 1 (kVec = 16 bytes of T). Row max and row sum
// therefore reduce over 8 lanes of one warp, and the softmax state of a row never leaves registers.
//
// Shared memory (dynamic, config.smem_bytes must match kSmemBytes):
//   q_s [kBlockM][kStride], k_s [kBlockN][kStride], v_s [kBlockN][kStride], p_s [kBlockM][kPStride]
// kStride = kHeadDim + 16 bytes: rows stay 16-byte aligned for vector loads, and the 8 lanes that
// read 8 consecutive rows at one column hit 8 distinct 16-byte bank groups. kPStride = kBlockN + 8
// makes the scalar P stores of 4 (float) or 2 (double) row groups per phase conflict-free.
// Tiles arrive by cp.async (16-byte copies when rows are 16-byte aligned, else element copies),
// zero-filled past seqlen and head_dim; the next K tile is in flight during P V, the next V tile
// during the next S.
//
// Accuracy (fp32 must stay within 1e-6 of float64 up to N = 8192):
// - every sum over keys runs in two levels: inside a key block each thread accumulates a fresh
//   partial (kBlockN terms, FMA), folded into the running acc_o / row_sum once per block; for float
//   the fold is Kahan-compensated. With N = 8192 the plain fold of 256 partials dominated the error
//   on inputs with a nonzero mean (5e-7 absolute on uniform [0, 1) data, 1.2e-7 compensated;
//   emulated in NumPy);
// - S = Q K^T sums head_dim products in partials of 8 (dot_tile), which matters at small N;
// - alpha is exactly 1 while a row's max holds (see step 5).
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"

namespace cuflash {
namespace simt_fwd {

// ---- small helpers (this translation unit only) ------------------------------------------------

__device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

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

// 1 / s for a normal s > 0, to within about an ulp, without the IEEE division's slow-path call
// (its call frame would put a stack frame on the kernel): an fp32 estimate and Newton steps.
__device__ __forceinline__ float rcp_acc(float s) {
    const float r = __fdividef(1.f, s);
    return __fmaf_rn(r, __fmaf_rn(-s, r, 1.f), r);
}
__device__ __forceinline__ double rcp_acc(double s) {
    double r = static_cast<double>(__fdividef(1.f, static_cast<float>(s)));
    r = __fma_rn(r, __fma_rn(-s, r, 1.0), r);
    return __fma_rn(r, __fma_rn(-s, r, 1.0), r);
}
// a / s given r = rcp_acc(s): q = a * r plus one residual correction (correctly rounded but for
// rare ties).
template <typename A>
__device__ __forceinline__ A div_acc(A a, A s, A r) {
    const A q = a * r;
    return fma_acc(fma_acc(-q, s, a), r, q);
}

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

}  // namespace simt_fwd

// Launch bounds with minBlocks = 1: without it ptxas trims registers to the next occupancy step
// (128 or 168) even at the price of spills, which the compile gate forbids.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_fwd_simt(const __grid_constant__ FwdParams p) {
    using namespace simt_fwd;
    using A = acc_t<T>;
    static_assert(sizeof(A) == sizeof(T), "the SIMT kernels take float or double");
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kVec = 16 / int(sizeof(T));             // elements per 16-byte vector
    constexpr int kStride = kHeadDim + kVec;               // q_s / k_s / v_s row, elements
    constexpr int kPStride = kBlockN + 8;                  // p_s row, elements
    constexpr int kThreadsN = 8;                           // lanes sharing one query row
    constexpr int kThreadsM = kNThreads / kThreadsN;
    constexpr int kRows = kBlockM / kThreadsM;             // query rows per thread
    constexpr int kCols = kBlockN / kThreadsN;             // S columns per thread
    constexpr int kGroups = kHeadDim / (kThreadsN * kVec); // O vectors per thread and row
    constexpr int kChunk = pick_chunk(kGroups, kRows * kVec * int(sizeof(A)), 64);  // PV partial: <= 16 registers
    constexpr int kSmemBytes = (kBlockM * kStride + 2 * kBlockN * kStride + kBlockM * kPStride) * int(sizeof(T));
    static_assert(kRows >= 1 && kBlockM % kThreadsM == 0, "kBlockM must be a multiple of kNWarps * 4");
    static_assert(kCols >= 1 && kBlockN % kThreadsN == 0 && kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kHeadDim % (kThreadsN * kVec) == 0, "kHeadDim must be a multiple of 32");

    extern __shared__ __align__(16) char smem[];
    {
        unsigned dyn_smem;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
        if (dyn_smem < unsigned(kSmemBytes)) __trap();
    }
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = q_s + kBlockM * kStride;
    T* v_s = k_s + kBlockN * kStride;
    A* p_s = reinterpret_cast<A*>(v_s + kBlockN * kStride);

    const int tid = threadIdx.x;
    const int tx = tid % kThreadsN;
    const int ty = tid / kThreadsN;

    // [1] Block coordinates: m_block, head, batch; causal skips key blocks above the diagonal
    const int m_block = blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.nheads / p.nheads_k);
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, head_dim = p.head_dim;
    const int n_block_end = n_block_max<kIsCausal, kBlockM, kBlockN>(m_block, seqlen_q, seqlen_k);
    const T* q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
    const T* k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;

    // [2] Load the Q tile
    // Copies run asynchronously, one commit group per tile: Q, then K and V of key block 0. The
    // loop below keeps exactly one group (the next K or V tile) in flight behind the one it waits for.
    load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(
        q_s, q + static_cast<long long>(m_block) * kBlockM * p.q_row_stride, p.q_row_stride,
        seqlen_q - m_block * kBlockM, head_dim);
    cp_async_commit();
    if (n_block_end > 0) {
        load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k, p.k_row_stride, seqlen_k, head_dim);
        cp_async_commit();
        load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v, p.v_row_stride, seqlen_k, head_dim);
        cp_async_commit();
    }

    const A scale_log2 = static_cast<A>(p.scale_log2);
    A acc_o[kRows][kGroups * kVec], acc_o_comp[kRows][kGroups * kVec];
    // row_max_scaled = row_max * scale_log2 as rounded once; P, alpha and the LSE all use this value.
    A row_max[kRows], row_max_scaled[kRows], row_sum[kRows], row_sum_comp[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        row_max[i] = neg_inf<A>();
        row_max_scaled[i] = A(0);
        row_sum[i] = A(0);
        row_sum_comp[i] = A(0);
#pragma unroll
        for (int c = 0; c < kGroups * kVec; ++c) acc_o[i][c] = acc_o_comp[i][c] = A(0);
    }

    for (int n_block = 0; n_block < n_block_end; ++n_block) {
        const int next_row0 = (n_block + 1) * kBlockN;  // first key row of the next block
        // [3] S = Q K^T
        cp_async_wait<1>();  // Q and this block's K have landed (V may still be in flight)
        __syncthreads();
        A acc_s[kRows][kCols];
        dot_tile<A, kRows, kCols, kThreadsM, kStride>(acc_s, q_s, k_s, ty, tx, head_dim);

        // [4] Mask the sequence tail and the causal diagonal
        if (block_needs_mask<kIsCausal, kBlockM, kBlockN>(m_block, n_block, seqlen_q, seqlen_k)) {
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const int limit = col_limit<kIsCausal>(m_block * kBlockM + ty + i * kThreadsM, seqlen_q, seqlen_k);
#pragma unroll
                for (int j = 0; j < kCols; ++j)
                    if (n_block * kBlockN + tx + j * kThreadsN >= limit) acc_s[i][j] = neg_inf<A>();
            }
        }

        // [5] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
        // The rescale by alpha is applied when this block's partial is folded into acc_o (step 6).
        // alpha is exactly 1 while the max holds (an alpha off by an ulp would compound over the
        // key blocks: 128 blocks drifted the fp32 LSE by 1e-5). A row with no visible key so far
        // keeps row_max = -inf and subtracts 0 instead (P = 0, alpha = 0, never inf - inf).
        A alpha[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            A m = row_max[i];
#pragma unroll
            for (int j = 0; j < kCols; ++j) m = max_acc(m, acc_s[i][j]);
            m = warp_allreduce_max<kThreadsN>(m);
            const A max_scaled = m == neg_inf<A>() ? A(0) : m * scale_log2;
            alpha[i] = row_max[i] == neg_inf<A>() ? A(0)
                       : max_scaled == row_max_scaled[i] ? A(1)
                                                         : fast_exp2(row_max_scaled[i] - max_scaled);
            row_max[i] = m;
            row_max_scaled[i] = max_scaled;
            A part = A(0);
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                acc_s[i][j] = fast_exp2(fma_acc(acc_s[i][j], scale_log2, -max_scaled));
                part += acc_s[i][j];
            }
            fold(row_sum[i], row_sum_comp[i], alpha[i], part);
#pragma unroll
            for (int j = 0; j < kCols; ++j) p_s[(ty + i * kThreadsM) * kPStride + tx + j * kThreadsN] = acc_s[i][j];
        }
        __syncthreads();  // p_s complete, k_s free: start the next K tile behind this block's P V
        if (n_block + 1 < n_block_end)
            load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k + next_row0 * p.k_row_stride, p.k_row_stride,
                                                                seqlen_k - next_row0, head_dim);
        cp_async_commit();
        cp_async_wait<1>();  // this block's V has landed
        __syncthreads();

        // [6] O += P V
        // Per chunk of kChunk vectors: a fresh partial over this block's kBlockN keys, then
        // acc_o = acc_o * alpha + partial.
#pragma unroll
        for (int g0 = 0; g0 < kGroups; g0 += kChunk) {
            A part[kRows][kChunk * kVec];
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int c = 0; c < kChunk * kVec; ++c) part[i][c] = A(0);
#pragma unroll 1
            for (int j = 0; j < kBlockN; j += kVec) {
                A pv[kRows][kVec];
#pragma unroll
                for (int i = 0; i < kRows; ++i) lds<kVec>(pv[i], p_s + (ty + i * kThreadsM) * kPStride + j);
#pragma unroll
                for (int jj = 0; jj < kVec; ++jj) {
#pragma unroll
                    for (int g = 0; g < kChunk; ++g) {
                        A vv[kVec];
                        lds<kVec>(vv, v_s + (j + jj) * kStride + ((g0 + g) * kThreadsN + tx) * kVec);
#pragma unroll
                        for (int i = 0; i < kRows; ++i)
#pragma unroll
                            for (int e = 0; e < kVec; ++e)
                                part[i][g * kVec + e] = fma_acc(pv[i][jj], vv[e], part[i][g * kVec + e]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int c = 0; c < kChunk * kVec; ++c)
                    fold(acc_o[i][g0 * kVec + c], acc_o_comp[i][g0 * kVec + c], alpha[i], part[i][c]);
        }
        __syncthreads();  // v_s and p_s free: start the next V tile
        if (n_block + 1 < n_block_end)
            load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v + next_row0 * p.v_row_stride, p.v_row_stride,
                                                                seqlen_k - next_row0, head_dim);
        cp_async_commit();
    }
    cp_async_wait<0>();  // nothing may be in flight at exit (only the Q group when no key block ran)

    // [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
    A lse[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const A sum = warp_allreduce_sum<kThreadsN>(resolve(row_sum[i], row_sum_comp[i]));
        const bool empty = row_max[i] == neg_inf<A>();
        // row_max * softmax_scale, taken as row_max_scaled * ln(2): the exact reference of P.
        lse[i] = empty ? neg_inf<A>() : row_max_scaled[i] * static_cast<A>(0.6931471805599453) + log_acc(sum);
        const A inv_sum = empty ? A(0) : rcp_acc(sum);
#pragma unroll
        for (int c = 0; c < kGroups * kVec; ++c)
            acc_o[i][c] = empty ? A(0) : div_acc(resolve(acc_o[i][c], acc_o_comp[i][c]), sum, inv_sum);
    }

    // [8] Store O and LSE
    T* o = static_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
    const bool o_vec = aligned16(o, p.o_row_stride, sizeof(T)) && head_dim % kVec == 0;
    A* lse_ptr = static_cast<A*>(p.lse) + batch * p.lse_batch_stride + head * p.lse_head_stride;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = m_block * kBlockM + ty + i * kThreadsM;
        if (row >= seqlen_q) continue;
        T* o_row = o + static_cast<long long>(row) * p.o_row_stride;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int col = (g * kThreadsN + tx) * kVec;
            T out[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) out[e] = from_acc<T>(acc_o[i][g * kVec + e]);
            if (o_vec) {
                if (col < head_dim) *reinterpret_cast<typename Vec16<T>::type*>(o_row + col) = pack16(out);
            } else {
#pragma unroll
                for (int e = 0; e < kVec; ++e)
                    if (col + e < head_dim) o_row[col + e] = out[e];
            }
        }
        if (tx == 0) lse_ptr[row] = lse[i];
    }
}

}  // namespace cuflash
