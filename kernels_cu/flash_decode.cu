// FlashAttention over a KV cache for few query rows (decoding): split-KV and GQA heads packed into the query
// tile (fp16 / bf16 storage, mma.sync, fp32 accumulation). Reached from flash_attn_with_kvcache.
//
// A decode step has one query row (a few when speculating) per (entry, head) and a long cache: the prefill
// kernel's 128-row query tiles would be almost empty, its grid (query blocks, heads, batch) too small to
// fill the GPU, and each head of a GQA group would stream the same K and V again. Here:
// - a block's kBlockM = 16 rows are packed (query row, head of the group) pairs of one kv head: packed row r
//   is query row r / group of head head_k * group + r % group, so the group's heads share one read of K, V;
// - an entry's key blocks are shared out over num_splits blocks (grid x = split * m_blocks + m_block), each
//   writing its partial O (normalized over its keys) and LSE in fp32; flash_decode_combine merges them
//   exactly. With one split the block writes o and lse itself;
// - inside a block, warp w streams keys [w * kWarpKeys, (w + 1) * kWarpKeys) of every kBlockN-key block
//   through a kStages-deep cp.async ring of its own, with an online softmax of its own: no block barrier
//   in the loop. The warps' states are merged once, through shared memory, at the end.
// The stream of K and V is the cost; stages x warps x blocks per SM keep enough of it in flight.
//
// Shared memory (16-bit elements):
//   sQ [16][kHeadDim + 8] (padded rows, copy.cuh); per warp kStages slots of (K [kWarpKeys][kRingPitch],
//   V [kWarpKeys][kRingPitch]): rows of decode_ring_pitch elements, chunks swizzled (ring_offset)
//   after the loop the ring holds the merge: sO [kNWarps][16][kHeadDim], sMax, sSum [kNWarps][16] (fp32)
//   config.smem_bytes: 16 * (head_dim + 8) * 2 + 2 * kStages * block_n * ring_pitch * 2
//
// Variants: the mask (causal, window; the row of packed row r is r / group), the softcap, a paged cache
// (kPaged); kSeqused always. ALiBi (a slope per head: per packed row) takes the prefill kernel.
#include "params.cuh"
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "softmax.cuh"

