// Backward attention on CUDA cores (FFMA / DFMA) for float32 and float64 inputs: the algorithm of
// flash_bwd.cu with per-thread FMA loops in place of mma.sync, accumulating in acc_t<T> (== T here).
// The preprocess kernel (D = rowsum(dO * O), flash_bwd.cu) serves every dtype and has run before
// these two; they read D from p.dsum. Deterministic by construction: no atomics, no N x N buffer.
//   flash_bwd_dkdv_simt: one block per (n_block, kv head, batch) keeps its dK, dV tile in registers
//     across every query head of its group and every query block that sees it.
//   flash_bwd_dq_simt: one block per (m_block, head, batch) keeps its dQ tile in registers across
//     the key blocks.
//
// Thread layout: tx = tid % 8, ty = tid / 8, kThreadsM = threads / 8. An S / dP tile element
// (row ty + i * kThreadsM, key column tx + 8 * j) belongs to one thread, as in flash_fwd_simt.cu.
// Output tiles (dK, dV: kBlockN x head dim; dQ: kBlockM x head dim) give each thread the head-dim
// vectors (8 * g + tx) * kVec .. + kVec - 1 of a few rows: dK / dV rows ty * kKRows + i
// (contiguous, so their P / dS column is one vector load), dQ rows ty + i * kThreadsM.
//
// Shared memory (dynamic; config.smem_bytes must match kSmemBytes), kStride = kHeadDim + 16 bytes,
// kPStride = kBlockN + 8 elements (see flash_fwd_simt.cu for why):
//   dkdv: q_s, do_s [kBlockM][kStride]; k_s, v_s [kBlockN][kStride]; p_s, ds_s [kBlockM][kPStride];
//         lse_s, dsum_s [kBlockM]
//   dq:   q_s, do_s [kBlockM][kStride]; k_s, v_s [kBlockN][kStride]; ds_s [kBlockM][kPStride];
//         lse_s, dsum_s [kBlockM]
//
// Tiles arrive by cp.async as in flash_fwd_simt.cu; the next query block's dO (dkdv) or the next
// key block's V (dq) is in flight during the dK (dQ) product, its Q (K) right after.
//
// Accuracy: each gradient sum runs in two levels, a fresh per-tile partial (FMA) folded once per
// tile into the running sum; for float the fold is Kahan-compensated. S and dP sum head_dim
// products in partials of 8 (see flash_fwd_simt.cu).
//
// Variants (kVariant, mask.cuh) as in flash_bwd.cu: the mask gives each kernel's loop range, S passes
// through ScoreMod (library tanh) and the mask before P is recomputed, and a softcap multiplies dS by
// 1 - tanh^2. Dropout regenerates the forward's keep mask (Dropout::keep, one Philox call per score):
// dV takes the dropped P, and dL/dP is dO V^T on kept entries times 1 / (1 - p), 0 on dropped ones.
#include "common.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "simt.cuh"

