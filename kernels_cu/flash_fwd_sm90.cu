// FlashAttention forward for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization.
//
// One thread block per (m_block, head, batch) computes O and LSE for kBlockM query rows, with kNWarps / 4
// warpgroups of two roles:
//   producer (warpgroup 0): one thread issues every copy. The Q tile once, then for each key block K and V
//     by TMA into a ring of kStages stages, each tile waiting on its `k_empty` / `v_empty` barrier until the
//     consumers are done with its previous use. It gives its registers to the consumers (setmaxnreg).
//   consumers (warpgroups 1 ..): each owns 64 query rows. Per key block: S = Q K^T by wgmma from shared
//     memory (fp32 in registers), score modifiers and mask, online softmax, then O += P V by wgmma with P
//     from registers. S of block i is in flight with P V of block i - 1, and the warpgroups take turns
//     issuing them, so that one's softmax runs under the others' products (FlashAttention-3's two overlaps).
//     With one consumer (kBlockM = 64) two blocks share an SM instead (kSm90BlocksPerSm), without turns.
// A consumer's accumulators are laid out as 16 rows per warp in the mma.sync C layout (wgmma.cuh), so the
// score modifiers, masks, dropout and online softmax are those of the mma.sync kernel (flash_fwd.cu).
//
// Shared memory (sm90.cuh: 128-byte swizzle, [head_dim / 64 slabs][rows][64], 1024-byte aligned):
//   sQ [kBlockM rows], then kStages x (sK, sV) [kBlockN rows each], then the mbarriers:
//   q_full, k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages]. config.smem_bytes mirrors
//   Sm90FwdSmem.
// Key blocks are visited from the last to the first (the masked ones first), as in flash_fwd.cu.
//
// Serves dense and varlen batches and KV caches (kSeqused), dense or paged (kPaged: K and V come a box per
// kv_box_rows(p) rows, each at its page's row, `load_kv`). Varlen arrays are one packed entry to TMA, so a tile
// past a sequence's end holds the next sequence's rows; a cache's, rows past the entry's key count, whatever
// it held before. Either way they are masked in S and zeroed in the V tile (`zero_v_tail`), since 0 * inf in
// P V would be NaN.
#include "params.cuh"
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "dropout.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"