namespace cuflash {

// The ring's rows: the head dim rounded up to 64 elements, so that every row starts on a 128-byte line.
__host__ __device__ constexpr int decode_ring_pitch(int head_dim) { return (head_dim + 63) / 64 * 64; }

// Stages of each warp's ring: 3 where a block fits in sm_80's shared memory, else 2 (config.decode_stages).
__host__ __device__ constexpr int decode_stages(int head_dim, int block_n) {
    return 16 * (head_dim + 8) * 2 + 2 * 3 * block_n * decode_ring_pitch(head_dim) * 2 <=
                   static_cast<int>(kSmemPortable)
               ? 3
               : 2;
}

// Element offset of (row, col) in a ring tile (pitch kPitch, col a multiple of 8): 16-byte chunk c of row r sits
// at chunk c ^ (r & 7). With rows on 128-byte lines, the 8 lanes of a cp.async quarter-warp fill one line (L2
// requests of 4 sectors; with rows padded by 16 bytes the L2 saw 1.5x the sectors: RESULTS (g)), and the 8 rows
// of an ldmatrix matrix, one chunk column, sit in 8 distinct bank groups.
template <int kPitch>
__device__ __forceinline__ int ring_offset(int row, int col) {
    static_assert(kPitch % 64 == 0, "128-byte rows");
    return row * kPitch + (((col >> 3) ^ (row & 7)) << 3);
}

// One run of key rows (tile shape S) from src (row r of the run: src + r * row_stride) into ring rows r0, r0 + 1, ...
// at base: rows below valid and columns below cols_valid are copied, the rest zero-filled from `zero`; kWhole: all
// of them are (no predicates).
template <bool kWhole, class S, int kPitch, typename T>
__device__ __forceinline__ void ring_copy_run(unsigned base, const T* src, const T* zero, long long row_stride, int r0,
                                              int valid, int cols_valid, int row_t, int col_t) {
    const T* from = src + row_t * row_stride + col_t;  // then steps of kRowStep rows: no 64-bit multiply per row
#pragma unroll
    for (int j = 0; j < S::kRowIters; ++j) {
        const int row = row_t + j * S::kRowStep;
#pragma unroll
        for (int c = 0; c < S::kColIters; ++c) {
            const int col = col_t + c * S::kThreadsPerRow * 8;
            const bool ok = kWhole || (row < valid && col < cols_valid);
            const T* at = from + j * S::kRowStep * row_stride + c * S::kThreadsPerRow * 8;
            cp_async_16(base + ring_offset<kPitch>(r0 + row, col) * sizeof(T), ok ? at : zero, ok);
        }
    }
}

// Key rows [key0, key0 + kRows) of one entry (KeyRows, seqinfo.cuh) into a ring tile (pitch kPitch, ring_offset),
// by the 32 lanes of one warp. A dense entry's rows are one run; a paged entry's come in runs of 16, one page
// lookup each (page sizes are multiples of 16). Rows past seqlen_k, or on a page outside the pool, and columns
// past cols_valid are zero-filled and read nothing. A run of kRun whole rows (the loop's common case) is copied
// without per-chunk predicates.
template <int kRows, int kCols, int kPitch, typename T, class Rows>
__device__ __forceinline__ void cp_async_key_run(T* smem, const Rows& rows, int key0, int seqlen_k, int cols_valid,
                                                 int lane) {
    constexpr int kRun = Rows::kPaged ? 16 : kRows;
    static_assert(kRows % kRun == 0, "runs of 16 keys");
    using S = TileShape<kRun, kCols, 32>;
    static_assert(kRun % S::kRowStep == 0, "whole steps of rows");
    const int row_t = lane / S::kThreadsPerRow, col_t = (lane % S::kThreadsPerRow) * 8;
    const unsigned base = smem_u32(smem);
#pragma unroll
    for (int r = 0; r < kRows; r += kRun) {
        const int key = key0 + r;
        const T* src = rows.base;
        const bool any = key < seqlen_k && rows.row(key, src);
        const int valid = any ? seqlen_k - key : 0;
        // Whole runs and the rest in separate loops: one loop with a select per chunk ran 1.45x the instructions
        // (ncu, RESULTS (g))
        if (valid >= kRun && cols_valid == kCols) {
            ring_copy_run<true, S, kPitch>(base, src, rows.base, rows.row_stride, r, valid, cols_valid, row_t, col_t);
        } else {
            ring_copy_run<false, S, kPitch>(base, src, rows.base, rows.row_stride, r, valid, cols_valid, row_t, col_t);
        }
    }
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_decode(const __grid_constant__ DecodeParams dp) {
    static_assert(sizeof(T) == 2, "tensor-core kernel: __half or __nv_bfloat16");
    static_assert(kBlockM == 16, "one 16-row m-tile of packed rows, shared by every warp");
    static_assert((kVariant & kSeqused) != 0 && (kVariant & (kAlibi | kDropout | kVarlen)) == 0,
                  "KV-cache calls; ALiBi, dropout and varlen take flash_fwd");
    constexpr int kWarpKeys = kBlockN / kNWarps;  // keys of each key block one warp takes
    static_assert(kHeadDim % 32 == 0 && kWarpKeys % 16 == 0, "16-wide k-slices; 32 lanes over the head dim");
    constexpr int kPitch = kHeadDim + 8;                       // sQ's rows
    constexpr int kRingPitch = decode_ring_pitch(kHeadDim);    // the K and V rows of the ring (ring_offset)
    constexpr int kStages = decode_stages(kHeadDim, kBlockN);
    constexpr int kNTilesS = kWarpKeys / 8;     // 8-key n-tiles of a warp's S
    constexpr int kNTilesO = kHeadDim / 8;      // 8-dim n-tiles of O
    constexpr int kKSlicesQK = kHeadDim / 16;   // k-slices of Q K^T (over head dim)
    constexpr int kKSlicesPV = kWarpKeys / 16;  // k-slices of P V (over keys)
    constexpr bool kQInRegs = kHeadDim <= 128;  // Q's A fragments: registers, or re-read from sQ
    constexpr int kSlot = 2 * kWarpKeys * kRingPitch;  // elements of one stage of one warp: K, then V
    constexpr unsigned kRingBytes = kNWarps * kStages * kSlot * sizeof(T);
    constexpr unsigned kSmemBytes = kBlockM * kPitch * sizeof(T) + kRingBytes;
    static_assert(kNWarps * kBlockM * (kHeadDim + 2) * sizeof(float) <= kRingBytes, "the merge fits in the ring");
    constexpr bool kIsPaged = (kVariant & kPaged) != 0;
    using Mod = ScoreMod<float, kVariant, kTanhApprox>;
    const FwdParams& p = dp.fwd;

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < kSmemBytes) __trap();

    extern __shared__ __align__(16) char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    T* sRing = sQ + kBlockM * kPitch + warp * kStages * kSlot;  // this warp's stages

    // [1] Block coordinates: packed query block, split, kv head, batch; the mask gives the key blocks, the split its share
    const int m_blocks = gridDim.x / dp.num_splits;
    const int m_block = blockIdx.x % m_blocks, split = blockIdx.x / m_blocks;
    const int head_k = blockIdx.y, batch = blockIdx.z;
    const SeqInfo<false, true> seq(p, batch);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = p.head_dim;
    const int group = p.nheads / p.nheads_k, packed_rows = seqlen_q * group;
    const int r0 = m_block * kBlockM, r1 = min(r0 + kBlockM, packed_rows);
    const int row_lo = r0 / group, row_hi = (r1 - 1) / group + 1;  // the query rows of the tile
    const Mask<kVariant> mask(p, seqlen_q, seqlen_k);
    const Mod mod(p, batch, 0, mask.shift);  // no per-head term: ALiBi is not served here
    int n_lo, n_hi;
    mask.template key_block_range<kBlockN>(row_lo, row_hi, n_lo, n_hi);
    const int per_split = ceil_div(max(n_hi - n_lo, 0), dp.num_splits);
    const int n_begin = n_lo + split * per_split;
    const int n_count = max(min(n_hi, n_begin + per_split) - n_begin, 0);

    // [2] Load the Q tile: packed row r is query row r / group of head head_k * group + r % group
    {
        constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
        const T* q = static_cast<const T*>(p.q) + seq.q_offset(batch, p.q_batch_stride, p.q_row_stride) +
                     head_k * group * p.q_head_stride;
        for (int c = tid; c < kBlockM * kChunks; c += kNWarps * 32) {
            const int r = c / kChunks, col = (c % kChunks) * 8, pr = r0 + r;
            const bool valid = pr < packed_rows && col < head_dim;
            const T* src = valid ? q + (pr / group) * p.q_row_stride + (pr % group) * p.q_head_stride + col : q;
            cp_async_16(smem_u32(sQ + r * kPitch + col), src, valid);
        }
        cp_async_commit();
    }

    // [3] Each warp: its slice of the first key blocks into its own ring of stages
    const auto k_rows = key_rows<kIsPaged, T>(p, seq, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                              batch, head_k);
    const auto v_rows = key_rows<kIsPaged, T>(p, seq, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                              batch, head_k);
    auto load_stage = [&](int i) {
        // A slice past the keys loads zeros (P V then meets 0, never stale bits)
        const int key0 = (n_begin + i) * kBlockN + warp * kWarpKeys;
        T* sK = sRing + (i % kStages) * kSlot;
        cp_async_key_run<kWarpKeys, kHeadDim, kRingPitch>(sK, k_rows, key0, seqlen_k, head_dim, lane);
        cp_async_key_run<kWarpKeys, kHeadDim, kRingPitch>(sK + kWarpKeys * kRingPitch, v_rows, key0, seqlen_k,
                                                          head_dim, lane);
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (i < n_count) load_stage(i);
        cp_async_commit();  // empty groups too: the wait counts below stay uniform
    }

    // Q (the oldest group) has landed for every thread, and so for all after the barrier
    cp_async_wait<kStages - 1>();
    __syncthreads();
    const unsigned q_addr = smem_u32(sQ + ldsm_a_offset(lane, kPitch));
    unsigned q_frag[kQInRegs ? kKSlicesQK : 1][4];
    if constexpr (kQInRegs) {
#pragma unroll
        for (int ks = 0; ks < kKSlicesQK; ++ks) ldmatrix_x4(q_frag[ks], q_addr + ks * 16 * sizeof(T));
    }
    // The query rows of this thread's two packed rows g and g + 8 (the mask's rows)
    const int q_row[2] = {(r0 + g) / group, (r0 + g + 8) / group};
    // The ring rows and swizzled chunks this lane's ldmatrix addresses: K (B from [key][dim]) at chunk 2 ks + its
    // chunk, V (B^T from [key][dim]) at chunk 2 np + its chunk; each row's chunks are XORed with row & 7 = lane & 7,
    // and as bit 0 is the lane's own, (2 i + c) ^ (lane & 7) = 2 i ^ (c ^ (lane & 7)).
    const int k_row = ldsm_b_row(lane), k_chunk = ldsm_b_chunk(lane) ^ (lane & 7);
    const int v_row = ldsm_bt_row(lane), v_chunk = ldsm_bt_chunk(lane) ^ (lane & 7);

    float acc_o[1][kNTilesO][4];
#pragma unroll
    for (int no = 0; no < kNTilesO; ++no)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][no][e] = 0.f;
    OnlineSoftmax<1> softmax;
    softmax.init();
    const float scale_log2 = mod.score_log2(p);

