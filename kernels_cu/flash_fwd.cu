// FlashAttention forward on tensor cores (fp16 / bf16 storage, fp32 accumulation).
//
// One thread block per (m_block, head, batch) computes O and LSE for kBlockM query rows. Warp w owns
// query rows [w * kMTiles * 16, (w + 1) * kMTiles * 16) of the block and everything about them: its
// scores S (kMTiles x kBlockN), the online-softmax state and O (kMTiles x kHeadDim) live in its
// registers in the mma.sync C layout, so no score ever leaves the register file.
//
// Shared memory (16-bit elements, row pitch kHeadDim + 8, see copy.cuh):
//   sQ [kBlockM][pitch], sK [kBlockN][pitch], sV [kBlockN][pitch]
//   config.smem_bytes: (block_m + 2 * block_n) * (head_dim + 8) * 2
// K and V stream through one buffer each: V[n] is fetched while S = Q K[n]^T is computed, K[n-1]
// while the softmax and P V[n] run. Key blocks are visited from the last to the first, so the blocks
// that need masking (sequence tail, causal diagonal) come first.
//
// Variants (kVariant, mask.cuh): the key blocks a query block visits come from Mask::n_block_range;
// scores pass through ScoreMod (softcap, ALiBi) and the mask, P through dropout before P V. Varlen
// batches take their rows and lengths from SeqInfo; a KV cache its key counts (kSeqused) and, paged,
// its key rows through KeyRows (kPaged).
#include "params.cuh"
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "dropout.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "softmax.cuh"

