// FlashAttention backward for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization. The main
// launch of the backward on sm_90, between flash_bwd.cu's preprocess (D = rowsum(dO * O), the zeroed fp32
// dQ accumulator) and postprocess (dQ = dQ_accum * softmax_scale); the same algorithm as flash_bwd:
// one pass over key blocks, five tile GEMMs per (query block, key block).
//
// One thread block per (kv head, batch, n_block) owns kBlockN keys and loops over the (query head of the
// group, query block) pairs that see them, with kNWarps / 4 warpgroups of two roles:
//   producer (warpgroup 0): K and V once, then per pair the Q and dO tiles by TMA into a ring of kStages
//     stages (thread 0), and the pair's LSE (as exp2's offset) and D rows into the stage (warp 1).
//   consumers (warpgroups 1 ..): each owns 64 of the keys. Per pair, with keys as the wgmma's M dimension:
//     S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory, P^T = exp2(S^T * scale_log2 - LSE * log2(e)),
//     dV += P^T dO (P^T from registers), dS^T = P^T (dP^T - D), dK += dS^T Q (dS^T from registers; kDkFromSmem,
//     d = 128 with plain scores and no mask of key blocks: from sdS, the next pair's S^T, dP^T issued under it),
//     the steps to dS^T over two halves of 64 queries in turn where a consumer has 128 (kHalves: S^T and dP^T of
//     all would leave too few registers beside dK and dV); dS^T goes to shared memory as dS (queries x keys), and
//     each consumer computes its share of dQ = dS K, its own 64 x 64 tile over all the block's keys, and writes
//     it into the block's fp32 dQ tile in shared memory (sDqAcc).
//   the dQ warp (producer warp 2): per pair, once the consumers have written sDqAcc, adds its rows into the fp32
//     dQ accumulator in global memory by bulk reduces (the copy engine: no atomics from the consumers), and
//     hands the buffer back as soon as the engine has read it.
//   kDeterministic: the adds into each dQ tile come in a fixed order of key blocks (first to last, the launch
//     order; query blocks visited last to first), each tile's turn kept by a semaphore (backward.cuh). sDqAcc is
//     double-buffered, and producer warp 2 + b adds buffer b (the pairs it with it % 2 == b): it waits for the
//     tile's turn, adds, and hands the tile on once its adds have completed, while the other warp does the same
//     for the next pair, so that neither wait holds the consumers.
//   kQuerySplit (a grid too small for the GPU; not with kDeterministic): the two blocks of a cluster share the key
//     block, rank 0 taking the first half of its query blocks and rank 1 the rest (under a causal mask the first
//     key blocks' pairs, the grid's longest path, take half as long); at the end rank 0 puts its dK and dV into
//     its shared memory and rank 1 adds them to its own through the cluster's shared memory and stores.
// kSplitDims (d = 256): dK and dV over 64 keys would take 256 registers a thread. Blocks own 64 keys, and the
//   two consumers share them: each computes S^T and dP^T for half the queries (wgmma N = 32), and dV, dK and dQ for
//   half the head dim. P^T and dS^T reach the other consumer through shared memory (sP^T, sdS^T: keys x queries),
//   and dV, dK take them from there (wgmma A from shared memory), dQ = dS K too (A transposed: dS^T's tile read as
//   dS). No sDqAcc (no shared memory left for 64 x 256 floats): once both consumers' GEMMs of the pair have
//   completed, the pair's own Q and dO stage is free, and the dQ tile goes there, laid out as sDqAcc (rows 0-31 over
//   sQ, 32-63 over sdO); the dQ warp adds it by two bulk reduces and gives the stage back to the producer once the
//   engine has read it, sQ before sdO (the consumers' atomics, 64 KiB a pair, had kept the L2 busiest of all units).
// Accumulators are in the mma.sync C layout per warp (wgmma.cuh), so masks, score modifiers and dropout are
// flash_bwd's (for_each_score_t, for_each_keep_t).
//
// Shared memory (sm90.cuh: 128-byte swizzle, [head_dim / 64 slabs][rows][64], 1024-byte aligned), Sm90BwdSmem:
//   sK, sV [kBlockN rows]; kStages x sQ, kStages x sdO [kBlockM rows]; two sdS [kBlockN / 64 slabs][kBlockM]
//   [64 keys] (one written while the other may still be read); kStages x LSE offsets and D [kBlockM floats];
//   kDqBuffers x sDqAcc [kBlockM rows][dq_accum_row_stride <= kHeadDim floats]; kSplitDims: two sP^T (as sdS)
//   after the sdS, no sDqAcc. Then the small block: exp2's scale (a float), mbarriers kv_full, q_full[kStages],
//   do_full[kStages], q_empty[kStages], do_empty[kStages]; where it would not fit after the tiles, in the alignment
//   slack before them (kSmallInSlack). config.smem_bytes mirrors it. kQuerySplit: rank 0's dK, dV partials, at the
//   end, over sK, sV, sQ and sdO.
//
// Serves dense and varlen batches. Varlen arrays are one packed entry to TMA (as in flash_fwd_sm90.cu), so the
// tiles that run past a sequence's end hold the next sequence's rows: the consumers zero them (K, V once; Q,
// dO of a sequence's last query block), so that the P = 0 and dS = 0 there are not NaN where an inf lies.
#include "params.cuh"
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "dropout.cuh"
#include "mma.cuh"
#include "sm90.cuh"
#include "wgmma.cuh"
#include "backward.cuh"