    for (int i = 0; i < n_count; ++i) {
        // [4] Wait for this warp's slice of the key block; refill the stage freed by the previous one
        cp_async_wait<kStages - 2>();
        __syncwarp();  // every lane has landed its part, and is done reading the stage refilled next
        if (i + kStages - 1 < n_count) load_stage(i + kStages - 1);
        cp_async_commit();
        const int key0 = (n_begin + i) * kBlockN + warp * kWarpKeys;
        const T* sK = sRing + (i % kStages) * kSlot;
        const unsigned k_addr = smem_u32(sK + k_row * kRingPitch);
        const unsigned v_addr = smem_u32(sK + kWarpKeys * kRingPitch + v_row * kRingPitch);

        // [5] S = Q K^T
        float acc_s[1][kNTilesS][4];
#pragma unroll
        for (int ni = 0; ni < kNTilesS; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][ni][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kKSlicesQK; ++ks) {
            unsigned a[4];
            if constexpr (kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[e] = q_frag[ks][e];
            } else {
                ldmatrix_x4(a, q_addr + ks * 16 * sizeof(T));
            }
#pragma unroll
            for (int np = 0; np < kNTilesS / 2; ++np) {
                unsigned b[4];
                ldmatrix_x4(b, k_addr + (np * 16 * kRingPitch + (((2 * ks) ^ k_chunk) << 3)) * sizeof(T));
                mma_16816<T>(acc_s[0][2 * np], a, b[0], b[1]);
                mma_16816<T>(acc_s[0][2 * np + 1], a, b[2], b[3]);
            }
        }

        // [6] Score modifier (softcap); mask the sequence tail, the causal diagonal and the window
        // acc_s[0][ni][2h + e]: packed row g + 8h (query row q_row[h]), key key0 + 8*ni + 2t + e
        if constexpr (Mod::kTransform) {
            for_each_score<1, kNTilesS>(0, key0, lane, [&](float& x, int row, int col) {
                float dcap;
                x = mod.apply(x, row, col, dcap);
            }, acc_s);
        }
        if (mask.tile_needs_mask(row_lo, row_hi, key0, key0 + kWarpKeys)) {
#pragma unroll
            for (int ni = 0; ni < kNTilesS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!mask.visible(q_row[e >> 1], key0 + 8 * ni + 2 * t + (e & 1))) acc_s[0][ni][e] = neg_inf<float>();
        }

        // [7] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
        // acc_o's rescale only where some row's max moved (a factor of exactly 1 otherwise): once the maxima settle,
        // the 4 * kNTilesO multiplies per key block are skipped.
        float correction[2];
        softmax.update(acc_s, scale_log2, correction);
        if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) softmax.rescale(acc_o, correction);

