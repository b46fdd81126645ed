"""Mirror of kernels_cu/flash_fwd_sm90.cu: the Hopper forward (a producer and consumer warpgroups) in Numba-CUDA.

`make_flash_fwd_sm90(cfg)` turns a KernelConfig of kernel "flash_fwd_sm90" into a kernel as make_flash_fwd
does (proto/flash_fwd.py): head_dim (a multiple of 64: whole swizzle slabs), block_m (64 per consumer
warpgroup), block_n, warps (4 per warpgroup: 4 * (1 + block_m / 64)), the variant bits and the
accumulator type are closure constants. Launch and arguments are make_flash_fwd's:

    grid (ceil(seqlen_q / block_m), nheads, batch), block (warps * 32,)
    kernel[grid, block](q, k, v, o, lse, softmax_scale, scale_log2, *variant_args)

Every variant, varlen and KV caches (SEQUSED), dense or paged (PAGED: k and v page pools, block_table's pages),
as the CUDA kernel. As TMA sees them, varlen's packed arrays are one entry: a tile past a sequence's end loads
the next sequence's rows (zeros only past the array); a cache's tile past an entry's key count, rows of
whatever the cache held. Both are masked in S and zeroed in the V tile by the consumers (zero_v_tail). A
paged tile comes in boxes of config.kv_box_rows rows, each from its page (load_kv).

Roles, as in CUDA. Warpgroup 0 is the producer: its thread 0 copies the Q tile once, then K and V of
each key block (last to first) into a ring of kStages stages (Sm90FwdSmem::kStages, config.sm90_stages),
a tile waiting until the consumers have released the stage's previous use. Warpgroup 1 + c is consumer
c, owning query rows 64 c .. 64 c + 63 of the block: S of key block i, the score modifiers and mask,
the online softmax, and O += P V of block i - 1, whose rescale of acc_o (`correction`) waits until
that P V has completed.

What stands in for Hopper's machinery (the kernel's names are kept: k_full, v_full, k_empty, v_empty,
producer, consumer, issue_s, softmax_of, issue_pv, release, to_p_frag, n_blocks, use; stage is CUDA's
s = i % kStages):
  mbarriers    `bars`, a shared int32 array in the kernel's order (q_full, k_full[kStages],
               v_full[kStages], k_empty[kStages], v_empty[kStages]) counting arrivals. Phase p of a
               barrier of `count` arrivals has completed once (p + 1) * count have arrived; CUDA's
               waiters name the parity p & 1, so p must be the barrier's last completed phase.
  TMA          the producer thread copies a tile itself (flash_fwd.load_tile: zeros past the sequence
               and head_dim, as a box past the tensor's extent) and then arrives on the full barrier;
               CUDA arrives first (expect_tx: the bytes to come) and the copy engine completes the phase.
  asynchrony   none: lock-step phases separated by syncthreads. Each phase is one consumer iteration
               (every consumer warpgroup at once), then the producer issues every copy whose stage
               has been released (where CUDA's producer blocks in mbarrier_wait, this one stops, and
               goes on after the next phase). A consumer's mbarrier_wait therefore finds its phase
               complete; one that would block, or find the barrier a phase further, raises (a broken
               schedule).
  wgmma        per-thread FMA loops marked `# CUDA: wgmma`, complete when they return: S of block i
               and P V of block i - 1 are computed in CUDA's issue order, the softmax after both.
  turns        CUDA's consumers take turns issuing their wgmma (named barriers kTurn + consumer) so
               that one's softmax runs under the others' products (one consumer: none, and two blocks
               share an SM); here they compute in the same phase.
  setmaxnreg   no counterpart (the producer gives its registers to the consumers).
Layout: a consumer's 128 threads share its 64 rows as thread_layout(64, ., 128) says (proto/flash_fwd.py),
not 16 rows per warp in the mma C layout. The row reductions go through shared memory with block-wide
barriers (softmax.py), which every thread must reach: the producer warpgroup's threads pass them
holding no rows (zero-row views of the local arrays), where CUDA's producer has returned and its
consumers reduce with warp shuffles. P goes through shared memory (sP) where CUDA keeps it in registers
(p_frag); O goes out through the warpgroup's rows of sQ, as in CUDA.

Arithmetic is proto/flash_fwd.py's (see there): acc_t accumulation, dot products summed in order, P not
rounded to 16 bits, one Philox call per dropout keep flag, math.tanh for the softcap.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, int32, uint64

from ..config import PAGED, SEQUSED, longest_first, sm90_stages
from .dropout import keep
from .flash_fwd import LOG2E, acc_type, load_tile, thread_layout, variant_flags
from .mask import n_block_range, needs_mask, score_mod, score_mod_init, visible
from .seqinfo import batch_index, seq_info, used_keys
from .softmax import softmax_finalize, softmax_init, softmax_rescale, softmax_update_correction

WARPGROUP = 128  # threads
WG_ROWS = 64  # query rows of one consumer warpgroup


@cuda.jit(device=True)
def mbarrier_arrive(bars, bar):
    # sm90.cuh mbarrier_arrive (for a full barrier also the copy's complete_tx): one more arrival
    cuda.atomic.add(bars, bar, 1)


@cuda.jit(device=True)
def mbarrier_try_wait(bars, bar, phase, count):
    # Has phase `phase` of the barrier (`count` arrivals a phase) completed? (mbarrier.try_wait.parity)
    return bars[bar] >= (phase + 1) * count


@cuda.jit(device=True)
def mbarrier_wait(bars, bar, phase, count):
    # CUDA spins on try_wait.parity until the phase completes. A parity names phases p and p + 2 alike, and a
    # full barrier a phase further would mean the stage was refilled unread: the phase waited for must be
    # the barrier's last completed one. The lock-step schedule completes it before its waiter comes.
    if bars[bar] // count != phase + 1:
        raise RuntimeError("sm90 prototype: an mbarrier wait did not find its phase the last completed one")


@functools.lru_cache(maxsize=None)
def make_flash_fwd_sm90(cfg, stages=None):
    """The Hopper forward kernel for one KernelConfig (any dtype here; CUDA's is 16-bit only).

    stages: the ring's depth, Sm90FwdSmem::kStages (config.sm90_stages) where None; a smaller one (>= 2)
    makes the simulator's few key blocks go round the ring.
    """
    if cfg.kernel != "flash_fwd_sm90":
        raise ValueError(f"make_flash_fwd_sm90 builds flash_fwd_sm90, not {cfg.kernel}")
    if cfg.block_m <= 0 or cfg.block_m % WG_ROWS or cfg.warps != 4 * (1 + cfg.block_m // WG_ROWS):
        raise ValueError(f"flash_fwd_sm90: block_m must be a multiple of {WG_ROWS} and warps 4 * (1 + block_m / "
                         f"{WG_ROWS}) (a producer and one consumer warpgroup per {WG_ROWS} rows), got "
                         f"block_m={cfg.block_m}, warps={cfg.warps}")
    if cfg.head_dim <= 0 or cfg.head_dim % 64:
        raise ValueError(f"flash_fwd_sm90: head_dim must be whole 64-column slabs, got {cfg.head_dim}")
    STAGES = sm90_stages(cfg) if stages is None else stages
    if STAGES < 2:
        raise ValueError(f"flash_fwd_sm90: two stages at least (one loads while the other is read), got {STAGES}")
    HEAD_DIM = cfg.head_dim
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    CONSUMERS = cfg.warps // 4 - 1  # kConsumers
    LONGEST_FIRST = longest_first(cfg.variant, hopper=True)  # mask.cuh query_block<kVariant, true>
    IS_LOCAL, IS_SOFTCAP, IS_ALIBI, IS_DROPOUT, IS_VARLEN, TRANSFORM = variant_flags(cfg)
    IS_SEQUSED = bool(cfg.variant & SEQUSED)
    IS_PAGED = bool(cfg.variant & PAGED)
    if IS_PAGED and BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"flash_fwd_sm90: a paged cache takes key blocks of a power of two, got {BLOCK_N}")
    ACC = acc_type(cfg.dtype)
    # A consumer thread's share of its warpgroup's 64 rows: rows row0 + r * ROW_STRIDE, columns lane + j * TPR
    TPR, ROW_STRIDE, RPT, S_CPT = thread_layout(WG_ROWS, BLOCK_N, WARPGROUP)
    O_CPT = thread_layout(WG_ROWS, HEAD_DIM, WARPGROUP)[3]
    # mbarriers: indices into `bars`, in the kernel's order (q_full, then k_full(s) .. v_empty(s) below);
    # arrivals a phase
    Q_FULL = 0
    N_BARS = 1 + 4 * STAGES
    FULL_COUNT = 1  # the producer's arrive.expect_tx (the bytes complete the phase)
    EMPTY_COUNT = 4 * CONSUMERS  # lane 0 of every consumer warp

    # The kernel's k_full(s), v_full(s), k_empty(s), v_empty(s): the barriers of stage s
    @cuda.jit(device=True)
    def k_full(stage):
        return 1 + stage

    @cuda.jit(device=True)
    def v_full(stage):
        return 1 + STAGES + stage

    @cuda.jit(device=True)
    def k_empty(stage):
        return 1 + 2 * STAGES + stage

    @cuda.jit(device=True)
    def v_empty(stage):
        return 1 + 3 * STAGES + stage

    @cuda.jit(device=True)
    def block_coordinates(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, window_left, window_right):
        # [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x if LONGEST_FIRST else cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        # the cache's capacity: k's rows, or (paged: k a page pool) max_pages * page_size
        capacity = block_table.shape[1] * k.shape[1] if IS_PAGED else k.shape[1]
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch, q.shape[1],
                                                        capacity)
        seqlen_k = used_keys(IS_SEQUSED, seqused_k, batch, seqlen_k)
        head_k = head // (q.shape[2] // k.shape[2])  # GQA
        n_block_min, n_block_end = n_block_range(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k,
                                                 BLOCK_M, BLOCK_N, m_block)
        return (m_block, head, batch, head_k, q_start, k_start, seqlen_q, seqlen_k, n_block_min,
                n_block_end)

    @cuda.jit(device=True)
    def load_kv(s, g, tma_batch, head_k, k_row0, key0, block_table, batch):
        # K or V of the key block from key0 into s (CUDA: load_kv's TMA boxes). Dense, varlen: the array's rows
        # from the entry's row k_row0, zeros past the array. Paged: boxes of kv_box_rows rows, each at its page's
        # row, zeros for a page outside the pool or past the table (capacity: max_pages * page_size keys)
        head_dim = g.shape[3]
        if not IS_PAGED:
            load_tile(s, g, tma_batch, k_row0 + key0, head_k, g.shape[1], head_dim, 0, 1)
            return
        page_size = g.shape[1]
        box = min(page_size & -page_size, BLOCK_N)  # config.kv_box_rows
        for r0 in range(0, BLOCK_N, box):
            key = key0 + r0
            page = block_table[batch, key // page_size] if key < block_table.shape[1] * page_size else -1
            for r in range(box):
                for c in range(s.shape[1]):
                    s[r0 + r, c] = 0
                    if 0 <= page < g.shape[0] and c < head_dim:
                        s[r0 + r, c] = g[page, key % page_size + r, head_k, c]

    @cuda.jit(device=True)
    def producer(tile, bars, sQ, sK, sV, q, k, v, tma_batch, head, head_k, q_row0, k_row0, row_begin, n_block_end,
                 n_blocks, block_table, batch):
        # [2] Producer: the Q tile, then K and V of each key block into a free stage of the ring (TMA)
        # The CUDA producer's copies in its order, from copy `tile` on: -1 the Q tile, 2 i K of key block i
        # (n_block = n_block_end - 1 - i), 2 i + 1 its V. Returns the first copy it could not issue yet
        # (its stage still in use: CUDA's producer blocks there in mbarrier_wait), or 2 n_blocks: all issued.
        # Rows are the array's (TMA's box): from the entry's row q_row0 / k_row0, zeros past the array only.
        head_dim = q.shape[3]
        if tile < 0:
            load_tile(sQ, q, tma_batch, q_row0 + row_begin, head, q.shape[1], head_dim, 0, 1)  # CUDA: TMA
            mbarrier_arrive(bars, Q_FULL)
            tile = 0
        while tile < 2 * n_blocks:
            i = tile // 2
            stage = i % STAGES
            use = i // STAGES
            key0 = (n_block_end - 1 - i) * BLOCK_N
            # each tile waits until the consumers are done with the stage's last use of it
            if tile % 2 == 0:
                if use > 0 and not mbarrier_try_wait(bars, k_empty(stage), use - 1, EMPTY_COUNT):
                    break
                load_kv(sK[stage], k, tma_batch, head_k, k_row0, key0, block_table, batch)  # CUDA: TMA
                mbarrier_arrive(bars, k_full(stage))
            else:
                if use > 0 and not mbarrier_try_wait(bars, v_empty(stage), use - 1, EMPTY_COUNT):
                    break
                load_kv(sV[stage], v, tma_batch, head_k, k_row0, key0, block_table, batch)  # CUDA: TMA
                mbarrier_arrive(bars, v_full(stage))
            tile += 1
        return tile

    @cuda.jit(device=True)
    def issue_s(i, acc_s, bars, sQ, sK, row0, lane):
        # [3] S = Q K^T (wgmma from shared memory)
        stage = i % STAGES
        mbarrier_wait(bars, k_full(stage), i // STAGES, FULL_COUNT)
        for r in range(acc_s.shape[0]):
            row = row0 + r * ROW_STRIDE
            for j in range(S_CPT):
                c = lane + j * TPR
                x = ACC(0)
                for d in range(HEAD_DIM):  # CUDA: wgmma (Q, K from shared memory; fp32 in registers)
                    x += sQ[row, d] * sK[stage, c, d]
                acc_s[r, j] = x

    @cuda.jit(device=True)
    def softmax_of(i, acc_s, correction, row_max, row_sum, sRed, row0, lane, m_block, n_block_end, row_begin,
                   seqlen_q, seqlen_k, window_left, window_right, tanh_in, bias, score_log2, seed_lo, seed_hi,
                   bh, offset, dropout_threshold):
        # S of key block i (in acc_s, complete) -> P of block i in acc_s; the rescale of acc_o in `correction`.
        # Every thread calls it (softmax_update_correction's barriers); the producer's threads with no rows.
        n_block = n_block_end - 1 - i
        key0 = n_block * BLOCK_N
        shift = seqlen_k - seqlen_q
        # [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
        if TRANSFORM:
            for r in range(acc_s.shape[0]):
                row = row_begin + row0 + r * ROW_STRIDE
                for j in range(S_CPT):
                    x, dcap = score_mod(IS_SOFTCAP, IS_ALIBI, tanh_in, bias, shift, acc_s[r, j], row,
                                        key0 + lane + j * TPR)
                    acc_s[r, j] = x
        if needs_mask(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, m_block, n_block):
            for r in range(acc_s.shape[0]):
                row = row_begin + row0 + r * ROW_STRIDE
                for j in range(S_CPT):
                    if not visible(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, row, key0 + lane + j * TPR):
                        acc_s[r, j] = -math.inf
        # [5] Online softmax: update row_max and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2); acc_o's rescale waits for P V
        # (always the running max: config.BOUNDED is not this kernel's, choose_forward drops it)
        softmax_update_correction(acc_s, correction, row_max, row_sum, sRed, row0, ROW_STRIDE, lane, TPR, score_log2,
                                  False)
        if IS_DROPOUT:  # dropped entries are 0 in P V only: row_sum keeps them
            for r in range(acc_s.shape[0]):
                row = row_begin + row0 + r * ROW_STRIDE
                for j in range(S_CPT):
                    if not keep(seed_lo, seed_hi, bh, offset, dropout_threshold, row, key0 + lane + j * TPR):
                        acc_s[r, j] = 0

    @cuda.jit(device=True)
    def issue_pv(i, acc_o, bars, sP, sV, row0, lane):
        # [6] O += dropout(P) V (wgmma, P from registers)
        stage = i % STAGES
        mbarrier_wait(bars, v_full(stage), i // STAGES, FULL_COUNT)
        for r in range(acc_o.shape[0]):
            row = row0 + r * ROW_STRIDE
            for j in range(O_CPT):
                c = lane + j * TPR
                a = acc_o[r, j]
                for n in range(BLOCK_N):  # CUDA: wgmma (P from registers, V from shared memory)
                    a += sP[row, n] * sV[stage, n, c]
                acc_o[r, j] = a

    @cuda.jit(device=True)
    def release(bars, empty, tid):
        # This warp is done with key block i's K (its S has completed) or V (its P V has): the stage's tile
        # can take the next key block's while the other tile is still in use.
        if tid % 32 == 0:
            mbarrier_arrive(bars, empty)

    @cuda.jit(device=True)
    def zero_v_tail(bars, sV, seqlen_k, n_block_end, consumer, tid):
        # Varlen, KV cache: the first key block visited (i = 0) may end past the entry's keys, its V rows there
        # the next sequence's or stale; the consumers zero them in stage 0 (CUDA: 16-byte stores shared out
        # over the consumer warpgroups, fence.proxy.async, a named barrier of theirs; here the caller's
        # syncthreads)
        first = seqlen_k - (n_block_end - 1) * BLOCK_N  # first row past the entry's keys
        if not (IS_VARLEN or IS_SEQUSED) or first >= BLOCK_N:
            return
        mbarrier_wait(bars, v_full(0), 0, FULL_COUNT)
        for e in range(consumer * WARPGROUP + tid, (BLOCK_N - first) * HEAD_DIM, WARPGROUP * CONSUMERS):
            sV[0, first + e // HEAD_DIM, e % HEAD_DIM] = 0

    @cuda.jit(device=True)
    def to_p_frag(acc_s, sP, row0, lane):
        # P of the last key block as the next P V's A operand (CUDA: p_frag, this thread's registers)
        for r in range(acc_s.shape[0]):
            for j in range(S_CPT):
                sP[row0 + r * ROW_STRIDE, lane + j * TPR] = acc_s[r, j]

    @cuda.jit
    def flash_fwd_sm90(q, k, v, o, lse, softmax_scale, scale_log2, cu_seqlens_q, cu_seqlens_k, window_left,
                       window_right, softcap, alibi_slopes, alibi_batch_stride, seed_lo, seed_hi, offset,
                       dropout_threshold, dropout_scale, seqused_k, block_table):
        sQ = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sK = cuda.shared.array((STAGES, BLOCK_N, HEAD_DIM), ACC)
        sV = cuda.shared.array((STAGES, BLOCK_N, HEAD_DIM), ACC)
        sP = cuda.shared.array((BLOCK_M, BLOCK_N), ACC)
        sRed = cuda.shared.array((BLOCK_M, TPR), ACC)
        bars = cuda.shared.array(N_BARS, int32)

        (m_block, head, batch, head_k, q_start, k_start, seqlen_q, seqlen_k, n_block_min,
         n_block_end) = block_coordinates(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, window_left,
                                          window_right)
        row_begin = m_block * BLOCK_M
        if row_begin >= seqlen_q:
            return  # varlen: a shorter sequence than the grid's
        bidx = batch_index(IS_VARLEN, batch)  # CUDA: tma_batch, the entry's index in the arrays
        n_blocks = n_block_end - n_block_min
        warpgroup = cuda.threadIdx.x // WARPGROUP

        if cuda.threadIdx.x == 0:  # mbarrier_init: no arrivals yet (the counts are FULL_COUNT, EMPTY_COUNT)
            for b in range(N_BARS):
                bars[b] = 0
        cuda.syncthreads()

        # Producer (CUDA: setmaxnreg.dec to kProducerRegs; thread 0 issues every copy, then the warpgroup
        # returns). Here its thread 0 fills the ring now and goes on after each phase below.
        tile = -1
        if cuda.threadIdx.x == 0:
            tile = producer(tile, bars, sQ, sK, sV, q, k, v, bidx, head, head_k, q_start, k_start, row_begin,
                            n_block_end, n_blocks, block_table, batch)
        cuda.syncthreads()  # the copies have landed (CUDA: the consumers wait on q_full, k_full, v_full)

        # Consumers (CUDA: setmaxnreg.inc to kConsumerRegs). consumer -1: the producer warpgroup, no rows.
        consumer = warpgroup - 1
        tid = cuda.threadIdx.x - WARPGROUP * warpgroup
        rows = RPT if consumer >= 0 else 0
        wg_row0 = WG_ROWS * consumer
        row0 = wg_row0 + tid // TPR if consumer >= 0 else 0  # this thread's first row inside the block
        lane = tid % TPR
        nheads = q.shape[2]
        head_dim = q.shape[3]
        slope = alibi_slopes[batch * alibi_batch_stride + head] if IS_ALIBI else ACC(0)
        lse_scale, tanh_in, bias, score_log2 = score_mod_init(IS_SOFTCAP, softmax_scale, softcap, slope, scale_log2,
                                                              ACC(LOG2E))
        bh = uint64(batch * nheads + head)  # dropout: Philox counter word 2

        acc_o = cuda.local.array((RPT, O_CPT), ACC)[:rows]
        acc_s = cuda.local.array((RPT, S_CPT), ACC)[:rows]
        row_max = cuda.local.array(RPT, ACC)[:rows]
        row_sum = cuda.local.array(RPT, ACC)[:rows]
        correction = cuda.local.array(RPT, ACC)[:rows]
        lse_rows = cuda.local.array(RPT, ACC)[:rows]
        for r in range(rows):
            for j in range(O_CPT):
                acc_o[r, j] = 0
        softmax_init(row_max, row_sum, False)

        if consumer >= 0:
            mbarrier_wait(bars, Q_FULL, 0, FULL_COUNT)
        # Phase i: S of key block i with P V of block i - 1 (CUDA: both in flight, S completing first), the
        # softmax of S, then acc_o's rescale once P V has completed. Block 0 has no P V to overlap with, and
        # acc_o is still 0 (no rescale); the P V of the last block follows the loop.
        for i in range(n_blocks):
            if consumer >= 0:
                # CUDA: take_turn(), the two wgmma groups (wgmma_commit each), pass_turn(): the consumer
                # warpgroups issue one after the other (named barriers), then wgmma_wait<1> for S alone
                issue_s(i, acc_s, bars, sQ, sK, row0, lane)
                if i > 0:
                    issue_pv(i - 1, acc_o, bars, sP, sV, row0, lane)
                release(bars, k_empty(i % STAGES), tid)
            softmax_of(i, acc_s, correction, row_max, row_sum, sRed, row0, lane, m_block, n_block_end, row_begin,
                       seqlen_q, seqlen_k, window_left, window_right, tanh_in, bias, score_log2, seed_lo, seed_hi,
                       bh, offset, dropout_threshold)
            if consumer >= 0 and i > 0:  # CUDA: after wgmma_wait<0>, P V has completed
                release(bars, v_empty((i - 1) % STAGES), tid)
                softmax_rescale(acc_o, correction)
            cuda.syncthreads()  # every P V of block i - 1 has read sP
            to_p_frag(acc_s, sP, row0, lane)
            if consumer >= 0 and i == 0:
                zero_v_tail(bars, sV, seqlen_k, n_block_end, consumer, tid)
            cuda.syncthreads()  # end of the phase: the releases are in
            if cuda.threadIdx.x == 0:
                tile = producer(tile, bars, sQ, sK, sV, q, k, v, bidx, head, head_k, q_start, k_start, row_begin,
                                n_block_end, n_blocks, block_table, batch)
            cuda.syncthreads()  # and the copies they allowed have landed
        if consumer >= 0 and n_blocks > 0:
            issue_pv(n_blocks - 1, acc_o, bars, sP, sV, row0, lane)
            release(bars, v_empty((n_blocks - 1) % STAGES), tid)

        # [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
        # (softmax_scale here is lse_scale: the held units' factor, softcap with a softcap)
        softmax_finalize(acc_o, row_max, row_sum, lse_rows, sRed, row0, ROW_STRIDE, lane, TPR, lse_scale)

        # [8] Store O and LSE: O through this warpgroup's own rows of sQ (its last S = Q K^T has completed)
        o_scale = dropout_scale if IS_DROPOUT else ACC(1)
        for r in range(rows):
            for j in range(O_CPT):
                sQ[row0 + r * ROW_STRIDE, lane + j * TPR] = acc_o[r, j] * o_scale
        cuda.syncthreads()  # CUDA: named barrier 1 + consumer, the warpgroup's 128 threads
        if consumer >= 0:
            for e in range(tid, WG_ROWS * HEAD_DIM, WARPGROUP):
                r = wg_row0 + e // HEAD_DIM
                c = e % HEAD_DIM
                if row_begin + r < seqlen_q and c < head_dim:
                    o[bidx, q_start + row_begin + r, head, c] = sQ[r, c]
            if lane == 0:
                for r in range(rows):
                    row = row_begin + row0 + r * ROW_STRIDE
                    if row < seqlen_q:
                        lse[bidx, head, q_start + row] = lse_rows[r]

    return flash_fwd_sm90