namespace cuflash {

template <int kHeadDim, int kBlockM, int kBlockN, int kStages, int kDqBuffers>
struct Sm90BwdSmem {  // byte offsets from the 1024-aligned base
    static constexpr bool kSplitDims = kHeadDim > 128;
    static constexpr unsigned kKV = kBlockN * kHeadDim * 2;  // sK or sV
    static constexpr unsigned kQ = kBlockM * kHeadDim * 2;   // one stage of sQ or sdO
    static constexpr unsigned kDS = kBlockM * kBlockN * 2;   // one sdS
    static constexpr unsigned kK = 0, kV = kKV, kQs = 2 * kKV, kdOs = kQs + kStages * kQ, kdSs = kdOs + kStages * kQ;
    static constexpr unsigned kPs = kdSs + 2 * kDS;  // kSplitDims: two sP^T
    static constexpr unsigned kLse = kPs + (kSplitDims ? 2 * kDS : 0), kD = kLse + kStages * kBlockM * 4;
    // sDqAcc holds the tile as the accumulator does (rows of dq_accum_row_stride floats, swizzled: no bank
    // conflicts): one bulk reduce adds it (per-row reduces, or padded rows, cost more in the copy engine)
    static constexpr unsigned kDqAcc = kD + kStages * kBlockM * 4;
    static constexpr unsigned kDqAccBytes = kSplitDims ? 0 : kBlockM * kHeadDim * 4;  // one of kDqBuffers
    static constexpr unsigned kTiles = kDqAcc + kDqBuffers * kDqAccBytes;
    // The small block: exp2's scale (8 bytes), then the mbarriers. After the tiles, but where the alignment slack,
    // the tiles and it would pass sm_90's 227 KiB (deterministic d = 64 at 128 x 128, by 80 bytes): then in the
    // slack before the base if it has room, else after the tiles. Dynamic shared memory is 16-byte aligned, so the
    // slack is at most 1008 bytes, and with less than kSmall of it the small block after the tiles ends sooner.
    static constexpr unsigned kSmall = 8 + 8 * (1 + 4 * kStages);
    static constexpr bool kSmallInSlack = 1024 + kTiles + kSmall > kSmemSm90;
    static_assert(2 * kSmall <= 1024, "the small block after the tiles where the slack is smaller than it");
    static constexpr unsigned kBytes = kSmallInSlack ? 1008 + kTiles : 1024 + kTiles + kSmall;
};

// A warp's rows of a dQ tile into shared memory at `tile` as the fp32 accumulator holds them (rows of `width` =
// dq_accum_row_stride floats; sDqAcc's layout): acc[nd][2h + e] (the wgmma C layout; g = lane / 4, t = lane % 4) is
// row row0 + g + 8h (row0 a multiple of 4), column col0 + 8 nd + 2t + e. Only the columns the accumulator has (a
// whole 8-column group or none: its width is a multiple of 32), swizzled as there (a warp's 8 rows x 32 bytes in 2
// wavefronts): dq_accum_col(row, ., kDqSwizzleSm90), the rows' swizzle g's, as an XOR on the address (rows are
// 128-byte aligned, and chunk nd's place differs from chunk nd % 4's by (nd / 4) 128 bytes).
template <int kTiles>
__device__ __forceinline__ void store_dq_rows(unsigned tile, int row0, int col0, int width, int g, int t,
                                              const float (&acc)[kTiles][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        const unsigned at = tile + (row * width + col0 + 8 * (g & kDqSwizzleSm90) + 2 * t) * 4;
#pragma unroll
        for (int nd = 0; nd < kTiles; ++nd)
            if (col0 + 8 * nd < width)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};"
                             ::"r"((at ^ (nd % 4) * 32) + (nd / 4) * 128), "f"(acc[nd][2 * h]), "f"(acc[nd][2 * h + 1])
                             : "memory");
    }
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __cluster_dims__((kVariant & kQuerySplit) ? 2 : 1, 1, 1) __launch_bounds__(kNWarps * 32, 1)
    flash_bwd_sm90(const __grid_constant__ BwdSm90Params params) {
    static_assert(sizeof(T) == 2, "tensor-core kernel: __half or __nv_bfloat16");
    static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0, "whole 128-byte swizzle slabs of 64 columns");
    constexpr int kConsumers = kNWarps / 4 - 1;
    constexpr int kStages = 2;
    constexpr bool kIsDeterministic = (kVariant & kDeterministic) != 0;
    // sDqAcc's buffers (of no bytes with kSplitDims): two under kDeterministic, one for each dQ warp
    constexpr int kDqBuffers = kIsDeterministic ? 2 : 1;
    using Smem = Sm90BwdSmem<kHeadDim, kBlockM, kBlockN, kStages, kDqBuffers>;
    constexpr bool kSplitDims = Smem::kSplitDims;
    static_assert(kSplitDims ? kBlockN == 64 && kConsumers == 2 : kBlockN == 64 * kConsumers,
                  "one consumer warpgroup per 64 keys, or two sharing them (kSplitDims)");
    static_assert(!kSplitDims || (kHeadDim == 256 && kBlockM == 64),
                  "kSplitDims: 32 queries a consumer (of one 128-byte row a key), 128 dims (two whole slabs)");
    // dQ = dS K: one 64 x 64 tile per consumer over all kBlockN keys (kSplitDims: 64 x 128, its half of the dims)
    constexpr int kDqTiles = (kBlockM / 64) * (kHeadDim / 64);
    static_assert(kSplitDims || kDqTiles == kConsumers, "dQ: one 64 x 64 tile per consumer");
    static_assert((kVariant & (kSeqused | kPaged)) == 0, "dense or varlen batches");
    constexpr bool kIsVarlen = (kVariant & kVarlen) != 0;
    constexpr bool kIsQuerySplit = (kVariant & kQuerySplit) != 0;
    static_assert(!(kIsQuerySplit && kIsDeterministic), "the turns count key blocks, not halves of them");
    static_assert(!(kIsQuerySplit && kSplitDims), "rank 0's partials are whole rows of dK, dV");
    constexpr int kQueries = kSplitDims ? kBlockM / 2 : kBlockM;  // a consumer's queries of S^T
    constexpr int kDims = kSplitDims ? kHeadDim / 2 : kHeadDim;   // a consumer's dims of dK, dV (and dQ)
    // d = 64 at 128 x 128: steps [4]-[8] run over two halves of 64 queries in turn, so that S^T and dP^T of one
    // half (64 fp32 registers) live beside dK and dV; dS^T of all the queries is kept (wgmma A fragments)
    constexpr int kQH = kQueries > 64 ? 64 : kQueries, kHalves = kQueries / kQH;
    constexpr int kNTilesH = kQH / 8;  // 8-query column groups of a half's S^T
    static_assert(kQueries % kQH == 0, "whole halves");
    constexpr int kNTilesD = kDims / 8;     // 8-dim column groups of dK, dV
    constexpr unsigned kSlabKV = kBlockN * 128, kSlabQ = kBlockM * 128;  // bytes of one 64-column slab
    constexpr bool kIsDropout = (kVariant & kDropout) != 0;
    constexpr bool kIsSoftcap = (kVariant & kSoftcap) != 0;
    using Mod = ScoreMod<float, kVariant, kTanhExp2>;
    // d = 128: dK's A operand (dS^T) read from sdS rather than registers, so that no register holds it once dS is
    // stored, and the next pair's S^T and dP^T are issued while dK still runs (1.02-1.03x without a mask, H100,
    // bench/RESULTS.md 2026-12-07 (x)). Plain scores only (with a softcap, ALiBi or dropout ptxas spilled or
    // serialized the wgmmas), no mask of key blocks (causal 0.95-0.98x), not kDeterministic (0.97x at N = 16k)
    constexpr bool kDkFromSmem = !kSplitDims && kHalves == 1 && !Mod::kTransform && !kIsDropout &&
                                 !(kVariant & kLocal) && !kIsDeterministic;
    // The softcap's derivative 1 - t^2 kept from [5] to [7] as fp16 pairs (16 registers for 64 queries; fp32
    // spilled at d = 128): 5.5-7.5 instructions a score fewer than recovering it from P, a log2 among them. Not
    // with dropout, whose draws take those registers (spills)
    constexpr bool kKeepDcap = kIsSoftcap && !kIsDropout;
    const BwdParams& p = params.bwd;
    constexpr int kProducerRegs = 24, kConsumerRegs = 240;
    static_assert(kProducerRegs + kConsumers * kConsumerRegs <= (1 + kConsumers) * launch_regs(kNWarps * 32),
                  "setmaxnreg moves registers between warpgroups: no more than the launch gave them");
    // Named barriers: kDsReady both consumers (also once varlen's tails are zeroed); kStore one per consumer;
    // sDqAcc buffer b's (the consumers and dQ warp 2 + b): kDqFree + 4 b, the warp has read the buffer's last
    // pair, kDqFull + 4 b, this pair's tile is written (kSplitDims: b = it & 1 whatever the dQ warps, so that the
    // consumers never arrive on a barrier its dQ warp has not yet passed: their next arrival there waits for the
    // stage that warp gives back)
    constexpr int kDsReady = 1, kStore = 2, kDqFree = 5, kDqFull = 6;
    constexpr int kDqThreads = 128 * kConsumers + 32;

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    // sDqAcc holds kBlockM rows of the accumulator's width: a width past kHeadDim would overrun it; the stores
    // below write whole groups of 32 floats, swizzled by kDqSwizzleSm90, as the postprocess will read them
    if (dyn_smem < Smem::kBytes || p.dq_accum_row_stride > kHeadDim || p.dq_accum_row_stride % 32 ||
        p.dq_accum_swizzle != kDqSwizzleSm90)
        __trap();
    extern __shared__ __align__(16) char smem[];
    const unsigned base = (smem_u32(smem) + 1023u) & ~1023u;
    char* const base_ptr = smem + (base - smem_u32(smem));
    const unsigned sK = base + Smem::kK, sV = base + Smem::kV, sdS = base + Smem::kdSs;
    auto sQ = [&](int s) { return base + Smem::kQs + s * Smem::kQ; };
    auto sdO = [&](int s) { return base + Smem::kdOs + s * Smem::kQ; };
    float* const sLse = reinterpret_cast<float*>(base_ptr + Smem::kLse);  // [kStages][kBlockM]
    float* const sD = reinterpret_cast<float*>(base_ptr + Smem::kD);
    const unsigned sDqAcc = base + Smem::kDqAcc;
    // The small block (Sm90BwdSmem::kSmall): after the tiles, or in the alignment slack before them
    unsigned small = base + Smem::kTiles;
    if constexpr (Smem::kSmallInSlack) {
        if (base - smem_u32(smem) >= Smem::kSmall) small = base - Smem::kSmall;
    }
    // exp2's scale, converted from the params' double once: in the loop ptxas rematerialized the conversion
    // (an fp64 compare and convert per pair, 5 % of the consumers' stall samples at d = 128)
    float* const sScaleLog2 = reinterpret_cast<float*>(base_ptr + static_cast<int>(small - base));
    const unsigned bars = small + 8;
    const unsigned kv_full = bars;
    auto q_full = [&](int s) { return bars + 8u * (1 + s); };
    auto do_full = [&](int s) { return bars + 8u * (1 + kStages + s); };
    auto q_empty = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
    auto do_empty = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };

    // [2] Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
    // (kQuerySplit: x = 2 head_k + the block's rank in its cluster, and each rank takes a half of them)
    const int head_k = kIsQuerySplit ? blockIdx.x / 2 : blockIdx.x;
    int n_block, batch;
    backward_block<kIsDeterministic>(n_block, batch);
    const SeqInfo<kIsVarlen, false> seq(p.fwd, batch);
    const int key_begin = n_block * kBlockN;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if (key_begin >= seqlen_k) return;  // varlen: a shorter sequence than the grid's (a cluster's ranks alike)
    // TMA coordinates (row, entry) of the entry's row 0: a varlen batch is one packed entry
    const int q_row0 = seq.q_start, k_row0 = seq.k_start, tma_batch = kIsVarlen ? 0 : batch;
    const int group = p.fwd.nheads / p.fwd.nheads_k;
    const Mask<kVariant> mask(p.fwd, seqlen_q, seqlen_k);
    int m_block_first, m_block_end;
    mask.template m_block_range<kBlockM, kBlockN>(n_block, m_block_first, m_block_end);
    if constexpr (kIsQuerySplit) {
        const int mid = m_block_first + (max(m_block_end - m_block_first, 0) + 1) / 2;
        (cluster_rank() == 0 ? m_block_end : m_block_first) = mid;
    }
    // The (query head, query block) pairs, in backward_pair's order
    // pairs to visit; recomputed after the producer / consumer split rather than kept across it
    auto n_pairs = [&]() { return group * max(m_block_end - m_block_first, 0); };
    auto pair = [&](int it, int& head, int& m_block) {
        backward_pair<kIsDeterministic>(it, head_k, group, m_block_first, m_block_end, head, m_block);
    };
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbarrier_init(kv_full, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(q_full(s), 1 + 32);  // the TMA thread, and warp 1's lanes with LSE and D
            mbarrier_init(do_full(s), 1);
            // every consumer thread (each has read LSE and D), lane 0 of every consumer warp (dO: wgmma's reads);
            // kSplitDims: and the dQ warp, once the engine has read the dQ tile the consumers wrote over the stage
            mbarrier_init(q_empty(s), 128 * kConsumers + kSplitDims);
            mbarrier_init(do_empty(s), kSplitDims ? 1 : 4 * kConsumers);
        }
        fence_barrier_init();
        *sScaleLog2 = Mod(p.fwd, batch, head_k * group, mask.shift).score_log2(p.fwd);  // the same for every head
    }
    __syncthreads();

    if (warpgroup == 0) {
        // [3] Producer: K and V, then the Q, dO tiles (TMA) and LSE, D rows of each query block into a free stage
        setmaxnreg_dec<kProducerRegs>();
        const int n_it = n_pairs();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (threadIdx.x == 0) {
            mbarrier_arrive_expect_tx(kv_full, 2 * Smem::kKV);
#pragma unroll
            for (int slab = 0; slab < kHeadDim / 64; ++slab) {
                tma_load_4d(sK + slab * kSlabKV, &params.tma_k, kv_full, 64 * slab, k_row0 + key_begin, head_k,
                            tma_batch);
                tma_load_4d(sV + slab * kSlabKV, &params.tma_v, kv_full, 64 * slab, k_row0 + key_begin, head_k,
                            tma_batch);
            }
#pragma unroll 1
            for (int it = 0; it < n_it; ++it) {
                int head, m_block;
                pair(it, head, m_block);
                const int s = it % kStages, use = it / kStages, row_begin = m_block * kBlockM;
                // each tile waits until the consumers are done with the stage's last use of it
                if (use > 0) mbarrier_wait(q_empty(s), (use - 1) & 1);
                mbarrier_arrive_expect_tx(q_full(s), Smem::kQ);
#pragma unroll
                for (int slab = 0; slab < kHeadDim / 64; ++slab)
                    tma_load_4d(sQ(s) + slab * kSlabQ, &params.tma_q, q_full(s), 64 * slab, q_row0 + row_begin, head,
                                tma_batch);
                if (use > 0) mbarrier_wait(do_empty(s), (use - 1) & 1);
                mbarrier_arrive_expect_tx(do_full(s), Smem::kQ);
#pragma unroll
                for (int slab = 0; slab < kHeadDim / 64; ++slab)
                    tma_load_4d(sdO(s) + slab * kSlabQ, &params.tma_do, do_full(s), 64 * slab, q_row0 + row_begin,
                                head, tma_batch);
            }
        } else if (warp == 1) {
            // LSE as exp2's offset (lse_to_log2_offset: +inf for a row that saw no key, so its P is 0) and D;
            // rows past seqlen_q take offset +inf (P = 0) and D 0: they add nothing, whatever their Q and dO hold
#pragma unroll 1
            for (int it = 0; it < n_it; ++it) {
                int head, m_block;
                pair(it, head, m_block);
                const int s = it % kStages, use = it / kStages, row_begin = m_block * kBlockM;
                const float* lse = static_cast<const float*>(p.fwd.lse) +
                                   seq.row_offset(batch, head, p.fwd.lse_batch_stride, p.fwd.lse_head_stride);
                const float* dsum = static_cast<const float*>(p.dsum) +
                                    seq.row_offset(batch, head, p.dsum_batch_stride, p.dsum_head_stride);
                if (use > 0) mbarrier_wait(q_empty(s), (use - 1) & 1);
                for (int r = lane; r < kBlockM; r += 32) {
                    const int row = row_begin + r;
                    const bool valid = row < seqlen_q;
                    sLse[s * kBlockM + r] = valid ? lse_to_log2_offset(lse[row]) : -neg_inf<float>();
                    sD[s * kBlockM + r] = valid ? dsum[row] : 0.f;
                }
                mbarrier_arrive(q_full(s));
            }
        } else if (warp == 2 || (kDqBuffers == 2 && warp == 3)) {
            // The dQ warps: warp 2 + b adds sDqAcc buffer b, the pairs it with it % kDqBuffers == b. Per pair, once
            // the buffer holds the tile (kDqFull + 4 b), add its rows below seqlen_q into the accumulator (contiguous
            // there: one bulk reduce), and give the buffer back (kDqFree + 4 b) once the engine has read it.
            // kSplitDims: the tile lies over the pair's stage, rows 0-31 over sQ and 32-63 over sdO (two reduces),
            // and the stage goes back to the producer once the engine has read it: sQ (q_empty) as soon as its rows
            // are read (a bulk group of their own), so that the next Q load need not wait for the read of sdO's rows
            // (1.07-1.19x faster at d = 256, bench/RESULTS.md 2026-12-07 (v)); kDeterministic: both at once, as its
            // turns ran 6-26 % slower non-causal the other way.
            // kDeterministic: before its reduce, lane 0 waits for the tile's turn (the key blocks before this one
            // have added), and once the adds have completed hands the tile on
            const int b = kDqBuffers == 1 ? 0 : warp - 2;  // (a constant for the compiler where it is one)
            if (!kSplitDims && b < n_it) named_barrier_arrive(kDqFree + 4 * b, kDqThreads);
#pragma unroll 1
            for (int it = b; it < n_it; it += kDqBuffers) {
                int head, m_block;
                pair(it, head, m_block);
                const int row_begin = m_block * kBlockM, s = it % kStages;
                int* semaphore = nullptr;
                int turn = 0;
                if constexpr (kIsDeterministic) {
                    semaphore = dq_semaphores(p, batch, head) + m_block;
                    turn = dq_turn<kBlockM, kBlockN>(mask, m_block, n_block);
                    if (lane == 0) {
                        while (load_acquire(semaphore) != turn) {}
                    }
                    __syncwarp();
                }
                named_barrier_sync(kDqFull + 4 * (kSplitDims ? it & 1 : b), kDqThreads);
                // kDeterministic: the previous key block's adds, acquired by lane 0 (generic proxy), before this
                // reduce (async proxy) adds to them
                if constexpr (kIsDeterministic) asm volatile("fence.proxy.async.global;" ::: "memory");
                if (lane == 0) {
                    const int rows = min(kBlockM, seqlen_q - row_begin), width = p.dq_accum_row_stride;
                    float* const dst = dq_accum_rows(p, seq, batch, head) + row_begin * width;
                    if constexpr (kSplitDims) {
                        bulk_reduce_add_f32(dst, sQ(s), min(rows, 32) * width * 4);
                        if constexpr (!kIsDeterministic) bulk_commit();
                        if (rows > 32) bulk_reduce_add_f32(dst + 32 * width, sdO(s), (rows - 32) * width * 4);
                    } else {
                        bulk_reduce_add_f32(dst, sDqAcc + b * Smem::kDqAccBytes, rows * width * 4);
                    }
                }
                bulk_commit();
                if constexpr (kSplitDims) {
                    if constexpr (kIsDeterministic) bulk_wait_read<0>();
                    else bulk_wait_read<1>();  // sQ's rows read
                    if (lane == 0) mbarrier_arrive(q_empty(s));
                    bulk_wait_read<0>();
                    if (lane == 0) mbarrier_arrive(do_empty(s));
                } else {
                    bulk_wait_read<0>();
                    if (it + kDqBuffers < n_it) named_barrier_arrive(kDqFree + 4 * b, kDqThreads);
                }
                if constexpr (kIsDeterministic) {
                    bulk_wait<0>();   // the adds have landed
                    __threadfence();  // and are visible before the turn is
                    if (lane == 0) store_release(semaphore, turn + 1);
                }
            }
            bulk_wait<0>();
        }
        return;
    }

    // Consumers
    setmaxnreg_inc<kConsumerRegs>();
    const int n_it = n_pairs();
    const int consumer = warpgroup - 1;
    const int tid = threadIdx.x - 128 * warpgroup, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;
    const int wg_key0 = kSplitDims ? 0 : 64 * consumer, key_row0 = wg_key0 + 16 * warp;  // first keys inside the block
    // kSplitDims: this consumer's first query of S^T and first dim of dK, dV and dQ
    const int q0 = kSplitDims ? kQueries * consumer : 0, d0 = kSplitDims ? kDims * consumer : 0;
    // This consumer's dQ tile: 64 query rows from dq_row0 x 64 dims from dq_col0, summed over all kBlockN keys
    const int dq_row0 = 64 * (consumer % (kBlockM / 64)), dq_col0 = 64 * (consumer / (kBlockM / 64));

    float acc_dk[kNTilesD][4], acc_dv[kNTilesD][4];