        // [8] O += P V
#pragma unroll
        for (int ks = 0; ks < kKSlicesPV; ++ks) {
            unsigned a[4];
            acc_to_a<T>(a, acc_s[0][2 * ks], acc_s[0][2 * ks + 1]);
#pragma unroll
            for (int np = 0; np < kHeadDim / 16; ++np) {
                unsigned b[4];
                ldmatrix_x4_trans(b, v_addr + (ks * 16 * kRingPitch + (((2 * np) ^ v_chunk) << 3)) * sizeof(T));
                mma_16816<T>(acc_o[0][2 * np], a, b[0], b[1]);
                mma_16816<T>(acc_o[0][2 * np + 1], a, b[2], b[3]);
            }
        }
    }

    // [9] Merge the warps: row max, row sum and O of each warp through shared memory
    cp_async_wait<0>();  // only empty groups can be left; the ring is then idle
    __syncthreads();
    float* sO = reinterpret_cast<float*>(sQ + kBlockM * kPitch);  // [warp][packed row][dim], over the ring
    float* sMax = sO + kNWarps * kBlockM * kHeadDim;               // [warp][packed row]: row_max (held units)
    float* sSum = sMax + kNWarps * kBlockM;                        // [warp][packed row]: row_sum
    float row_sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = warp_allreduce_sum<4>(softmax.row_sum[h]);
    if (t == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sMax[warp * kBlockM + g + 8 * h] = softmax.row_max[h];
            sSum[warp * kBlockM + g + 8 * h] = row_sum[h];
        }
    }
    __syncthreads();
    // Row r of the block: max over the warps M, and L = sum_w exp2((max_w - M) * scale_log2) sum_w. Every warp
    // scales its O by exp2((max_w - M) * scale_log2) / L; L = 0 (no warp saw a key) gives O = 0, LSE = -inf. A warp
    // that saw no key adds 0 * sum_w: 0, or NaN where its scores were NaN (then L, O and LSE are NaN, as unsplit).
    auto merged = [&](int r, float& m, float& l) {
        m = neg_inf<float>();
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) m = fmaxf(m, sMax[w * kBlockM + r]);
        l = 0.f;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) {
            const float mw = sMax[w * kBlockM + r];
            l += (mw == neg_inf<float>() ? 0.f : exp2f((mw - m) * scale_log2)) * sSum[w * kBlockM + r];
        }
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float m, l;
        merged(g + 8 * h, m, l);
        const float mine = softmax.row_max[h];
        const float f = l == 0.f ? 0.f : (mine == neg_inf<float>() ? 0.f : exp2f((mine - m) * scale_log2)) / l;
        float* dst = sO + (warp * kBlockM + g + 8 * h) * kHeadDim + 2 * t;
