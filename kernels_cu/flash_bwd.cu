// FlashAttention backward, three launches: preprocess (every dtype), flash_bwd and postprocess (fp16 / bf16,
// on tensor cores; fp32 / fp64 run flash_bwd_simt.cu's kernels after the same preprocess).
//
// One pass over key blocks, five tile GEMMs per (query block, key block): flash_bwd owns one key block
// and loops over the group's query heads and their query blocks, recomputing S and P = exp2(S * scale_log2
// - LSE * log2(e)) from Q, K and the forward's LSE once, accumulating dK and dV in fp32 registers, and
// adding dQ's share dS K into an fp32 dQ accumulator in global memory (the workspace, config.BackwardWorkspace):
// atomic adds as they come, or (kDeterministic) in a fixed order of key blocks (first to last,
// backward.cuh's backward_pair and dq_turn), each dQ tile's turn kept by a semaphore, so that repeated calls
// are bitwise identical. Preprocess zeroes the accumulator and the semaphores; postprocess converts
// dQ_accum * softmax_scale to the input dtype. A row with LSE = -inf (it saw no key) takes the offset +inf so
// that its P is exactly 0, never NaN.
//
// Fragment layouts (mma.sync m16n8k16, ldmatrix) are spelled out in mma.cuh.
//
// Variants (kVariant, mask.cuh) as in the forward: the mask gives each key block's query blocks, S passes
// through ScoreMod and the mask before P is recomputed. A softcap multiplies dS by its derivative
// 1 - tanh^2. Dropout regenerates the forward's keep mask: dV takes the dropped P, and dL/dP is
// dO V^T on kept entries times 1 / (1 - p), 0 on dropped ones; D = rowsum(dO * O) holds as it is.
#include "params.cuh"
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "dropout.cuh"
#include "mma.cuh"
#include "copy.cuh"
#include "backward.cuh"

