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
//
// Variants (kVariant, mask.cuh) as in flash_fwd.cu: the key blocks come from Mask::n_block_range, scores
// pass through ScoreMod (softcap, ALiBi; the library tanh: fp32 / fp64 outputs need its accuracy) and
// the mask, P through dropout before P V (one Philox call per score: Dropout::keep). Varlen batches
// take their rows and lengths from SeqInfo; a KV cache its key counts (kSeqused) and, paged, its key
// rows through KeyRows (kPaged).
#include "common.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "simt.cuh"

namespace cuflash {
namespace simt_fwd {
using namespace simt;  // the building blocks shared with the other SIMT kernel (simt.cuh)

// ---- helpers of this translation unit only ------------------------------------------------

__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

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

}  // namespace simt_fwd

// Launch bounds with minBlocks = 1: without it ptxas trims registers to the next occupancy step
// (128 or 168) even at the price of spills, which the compile gate forbids.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
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
    constexpr bool kIsDropout = (kVariant & kDropout) != 0;
    using Mod = ScoreMod<A, kVariant, kTanhLibrary>;

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

    // [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
    const int m_block = query_block<kVariant>();
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0, (kVariant & kSeqused) != 0> seq(p, batch);
    const int row_begin = m_block * kBlockM;
    if (row_begin >= seq.seqlen_q) return;  // varlen: a shorter sequence than the grid's
    const int kv_head = head / (p.nheads / p.nheads_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = p.head_dim;
    const Mask<kVariant> mask(p, seqlen_q, seqlen_k);
    const Mod mod(p, batch, head, mask.shift);
    int n_block_min, n_block_end;
    mask.template n_block_range<kBlockM, kBlockN>(m_block, n_block_min, n_block_end);
    const T* q = static_cast<const T*>(p.q) + seq.q_offset(batch, p.q_batch_stride, p.q_row_stride) +
                 head * p.q_head_stride;
    constexpr bool kIsPaged = (kVariant & kPaged) != 0;
    const auto k_rows = key_rows<kIsPaged, T>(p, seq, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                              batch, kv_head);
    const auto v_rows = key_rows<kIsPaged, T>(p, seq, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                              batch, kv_head);

    // [2] Load the Q tile
    // Copies run asynchronously, one commit group per tile: Q, then K and V of key block 0. The
    // loop below keeps exactly one group (the next K or V tile) in flight behind the one it waits for.
    load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(
        q_s, q + static_cast<long long>(row_begin) * p.q_row_stride, p.q_row_stride, seqlen_q - row_begin, head_dim);
    cp_async_commit();
    if (n_block_end > n_block_min) {
        const int key0 = n_block_min * kBlockN;
        load_keys<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k_rows, key0, seqlen_k - key0, head_dim);
        cp_async_commit();
        load_keys<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v_rows, key0, seqlen_k - key0, head_dim);
        cp_async_commit();
    }

    const A scale_log2 = mod.score_log2(p);
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

    for (int n_block = n_block_min; n_block < n_block_end; ++n_block) {
        const int next_row0 = (n_block + 1) * kBlockN;  // first key row of the next block
        // [3] S = Q K^T
        cp_async_wait<1>();  // Q and this block's K have landed (V may still be in flight)
        __syncthreads();
        A acc_s[kRows][kCols];
        dot_tile<A, kRows, kCols, kThreadsM, kStride>(acc_s, q_s, k_s, ty, tx, head_dim);

        // [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
        // acc_s[i][j]: query row row_begin + ty + i * kThreadsM, key n_block * kBlockN + tx + j * kThreadsN
        if constexpr (Mod::kTransform) {
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int j = 0; j < kCols; ++j) {
                    A dcap;
                    acc_s[i][j] = mod.apply(acc_s[i][j], row_begin + ty + i * kThreadsM,
                                            n_block * kBlockN + tx + j * kThreadsN, dcap);
                }
        }
        if (mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block)) {
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int j = 0; j < kCols; ++j)
                    if (!mask.visible(row_begin + ty + i * kThreadsM, n_block * kBlockN + tx + j * kThreadsN))
                        acc_s[i][j] = neg_inf<A>();
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
            // Dropout (for step 6): dropped entries are 0 in P V only; row_sum, and so the LSE, keep them
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                A pv = acc_s[i][j];
                if constexpr (kIsDropout) {
                    const int row = row_begin + ty + i * kThreadsM, col = n_block * kBlockN + tx + j * kThreadsN;
                    if (!Dropout(p, batch, head).keep(row, col)) pv = A(0);
                }
                p_s[(ty + i * kThreadsM) * kPStride + tx + j * kThreadsN] = pv;
            }
        }
        __syncthreads();  // p_s complete, k_s free: start the next K tile behind this block's P V
        if (n_block + 1 < n_block_end)
            load_keys<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k_rows, next_row0, seqlen_k - next_row0, head_dim);
        cp_async_commit();
        cp_async_wait<1>();  // this block's V has landed
        __syncthreads();

        // [6] O += dropout(P) V
        // p_s holds P with the dropped entries 0 (step 5); O is scaled by 1 / (1 - dropout_p) at the store.
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
            load_keys<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v_rows, next_row0, seqlen_k - next_row0, head_dim);
        cp_async_commit();
    }
    cp_async_wait<0>();  // nothing may be in flight at exit (only the Q group when no key block ran)

    // [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
    A lse[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const A sum = warp_allreduce_sum<kThreadsN>(resolve(row_sum[i], row_sum_comp[i]));
        const bool empty = row_max[i] == neg_inf<A>();
        // row_max * softmax_scale (mod.lse_scale()), taken as row_max_scaled * ln(2): the exact reference
        // of P, whatever exp2's scale (mod.score_log2) is.
        lse[i] = empty ? neg_inf<A>() : row_max_scaled[i] * static_cast<A>(0.6931471805599453) + log_acc(sum);
        const A inv_sum = empty ? A(0) : rcp_acc(sum);
#pragma unroll
        for (int c = 0; c < kGroups * kVec; ++c)
            acc_o[i][c] = empty ? A(0) : div_acc(resolve(acc_o[i][c], acc_o_comp[i][c]), sum, inv_sum);
    }

    // [8] Store O and LSE
    T* o = static_cast<T*>(p.o) + seq.q_offset(batch, p.o_batch_stride, p.o_row_stride) + head * p.o_head_stride;
    const bool o_vec = aligned16(o, p.o_row_stride, sizeof(T)) && head_dim % kVec == 0;
    A* lse_ptr = static_cast<A*>(p.lse) + seq.row_offset(batch, head, p.lse_batch_stride, p.lse_head_stride);
    // Dropout: the kept entries' 1 / (1 - dropout_p), as a float in the params
    const A out_scale = kIsDropout ? static_cast<A>(p.dropout_scale) : A(1);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = row_begin + ty + i * kThreadsM;
        if (row >= seqlen_q) continue;
        T* o_row = o + static_cast<long long>(row) * p.o_row_stride;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int col = (g * kThreadsN + tx) * kVec;
            T out[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e)
                out[e] = from_acc<T>(kIsDropout ? acc_o[i][g * kVec + e] * out_scale : acc_o[i][g * kVec + e]);
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