namespace cuflash {
namespace simt_bwd {
using namespace simt;  // the building blocks shared with the other SIMT kernel (simt.cuh)

// ---- helpers of this translation unit only ------------------------------------------------

// LSE and D of query rows [row0, row0 + kBlockM) into shared memory. lse_s holds LSE * log2(e), so
// that P = exp2(S * scale_log2 - lse_s). A row past seqlen_q, or one with LSE = -inf (it saw no
// key), gets +inf there: its P is exactly 0 (never exp2(+inf), never inf - inf), and D = 0.
template <typename A, int kBlockM, int kNThreads>
__device__ __forceinline__ void load_rows(A* lse_s, A* dsum_s, const A* lse, const A* dsum, int row0, int seqlen_q) {
    for (int r = threadIdx.x; r < kBlockM; r += kNThreads) {
        const int row = row0 + r;
        A l = -neg_inf<A>(), d = A(0);
        if (row < seqlen_q) {
            const A x = lse[row];
            if (x != neg_inf<A>()) l = x * static_cast<A>(1.4426950408889634);
            d = dsum[row];
        }
        lse_s[r] = l;
        dsum_s[r] = d;
    }
}

// One score s of query row `row`, key `col` (within the sequence) -> P: the score modifiers, then the
// mask (masked: the tile needs it) turns invisible scores into -inf, then P = exp2(s * scale_log2 -
// lse_log2), which is 0 for them. dcap receives the softcap's 1 - tanh^2 (1 without one).
template <typename Mod, typename MaskT, typename A>
__device__ __forceinline__ A score_to_p(A s, int row, int col, bool masked, const Mod& mod, const MaskT& mask,
                                        A scale_log2, A lse_log2, A& dcap) {
    s = mod.apply(s, row, col, dcap);
    if (masked && !mask.visible(row, col)) s = neg_inf<A>();
    return fast_exp2(fma_acc(s, scale_log2, -lse_log2));
}

// acc[i][.] += sum_{r < kM} a_s[r][ty * kRows + i] * b_s[r][head-dim vectors of this thread]
// (A operand transposed: P^T dO, dS^T Q). Per chunk of kChunk vectors a fresh partial over the
// kM rows, then one (compensated) fold into acc.
template <typename A, int kRows, int kGroups, int kChunk, int kM, int kAStride, int kBStride>
__device__ __forceinline__ void gemm_tn(A (&acc)[kRows][kGroups * (16 / sizeof(A))],
                                        A (&comp)[kRows][kGroups * (16 / sizeof(A))], const A* a_s, const A* b_s,
                                        int ty, int tx) {
    constexpr int kVec = 16 / int(sizeof(A));
#pragma unroll
    for (int g0 = 0; g0 < kGroups; g0 += kChunk) {
        A part[kRows][kChunk * kVec];
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int c = 0; c < kChunk * kVec; ++c) part[i][c] = A(0);
#pragma unroll 1
        for (int r = 0; r < kM; ++r) {
            A av[kRows];
            lds<kRows>(av, a_s + r * kAStride + ty * kRows);
#pragma unroll
            for (int g = 0; g < kChunk; ++g) {
                A bv[kVec];
                lds<kVec>(bv, b_s + r * kBStride + ((g0 + g) * 8 + tx) * kVec);
#pragma unroll
                for (int i = 0; i < kRows; ++i)
#pragma unroll
                    for (int e = 0; e < kVec; ++e) part[i][g * kVec + e] = fma_acc(av[i], bv[e], part[i][g * kVec + e]);
            }
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int c = 0; c < kChunk * kVec; ++c) fold(acc[i][g0 * kVec + c], comp[i][g0 * kVec + c], A(1), part[i][c]);
    }
}

// acc[i][.] += sum_{j < kN} a_s[ty + i * kThreadsM][j] * b_s[j][head-dim vectors of this thread]
// (dS K), two-level as in gemm_tn.
template <typename A, int kRows, int kGroups, int kChunk, int kN, int kThreadsM, int kAStride, int kBStride>
__device__ __forceinline__ void gemm_nn(A (&acc)[kRows][kGroups * (16 / sizeof(A))],
                                        A (&comp)[kRows][kGroups * (16 / sizeof(A))], const A* a_s, const A* b_s,
                                        int ty, int tx) {
    constexpr int kVec = 16 / int(sizeof(A));
#pragma unroll
    for (int g0 = 0; g0 < kGroups; g0 += kChunk) {
        A part[kRows][kChunk * kVec];
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int c = 0; c < kChunk * kVec; ++c) part[i][c] = A(0);
#pragma unroll 1
        for (int j = 0; j < kN; j += kVec) {
            A av[kRows][kVec];
#pragma unroll
            for (int i = 0; i < kRows; ++i) lds<kVec>(av[i], a_s + (ty + i * kThreadsM) * kAStride + j);
#pragma unroll
            for (int jj = 0; jj < kVec; ++jj) {
#pragma unroll
                for (int g = 0; g < kChunk; ++g) {
                    A bv[kVec];
                    lds<kVec>(bv, b_s + (j + jj) * kBStride + ((g0 + g) * 8 + tx) * kVec);
#pragma unroll
                    for (int i = 0; i < kRows; ++i)
#pragma unroll
                        for (int e = 0; e < kVec; ++e)
                            part[i][g * kVec + e] = fma_acc(av[i][jj], bv[e], part[i][g * kVec + e]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int c = 0; c < kChunk * kVec; ++c) fold(acc[i][g0 * kVec + c], comp[i][g0 * kVec + c], A(1), part[i][c]);
    }
}

// Store rows of an output tile from registers: val[i][g * kVec + e] goes to row rows[i] (skipped
// when >= nrows), head-dim column (8 * g + tx) * kVec + e (skipped when >= head_dim), times scale.
template <typename T, typename A, int kRows, int kGroups>
__device__ __forceinline__ void store_rows(T* g, long long row_stride, const int (&rows)[kRows], int nrows,
                                           int head_dim, int tx, const A (&acc)[kRows][kGroups * (16 / sizeof(A))],
                                           const A (&comp)[kRows][kGroups * (16 / sizeof(A))], A scale) {
    constexpr int kVec = 16 / int(sizeof(T));
    const bool vec = aligned16(g, row_stride, sizeof(T)) && head_dim % kVec == 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        if (rows[i] >= nrows) continue;
        T* row = g + static_cast<long long>(rows[i]) * row_stride;
#pragma unroll
        for (int gi = 0; gi < kGroups; ++gi) {
            const int col = (gi * 8 + tx) * kVec;
            T out[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e)
                out[e] = from_acc<T>(resolve(acc[i][gi * kVec + e], comp[i][gi * kVec + e]) * scale);
            if (vec) {
                if (col < head_dim) *reinterpret_cast<typename Vec16<T>::type*>(row + col) = pack16(out);
            } else {
#pragma unroll
                for (int e = 0; e < kVec; ++e)
                    if (col + e < head_dim) row[col + e] = out[e];
            }
        }
    }
}

}  // namespace simt_bwd

// Launch bounds with minBlocks = 1: without it ptxas trims registers to the next occupancy step
// (128 or 168) even at the price of spills, which the compile gate forbids.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_bwd_dkdv_simt(const __grid_constant__ BwdParams p) {
    using namespace simt_bwd;
    using A = acc_t<T>;
    static_assert(sizeof(A) == sizeof(T), "the SIMT kernels take float or double");
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kVec = 16 / int(sizeof(T));
    constexpr int kStride = kHeadDim + kVec;
    constexpr int kPStride = kBlockN + 8;
    constexpr int kThreadsM = kNThreads / 8;
    constexpr int kSRows = kBlockM / kThreadsM;   // S / dP rows per thread
    constexpr int kSCols = kBlockN / 8;           // S / dP columns per thread
    constexpr int kKRows = kBlockN / kThreadsM;   // dK / dV rows per thread
    constexpr int kGroups = kHeadDim / (8 * kVec);
    constexpr int kChunk = pick_chunk(kGroups, kKRows * kVec * int(sizeof(A)), 64);
    constexpr int kSmemBytes =
        (2 * kBlockM * kStride + 2 * kBlockN * kStride + 2 * kBlockM * kPStride + 2 * kBlockM) * int(sizeof(T));
    static_assert(kSRows >= 1 && kBlockM % kThreadsM == 0, "kBlockM must be a multiple of kNWarps * 4");
    static_assert(kKRows >= 1 && kBlockN % kThreadsM == 0, "kBlockN must be a multiple of kNWarps * 4");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kHeadDim % (8 * kVec) == 0, "kHeadDim must be a multiple of 32");
    constexpr bool kIsDropout = (kVariant & kDropout) != 0;
    using Mod = ScoreMod<A, kVariant, kTanhLibrary>;

    extern __shared__ __align__(16) char smem[];
    {
        unsigned dyn_smem;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
        if (dyn_smem < unsigned(kSmemBytes)) __trap();
    }
    T* q_s = reinterpret_cast<T*>(smem);
    T* do_s = q_s + kBlockM * kStride;
    T* k_s = do_s + kBlockM * kStride;
    T* v_s = k_s + kBlockN * kStride;
    A* p_s = reinterpret_cast<A*>(v_s + kBlockN * kStride);
    A* ds_s = p_s + kBlockM * kPStride;
    A* lse_s = ds_s + kBlockM * kPStride;
    A* dsum_s = lse_s + kBlockM;

    const int tid = threadIdx.x;
    const int tx = tid % 8;
    const int ty = tid / 8;
    const FwdParams& f = p.fwd;

    // [2] dK/dV block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
    const int n_block = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0> seq(f, batch);
    const int key_begin = n_block * kBlockN;
    if (key_begin >= seq.seqlen_k) return;  // varlen: a shorter sequence than the grid's
    const int group = f.nheads / f.nheads_k;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = f.head_dim;
    const Mask<kVariant> mask(f, seqlen_q, seqlen_k);
    int m_block_begin, m_block_end;
    mask.template m_block_range<kBlockM, kBlockN>(n_block, m_block_begin, m_block_end);
    const int n_mblocks = max(m_block_end - m_block_begin, 0);
    const int n_iters = group * n_mblocks;  // (query head of the group, query block) pairs
    const T* k = static_cast<const T*>(f.k) + seq.k_offset(batch, f.k_batch_stride, f.k_row_stride) +
                 kv_head * f.k_head_stride + static_cast<long long>(key_begin) * f.k_row_stride;
    const T* v = static_cast<const T*>(f.v) + seq.k_offset(batch, f.v_batch_stride, f.v_row_stride) +
                 kv_head * f.v_head_stride + static_cast<long long>(key_begin) * f.v_row_stride;
    // Row 0 of this batch entry (head 0) in Q, dO, LSE, D
    const T* q_b = static_cast<const T*>(f.q) + seq.q_offset(batch, f.q_batch_stride, f.q_row_stride);
    const T* do_b = static_cast<const T*>(p.dout) + seq.q_offset(batch, p.do_batch_stride, p.do_row_stride);
    const A* lse_b = static_cast<const A*>(f.lse) + seq.row_offset(batch, 0, f.lse_batch_stride, f.lse_head_stride);
    const A* dsum_b = static_cast<const A*>(p.dsum) + seq.row_offset(batch, 0, p.dsum_batch_stride, p.dsum_head_stride);

    // [3] Load the Q, dO tiles and LSE, D rows of one query block
    // Iteration it covers query head kv_head * group + it / n_mblocks and query block
    // m_block_begin + it % n_mblocks. Block 0 is issued here, block it + 1 during block it.
    auto load_q = [&](int it) {
        const int h = kv_head * group + it / n_mblocks, row0 = (m_block_begin + it % n_mblocks) * kBlockM;
        load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(
            q_s, q_b + h * f.q_head_stride + static_cast<long long>(row0) * f.q_row_stride, f.q_row_stride,
            seqlen_q - row0, head_dim);
    };
    auto load_do_rows = [&](int it) {
        const int h = kv_head * group + it / n_mblocks, row0 = (m_block_begin + it % n_mblocks) * kBlockM;
        load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(
            do_s, do_b + h * p.do_head_stride + static_cast<long long>(row0) * p.do_row_stride, p.do_row_stride,
            seqlen_q - row0, head_dim);
        load_rows<A, kBlockM, kNThreads>(lse_s, dsum_s, lse_b + h * f.lse_head_stride, dsum_b + h * p.dsum_head_stride,
                                         row0, seqlen_q);
    };
    load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k, f.k_row_stride, seqlen_k - key_begin, head_dim);
    load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v, f.v_row_stride, seqlen_k - key_begin, head_dim);
    if (n_iters > 0) {
        load_q(0);
        load_do_rows(0);
    }
    cp_async_commit();

    A acc_dk[kKRows][kGroups * kVec], acc_dk_comp[kKRows][kGroups * kVec];
    A acc_dv[kKRows][kGroups * kVec], acc_dv_comp[kKRows][kGroups * kVec];