#pragma unroll
    for (int nd = 0; nd < kNTilesD; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[nd][e] = acc_dv[nd][e] = 0.f;
    mbarrier_wait(kv_full, 0);
    // Varlen: rows past the sequence zeroed (K, V here; Q, dO per pair below), then every consumer reads them
    auto zero_tails = [&](unsigned a, unsigned b, unsigned slab_bytes, int first, int rows) {
        zero_tile_rows(a, slab_bytes, kHeadDim / 64, first, rows, tid + 128 * consumer, 128 * kConsumers);
        zero_tile_rows(b, slab_bytes, kHeadDim / 64, first, rows, tid + 128 * consumer, 128 * kConsumers);
        fence_proxy_async();
        named_barrier_sync(kDsReady, 128 * kConsumers);
    };
    if (kIsVarlen && key_begin + kBlockN > seqlen_k) zero_tails(sK, sV, kSlabKV, seqlen_k - key_begin, kBlockN);

    for (int it = 0; it < n_it; ++it) {
        const int s = it % kStages;
        const unsigned phase = (it / kStages) & 1;
        int head, m_block;
        pair(it, head, m_block);
        const int row_begin = m_block * kBlockM;
        const Mod mod(p.fwd, batch, head, mask.shift);
        const float scale_log2 = *sScaleLog2;
        const float inv_scale_log2 = kIsSoftcap ? 1.f / scale_log2 : 0.f;

        // [4]-[8] per half of the consumer's queries (one half but at d = 64 with 128 query rows)
        // a_frag: wgmma A fragments of the consumer's queries, each half's P^T, then its dS^T
        unsigned a_frag[kQueries / 16][4];
        // kSplitDims: a_frag's 8 x 8 tiles into a keys x queries tile (sP^T, sdS^T) as they are: a_frag[kq][j] is
        // keys key_row0 + 8 (j & 1) + 0..7 by this consumer's queries 16 kq + 8 (j >> 1) + 0..7, a 16-byte chunk
        // of each key's row; lane l gives the address of tile l / 8's key row l % 8
        auto store_keys_by_queries = [&](unsigned tile) {
            const int j = lane / 8, key = key_row0 + 8 * (j & 1) + lane % 8;
#pragma unroll
            for (int kq = 0; kq < kQueries / 16; ++kq) {
                const int chunk = q0 / 8 + 2 * kq + (j >> 1);
                stmatrix_x4(tile + key * 128 + ((chunk ^ (key % 8)) * 16), a_frag[kq]);
            }
        };
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
            const int qh = q0 + kQH * half;  // the half's first query of the tile
            // [4] S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory)
            // acc_s[ni][2h + e]: key key_row0 + g + 8h, query qh + 8 ni + 2t + e (for_each_score_t's layout)
            float acc_s[kNTilesH][4], acc_dp[kNTilesH][4];
            if (half == 0) {
                mbarrier_wait(q_full(s), phase);
                if (kIsVarlen && row_begin + kBlockM > seqlen_q) {
                    mbarrier_wait(do_full(s), phase);
                    zero_tails(sQ(s), sdO(s), kSlabQ, seqlen_q - row_begin, kBlockM);
                }
            }
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kHeadDim / 16; ++ks) {
                const unsigned slab = ks / 4, col_bytes = (ks % 4) * 32;
                Wgmma<T, kQH>::ss(acc_s, smem_desc(sK + slab * kSlabKV + wg_key0 * 128 + col_bytes, 16, 1024),
                                  smem_desc(sQ(s) + slab * kSlabQ + qh * 128 + col_bytes, 16, 1024), ks > 0);
            }
            wgmma_commit();
            if (half == 0) mbarrier_wait(do_full(s), phase);
#pragma unroll
            for (int ks = 0; ks < kHeadDim / 16; ++ks) {
                const unsigned slab = ks / 4, col_bytes = (ks % 4) * 32;
                Wgmma<T, kQH>::ss(acc_dp, smem_desc(sV + slab * kSlabKV + wg_key0 * 128 + col_bytes, 16, 1024),
                                  smem_desc(sdO(s) + slab * kSlabQ + qh * 128 + col_bytes, 16, 1024), ks > 0);
            }
            wgmma_commit();
            const float* lse_off = sLse + s * kBlockM + qh;
            const float* d_rows = sD + s * kBlockM + qh;
            // a per-query row (LSE offsets, D) at acc element [ni][e]'s query: 8 ni + 2t + (e & 1), both of a
            // thread's queries in one 8-byte load
            auto at_query = [&](const float* rows, int ni, int e) {
                const float2 two = *reinterpret_cast<const float2*>(rows + 8 * ni + 2 * t);
                return (e & 1) ? two.y : two.x;
            };
            if constexpr (kDkFromSmem) {  // (one half: kHalves == 1)
                // the last pair's dK has completed (it ran on under these): its stage's Q goes back
                wgmma_wait<2>();
                fence_operands(acc_dk);
                if (it > 0) mbarrier_arrive(q_empty((it - 1) % kStages));
            }
            wgmma_wait<1>();  // S^T has completed (and the last half's dV); dP^T may still run
            fence_operands(acc_s);

            // [5] Score modifiers, mask, P^T = exp2(S^T * scale_log2 - LSE * log2(e)), dropout
            // kKeepDcap: dcap[ni][h] the softcap's 1 - t^2 of acc_s[ni][2h], acc_s[ni][2h + 1], for [7]
            __half2 dcap[kKeepDcap ? kNTilesH : 1][2];
            if constexpr (kKeepDcap) {
#pragma unroll
                for (int ni = 0; ni < kNTilesH; ++ni)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = row_begin + qh + 8 * ni + 2 * t, col = key_begin + key_row0 + g + 8 * h;
                        float d0, d1;
                        acc_s[ni][2 * h] = mod.apply(acc_s[ni][2 * h], row, col, d0);
                        acc_s[ni][2 * h + 1] = mod.apply(acc_s[ni][2 * h + 1], row + 1, col, d1);
                        dcap[ni][h] = __floats2half2_rn(d0, d1);
                    }
            } else if constexpr (Mod::kTransform) {
                for_each_score_t<kNTilesH>(key_begin + key_row0, row_begin + qh, lane, [&](float& x, int row, int col) {
                    float dc;
                    x = mod.apply(x, row, col, dc);
                }, acc_s);
            }
            if (mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block)) {
                for_each_score_t<kNTilesH>(key_begin + key_row0, row_begin + qh, lane, [&](float& x, int row, int col) {
                    if (!mask.visible(row, col)) x = neg_inf<float>();
                }, acc_s);
            }