#pragma unroll
        for (int no = 0; no < kNTilesO; ++no)
            *reinterpret_cast<float2*>(dst + 8 * no) = make_float2(acc_o[0][no][2 * h] * f, acc_o[0][no][2 * h + 1] * f);
    }
    __syncthreads();

    // [10] Store O and LSE, or this split's partial O and LSE
    const bool partial = dp.num_splits > 1;
    // Partials: [split, batch, head, row] (times kHeadDim for O); head and row of packed row pr
    auto partial_row = [&](int pr) {
        return ((static_cast<long long>(split) * p.batch + batch) * p.nheads + head_k * group + pr % group) *
                   seqlen_q + pr / group;
    };
    constexpr int kChunks = kHeadDim / 8;
    for (int c = tid; c < kBlockM * kChunks; c += kNWarps * 32) {
        const int r = c / kChunks, col = (c % kChunks) * 8, pr = r0 + r;
        if (pr >= packed_rows || col >= head_dim) continue;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) {
            const float* src = sO + (w * kBlockM + r) * kHeadDim + col;
            const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
            v[0] += lo.x, v[1] += lo.y, v[2] += lo.z, v[3] += lo.w, v[4] += hi.x, v[5] += hi.y, v[6] += hi.z, v[7] += hi.w;
        }
        if (partial) {
            float* dst = dp.o_partial + partial_row(pr) * kHeadDim + col;
            *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            T* dst = static_cast<T*>(p.o) + seq.q_offset(batch, p.o_batch_stride, p.o_row_stride) +
                     (pr / group) * p.o_row_stride + (head_k * group + pr % group) * p.o_head_stride + col;
            *reinterpret_cast<uint4*>(dst) =
                make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
        }
    }
    if (tid < kBlockM && r0 + tid < packed_rows) {
        const int pr = r0 + tid;
        float m, l;
        merged(tid, m, l);
        const float lse = l == 0.f ? neg_inf<float>() : m * mod.lse_scale() + logf(l);
        if (partial) {
            dp.lse_partial[partial_row(pr)] = lse;
        } else {
            static_cast<float*>(p.lse)[seq.row_offset(batch, head_k * group + pr % group, p.lse_batch_stride,
                                                      p.lse_head_stride) + pr / group] = lse;
        }
    }
}