namespace cuflash {

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32) flash_fwd(const __grid_constant__ FwdParams p) {
    static_assert(sizeof(T) == 2, "tensor-core kernel: __half or __nv_bfloat16");
    static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "16-wide mma k-slices / ldmatrix pairs");
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns a multiple of 16 query rows");
    constexpr int kNThreads = kNWarps * 32;
    constexpr int kPitch = kHeadDim + 8;
    constexpr int kMTiles = kBlockM / (16 * kNWarps);  // 16-row m-tiles per warp
    constexpr int kNTilesS = kBlockN / 8;               // 8-key n-tiles of S
    constexpr int kNTilesO = kHeadDim / 8;              // 8-dim n-tiles of O
    constexpr int kKSlicesQK = kHeadDim / 16;           // k-slices of Q K^T (over head dim)
    constexpr int kKSlicesPV = kBlockN / 16;            // k-slices of P V (over keys)
    // Q's A fragments stay in registers when small; otherwise they are re-read from sQ per key block.
    constexpr bool kQInRegs = kMTiles * kHeadDim <= 128;
    constexpr unsigned kSmemBytes = (kBlockM + 2 * kBlockN) * kPitch * sizeof(T);
    using Mod = ScoreMod<float, kVariant, kTanhApprox>;
    static_assert(!Mod::kIsBounded || kIsBf16<T>, "kBounded: P up to e^50 needs bf16's range");

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < kSmemBytes) __trap();

    extern __shared__ __align__(16) char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + kBlockM * kPitch;
    T* sV = sK + kBlockN * kPitch;

    // [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
    const int m_block = query_block<kVariant>(), head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0, (kVariant & kSeqused) != 0> seq(p, batch);
    const int row_begin = m_block * kBlockM;
    if (row_begin >= seq.seqlen_q) return;  // varlen: a shorter sequence than the grid's
    const int head_k = head / (p.nheads / p.nheads_k);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = p.head_dim;
    const Mask<kVariant> mask(p, seq.seqlen_q, seq.seqlen_k);
    const Mod mod(p, batch, head, mask.shift);
    int n_block_min, n_block_end;
    mask.template n_block_range<kBlockM, kBlockN>(m_block, n_block_min, n_block_end);
    const int warp_row0 = warp * kMTiles * 16;  // first row of this warp inside the block

    const T* q = static_cast<const T*>(p.q) + seq.q_offset(batch, p.q_batch_stride, p.q_row_stride) +
                 head * p.q_head_stride + row_begin * p.q_row_stride;
    constexpr bool kIsPaged = (kVariant & kPaged) != 0;
    // K's and V's rows. Where the accumulators take 192 registers a thread or more (128 x 64 x 4 tiles at d = 128),
    // they are rebuilt at each load from the params, batch and head_k opaque so that they are not hoisted: two
    // 64-bit bases held across the loop made those tiles spill. Elsewhere the compiler keeps them (as measured).
    constexpr bool kTight = kMTiles * (kBlockN + kHeadDim) / 2 >= 192;  // acc_s and acc_o registers a thread
    const auto k_rows_held = key_rows<kIsPaged, T>(p, seq, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                                   batch, head_k);
    const auto v_rows_held = key_rows<kIsPaged, T>(p, seq, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                                   batch, head_k);
    auto k_rows = [&] {
        if constexpr (!kTight) return k_rows_held;
        else return key_rows<kIsPaged, T>(p, seq, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                          recompute(batch), recompute(head_k));
    };
    auto v_rows = [&] {
        if constexpr (!kTight) return v_rows_held;
        else return key_rows<kIsPaged, T>(p, seq, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                          recompute(batch), recompute(head_k));
    };
    // This warp's first row in the sequence, in the key-block loop (kTight: rebuilt, as held across the loop it took a
    // register there too)
    auto warp_row = [&] { return row_begin + (kTight ? recompute(warp) * (kMTiles * 16) : warp_row0); };

    // [2] Load the Q tile
    cp_async_tile<kBlockM, kHeadDim, kPitch, kNThreads>(sQ, q, p.q_row_stride, seqlen_q - row_begin, head_dim, tid);
    if (n_block_end > n_block_min) {
        const int key0 = (n_block_end - 1) * kBlockN;
        cp_async_keys<kBlockN, kHeadDim, kPitch, kNThreads>(sK, k_rows(), key0, seqlen_k - key0, head_dim, tid);
    }
    cp_async_commit();

    // Per-lane ldmatrix addresses (bytes, shared space); see mma.cuh for the lane -> row maps.
    // Q: A operand, rows = this warp's query rows, k = head dim.
    const unsigned q_addr = smem_u32(sQ + warp_row0 * kPitch + ldsm_a_offset(lane, kPitch));
    // K: B operand of Q K^T from the [key][dim] tile = [n][k], non-transposed.
    const unsigned k_addr = smem_u32(sK + ldsm_b_offset(lane, kPitch));
    // V: B operand of P V from the [key][dim] tile = [k][n], transposed.
    const unsigned v_addr = smem_u32(sV + ldsm_bt_offset(lane, kPitch));

    unsigned q_frag[kQInRegs ? kMTiles : 1][kQInRegs ? kKSlicesQK : 1][4];
    if constexpr (kQInRegs) {
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int ks = 0; ks < kKSlicesQK; ++ks)
                ldmatrix_x4(q_frag[mi][ks], q_addr + (mi * 16 * kPitch + ks * 16) * sizeof(T));
    }

    float acc_o[kMTiles][kNTilesO][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int no = 0; no < kNTilesO; ++no)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mi][no][e] = 0.f;
    OnlineSoftmax<kMTiles, Mod::kIsBounded> softmax;
    softmax.init();
    const float scale_log2 = mod.score_log2(p);

    for (int n_block = n_block_end - 1; n_block >= n_block_min; --n_block) {
        const int key0 = n_block * kBlockN;
        cp_async_wait<0>();  // K[n_block] (and Q) have landed for this thread ...
        __syncthreads();     // ... and for all; every warp is also done reading sV of the previous block
        cp_async_keys<kBlockN, kHeadDim, kPitch, kNThreads>(sV, v_rows(), key0, seqlen_k - key0, head_dim, tid);
        cp_async_commit();

        // [3] S = Q K^T
        float acc_s[kMTiles][kNTilesS][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNTilesS; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mi][ni][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kKSlicesQK; ++ks) {
            // a: Q rows 16*mi + {g, g+8}, dims 16*ks + {2t, 2t+1, 2t+8, 2t+9} (A layout)
            unsigned a[kMTiles][4];
#pragma unroll
            for (int mi = 0; mi < kMTiles; ++mi) {
                if constexpr (kQInRegs) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mi][e] = q_frag[mi][ks][e];
                } else {
                    ldmatrix_x4(a[mi], q_addr + (mi * 16 * kPitch + ks * 16) * sizeof(T));
                }
            }