#pragma unroll
            for (int ni = 0; ni < kNTilesH; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[ni][e] = exp2f(acc_s[ni][e] * scale_log2 - at_query(lse_off, ni, e));
            if constexpr (kIsDropout) {
                // a dropped entry is kept as -P: dV reads max(P, 0) (its 1 / (1 - p) applied at the store), dS
                // below tells kept from dropped by the sign
                Dropout(p.fwd, batch, head).for_each_keep_t(acc_s, key_begin + key_row0, row_begin + qh, lane,
                                                            [](float& x, bool kept) { if (!kept) x = -x; });
            }

            // [6] dV += P^T dO (wgmma, P^T from registers)
            // kSplitDims: P^T into sP^T, its wgmma with dK's and dQ's in [9]
            // P^T into the half's slots of a_frag, from kf (its dS^T takes them in [8])
            const int kf = kQH / 16 * half;
#pragma unroll
            for (int kq = 0; kq < kQH / 16; ++kq)
                acc_to_a<T>(a_frag[kf + kq], acc_s[2 * kq], acc_s[2 * kq + 1], kIsDropout);
            if constexpr (kSplitDims) {
                static_assert(kHalves == 1, "P^T of all the consumer's queries in one half");
                store_keys_by_queries(base + Smem::kPs + (it & 1) * Smem::kDS);
            } else {
                wgmma_fence();
#pragma unroll
                for (int kq = 0; kq < kQH / 16; ++kq)
                    Wgmma<T, kHeadDim>::rs(acc_dv, a_frag[kf + kq],
                                           smem_desc(sdO(s) + (qh + 16 * kq) * 128, kSlabQ, 1024));
                wgmma_commit();
            }
            wgmma_wait<kSplitDims ? 0 : 1>();  // dP^T has completed; dV may still run
            fence_operands(acc_dp);

            // [7] dS^T = P^T (dP^T - D)
            // D belongs to the query (column). Dropout: dL/dP is dP / (1 - p) where
            // kept and 0 where dropped (there acc_s = -P, so dS = -P * D = acc_s * D). Softcap: times 1 - tanh^2.
#pragma unroll
            for (int ni = 0; ni < kNTilesH; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float d = at_query(d_rows, ni, e);
                    float ds;
                    if constexpr (kIsDropout) {
                        ds = acc_s[ni][e] >= 0.f
                                 ? acc_s[ni][e] * (acc_dp[ni][e] * static_cast<float>(p.fwd.dropout_scale) - d)
                                 : acc_s[ni][e] * d;
                    } else {
                        ds = acc_s[ni][e] * (acc_dp[ni][e] - d);
                    }
                    if constexpr (kKeepDcap) {
                        const float2 dc = __half22float2(dcap[ni][e >> 1]);
                        ds *= (e & 1) ? dc.y : dc.x;
                    } else if constexpr (kIsSoftcap) {
                        // with dropout, the softcap's 1 - t^2 from P (held logit = (log2 P + LSE offset) /
                        // scale_log2). P = 0 (masked, underflowed) gives dS = 0
                        const float pv = fabsf(acc_s[ni][e]);
                        const float x = (__log2f(pv) + at_query(lse_off, ni, e)) * inv_scale_log2;
                        const float dc = mod.dcap_of(x, row_begin + qh + 8 * ni + 2 * t + (e & 1),
                                                    key_begin + key_row0 + g + 8 * (e >> 1));
                        ds = pv == 0.f ? 0.f : ds * dc;
                    }
                    acc_dp[ni][e] = ds;
                }

            // [8] dK += dS^T Q (wgmma, dS^T from registers)
            // Its wgmma is issued in [9], behind dQ's, so that it runs under dQ's stores (kDkFromSmem: dS^T from sdS)
#pragma unroll
            for (int kq = 0; kq < kQH / 16; ++kq) acc_to_a<T>(a_frag[kf + kq], acc_dp[2 * kq], acc_dp[2 * kq + 1]);
        }

        // [9] dS into shared memory; dQ = dS K (wgmma) into sDqAcc, which the dQ warp adds into dQ_accum
        const unsigned p_tile = base + Smem::kPs + (it & 1) * Smem::kDS, ds_tile = sdS + (it & 1) * Smem::kDS;
        if constexpr (kSplitDims) {
            // dS^T into sdS^T; once both consumers' halves of P^T and dS^T are in, this consumer's dims of
            // dQ = dS K (A: sdS^T read transposed), dV += P^T dO and dK += dS^T Q, all from shared memory; once
            // both consumers' GEMMs have completed, dQ's share over the stage for the dQ warp (it hands the stage on)
            store_keys_by_queries(ds_tile);
            fence_proxy_async();  // the stores, then the wgmma that reads them
            named_barrier_sync(kDsReady, 128 * kConsumers);
            float acc_dq[kNTilesD][4];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kBlockN / 16; ++ks)
                Wgmma<T, kDims>::ss_t(acc_dq, smem_desc(ds_tile + ks * 16 * 128, Smem::kDS, 1024),
                                      smem_desc(sK + (d0 / 64) * kSlabKV + ks * 16 * 128, kSlabKV, 1024), ks > 0);
            wgmma_commit();