#pragma unroll
    for (int i = 0; i < kKRows; ++i)
#pragma unroll
        for (int c = 0; c < kGroups * kVec; ++c) acc_dk[i][c] = acc_dk_comp[i][c] = acc_dv[i][c] = acc_dv_comp[i][c] = A(0);

    for (int it = 0; it < n_iters; ++it) {
        const int m_block = m_block_begin + it % n_mblocks;
        const int head = kv_head * group + it / n_mblocks;
        const int row_begin = m_block * kBlockM;
        cp_async_wait<0>();
        __syncthreads();  // this block's Q, dO, LSE, D (and K, V) are in shared memory

        // [4] Recompute S = Q K^T, score modifiers, mask, P = exp2(S * scale_log2 - LSE * log2(e))
        // acc_s[i][j]: query row row_begin + ty + i * kThreadsM, key key_begin + tx + 8 * j
        const Mod mod(f, batch, head, mask.shift);
        A acc_s[kSRows][kSCols];
        dot_tile<A, kSRows, kSCols, kThreadsM, kStride>(acc_s, q_s, k_s, ty, tx, head_dim);
        {
            const bool masked = mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block);
            const A scale_log2 = mod.score_log2(f);
#pragma unroll
            for (int i = 0; i < kSRows; ++i)
#pragma unroll
                for (int j = 0; j < kSCols; ++j) {
                    A dc;
                    acc_s[i][j] = score_to_p(acc_s[i][j], row_begin + ty + i * kThreadsM, key_begin + tx + 8 * j,
                                             masked, mod, mask, scale_log2, lse_s[ty + i * kThreadsM], dc);
                    // d logit / d(scale * S), the softcap's 1 - tanh^2, waits for step 7 in this thread's
                    // own dS slot (free since the last dK product): registers would spill (fp64, d <= 64)
                    if constexpr ((kVariant & kSoftcap) != 0) ds_s[(ty + i * kThreadsM) * kPStride + tx + j * 8] = dc;
                }
        }
        if constexpr (kIsDropout) {
            // a dropped entry is kept as -P: dV reads max(P, 0) (its 1 / (1 - p) applied at the store),
            // dS below tells kept from dropped by the sign
#pragma unroll
            for (int i = 0; i < kSRows; ++i)
#pragma unroll
                for (int j = 0; j < kSCols; ++j)
                    if (!Dropout(f, batch, head).keep(row_begin + ty + i * kThreadsM, key_begin + tx + 8 * j))
                        acc_s[i][j] = -acc_s[i][j];
        }