#pragma unroll
            for (int np = 0; np < kNTilesS / 2; ++np) {
                // b[0], b[1]: B of keys 16*np + g, dims 16*ks + {2t,2t+1} / {2t+8,2t+9};
                // b[2], b[3]: the same for keys 16*np + 8 + g.
                unsigned b[4];
                ldmatrix_x4(b, k_addr + (np * 16 * kPitch + ks * 16) * sizeof(T));
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) {
                    mma_16816<T>(acc_s[mi][2 * np], a[mi], b[0], b[1]);
                    mma_16816<T>(acc_s[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }

        // [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
        // acc_s[mi][ni][2h + e]: query row warp_row() + 16*mi + g + 8h, key key0 + 8*ni + 2t + e
        if constexpr (Mod::kTransform) {
            for_each_score<kMTiles, kNTilesS>(warp_row(), key0, lane, [&](float& x, int row, int col) {
                float dcap;
                x = mod.apply(x, row, col, dcap);
            }, acc_s);
        }
        if (mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block)) {
            for_each_score<kMTiles, kNTilesS>(warp_row(), key0, recompute(lane), [&](float& x, int row, int col) {
                if (!mask.visible(row, col)) x = neg_inf<float>();
            }, acc_s);
        }

        cp_async_wait<0>();  // V[n_block] has landed ...
        __syncthreads();     // ... for all, and every warp is done reading sK
        if (n_block > n_block_min) {
            const int key_prev = key0 - kBlockN;
            cp_async_keys<kBlockN, kHeadDim, kPitch, kNThreads>(sK, k_rows(), key_prev, seqlen_k - key_prev, head_dim,
                                                               tid);
            cp_async_commit();
        }

        // [5] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
        softmax.update(acc_s, acc_o, scale_log2);

        // [6] O += dropout(P) V
        // Dropped entries are 0 in P V only: row_sum, and so the LSE, keep them. O is scaled by
        // 1 / (1 - dropout_p) at the store.
        if constexpr ((kVariant & kDropout) != 0) {
            Dropout(p, batch, head).for_each_keep(acc_s, warp_row(), key0, lane, [](float& x, bool kept) {
                if (!kept) x = 0.f;
            });
        }
#pragma unroll
        for (int ks = 0; ks < kKSlicesPV; ++ks) {
            // P as A fragment in registers: keys 16*ks .. +15 are n-tiles 2ks, 2ks+1 of acc_s.
            unsigned a[kMTiles][4];
#pragma unroll
            for (int mi = 0; mi < kMTiles; ++mi) acc_to_a<T>(a[mi], acc_s[mi][2 * ks], acc_s[mi][2 * ks + 1]);
#pragma unroll
            for (int np = 0; np < kHeadDim / 16; ++np) {
                // b[0], b[1]: B of dims 16*np + g, keys 16*ks + {2t,2t+1} / {2t+8,2t+9} (V^T via .trans);
                // b[2], b[3]: the same for dims 16*np + 8 + g.
                unsigned b[4];
                ldmatrix_x4_trans(b, v_addr + (ks * 16 * kPitch + np * 16) * sizeof(T));
#pragma unroll
                for (int mi = 0; mi < kMTiles; ++mi) {
                    mma_16816<T>(acc_o[mi][2 * np], a[mi], b[0], b[1]);
                    mma_16816<T>(acc_o[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }

    // [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
    float lse[2 * kMTiles];
    softmax.finalize(acc_o, mod.lse_scale(), lse);

    // [8] Store O and LSE
    cp_async_wait<0>();  // nothing may still be landing in sQ (the loop may not have run)
    __syncthreads();     // every warp is done with sQ / sK / sV
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
        acc_to_smem<T, kNTilesO, kPitch>(sQ, acc_o[mi], warp_row0 + 16 * mi, 0, lane,
                                         (kVariant & kDropout) ? static_cast<float>(p.dropout_scale) : 1.f);
    __syncthreads();
    T* o = static_cast<T*>(p.o) + seq.q_offset(batch, p.o_batch_stride, p.o_row_stride) + head * p.o_head_stride +
           row_begin * p.o_row_stride;
    store_tile<kBlockM, kHeadDim, kPitch, kNThreads>(o, p.o_row_stride, sQ, seqlen_q - row_begin, head_dim, tid);

    // lse[2mi + h] is row warp_row0 + 16*mi + g + 8h; the 4 lanes of a quad hold the same value.
    if (t == 0) {
        float* lse_ptr = static_cast<float*>(p.lse) + seq.row_offset(batch, head, p.lse_batch_stride, p.lse_head_stride);
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_begin + warp_row0 + 16 * mi + g + 8 * h;
                if (row < seqlen_q) lse_ptr[row] = lse[2 * mi + h];
            }
    }
}

}  // namespace cuflash