namespace cuflash {

// D = rowsum(dO * O), accumulated in acc_t<T>; and, where the workspace has them, the block's rows of the dQ
// accumulator and its dQ semaphore set to 0. Grid (ceil(seqlen_q / kBlockM), nheads, batch); rows >= seqlen_q are
// not written. No shared memory. Each row is read 16 bytes a lane by a group of `lanes` lanes (the power of two
// that covers the row, at most a warp) and reduced over the group by shuffles, in a fixed order; the loads of
// kInFlight rows a thread are issued before any is used. (One warp a row, its lanes striding over head_dim,
// waited for each row's loads in turn: 16-18 us at B2 H8 N512-1024 d128 on an H100, 2x cuDNN's dot(dO, O).)
// Takes no head dim, key tile or mask: one instantiation per dtype serves every head_dim (a multiple of 8, the
// API's rule, up to config.MAX_HEAD_DIM) and every variant but kVarlen, its only bit of kVariant (config:
// head_dim = block_n = 0).
template <typename T, int kBlockM, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32) flash_bwd_preprocess(const __grid_constant__ BwdParams p) {
    using A = acc_t<T>;
    constexpr int kVec = 16 / sizeof(T);                        // elements a 16-byte load
    constexpr int kLoadsPerRow = 256 / kVec / 32;               // a lane's loads of a 256-dim row: 1, 2 or 4
    constexpr int kInFlight = 4 / kLoadsPerRow;                 // rows a thread loads at once: 4, 2 or 1

    // [1] Preprocess: D = rowsum(dO * O); zero the dQ accumulator and semaphores
    const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0> seq(p.fwd, batch);
    const int seqlen_q = seq.seqlen_q, head_dim = p.fwd.head_dim;
    if (p.dq_semaphore_offset >= 0 && threadIdx.x == 0) dq_semaphores(p, batch, head)[m_block] = 0;
    if (p.dq_accum_offset >= 0 && m_block * kBlockM < seqlen_q) {
        // the block's rows are contiguous: (rows * row stride) floats, a multiple of 4 (row stride: a head dim)
        const int rows = min(kBlockM, seqlen_q - m_block * kBlockM);
        float4* acc = reinterpret_cast<float4*>(dq_accum_rows(p, seq, batch, head) +
                                                m_block * kBlockM * p.dq_accum_row_stride);
        const int n4 = rows * static_cast<int>(p.dq_accum_row_stride) / 4;
        for (int i = threadIdx.x; i < n4; i += kNWarps * 32) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const T* o = static_cast<const T*>(p.fwd.o) + seq.q_offset(batch, p.fwd.o_batch_stride, p.fwd.o_row_stride) +
                 head * p.fwd.o_head_stride;
    const T* dout = static_cast<const T*>(p.dout) + seq.q_offset(batch, p.do_batch_stride, p.do_row_stride) +
                    head * p.do_head_stride;
    A* dsum = static_cast<A*>(p.dsum) + seq.row_offset(batch, head, p.dsum_batch_stride, p.dsum_head_stride);
    const int loads = head_dim / kVec;  // 16-byte loads a row (inputs are 16-byte aligned: backends/cuda.py)
    int lanes = 1;
    while (lanes < loads && lanes < 32) lanes *= 2;
    const int rows_per_pass = kNWarps * 32 / lanes, part = threadIdx.x % lanes;
    const int row_end = min(kBlockM, seqlen_q - m_block * kBlockM);
    for (int r0 = threadIdx.x / lanes; r0 < kBlockM; r0 += kInFlight * rows_per_pass) {
        uint4 o_vec[kInFlight][kLoadsPerRow], do_vec[kInFlight][kLoadsPerRow];
#pragma unroll
        for (int i = 0; i < kInFlight; ++i) {
            const int r = r0 + i * rows_per_pass, row = m_block * kBlockM + r;
#pragma unroll
            for (int j = 0; j < kLoadsPerRow; ++j) {
                const int c = (part + j * lanes) * kVec;
                o_vec[i][j] = do_vec[i][j] = make_uint4(0, 0, 0, 0);
                if (r < row_end && c < head_dim) {
                    o_vec[i][j] = *reinterpret_cast<const uint4*>(o + row * p.fwd.o_row_stride + c);
                    do_vec[i][j] = *reinterpret_cast<const uint4*>(dout + row * p.do_row_stride + c);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kInFlight; ++i) {
            A sum = A(0);
#pragma unroll
            for (int j = 0; j < kLoadsPerRow; ++j) {
                const T* x = reinterpret_cast<const T*>(&o_vec[i][j]);
                const T* y = reinterpret_cast<const T*>(&do_vec[i][j]);
#pragma unroll
                for (int e = 0; e < kVec; ++e) sum += to_acc(x[e]) * to_acc(y[e]);
            }
            for (int offset = lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            const int r = r0 + i * rows_per_pass;
            if (part == 0 && r < row_end) dsum[m_block * kBlockM + r] = sum;
        }
    }
}

// dK, dV and dQ's share of one key block of kBlockN keys. Grid (nheads_k, ceil(seqlen_k / kBlockN), batch):
// batch by batch, key blocks slowest within it. The blocks resident at once are then many key blocks of one
// entry's heads, which stream the same Q, dO and dQ tiles at about the same time and share them in L2 (with
// the batch in y instead, slowest but one, they spread over every entry's heads), and an entry's longest
// causal blocks start first. kDeterministic: (nheads_k, batch, key blocks) (backward_block).
//
// Warps form a kWN x kWM grid: kWN = kBlockN / kWarpKeys warps along the keys (kWarpKeys = 16 * kMT key rows
// each) and kWM warps sharing those rows. S, P, dP, dS, dK and dV are computed transposed so that keys are the
// mma's M dimension:
//   S^T = K Q^T, P^T, dP^T = V dO^T, dS^T (per warp: kWarpKeys keys x kBlockM / kWM queries),
//   dV += P^T dO, dK += dS^T Q (per warp: kWarpKeys keys x kHeadDim / kWM dims, fp32 registers).
// 32 key rows a warp (kMT = 2) where 16 would leave one warp on all of a block's queries, from d = 96: every
// product then reads fewer operand bytes from shared memory (at 64 x 128, d = 128: K and Q rows 32 + 32 a warp
// for S^T against 16 + 64; dO and P^T 64 + 32 for dV against 128), at the cost of P^T through shared memory
// (measured on an H200, bench/RESULTS.md 2026-12-04 (k): 1.03-1.05x at d = 128; at d = 32 and 64, whose S^T
// products are short, 0.86x and 0.95-0.97x).
// With kWM == 1 a warp's P^T / dS^T rows are exactly the A operands it needs, converted in registers.
// With kWM > 1 they go through shared memory (sP, sdS) so that each warp sees all kBlockM queries; sP is sdS
// (kAliasP) where two tiles would leave room for one stage of Q and dO only (a barrier then parts dV's reads of
// P^T from the writes of dS^T).
// dS^T always goes to sdS: dQ's share dS K takes dS as its A operand (queries x keys, ldmatrix .trans), each
// warp 16-row groups of queries x a slice of the head dim, 32 (or 16) dims at a time in fp32 registers,
// then added into the accumulator.
//
// Shared memory (16-bit elements, pitch kHeadDim + 8; sP / sdS pitch kBlockM + 8; then floats), Q, dO,
// LSE and D in kStages buffers (2: the next query block loads while this one is computed; 1 where two do
// not fit the budget, FlashBwdLayout::kBudget: sm_80's 163 KiB, or with kWideSmem, which config.choose_backward
// sets on compute capability 9.0 where sm_80's leaves one buffer (d >= 224), sm_90's 227 KiB):
//   sK [kBlockN], sV [kBlockN], sQ [kStages][kBlockM], sdO [kStages][kBlockM], sdS [kBlockN],
//   (kWM > 1 and not kAliasP: sP [kBlockN]), sLse [kStages][kBlockM], sD [kStages][kBlockM]
//   config.flash_bwd_layout: 2 * block_n * (head_dim + 8) * 2 + (1 or 2) * block_n * (block_m + 8) * 2
//                            + stages * (2 * block_m * (head_dim + 8) * 2 + 2 * block_m * 4)
//
// The warp grid and the shared memory of a flash_bwd tile (16-bit elements): kWarpKeys key rows a warp (kMT
// m-tiles), kWN x kWM warps; Q, dO, LSE and D in two buffers where that fits the block's budget, with sP beside sdS
// if it fits too, else in its place (kAliasP); else one buffer. The budget: every target's shared memory (sm_80's),
// or sm_90's (kWideSmem). config.flash_bwd_layout mirrors kBytes and kStages (tests/test_config.py compares them).
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
struct FlashBwdLayout {
    static constexpr int kPitch = kHeadDim + 8, kPPitch = kBlockM + 8;  // of sK .. sdO; of sP, sdS
    static constexpr int kMT = kNWarps == kBlockN / 16 && kBlockN % 32 == 0 && kHeadDim >= 96 ? 2 : 1;
    static constexpr int kWarpKeys = 16 * kMT, kWN = kBlockN / kWarpKeys, kWM = kNWarps / kWN;
    static constexpr bool kPInSmem = kWM > 1;
    static constexpr unsigned kBudget = (kVariant & kWideSmem) ? kSmemSm90 : kSmemPortable;
    static constexpr unsigned kKV = 2 * kBlockN * kPitch * 2;
    static constexpr unsigned kTile = kBlockN * kPPitch * 2;  // sdS, sP
    static constexpr unsigned kPerStage = 2 * kBlockM * kPitch * 2 + 2 * kBlockM * 4;
    static constexpr bool kAliasP = kPInSmem && kKV + 2 * kTile + 2 * kPerStage > kBudget;
    static constexpr unsigned kFixed = kKV + (kPInSmem && !kAliasP ? 2 : 1) * kTile;
    static constexpr int kStages = kFixed + 2 * kPerStage <= kBudget ? 2 : 1;
    static constexpr unsigned kBytes = kFixed + kStages * kPerStage;
};

// Launch bounds: minBlocks 0 leaves ptxas its occupancy heuristic, except at d <= 64 with a mask, where
// the heuristic trims to an occupancy step (128 or 168 registers) and spills (the compile gate, sm_80
// and sm_90): there 1 lifts the trim.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32, kHeadDim <= 64 && (kVariant & kLocal) ? 1 : 0)
    flash_bwd(const __grid_constant__ BwdParams p) {
    static_assert(sizeof(T) == 2, "tensor-core kernel: __half or __nv_bfloat16");
    static_assert(kBlockN % 16 == 0 && kNWarps % (kBlockN / 16) == 0, "16 key rows per warp or more");
    constexpr int kNThreads = kNWarps * 32;
    using Layout = FlashBwdLayout<kHeadDim, kBlockM, kBlockN, kNWarps, kVariant>;
    constexpr int kPitch = Layout::kPitch, kPPitch = Layout::kPPitch;
    constexpr int kMT = Layout::kMT, kWarpKeys = Layout::kWarpKeys, kWN = Layout::kWN, kWM = Layout::kWM;
    constexpr int kQCols = kBlockM / kWM;   // query columns of S^T per warp
    constexpr int kDCols = kHeadDim / kWM;  // head-dim columns of dK / dV per warp
    static_assert(kQCols % 16 == 0 && kDCols % 16 == 0, "ldmatrix.x4 covers 16 columns");
    constexpr int kNTilesQ = kQCols / 8;
    constexpr int kNTilesD = kDCols / 8;
    constexpr bool kPInSmem = Layout::kPInSmem, kAliasP = Layout::kAliasP;
    constexpr int kStages = Layout::kStages;
    constexpr unsigned kSmemBytes = Layout::kBytes;
    constexpr bool kIsDropout = (kVariant & kDropout) != 0;
    constexpr bool kIsDeterministic = (kVariant & kDeterministic) != 0;
    // dQ's share: kDqWM warps along the query rows (kDqMTiles 16-row groups each) x kDqWD along the head dim;
    // 32 rows a warp where the head dim still splits in 16s (it reads less of sK than 16 rows and twice the dims)
    constexpr int kDqWM32 = kNWarps < kBlockM / 32 ? kNWarps : kBlockM / 32;
    constexpr int kDqWM16 = kNWarps < kBlockM / 16 ? kNWarps : kBlockM / 16;
    constexpr int kDqWM = kDqWM32 >= 1 && (kHeadDim / (kNWarps / kDqWM32)) % 16 == 0 ? kDqWM32 : kDqWM16;
    constexpr int kDqWD = kNWarps / kDqWM;
    constexpr int kDqMTiles = kBlockM / 16 / kDqWM;
    constexpr int kDqDCols = kHeadDim / kDqWD;
    constexpr int kDqChunk = kDqDCols % 32 == 0 ? 32 : 16;  // dims per pass through the fp32 registers
    static_assert(kNWarps % kDqWM == 0 && kDqDCols % kDqChunk == 0, "dQ's share splits over the warps");
    using Mod = ScoreMod<float, kVariant, kTanhExp2>;
    constexpr int kNTilesCap = (kVariant & kSoftcap) ? kNTilesQ : 1;  // the softcap derivative's tile

    unsigned dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < kSmemBytes) __trap();

    extern __shared__ __align__(16) char smem[];
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + kBlockN * kPitch;
    T* sQ = sV + kBlockN * kPitch;
    T* sdO = sQ + kStages * kBlockM * kPitch;
    T* sdS = sdO + kStages * kBlockM * kPitch;
    T* sP = kAliasP ? sdS : sdS + kBlockN * kPPitch;
    float* sLse = reinterpret_cast<float*>(sdS + (kPInSmem && !kAliasP ? 2 : 1) * kBlockN * kPPitch);
    float* sD = sLse + kStages * kBlockM;

    // [2] Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
    const int head_k = blockIdx.x;
    int n_block, batch;
    backward_block<kIsDeterministic>(n_block, batch);
    const SeqInfo<(kVariant & kVarlen) != 0> seq(p.fwd, batch);
    const int key_begin = n_block * kBlockN;
    if (key_begin >= seq.seqlen_k) return;  // varlen: a shorter sequence than the grid's
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = p.fwd.head_dim;
    const int group = p.fwd.nheads / p.fwd.nheads_k;
    const Mask<kVariant> mask(p.fwd, seq.seqlen_q, seq.seqlen_k);
    int m_block_first, m_block_end;
    mask.template m_block_range<kBlockM, kBlockN>(n_block, m_block_first, m_block_end);
    const int wn = warp % kWN, wm = warp / kWN;
    const int key_row0 = wn * kWarpKeys;  // this warp's key rows inside the block
    const int q_col0 = wm * kQCols;     // this warp's query columns of S^T inside the block
    const int d_col0 = wm * kDCols;     // this warp's dK / dV columns

    const T* k = static_cast<const T*>(p.fwd.k) + seq.k_offset(batch, p.fwd.k_batch_stride, p.fwd.k_row_stride) +
                 head_k * p.fwd.k_head_stride + key_begin * p.fwd.k_row_stride;
    const T* v = static_cast<const T*>(p.fwd.v) + seq.k_offset(batch, p.fwd.v_batch_stride, p.fwd.v_row_stride) +
                 head_k * p.fwd.v_head_stride + key_begin * p.fwd.v_row_stride;
    cp_async_tile<kBlockN, kHeadDim, kPitch, kNThreads>(sK, k, p.fwd.k_row_stride, seqlen_k - key_begin, head_dim, tid);
    cp_async_tile<kBlockN, kHeadDim, kPitch, kNThreads>(sV, v, p.fwd.v_row_stride, seqlen_k - key_begin, head_dim, tid);
    cp_async_commit();

    // Per-lane ldmatrix addresses (bytes, shared space); mma.cuh has the lane -> row maps.
    // K, V as A operands (rows = this warp's first 16 keys, k = head dim; m-tile mt 16 mt rows on).
    const unsigned k_a = smem_u32(sK + key_row0 * kPitch + ldsm_a_offset(lane, kPitch));
    const unsigned v_a = smem_u32(sV + key_row0 * kPitch + ldsm_a_offset(lane, kPitch));
    // Q, dO as B operands of K Q^T / V dO^T: [query][dim] tiles = [n][k], non-transposed.
    const unsigned q_b = smem_u32(sQ + q_col0 * kPitch + ldsm_b_offset(lane, kPitch));
    const unsigned do_b = smem_u32(sdO + q_col0 * kPitch + ldsm_b_offset(lane, kPitch));
    // dO, Q as B operands of P^T dO / dS^T Q: [query][dim] tiles = [k][n], transposed.
    const unsigned do_bt = smem_u32(sdO + d_col0 + ldsm_bt_offset(lane, kPitch));
    const unsigned q_bt = smem_u32(sQ + d_col0 + ldsm_bt_offset(lane, kPitch));
    // P^T, dS^T as A operands from shared memory (kWM > 1): rows = this warp's keys, k = queries.
    const unsigned p_a = smem_u32(sP + key_row0 * kPPitch + ldsm_a_offset(lane, kPPitch));
    const unsigned ds_a = smem_u32(sdS + key_row0 * kPPitch + ldsm_a_offset(lane, kPPitch));
    // dQ's share: dS as the A operand from the [key][query] sdS (.trans), K as B from [key][dim] (.trans)
    const int dq_row0 = (warp % kDqWM) * kDqMTiles * 16, dq_col0 = (warp / kDqWM) * kDqDCols;
    const unsigned ds_at = smem_u32(sdS + dq_row0 + ldsm_at_offset(lane, kPPitch));
    const unsigned k_bt = smem_u32(sK + dq_col0 + ldsm_bt_offset(lane, kPitch));
    const int g = lane >> 2, t = lane & 3;

    float acc_dk[kMT][kNTilesD][4], acc_dv[kMT][kNTilesD][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nd = 0; nd < kNTilesD; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[mt][nd][e] = acc_dv[mt][nd][e] = 0.f;
    int* pending = nullptr;  // kDeterministic: the semaphore of the last dQ tile added into, and its turn
    int pending_turn = 0;

    // The (query head, query block) pairs this key block visits, in backward_pair's order. With two buffers,
    // pair it + 1's Q, dO tiles and LSE, D rows load into one while pair it is computed.
    const int n_m = max(m_block_end - m_block_first, 0), n_it = group * n_m;
    auto pair = [&](int it, int& head, int& m_block) {
        backward_pair<kIsDeterministic>(it, head_k, group, m_block_first, m_block_end, head, m_block);
    };
    auto load_block = [&](int it, int buf) {
        int head, m_block;
        pair(it, head, m_block);
        const int row_begin = m_block * kBlockM;
        const int tid_m = recompute(tid);  // copy offsets and predicates per query block, not loop-carried
        // [3] Load the Q, dO tiles and LSE, D rows of one query block
        const T* q = static_cast<const T*>(p.fwd.q) + seq.q_offset(batch, p.fwd.q_batch_stride, p.fwd.q_row_stride) +
                     head * p.fwd.q_head_stride + row_begin * p.fwd.q_row_stride;
        const T* dout = static_cast<const T*>(p.dout) + seq.q_offset(batch, p.do_batch_stride, p.do_row_stride) +
                        head * p.do_head_stride + row_begin * p.do_row_stride;
        cp_async_tile<kBlockM, kHeadDim, kPitch, kNThreads>(sQ + buf * kBlockM * kPitch, q, p.fwd.q_row_stride,
                                                           seqlen_q - row_begin, head_dim, tid_m);
        cp_async_tile<kBlockM, kHeadDim, kPitch, kNThreads>(sdO + buf * kBlockM * kPitch, dout, p.do_row_stride,
                                                           seqlen_q - row_begin, head_dim, tid_m);
        // raw LSE and D, 0 past seqlen_q (those rows' Q and dO are 0 too, so they add nothing anywhere)
        const float* lse = static_cast<const float*>(p.fwd.lse) +
                           seq.row_offset(batch, head, p.fwd.lse_batch_stride, p.fwd.lse_head_stride) + row_begin;
        const float* dsum = static_cast<const float*>(p.dsum) +
                            seq.row_offset(batch, head, p.dsum_batch_stride, p.dsum_head_stride) + row_begin;
        for (int i = tid_m; i < kBlockM; i += kNThreads) {
            const bool valid = row_begin + i < seqlen_q;
            cp_async_4(smem_u32(sLse + buf * kBlockM + i), valid ? lse + i : lse, valid);
            cp_async_4(smem_u32(sD + buf * kBlockM + i), valid ? dsum + i : dsum, valid);
        }
        cp_async_commit();
    };
    if (kStages == 2 && n_it > 0) load_block(0, 0);
    // With two buffers the next pair's tiles load just after the iteration's first barrier, which then also ends
    // the previous pair, and no barrier ends the iteration (1.01-1.04x at d = 64 and 128). Deterministic at d <= 64
    // keeps the barrier at the end, the next pair loading before this one's wait: there the other form ran 2-3 %
    // slower (an H100, bench/RESULTS.md 2026-12-06 (m)).
    constexpr bool kEndBarrier = kStages == 1 || (kIsDeterministic && kHeadDim <= 64);

    for (int it = 0; it < n_it; ++it) {
        const int buf = kStages == 2 ? it & 1 : 0;
        if (kStages == 1) load_block(it, 0);
        if (kStages == 2 && kEndBarrier && it + 1 < n_it) {
            load_block(it + 1, buf ^ 1);
            cp_async_wait<1>();  // this pair's tiles (and K, V) have landed; the next pair's are in flight
        } else {
            cp_async_wait<0>();  // this pair's tiles (and K, V) have landed
        }
        // Without kEndBarrier this barrier also ends the previous pair: every warp is done with the other buffer
        // and with sP, sdS, so the next pair's tiles load into it now
        __syncthreads();
        if (kStages == 2 && !kEndBarrier && it + 1 < n_it) load_block(it + 1, buf ^ 1);
        int head, m_block;
        pair(it, head, m_block);
        const int row_begin = m_block * kBlockM;
        const Mod mod(p.fwd, batch, head, mask.shift);
        const float scale_log2 = mod.score_log2(p.fwd);
        const unsigned qo_buf = buf * kBlockM * kPitch * sizeof(T);  // bytes: this pair's Q, dO buffer
        const float* lse_rows = sLse + buf * kBlockM;
        const float* d_rows = sD + buf * kBlockM;
        // kDeterministic: this key block's turn at the dQ tile; the semaphore is read now, its value waited for
        // before the adds, so the read's latency is hidden
        int turn = 0, seen = 0;
        int* semaphore = nullptr;
        if constexpr (kIsDeterministic) {
            turn = dq_turn<kBlockM, kBlockN>(mask, m_block, n_block);
            semaphore = dq_semaphores(p, batch, head) + m_block;
            if (tid == 0) seen = load_acquire(semaphore);
        }

        // [4] Recompute S = Q K^T, score modifiers, mask, P = exp2(S * scale_log2 - LSE * log2(e))
        // Computed as S^T = K Q^T: acc_s[mt][ni][2h + e] is key key_row0 + 16*mt + g + 8h,
        // query q_col0 + 8*ni + 2t + e (C layout).
        float acc_s[kMT][kNTilesQ][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int ni = 0; ni < kNTilesQ; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][ni][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            unsigned a[kMT][4];  // K rows key_row0 + 16*mt + {g, g+8}, dims 16*ks + {2t,2t+1,2t+8,2t+9}
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], k_a + (mt * 16 * kPitch + ks * 16) * sizeof(T));
#pragma unroll
            for (int np = 0; np < kNTilesQ / 2; ++np) {
                unsigned b[4];  // {b0,b1} of queries 16*np + g, then of 16*np + 8 + g (k = dims)
                ldmatrix_x4(b, q_b + qo_buf + (np * 16 * kPitch + ks * 16) * sizeof(T));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_16816<T>(acc_s[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<T>(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
        float dcap[kMT][kNTilesCap][4];  // d logit / d(scale * S): the softcap's 1 - tanh^2
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            const int key0 = key_begin + key_row0 + 16 * mt;
            if constexpr ((kVariant & kSoftcap) != 0) {
                for_each_score_t<kNTilesQ>(key0, row_begin + q_col0, lane,
                                           [&](float& x, float& dc, int row, int col) {
                                               x = mod.apply(x, row, col, dc);
                                           },
                                           acc_s[mt], dcap[mt]);
            } else if constexpr (Mod::kTransform) {
                for_each_score_t<kNTilesQ>(key0, row_begin + q_col0, lane, [&](float& x, int row, int col) {
                    float dc;
                    x = mod.apply(x, row, col, dc);
                }, acc_s[mt]);
            }
        }
        if (mask.template needs_mask<kBlockM, kBlockN>(m_block, n_block)) {
            // d >= 128: lane through recompute, so that the walk's row / column offsets are not kept
            // across the loop (without it d = 128 spills; with it d = 32 does: the compile gate)
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
                for_each_score_t<kNTilesQ>(key_begin + key_row0 + 16 * mt, row_begin + q_col0,
                                           kHeadDim >= 128 ? recompute(lane) : lane,
                                           [&](float& x, int row, int col) {
                    if (!mask.visible(row, col)) x = neg_inf<float>();
                }, acc_s[mt]);
        }
#pragma unroll
        for (int ni = 0; ni < kNTilesQ; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float lse_off = lse_to_log2_offset(lse_rows[q_col0 + 8 * ni + 2 * t + (e & 1)]);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) acc_s[mt][ni][e] = exp2f(acc_s[mt][ni][e] * scale_log2 - lse_off);
            }
        if constexpr (kIsDropout) {
            // a dropped entry is kept as -P: dV reads max(P, 0) (its 1 / (1 - p) applied at the
            // store), dS below tells kept from dropped by the sign
            const Dropout dropout(p.fwd, batch, head);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
                dropout.for_each_keep_t(acc_s[mt], key_begin + key_row0 + 16 * mt, row_begin + q_col0, lane,
                                        [](float& x, bool kept) { if (!kept) x = -x; });
        }
        if constexpr (kPInSmem) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
                acc_to_smem<T, kNTilesQ, kPPitch>(sP, acc_s[mt], key_row0 + 16 * mt, q_col0, lane, 1.f, kIsDropout);
            __syncthreads();
        }

        // [5] dV += P^T dO
        // A = P^T (keys x queries, k-slice kq = queries 16*kq..+15); B = dO (k = queries, n = dims).
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
            unsigned a[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                if constexpr (kPInSmem) {
                    ldmatrix_x4(a[mt], p_a + (mt * 16 * kPPitch + kq * 16) * sizeof(T));
                } else {
                    acc_to_a<T>(a[mt], acc_s[mt][2 * kq], acc_s[mt][2 * kq + 1], kIsDropout);
                }
            }
#pragma unroll
            for (int np = 0; np < kNTilesD / 2; ++np) {
                unsigned b[4];  // {b0,b1} of dims d_col0 + 16*np + g, then + 8 (k = queries), via .trans
                ldmatrix_x4_trans(b, do_bt + qo_buf + (kq * 16 * kPitch + np * 16) * sizeof(T));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_16816<T>(acc_dv[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<T>(acc_dv[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        if constexpr (kAliasP) __syncthreads();  // every warp's dV has read sP, which dS^T overwrites

        // [6] dP = dO V^T
        // Computed as dP^T = V dO^T, same layout as acc_s.
        float acc_dp[kMT][kNTilesQ][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int ni = 0; ni < kNTilesQ; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dp[mt][ni][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            unsigned a[kMT][4];  // V rows key_row0 + 16*mt + {g, g+8}, dims 16*ks + ...
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], v_a + (mt * 16 * kPitch + ks * 16) * sizeof(T));
#pragma unroll
            for (int np = 0; np < kNTilesQ / 2; ++np) {
                unsigned b[4];  // dO rows as B columns, as for Q above
                ldmatrix_x4(b, do_b + qo_buf + (np * 16 * kPitch + ks * 16) * sizeof(T));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_16816<T>(acc_dp[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<T>(acc_dp[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        // [7] dS = P * (dP - D)
        // D belongs to the query (column): query q_col0 + 8*ni + 2t + (e & 1). Dropout: dL/dP is
        // dP / (1 - p) where kept and 0 where dropped (there acc_s = -P, so dS = -P * D = acc_s * D).
        // Softcap: times 1 - tanh^2.
#pragma unroll
        for (int ni = 0; ni < kNTilesQ; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float d = d_rows[q_col0 + 8 * ni + 2 * t + (e & 1)];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    const float s = acc_s[mt][ni][e], dp = acc_dp[mt][ni][e];
                    float ds;
                    if constexpr (kIsDropout) {
                        ds = s >= 0.f ? s * (dp * static_cast<float>(p.fwd.dropout_scale) - d) : s * d;
                    } else {
                        ds = s * (dp - d);
                    }
                    if constexpr ((kVariant & kSoftcap) != 0) ds *= dcap[mt][ni][e];
                    acc_dp[mt][ni][e] = ds;
                }
            }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            acc_to_smem<T, kNTilesQ, kPPitch>(sdS, acc_dp[mt], key_row0 + 16 * mt, q_col0, lane, 1.f);
        // kDeterministic: hand the previous tile on, then wait for this tile's turn. The release is cumulative:
        // every thread's adds, ordered before it by the barriers, are visible to whoever acquires the new count
        // (as CUTLASS's semaphore: no fence in the adding threads). An iteration late, so that the release
        // rarely waits for adds in flight. (The barrier here is not needed for that, but without it ptxas
        // spills the every-variant d = 64 config on sm_90.)
        if constexpr (kIsDeterministic) {
            if (pending != nullptr) {
                __syncthreads();
                if (tid == 0) store_release(pending, pending_turn + 1);
            }
            pending = semaphore;
            pending_turn = turn;
            if (tid == 0) {
                while (seen != turn) seen = load_acquire(semaphore);
            }
        }
        __syncthreads();  // sdS (and sP, the dQ tile's turn) for every warp

        // [8] dK += dS^T Q
        // A = dS^T (keys x queries); B = Q (k = queries, n = dims).
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq) {
            unsigned a[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                if constexpr (kPInSmem) {
                    ldmatrix_x4(a[mt], ds_a + (mt * 16 * kPPitch + kq * 16) * sizeof(T));
                } else {
                    acc_to_a<T>(a[mt], acc_dp[mt][2 * kq], acc_dp[mt][2 * kq + 1]);
                }
            }
#pragma unroll
            for (int np = 0; np < kNTilesD / 2; ++np) {
                unsigned b[4];
                ldmatrix_x4_trans(b, q_bt + qo_buf + (kq * 16 * kPitch + np * 16) * sizeof(T));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_16816<T>(acc_dk[mt][2 * np], a[mt], b[0], b[1]);
                    mma_16816<T>(acc_dk[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        // [9] dQ_accum += dS K: fp32 atomic adds, in key-block order when deterministic
        // A = dS (queries x keys, k-slice ks = keys 16*ks..+15); B = K (k = keys, n = dims).
        {
            float* dq_rows = dq_accum_rows(p, seq, batch, head) + (row_begin + dq_row0 + g) * p.dq_accum_row_stride +
                             dq_col0 + 2 * t;
#pragma unroll 1  // one chunk's registers at a time (unrolled, d = 224 with every variant spills)
            for (int c = 0; c < kDqDCols; c += kDqChunk) {
                float acc_dq[kDqMTiles][kDqChunk / 8][4];
#pragma unroll
                for (int mi = 0; mi < kDqMTiles; ++mi)
#pragma unroll
                    for (int nd = 0; nd < kDqChunk / 8; ++nd)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc_dq[mi][nd][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < kBlockN / 16; ++ks) {
                    unsigned a[kDqMTiles][4];  // reloaded per chunk: held for all chunks they spill at d = 128
#pragma unroll
                    for (int mi = 0; mi < kDqMTiles; ++mi)
                        ldmatrix_x4_trans(a[mi], ds_at + (mi * 16 + ks * 16 * kPPitch) * sizeof(T));
#pragma unroll
                    for (int np = 0; np < kDqChunk / 16; ++np) {
                        unsigned b[4];  // {b0,b1} of dims c + 16*np + g, then + 8 (k = keys), via .trans
                        ldmatrix_x4_trans(b, k_bt + (ks * 16 * kPitch + c + np * 16) * sizeof(T));
#pragma unroll
                        for (int mi = 0; mi < kDqMTiles; ++mi) {
                            mma_16816<T>(acc_dq[mi][2 * np], a[mi], b[0], b[1]);
                            mma_16816<T>(acc_dq[mi][2 * np + 1], a[mi], b[2], b[3]);
                        }
                    }
                }
                // acc_dq[mi][nd][2h + e]: query row dq_row0 + 16 mi + g + 8h, dim dq_col0 + c + 8 nd + 2t + e
#pragma unroll
                for (int mi = 0; mi < kDqMTiles; ++mi)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (row_begin + dq_row0 + 16 * mi + g + 8 * h >= seqlen_q) continue;
                        float* dst = dq_rows + (16 * mi + 8 * h) * p.dq_accum_row_stride + c;
#pragma unroll
                        for (int nd = 0; nd < kDqChunk / 8; ++nd)
                            red_add2(dst + 8 * nd, acc_dq[mi][nd][2 * h], acc_dq[mi][nd][2 * h + 1]);
                    }
            }
        }
        if constexpr (kEndBarrier) __syncthreads();  // every warp is done with this buffer and sP, sdS
    }
    // kDeterministic: hand the last dQ tile on once every warp's adds are done (after a barrier: the loop's last,
    // or below)
    if (kEndBarrier && kIsDeterministic && pending != nullptr && tid == 0) store_release(pending, pending_turn + 1);

    // [10] Store dK * softmax_scale and dV
    cp_async_wait<0>();  // K, V copies may still be in flight when no query block was visited
    __syncthreads();
    if (!kEndBarrier && kIsDeterministic && pending != nullptr && tid == 0) store_release(pending, pending_turn + 1);
    // Without kEndBarrier at d <= 64, lane through recompute: else its row / column offsets stay live across the
    // loop (spills on sm_90)
    const int lane_st = kHeadDim <= 64 && !kEndBarrier ? recompute(lane) : lane;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        acc_to_smem<T, kNTilesD, kPitch>(sK, acc_dk[mt], key_row0 + 16 * mt, d_col0, lane_st,
                                         static_cast<float>(p.fwd.softmax_scale));
        acc_to_smem<T, kNTilesD, kPitch>(sV, acc_dv[mt], key_row0 + 16 * mt, d_col0, lane_st,
                                         kIsDropout ? static_cast<float>(p.fwd.dropout_scale) : 1.f);
    }
    __syncthreads();
    T* dk = static_cast<T*>(p.dk) + seq.k_offset(batch, p.dk_batch_stride, p.dk_row_stride) + head_k * p.dk_head_stride +
            key_begin * p.dk_row_stride;
    T* dv = static_cast<T*>(p.dv) + seq.k_offset(batch, p.dv_batch_stride, p.dv_row_stride) + head_k * p.dv_head_stride +
            key_begin * p.dv_row_stride;
    const int tid_st = recompute(tid);  // not the K / V loads' offsets and predicates, kept across the loop
    store_tile<kBlockN, kHeadDim, kPitch, kNThreads>(dk, p.dk_row_stride, sK, seqlen_k - key_begin, head_dim, tid_st);
    store_tile<kBlockN, kHeadDim, kPitch, kNThreads>(dv, p.dv_row_stride, sV, seqlen_k - key_begin, head_dim, tid_st);
}

// dQ = dQ_accum * softmax_scale in T, 8 dims (two float4 loads, one 16-byte store) per thread and step.
// Grid (ceil(seqlen_q / kBlockM), nheads, batch); no shared memory; one instantiation per dtype, as for
// the preprocess (config: head_dim = block_n = 0). head_dim is a multiple of 8 (the API's rule).
template <typename T, int kBlockM, int kNWarps, int kVariant>
__global__ void __launch_bounds__(kNWarps * 32) flash_bwd_postprocess(const __grid_constant__ BwdParams p) {
    // [11] Postprocess: dQ = dQ_accum * softmax_scale in the input dtype
    const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo<(kVariant & kVarlen) != 0> seq(p.fwd, batch);
    const int row_begin = m_block * kBlockM;
    const int rows = min(kBlockM, seq.seqlen_q - row_begin);
    if (rows <= 0) return;  // varlen: a shorter sequence than the grid's
    const float* acc = dq_accum_rows(p, seq, batch, head) + row_begin * p.dq_accum_row_stride;
    T* dq = static_cast<T*>(p.dq) + seq.q_offset(batch, p.dq_batch_stride, p.dq_row_stride) +
            head * p.dq_head_stride + row_begin * p.dq_row_stride;
    const float scale = static_cast<float>(p.fwd.softmax_scale);
    const int chunks = p.fwd.head_dim / 8, n = rows * chunks;
    // kInFlight chunks a thread loaded before any is stored, so that their loads' latencies overlap
    constexpr int kThreads = kNWarps * 32, kInFlight = 4;
    for (int i0 = threadIdx.x; i0 < n; i0 += kInFlight * kThreads) {
        float4 x[kInFlight][2];
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
            const int i = i0 + k * kThreads, r = i / chunks, c = (i - r * chunks) * 8;
            if (i < n) {
                // (row_begin: a multiple of 4, which dq_accum_col's swizzle keys on)
                const float* chunk = acc + r * p.dq_accum_row_stride + dq_accum_col(r, c, p.dq_accum_swizzle);
                x[k][0] = *reinterpret_cast<const float4*>(chunk);
                x[k][1] = *reinterpret_cast<const float4*>(chunk + 4);
            }
        }
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
            const int i = i0 + k * kThreads, r = i / chunks, c = (i - r * chunks) * 8;
            if (i < n) {
                const float4 x0 = x[k][0], x1 = x[k][1];
                *reinterpret_cast<uint4*>(dq + r * p.dq_row_stride + c) =
                    make_uint4(pack2<T>(x0.x * scale, x0.y * scale), pack2<T>(x0.z * scale, x0.w * scale),
                               pack2<T>(x1.x * scale, x1.y * scale), pack2<T>(x1.z * scale, x1.w * scale));
            }
        }
    }
}

}  // namespace cuflash