namespace cuflash {

// Blocks per SM: one with two or more consumers (they take turns), two with one (kBlockM = 64), so that one
// block's prologue and epilogue run under the other's main loop. config.sm90_blocks_per_sm mirrors it.
template <int kConsumers>
constexpr int kSm90BlocksPerSm = kConsumers == 1 ? 2 : 1;

// A block has its share of an SM (registers, and 228 KiB of shared memory less 1 KiB the system keeps per block),
// so the ring takes as many stages as fit there, up to 4. config.smem_bytes computes the same.
template <int kHeadDim, int kBlockM, int kBlockN>
struct Sm90FwdSmem {  // byte offsets from the 1024-aligned base
    static constexpr unsigned kQ = kBlockM * kHeadDim * 2;   // sQ at 0
    static constexpr unsigned kKV = kBlockN * kHeadDim * 2;  // one K or V tile
    static constexpr unsigned kLimit = 233472 / kSm90BlocksPerSm<kBlockM / 64> - 1024, kSlack = 1024, kMaxStages = 4;
    static constexpr unsigned kFit = (kLimit - kSlack - kQ - 8 * (1 + 4 * kMaxStages)) / (2 * kKV);
    static constexpr int kStages = kFit < kMaxStages ? kFit : kMaxStages;
    static_assert(kStages >= 2, "two stages at least: one loads while the other is read");
    static constexpr unsigned kK = kQ, kV = kK + kStages * kKV, kBarriers = kV + kStages * kKV;
    static constexpr unsigned kBytes = kSlack + kBarriers + 8 * (1 + 4 * kStages);
};

// Paged KV caches: the rows of one K or V box, the largest power of two that divides both the page size (a
// multiple of 16) and kBlockN (config.kv_box_rows, which encodes the maps' boxes, mirrors it)
template <int kBlockN>
__device__ __forceinline__ int kv_box_rows(const FwdParams& p) {
    return min(p.page_size & -p.page_size, kBlockN);
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32, kSm90BlocksPerSm<kNWarps / 4 - 1>)
    flash_fwd_sm90(const __grid_constant__ FwdSm90Params params) {
    static_assert(sizeof(T) == 2, "tensor-core kernel: __half or __nv_bfloat16");
    static_assert(kHeadDim % 64 == 0, "whole 128-byte swizzle slabs of 64 columns");
    constexpr int kConsumers = kNWarps / 4 - 1;
    static_assert(kBlockM == 64 * kConsumers, "one consumer warpgroup per 64 query rows");
    constexpr bool kIsVarlen = (kVariant & kVarlen) != 0, kIsSeqused = (kVariant & kSeqused) != 0;
    constexpr bool kIsPaged = (kVariant & kPaged) != 0;
    static_assert(kBlockN % 16 == 0 && (!kIsPaged || (kBlockN & (kBlockN - 1)) == 0),
                  "paged: key blocks a power of two, so that whole boxes of kv_box_rows rows tile them");
    using Smem = Sm90FwdSmem<kHeadDim, kBlockM, kBlockN>;
    constexpr int kStages = Smem::kStages;
    constexpr int kNTilesS = kBlockN / 8;   // 8-key column groups of S
    constexpr int kNTilesO = kHeadDim / 8;  // 8-dim column groups of O
    constexpr unsigned kSlabQ = kBlockM * 128, kSlabKV = kBlockN * 128;  // bytes of one 64-column slab
    using Mod = ScoreMod<float, kVariant, kTanhApprox>;
    static_assert(!Mod::kIsBounded, "kBounded: measured no faster here (config.choose_forward drops it)");
    const FwdParams& p = params.fwd;
    // Registers per thread after setmaxnreg: the producer keeps few, the consumers share the rest (64K per SM)
    constexpr int kBlocksPerSm = kSm90BlocksPerSm<kConsumers>;
    constexpr int kProducerRegs = kConsumers == 3 ? 32 : 24;
    constexpr int kConsumerRegs = kConsumers == 1 ? 232 : kConsumers == 2 ? 240 : 160;
    static_assert(kProducerRegs + kConsumers * kConsumerRegs
                      <= (1 + kConsumers) * launch_regs(kBlocksPerSm * kNWarps * 32),
                  "setmaxnreg moves registers between warpgroups: no more than the launch gave them");
    // named barriers: 1 .. kConsumers for the store, then the turns, then the consumers' zeroed V tail
    constexpr int kTurn = 1 + kConsumers, kVTail = kTurn + kConsumers;

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < Smem::kBytes) __trap();
    extern __shared__ __align__(16) char smem[];
    const unsigned base = (smem_u32(smem) + 1023u) & ~1023u;
    const unsigned sQ = base, sK = base + Smem::kK, sV = base + Smem::kV, bars = base + Smem::kBarriers;
    const unsigned q_full = bars;
    auto k_full = [&](int s) { return bars + 8u * (1 + s); };
    auto v_full = [&](int s) { return bars + 8u * (1 + kStages + s); };
    auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
    auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };

    // [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
    const int m_block = query_block<kVariant, true>(), head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo<kIsVarlen, kIsSeqused> seq(p, batch);  // paged: seqlen_k the capacity, clamped by seqused
    const int row_begin = m_block * kBlockM;
    if (row_begin >= seq.seqlen_q) return;  // varlen: a shorter sequence than the grid's
    // TMA coordinates (row, entry) of the entry's row 0: a varlen batch is one packed entry
    const int q_row0 = seq.q_start, k_row0 = seq.k_start, tma_batch = kIsVarlen ? 0 : batch;
    const int head_k = head / (p.nheads / p.nheads_k);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const Mask<kVariant> mask(p, seqlen_q, seqlen_k);
    int n_block_min, n_block_end;
    mask.template n_block_range<kBlockM, kBlockN>(m_block, n_block_min, n_block_end);
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbarrier_init(q_full, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(k_full(s), 1);
            mbarrier_init(v_full(s), 1);
            mbarrier_init(k_empty(s), 4 * kConsumers);  // lane 0 of every consumer warp
            mbarrier_init(v_empty(s), 4 * kConsumers);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        // [2] Producer: the Q tile, then K and V of each key block into a free stage of the ring (TMA)
        setmaxnreg_dec<kProducerRegs>();
        // K or V of key block n_block into the tile at dst: a box per slab, or (kIsPaged) per slab and
        // kv_box_rows rows of a page, at that page's row (a page past the table: -1, zeros, as past the pool)
        auto load_kv = [&](unsigned dst, const TensorMap* map, unsigned bar, int n_block) {
            if constexpr (kIsPaged) {
                const int* pages = p.block_table + batch * p.block_table_batch_stride;
                for (int r = 0; r < kBlockN; r += kv_box_rows<kBlockN>(p)) {
                    const int key = n_block * kBlockN + r;
                    const int page = key < p.seqlen_k ? pages[key / p.page_size] : -1;
#pragma unroll
                    for (int slab = 0; slab < kHeadDim / 64; ++slab)
                        tma_load_4d(dst + slab * kSlabKV + r * 128, map, bar, 64 * slab, key % p.page_size, head_k,
                                    page);
                }
            } else {
#pragma unroll
                for (int slab = 0; slab < kHeadDim / 64; ++slab)
                    tma_load_4d(dst + slab * kSlabKV, map, bar, 64 * slab, k_row0 + n_block * kBlockN, head_k,
                                tma_batch);
            }
        };
        if (threadIdx.x == 0) {
            mbarrier_arrive_expect_tx(q_full, Smem::kQ);
#pragma unroll
            for (int slab = 0; slab < kHeadDim / 64; ++slab)
                tma_load_4d(sQ + slab * kSlabQ, &params.tma_q, q_full, 64 * slab, q_row0 + row_begin, head,
                            tma_batch);
            for (int i = 0, n_block = n_block_end - 1; n_block >= n_block_min; ++i, --n_block) {
                const int s = i % kStages, use = i / kStages;
                // each tile waits until the consumers are done with the stage's last use of it
                if (use > 0) mbarrier_wait(k_empty(s), (use - 1) & 1);
                mbarrier_arrive_expect_tx(k_full(s), Smem::kKV);
                load_kv(sK + s * Smem::kKV, &params.tma_k, k_full(s), n_block);
                if (use > 0) mbarrier_wait(v_empty(s), (use - 1) & 1);
                mbarrier_arrive_expect_tx(v_full(s), Smem::kKV);
                load_kv(sV + s * Smem::kKV, &params.tma_v, v_full(s), n_block);
            }
        }
        return;
    }

    // Consumers
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int tid = threadIdx.x - 128 * warpgroup, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    const int wg_row0 = 64 * consumer, warp_row0 = wg_row0 + 16 * warp;  // first rows inside the block
    const Mod mod(p, batch, head, mask.shift);
    const float scale_log2 = mod.score_log2(p);
    const unsigned q_tile = sQ + wg_row0 * 128;  // this warpgroup's 64 rows of Q: the A operand of S = Q K^T

    float acc_o[1][kNTilesO][4];