#pragma unroll
        for (int i = 0; i < kSRows; ++i)
#pragma unroll
            for (int j = 0; j < kSCols; ++j)
                p_s[(ty + i * kThreadsM) * kPStride + tx + j * 8] =
                    kIsDropout && acc_s[i][j] < A(0) ? A(0) : acc_s[i][j];  // dropout: P * keep
        __syncthreads();

        // [5] dV += P^T dO
        gemm_tn<A, kKRows, kGroups, kChunk, kBlockM, kPStride, kStride>(acc_dv, acc_dv_comp, p_s, do_s, ty, tx);

        // [6] dP = dO V^T
        A acc_dp[kSRows][kSCols];
        dot_tile<A, kSRows, kSCols, kThreadsM, kStride>(acc_dp, do_s, v_s, ty, tx, head_dim);

        // [7] dS = P * (dP - D)
        // Dropout: dL/dP is dP / (1 - p) where kept and 0 where dropped (there acc_s = -P, so dS = -P * D
        // = acc_s * D). Softcap: times 1 - tanh^2.
#pragma unroll
        for (int i = 0; i < kSRows; ++i) {
            const A d = dsum_s[ty + i * kThreadsM];
#pragma unroll
            for (int j = 0; j < kSCols; ++j) {
                A ds;
                if constexpr (kIsDropout) {
                    ds = acc_s[i][j] >= A(0)
                             ? acc_s[i][j] * fma_acc(acc_dp[i][j], static_cast<A>(f.dropout_scale), -d)
                             : acc_s[i][j] * d;
                } else {
                    ds = acc_s[i][j] * (acc_dp[i][j] - d);
                }
                A& ds_slot = ds_s[(ty + i * kThreadsM) * kPStride + tx + j * 8];
                if constexpr ((kVariant & kSoftcap) != 0) ds *= ds_slot;  // 1 - tanh^2 from step 4
                ds_slot = ds;
            }
        }
        __syncthreads();  // ds_s complete; do_s, lse_s, dsum_s free for the next query block
        if (it + 1 < n_iters) load_do_rows(it + 1);

        // [8] dK += dS^T Q
        gemm_tn<A, kKRows, kGroups, kChunk, kBlockM, kPStride, kStride>(acc_dk, acc_dk_comp, ds_s, q_s, ty, tx);
        __syncthreads();  // q_s, p_s, ds_s free
        if (it + 1 < n_iters) load_q(it + 1);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // [9] Store dK * softmax_scale and dV
    int rows[kKRows];