#pragma unroll
            for (int kq = 0; kq < kBlockM / 16; ++kq)
                Wgmma<T, kDims>::ss_n(acc_dv, smem_desc(p_tile + kq * 32, 16, 1024),
                                      smem_desc(sdO(s) + (d0 / 64) * kSlabQ + kq * 16 * 128, kSlabQ, 1024), 1);
            wgmma_commit();
#pragma unroll
            for (int kq = 0; kq < kBlockM / 16; ++kq)
                Wgmma<T, kDims>::ss_n(acc_dk, smem_desc(ds_tile + kq * 32, 16, 1024),
                                      smem_desc(sQ(s) + (d0 / 64) * kSlabQ + kq * 16 * 128, kSlabQ, 1024), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(acc_dq);
            fence_operands(acc_dv);
            fence_operands(acc_dk);
            named_barrier_sync(kDsReady, 128 * kConsumers);  // no wgmma reads the stage any more
            // acc_dq[nd][2h + e]: query row 16 warp + g + 8h of the tile, dim d0 + 8 nd + 2t + e, stored as sDqAcc
            // would hold it, rows 0-31 over sQ, 32-63 over sdO: 32 rows of the accumulator's width fit either (32 x
            // 256 floats, one stage of 64 x 256 16-bit elements)
            static_assert(32 * kHeadDim * 4 == Smem::kQ, "half the dQ tile over sQ, half over sdO");
            store_dq_rows(warp < 2 ? sQ(s) : sdO(s), 16 * (warp % 2), d0, p.dq_accum_row_stride, g, t, acc_dq);
            fence_proxy_async();  // the stores, then the copy engine that reads them
            named_barrier_arrive(kDqFull + 4 * (it & 1), kDqThreads);
            mbarrier_arrive(q_empty(s));  // LSE and D read (the dQ warp's arrival gives the tiles back)
            continue;
        }
        // dS (queries x keys) into sdS, this consumer's 64 keys = slab `consumer`, by stmatrix .trans:
        // a_frag[kq][j] is the 8 x 8 tile of keys 16 warp + 8 (j & 1) + 0..7 (one 16-byte chunk of an sdS row)
        // by queries 16 kq + 8 (j >> 1) + 0..7; lane l gives the address of tile l / 8's query row l % 8
        {
            const int j = lane / 8, chunk = 2 * warp + (j & 1);
#pragma unroll
            for (int kq = 0; kq < kQueries / 16; ++kq) {
                const int q = 16 * kq + 8 * (j >> 1) + lane % 8;
                stmatrix_x4_trans(ds_tile + consumer * kSlabQ + q * 128 + ((chunk ^ (q % 8)) * 16), a_frag[kq]);
            }
        }
        fence_proxy_async();  // the stores, then the wgmma that reads them
        named_barrier_sync(kDsReady, 128 * kConsumers);  // every consumer's keys are in

        // this consumer's 64 x 64 tile of dS K (K N-major), dK's products ([8]), then the tile into sDqAcc
        float acc_dq[8][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            const int key = 16 * ks;  // 64 keys per slab of sdS
            Wgmma<T, 64>::ss_n(acc_dq, smem_desc(ds_tile + (key / 64) * kSlabQ + dq_row0 * 128 + (key % 64) * 2, 16, 1024),
                               smem_desc(sK + (dq_col0 / 64) * kSlabKV + key * 128, kSlabKV, 1024), ks > 0);
        }
        wgmma_commit();
        if constexpr (kDkFromSmem) {
            // dS^T from this consumer's slab of sdS, read transposed (its 64 keys contiguous in each query's row)
#pragma unroll
            for (int kq = 0; kq < kQueries / 16; ++kq)
                Wgmma<T, kDims>::ss_t(acc_dk, smem_desc(ds_tile + consumer * kSlabQ + kq * 16 * 128, kSlabQ, 1024),
                                      smem_desc(sQ(s) + kq * 16 * 128, kSlabQ, 1024), 1);
        } else {
#pragma unroll
            for (int kq = 0; kq < kQueries / 16; ++kq)
                Wgmma<T, kDims>::rs(acc_dk, a_frag[kq], smem_desc(sQ(s) + kq * 16 * 128, kSlabQ, 1024));
        }
        wgmma_commit();
        wgmma_wait<1>();  // dV and dQ have completed (dK may still run): the stage's dO goes back to the producer
        fence_operands(acc_dq);
        fence_operands(acc_dv);
        if (lane == 0) mbarrier_arrive(do_empty(s));
        const int dq_buffer = kDqBuffers == 2 ? it & 1 : 0;
        named_barrier_sync(kDqFree + 4 * dq_buffer, kDqThreads);  // its dQ warp has read the buffer's last pair
        // acc_dq[nd][2h + e]: query row dq_row0 + 16 warp + g + 8h, dim dq_col0 + 8 nd + 2t + e
        static_assert(Smem::kDqAcc % 128 == 0, "sDqAcc's rows 128-byte aligned");
        store_dq_rows(sDqAcc + dq_buffer * Smem::kDqAccBytes, dq_row0 + 16 * warp, dq_col0, p.dq_accum_row_stride, g, t,
                      acc_dq);
        fence_proxy_async();  // the stores, then the copy engine that reads them
        named_barrier_arrive(kDqFull + 4 * dq_buffer, kDqThreads);
        if constexpr (!kDkFromSmem) {
            wgmma_wait<0>();  // dK has completed: the stage's Q goes back to the producer
            fence_operands(acc_dk);
            mbarrier_arrive(q_empty(s));
        }
    }
    if constexpr (kDkFromSmem) {
        wgmma_wait<0>();  // the last pair's dK
        fence_operands(acc_dk);
    }

    // [10] Store dK * softmax_scale and dV
    // Through this consumer's rows of sK and sV, once every consumer's last dQ (which reads sK) has completed
    named_barrier_sync(kDsReady, 128 * kConsumers);
    if constexpr (kIsQuerySplit) {
        // Rank 0's accumulators into its sK .. sdO (no wgmma reads them any more), 8 bytes per thread in turn
        // (a warp's 256 contiguous bytes: no bank conflicts); rank 1 adds them to its own, read from there.
        // Two cluster barriers (of the consumers: the producers have exited): the partials are in; rank 1 has
        // read them, so rank 0's shared memory may go.
        static_assert(128 * kConsumers * 4 * kNTilesD * 8 <= Smem::kdSs, "the partials fit over sK .. sdO");
        const unsigned partial = sK + (threadIdx.x - 128) * 8;  // consumer threads from 0
        constexpr unsigned kStride = 128 * kConsumers * 8;  // bytes from one pair of a thread's floats to its next
        if (cluster_rank() == 0) {
#pragma unroll
            for (int nd = 0; nd < kNTilesD; ++nd)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned at = partial + (4 * nd + h) * kStride;
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(acc_dk[nd][2 * h]),
                                 "f"(acc_dk[nd][2 * h + 1]) : "memory");
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at + 2 * kStride), "f"(acc_dv[nd][2 * h]),
                                 "f"(acc_dv[nd][2 * h + 1]) : "memory");
                }
            cluster_sync();
            cluster_sync();
            return;
        }
        cluster_sync();
        const unsigned remote = cluster_map(partial, 0);