#pragma unroll
    for (int no = 0; no < kNTilesO; ++no)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][no][e] = 0.f;
    OnlineSoftmax<1> softmax;
    softmax.init();
    float acc_s[1][kNTilesS][4];
    unsigned p_frag[kBlockN / 16][4];  // P of the last key block, as the A operand of P V
    float correction[2];

    // Issue points: S of key block 0; then S of block i with P V of block i - 1; then P V of the last block.
    // The consumer warpgroups take turns (named barriers kTurn + consumer): one issues its wgmma while the
    // others run their softmax. The last one opens the first turn, and skips its last hand-over, so that
    // every barrier completes as often as it is waited on.
    const int n_blocks = n_block_end - n_block_min;
    const int next_turn = kTurn + (consumer + 1) % kConsumers;
    // One consumer has no turns to take.
    auto take_turn = [&]() {
        if constexpr (kConsumers > 1) named_barrier_sync(kTurn + consumer, 256);
    };
    auto pass_turn = [&](bool last) {
        if constexpr (kConsumers > 1)
            if (!(last && consumer == kConsumers - 1)) named_barrier_arrive(next_turn, 256);
    };
    if (kConsumers > 1 && consumer == kConsumers - 1 && n_blocks > 0) named_barrier_arrive(kTurn, 256);

    // [3] S = Q K^T (wgmma from shared memory)
    auto issue_s = [&](int i) {
        const unsigned k_tile = sK + (i % kStages) * Smem::kKV;
        mbarrier_wait(k_full(i % kStages), (i / kStages) & 1);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            const unsigned slab = ks / 4, col_bytes = (ks % 4) * 32;
            Wgmma<T, kBlockN>::ss(acc_s[0], smem_desc(q_tile + slab * kSlabQ + col_bytes, 16, 1024),
                                  smem_desc(k_tile + slab * kSlabKV + col_bytes, 16, 1024), ks > 0);
        }
        wgmma_commit();
    };
    // S of key block i (in acc_s, complete) -> P of block i in p_frag; the rescale of acc_o in `correction`
    auto softmax_of = [&](int i) {
        const int n_block = n_block_end - 1 - i, key0 = n_block * kBlockN;
        fence_operands(acc_s[0]);
        // [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
        if constexpr (Mod::kTransform) {
            for_each_score<1, kNTilesS>(row_begin + warp_row0, key0, lane, [&](float& x, int row, int col) {
                float dcap;
                x = mod.apply(x, row, col, dcap);
            }, acc_s);
        }
        if (mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block)) {
            for_each_score<1, kNTilesS>(row_begin + warp_row0, key0, lane, [&](float& x, int row, int col) {
                if (!mask.visible(row, col)) x = neg_inf<float>();
            }, acc_s);
        }
        // [5] Online softmax: update row_max and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2); acc_o's rescale waits for P V
        softmax.update(acc_s, scale_log2, correction);
        if constexpr ((kVariant & kDropout) != 0) {  // dropped entries are 0 in P V only: row_sum keeps them
            Dropout(p, batch, head).for_each_keep(acc_s, row_begin + warp_row0, key0, lane, [](float& x, bool kept) {
                if (!kept) x = 0.f;
            });
        }
    };
    // [6] O += dropout(P) V (wgmma, P from registers)
    auto issue_pv = [&](int i) {
        const unsigned v_tile = sV + (i % kStages) * Smem::kKV;
        mbarrier_wait(v_full(i % kStages), (i / kStages) & 1);
        fence_operands(acc_o[0]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks)
            Wgmma<T, kHeadDim>::rs(acc_o[0], p_frag[ks], smem_desc(v_tile + ks * 16 * 128, kSlabKV, 1024));
        wgmma_commit();
    };
    // This warp is done with key block i's K (its S has completed) or V (its P V has): the stage's tile can
    // take the next key block's while the other tile is still in use.
    auto release = [&](unsigned empty) {
        if (lane == 0) mbarrier_arrive(empty);
    };
    // Varlen, KV cache: the first key block visited (i = 0, the last of the range) may end past the entry's
    // keys, its V rows there the next sequence's or stale. The consumers zero them in stage 0, fence them to
    // the async proxy that wgmma reads through, and wait for each other.
    auto zero_v_tail = [&]() {
        const int first = seqlen_k - (n_block_end - 1) * kBlockN;  // first row past the entry's keys
        if (!(kIsVarlen || kIsSeqused) || first >= kBlockN) return;
        mbarrier_wait(v_full(0), 0);
        zero_tile_rows(sV, kSlabKV, kHeadDim / 64, first, kBlockN, consumer * 128 + tid, 128 * kConsumers);
        fence_proxy_async();
        named_barrier_sync(kVTail, 128 * kConsumers);
    };
    auto to_p_frag = [&]() {
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) acc_to_a<T>(p_frag[ks], acc_s[0][2 * ks], acc_s[0][2 * ks + 1]);
    };

    mbarrier_wait(q_full, 0);
    if (n_blocks > 0) {
        // S of the first key block: nothing to overlap it with yet
        take_turn();
        issue_s(0);
        pass_turn(false);
        wgmma_wait<0>();
        release(k_empty(0));
        softmax_of(0);  // acc_o is still 0: no rescale
        to_p_frag();
        zero_v_tail();
    }
    for (int i = 1; i < n_blocks; ++i) {
        // S of key block i and P V of block i - 1 in flight together; the softmax of S runs while P V completes
        take_turn();
        issue_s(i);
        issue_pv(i - 1);
        pass_turn(false);
        wgmma_wait<1>();  // S, the older group, has completed
        release(k_empty(i % kStages));
        softmax_of(i);
        wgmma_wait<0>();  // P V too: acc_o can take the rescale, and V's tile can go back to the producer
        fence_operands(acc_o[0]);
        release(v_empty((i - 1) % kStages));
        softmax.rescale(acc_o, correction);
        to_p_frag();
    }
    if (n_blocks > 0) {
        take_turn();
        issue_pv(n_blocks - 1);
        pass_turn(true);
        wgmma_wait<0>();
        fence_operands(acc_o[0]);
        release(v_empty((n_blocks - 1) % kStages));
    }

    // [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
    float lse[2];
    softmax.finalize(acc_o, mod.lse_scale(), lse);

    // [8] Store O and LSE: O through this warpgroup's own rows of sQ (its last S = Q K^T has completed)
    const float o_scale = (kVariant & kDropout) ? static_cast<float>(p.dropout_scale) : 1.f;