#pragma unroll
    for (int i = 0; i < kKRows; ++i) rows[i] = key_begin + ty * kKRows + i;
    T* dk = static_cast<T*>(p.dk) + seq.k_offset(batch, p.dk_batch_stride, p.dk_row_stride) + kv_head * p.dk_head_stride;
    T* dv = static_cast<T*>(p.dv) + seq.k_offset(batch, p.dv_batch_stride, p.dv_row_stride) + kv_head * p.dv_head_stride;
    store_rows<T, A, kKRows, kGroups>(dk, p.dk_row_stride, rows, seqlen_k, head_dim, tx, acc_dk, acc_dk_comp,
                                      static_cast<A>(f.softmax_scale));
    // Dropout: the kept P's 1 / (1 - p), as a float in the params
    store_rows<T, A, kKRows, kGroups>(dv, p.dv_row_stride, rows, seqlen_k, head_dim, tx, acc_dv, acc_dv_comp,
                                      kIsDropout ? static_cast<A>(f.dropout_scale) : A(1));
}

// Launch bounds with minBlocks = 1: without it ptxas trims registers to the next occupancy step
// (128 or 168) even at the price of spills, which the compile gate forbids.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_bwd_dq_simt(const __grid_constant__ BwdParams p) {
    using namespace simt_bwd;
    using A = acc_t<T>;
    static_assert(sizeof(A) == sizeof(T), "the SIMT kernels take float or double");
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kVec = 16 / int(sizeof(T));
    constexpr int kStride = kHeadDim + kVec;
    constexpr int kPStride = kBlockN + 8;
    constexpr int kThreadsM = kNThreads / 8;
    constexpr int kRows = kBlockM / kThreadsM;   // S / dP / dQ rows per thread
    constexpr int kCols = kBlockN / 8;           // S / dP columns per thread
    constexpr int kGroups = kHeadDim / (8 * kVec);
    constexpr int kChunk = pick_chunk(kGroups, kRows * kVec * int(sizeof(A)), 64);
    constexpr int kSmemBytes =
        (2 * kBlockM * kStride + 2 * kBlockN * kStride + kBlockM * kPStride + 2 * kBlockM) * int(sizeof(T));
    static_assert(kRows >= 1 && kBlockM % kThreadsM == 0, "kBlockM must be a multiple of kNWarps * 4");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kHeadDim % (8 * kVec) == 0, "kHeadDim must be a multiple of 32");
    constexpr bool kIsDropout = (kVariant & kDropout) != 0;
    using Mod = ScoreMod<A, kVariant, kTanhLibrary>;

    extern __shared__ __align__(16) char smem[];
    {
        unsigned dyn_smem;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
        if (dyn_smem < unsigned(kSmemBytes)) __trap();
    }
    T* q_s = reinterpret_cast<T*>(smem);
    T* do_s = q_s + kBlockM * kStride;
    T* k_s = do_s + kBlockM * kStride;
    T* v_s = k_s + kBlockN * kStride;
    A* ds_s = reinterpret_cast<A*>(v_s + kBlockN * kStride);
    A* lse_s = ds_s + kBlockM * kPStride;
    A* dsum_s = lse_s + kBlockM;

    const int tid = threadIdx.x;
    const int tx = tid % 8;
    const int ty = tid / 8;
    const FwdParams& f = p.fwd;

    // [10] dQ block coordinates: m_block, head, batch; the mask gives the key blocks to visit
    const int m_block = query_block<kVariant>();
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0> seq(f, batch);
    const int row_begin = m_block * kBlockM;
    if (row_begin >= seq.seqlen_q) return;  // varlen: a shorter sequence than the grid's
    const int kv_head = head / (f.nheads / f.nheads_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = f.head_dim;
    const Mask<kVariant> mask(f, seqlen_q, seqlen_k);
    const Mod mod(f, batch, head, mask.shift);
    int n_block_min, n_block_end;
    mask.template n_block_range<kBlockM, kBlockN>(m_block, n_block_min, n_block_end);
    const T* q = static_cast<const T*>(f.q) + seq.q_offset(batch, f.q_batch_stride, f.q_row_stride) +
                 head * f.q_head_stride + static_cast<long long>(row_begin) * f.q_row_stride;
    const T* dout = static_cast<const T*>(p.dout) + seq.q_offset(batch, p.do_batch_stride, p.do_row_stride) +
                    head * p.do_head_stride + static_cast<long long>(row_begin) * p.do_row_stride;
    const T* k = static_cast<const T*>(f.k) + seq.k_offset(batch, f.k_batch_stride, f.k_row_stride) +
                 kv_head * f.k_head_stride;
    const T* v = static_cast<const T*>(f.v) + seq.k_offset(batch, f.v_batch_stride, f.v_row_stride) +
                 kv_head * f.v_head_stride;

    // Q, dO, LSE, D of this query block stay; K and V of block n_block_min follow, block n + 1 is
    // issued during block n.
    load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(q_s, q, f.q_row_stride, seqlen_q - row_begin, head_dim);
    load_tile<T, kBlockM, kHeadDim, kStride, kNThreads>(do_s, dout, p.do_row_stride, seqlen_q - row_begin, head_dim);
    load_rows<A, kBlockM, kNThreads>(
        lse_s, dsum_s,
        static_cast<const A*>(f.lse) + seq.row_offset(batch, head, f.lse_batch_stride, f.lse_head_stride),
        static_cast<const A*>(p.dsum) + seq.row_offset(batch, head, p.dsum_batch_stride, p.dsum_head_stride),
        row_begin, seqlen_q);
    if (n_block_end > n_block_min) {
        const int key0 = n_block_min * kBlockN;
        load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k + key0 * f.k_row_stride, f.k_row_stride,
                                                            seqlen_k - key0, head_dim);
        load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v + key0 * f.v_row_stride, f.v_row_stride,
                                                            seqlen_k - key0, head_dim);
    }
    cp_async_commit();

    const A scale_log2 = mod.score_log2(f);
    A acc_dq[kRows][kGroups * kVec], acc_dq_comp[kRows][kGroups * kVec];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int c = 0; c < kGroups * kVec; ++c) acc_dq[i][c] = acc_dq_comp[i][c] = A(0);

    for (int n_block = n_block_min; n_block < n_block_end; ++n_block) {
        const int key0 = n_block * kBlockN;
        const int next_row0 = key0 + kBlockN;
        cp_async_wait<0>();
        __syncthreads();  // K, V of this key block (and Q, dO, LSE, D) are in shared memory

        // [11] Recompute S, P and dS = P * (dO V^T - D) for one key block
        // Per score: modifiers and mask on S, P; dL/dP = dP / (1 - p) where kept, 0 where dropped
        // (dropout); dS = P * (dL/dP - D), times the softcap's 1 - tanh^2.
        // acc_s / acc_dp[i][j]: query row row_begin + ty + i * kThreadsM, key key0 + tx + 8 * j
        A acc_s[kRows][kCols];
        dot_tile<A, kRows, kCols, kThreadsM, kStride>(acc_s, q_s, k_s, ty, tx, head_dim);
        A acc_dp[kRows][kCols];
        dot_tile<A, kRows, kCols, kThreadsM, kStride>(acc_dp, do_s, v_s, ty, tx, head_dim);
        const bool masked = mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const int row = row_begin + ty + i * kThreadsM;
            const A d = dsum_s[ty + i * kThreadsM];
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                const int col = key0 + tx + 8 * j;
                A dcap;
                const A pv = score_to_p(acc_s[i][j], row, col, masked, mod, mask, scale_log2,
                                        lse_s[ty + i * kThreadsM], dcap);
                A dl = acc_dp[i][j] - d;  // dL/dP - D
                if constexpr (kIsDropout) {
                    const bool kept = Dropout(f, batch, head).keep(row, col);
                    dl = kept ? fma_acc(acc_dp[i][j], static_cast<A>(f.dropout_scale), -d) : -d;
                }
                A ds = pv * dl;
                if constexpr ((kVariant & kSoftcap) != 0) ds *= dcap;
                ds_s[(ty + i * kThreadsM) * kPStride + tx + j * 8] = ds;
            }
        }
        __syncthreads();  // ds_s complete, v_s free
        if (n_block + 1 < n_block_end)
            load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(v_s, v + next_row0 * f.v_row_stride, f.v_row_stride,
                                                                seqlen_k - next_row0, head_dim);

        // [12] dQ += dS K
        gemm_nn<A, kRows, kGroups, kChunk, kBlockN, kThreadsM, kPStride, kStride>(acc_dq, acc_dq_comp, ds_s, k_s, ty, tx);
        __syncthreads();  // k_s, ds_s free
        if (n_block + 1 < n_block_end)
            load_tile<T, kBlockN, kHeadDim, kStride, kNThreads>(k_s, k + next_row0 * f.k_row_stride, f.k_row_stride,
                                                                seqlen_k - next_row0, head_dim);
        cp_async_commit();
    }
    cp_async_wait<0>();

    // [13] Store dQ * softmax_scale
    int rows[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) rows[i] = row_begin + ty + i * kThreadsM;
    T* dq = static_cast<T*>(p.dq) + seq.q_offset(batch, p.dq_batch_stride, p.dq_row_stride) + head * p.dq_head_stride;
    store_rows<T, A, kRows, kGroups>(dq, p.dq_row_stride, rows, seqlen_q, head_dim, tx, acc_dq, acc_dq_comp,
                                     static_cast<A>(f.softmax_scale));
}

}  // namespace cuflash