// Merge the num_splits partials of each (batch, head, query row) into o and lse: one warp per row. Lane l holds the
// LSEs of splits l, l + 32, ... (all loaded at once), so the largest LSE and the weights' sum are warp reductions;
// then lane l takes columns l, l + 32, ... of every split's O, each split's weight broadcast from the lane holding
// it. The first kPrefetch splits' O are loaded with the LSEs: at 16 splits the kernel waits on one round of loads,
// not three (5.3 -> 4.2 us at B = 1, RESULTS 2026-12-03 (f)). The merge is the exact one of attention over disjoint
// key sets (merge_states). (A minimum of 1 block per SM in the bounds: without one, ptxas held the sm_90 build to
// 32-40 registers and spilled.)
template <typename T, int kHeadDim, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_decode_combine(const __grid_constant__ DecodeParams dp) {
    static_assert(kHeadDim % 32 == 0, "32 lanes over the head dim");
    constexpr int kPerLane = kHeadDim / 32;
    constexpr int kRounds = kMaxSplits / 32;  // splits a lane holds
    constexpr int kPrefetch = 64 / kPerLane < 16 ? 64 / kPerLane : 16;  // splits whose O is loaded with the LSEs
    const FwdParams& p = dp.fwd;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long rows = static_cast<long long>(p.batch) * p.nheads * p.seqlen_q;  // one split's [batch, head, row]
    const long long idx = static_cast<long long>(blockIdx.x) * kNWarps + warp;
    if (idx >= rows) return;  // the whole warp: the shuffles below see all 32 lanes
    const int row = static_cast<int>(idx % p.seqlen_q), head = static_cast<int>(idx / p.seqlen_q % p.nheads);
    const int batch = static_cast<int>(idx / (static_cast<long long>(p.seqlen_q) * p.nheads));
    const int num_splits = dp.num_splits;

    // [11] Combine: the largest partial LSE, the splits' weights exp(lse_s - max) and their sum
    // A NaN partial makes the row NaN, as unsplit: the max keeps it (fmaxf would drop it), and every weight takes it.
    auto nan_max = [](float a, float b) { return (b > a || b != b) ? b : a; };
    float x[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
        const int s = 32 * r + lane;
        x[r] = s < num_splits ? dp.lse_partial[s * rows + idx] : neg_inf<float>();
    }
    const float* o_split = dp.o_partial + idx * kHeadDim + lane;  // split s: o_split[s * rows * kHeadDim]
    float early[kPrefetch][kPerLane];  // the first splits' O, in flight with the LSEs
#pragma unroll
    for (int j = 0; j < kPrefetch; ++j)
#pragma unroll
        for (int e = 0; e < kPerLane; ++e)  // flash_decode writes columns below head_dim only
            early[j][e] = j < num_splits && lane + 32 * e < p.head_dim ? o_split[j * rows * kHeadDim + 32 * e] : 0.f;
    float m = x[0];
#pragma unroll
    for (int r = 1; r < kRounds; ++r) m = nan_max(m, x[r]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const bool empty = m == neg_inf<float>();
    float w[kRounds], l = 0.f;
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
        w[r] = empty ? 0.f : expf(x[r] - m);  // a split past num_splits: exp(-inf) = 0
        l += w[r];
    }
    l = warp_allreduce_sum<32>(l);

    // [12] O = sum_s weight_s O_s / sum; LSE = max + log(sum); a row no split saw gives O = 0, LSE = -inf
    float acc[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
    if (!empty) {
        const float inv = 1.f / l;
#pragma unroll
        for (int j = 0; j < kPrefetch; ++j) {  // a weight past num_splits is 0, its O 0
            const float wj = __shfl_sync(0xffffffffu, w[0], j) * inv;
#pragma unroll
            for (int e = 0; e < kPerLane; ++e) acc[e] += wj * early[j][e];
        }
#pragma unroll
        for (int r = 0; r < kRounds; ++r) {
            const int n = min(32, num_splits - 32 * r);  // <= 0 past the last round
            const float wr = w[r] * inv;
#pragma unroll 8
            for (int j = r == 0 ? kPrefetch : 0; j < n; ++j) {  // the loads of 8 splits in flight
                const float wj = __shfl_sync(0xffffffffu, wr, j);
                const float* src = o_split + (32 * r + j) * rows * kHeadDim;
#pragma unroll
                for (int e = 0; e < kPerLane; ++e)
                    if (lane + 32 * e < p.head_dim) acc[e] += wj * src[32 * e];
            }
        }
    }
    T* o = static_cast<T*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
        if (lane + 32 * e < p.head_dim) o[lane + 32 * e] = from_acc<T>(acc[e]);
    if (lane == 0)
        static_cast<float*>(p.lse)[batch * p.lse_batch_stride + head * p.lse_head_stride + row] =
            empty ? neg_inf<float>() : m + logf(l);
}

}  // namespace cuflash