#pragma unroll
        for (int nd = 0; nd < kNTilesD; ++nd)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 k2 = ld_cluster_f32x2(remote + (4 * nd + h) * kStride);
                const float2 v2 = ld_cluster_f32x2(remote + (4 * nd + h + 2) * kStride);
                acc_dk[nd][2 * h] += k2.x, acc_dk[nd][2 * h + 1] += k2.y;
                acc_dv[nd][2 * h] += v2.x, acc_dv[nd][2 * h + 1] += v2.y;
            }
        cluster_arrive();  // its wait at the end of the kernel
    }
    const float dk_scale = static_cast<float>(p.fwd.softmax_scale);
    const float dv_scale = kIsDropout ? static_cast<float>(p.fwd.dropout_scale) : 1.f;
#pragma unroll
    for (int nd = 0; nd < kNTilesD; ++nd) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = key_row0 + g + 8 * h, chunk = d0 / 8 + nd;
            const unsigned offset = (chunk / 8) * kSlabKV + r * 128 + (((chunk % 8) ^ (r % 8)) * 16) + t * 4;
            const unsigned k2 = pack2<T>(acc_dk[nd][2 * h] * dk_scale, acc_dk[nd][2 * h + 1] * dk_scale);
            const unsigned v2 = pack2<T>(acc_dv[nd][2 * h] * dv_scale, acc_dv[nd][2 * h + 1] * dv_scale);
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(sK + offset), "r"(k2) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(sV + offset), "r"(v2) : "memory");
        }
    }
    // kSplitDims: both consumers wrote every key's row; each then stores half of the rows
    constexpr int kStoreRows = kSplitDims ? 32 : 64;
    const int store_row0 = kSplitDims ? 32 * consumer : wg_key0;
    if constexpr (kSplitDims) {
        named_barrier_sync(kDsReady, 128 * kConsumers);
    } else {
        named_barrier_sync(kStore + consumer, 128);
    }
    T* dk = static_cast<T*>(p.dk) + seq.k_offset(batch, p.dk_batch_stride, p.dk_row_stride) + head_k * p.dk_head_stride;
    T* dv = static_cast<T*>(p.dv) + seq.k_offset(batch, p.dv_batch_stride, p.dv_row_stride) + head_k * p.dv_head_stride;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
#pragma unroll 4
    for (int c = tid; c < kStoreRows * kChunks; c += 128) {
        const int r = store_row0 + c / kChunks, chunk = c % kChunks;
        const int key = key_begin + r;
        if (key < seqlen_k && chunk * 8 < p.fwd.head_dim) {
            const unsigned offset = (chunk / 8) * kSlabKV + r * 128 + (((chunk % 8) ^ (r % 8)) * 16);
            uint4 k4, v4;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(k4.x), "=r"(k4.y), "=r"(k4.z), "=r"(k4.w) : "r"(sK + offset));
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v4.x), "=r"(v4.y), "=r"(v4.z), "=r"(v4.w) : "r"(sV + offset));
            *reinterpret_cast<uint4*>(dk + key * p.dk_row_stride + chunk * 8) = k4;
            *reinterpret_cast<uint4*>(dv + key * p.dv_row_stride + chunk * 8) = v4;
        }
    }
    if constexpr (kIsQuerySplit) cluster_wait();
}

}  // namespace cuflash