#pragma unroll
    for (int no = 0; no < kNTilesO; ++no) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row0 + g + 8 * h;
            const unsigned addr = sQ + (no / 8) * kSlabQ + r * 128 + (((no % 8) ^ (r % 8)) * 16) + t * 4;
            const unsigned v = pack2<T>(acc_o[0][no][2 * h] * o_scale, acc_o[0][no][2 * h + 1] * o_scale);
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
        }
    }
    named_barrier_sync(1 + consumer, 128);
    T* o = static_cast<T*>(p.o) + seq.q_offset(batch, p.o_batch_stride, p.o_row_stride) + head * p.o_head_stride;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
#pragma unroll 4
    for (int c = tid; c < 64 * kChunks; c += 128) {
        const int r = wg_row0 + c / kChunks, chunk = c % kChunks;
        const int row = row_begin + r;
        if (row < seqlen_q && chunk * 8 < p.head_dim) {
            const unsigned addr = sQ + (chunk / 8) * kSlabQ + r * 128 + (((chunk % 8) ^ (r % 8)) * 16);
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(addr));
            *reinterpret_cast<uint4*>(o + row * p.o_row_stride + chunk * 8) = v;
        }
    }
    // lse[h] is row warp_row0 + g + 8h; the 4 lanes of a quad hold the same value.
    if (t == 0) {
        float* lse_ptr = static_cast<float*>(p.lse) + seq.row_offset(batch, head, p.lse_batch_stride, p.lse_head_stride);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_begin + warp_row0 + g + 8 * h;
            if (row < seqlen_q) lse_ptr[row] = lse[h];
        }
    }
}

}  // namespace cuflash
