"""Mirror of kernels_cu/flash_bwd_sm90.cu: the Hopper backward (a producer and consumer warpgroups) in Numba-CUDA.

`make_flash_bwd_sm90(cfg)` turns a KernelConfig of kernel "flash_bwd_sm90" into a kernel as make_flash_bwd
does (proto/flash_bwd.py): head_dim (a multiple of 64: whole swizzle slabs), block_m (a multiple of 64),
block_n (64 keys per consumer warpgroup), warps (4 per warpgroup: 4 * (1 + block_n / 64)) or, at head_dim 256
(SPLIT_DIMS), block_m 64, block_n 64 and 12 warps (two consumers sharing the keys), the variant bits and the
accumulator type are closure constants. It runs between flash_bwd.py's preprocess and postprocess
(D, the zeroed dq_accum; dQ = dq_accum * softmax_scale), with make_flash_bwd's arguments and grid (dq_accum's
width may exceed the call's head_dim, as CUDA's dq_accum_row_stride: its extra columns take dQ's zeros):

    grid config.backward_grid(cfg, nheads_k, seqlen_k, batch), block (warps * 32,)
    kernel[grid, block](q, k, v, do, lse, dsum, dk, dv, dq_accum, semaphore, partial, softmax_scale, scale_log2,
                        *variant_args)

Dense and varlen batches, as the CUDA kernel (config.SM90_BWD_UNSERVED raises, and varlen with ALiBi and dropout
together, config.SM90_BWD_VARLEN_UNSERVED). As TMA sees them, varlen's packed arrays are one entry: a tile past a
sequence's end loads the next sequence's rows (zeros only past the array), which the consumers zero (K and V once, Q
and dO of a sequence's last query block: zero_tails). semaphore: flash_bwd.py's, int32 (batch, nheads, ceil(seqlen_q
/ 64)) zeroed by the preprocess, read and written only when DETERMINISTIC. QUERY_SPLIT: twice the grid's x (CUDA's
clusters of two blocks: x = 2 head_k + the block's rank); each rank takes a half of the key block's query blocks,
and `partial` (nheads_k, batch, ceil(seqlen_k / block_n), 2, block_n, head_dim) of the accumulator type stands for
the cluster's shared memory: rank 0 puts its dK, dV there, rank 1 adds them to its own and stores. The simulator
runs rank 0 first (blocks one after another in np.ndindex order, x slowest), so rank 1 finds them there; CUDA's
ranks run at once and pass two cluster barriers. Without QUERY_SPLIT `partial` is never read.

Roles, as in CUDA. Warpgroup 0 is the producer: thread 0 copies K and V once, then the Q and dO tiles of
each (query head, query block) pair `it` into a ring of kStages = 2 stages, each tile waiting until the
consumers have released the stage's previous use (q_empty, do_empty); warp 1 writes the pair's LSE offsets
and D rows into the stage and arrives on q_full beside the Q tile. Warpgroup 1 + c is consumer c, owning keys
64 c .. 64 c + 63: per pair S^T, dP^T, P^T, dV and dS^T (with block_m 128, over two halves of 64 queries in turn:
CUDA's kHalves), dK, its dS into sdS, then its own 64 x 64 tile of dQ = dS K over all the block's keys into the
block's dQ tile in shared memory, sDqAcc. Producer warp 2, the dQ warp, adds sDqAcc's rows into dq_accum (CUDA:
bulk reduces by the copy engine), so that the consumers issue no atomics.
DETERMINISTIC: key blocks add into each dQ tile first to last while each visits its query blocks last to
first (flash_bwd.py's backward_pair and dq_turn, as backward.cuh). sDqAcc has two buffers (by it & 1), and
producer warp 2 + (it & 1) adds pair it's: it waits for the tile's turn, adds, and hands the tile on once its
adds have completed (CUDA: so that one dQ warp's waits run under the other's pair).
SPLIT_DIMS (CUDA's kSplitDims, d = 256, where dK and dV over 64 keys would take 256 registers a thread): both
consumers own the block's 64 keys. Consumer c computes S^T, dP^T, P^T and dS^T for queries q0 = 32 c .. 32 c + 31
only and puts P^T and dS^T into keys x queries tiles, sPt and sdS (by it & 1); once both halves are in
(kDsReady), it computes for dims d0 = 128 c .. 128 c + 127 dQ = dS K (all 64 queries, from sdS read
transposed), dV += P^T dO and dK += dS^T Q (its A operands from shared memory). No sDqAcc: once both consumers'
GEMMs have completed (kDsReady), the pair's stage is free, and each writes its share of the dQ tile over it,
rows 0-31 over sQ[stage] and 32-63 over sdO[stage]; the pair's dQ warp adds the tile as above and gives the
stage back to the producer (q_empty beside the consumers' threads, do_empty alone). [10]: each consumer writes
its dims of every key into sK, sV, then (kDsReady) stores keys 32 c .. 32 c + 31.

What stands in for Hopper's machinery, as in proto/flash_fwd_sm90.py (the kernel's names are kept; stage is
CUDA's s = it % kStages):
  mbarriers    `bars`, a shared int32 array in the kernel's order (kv_full, q_full[2], do_full[2],
               q_empty[2], do_empty[2]) counting arrivals; q_full takes 1 + 32 a phase (the TMA thread
               and warp 1's lanes), q_empty 128 per consumer (every thread: each read LSE and D), do_empty
               4 per consumer (lane 0 of each warp); SPLIT_DIMS: the dQ warp's 1 more on q_empty, do_empty its
               alone (once the dQ tile over the stage is read).
  TMA          the producer thread copies a tile itself (flash_fwd.load_tile: zeros past the sequence
               and head_dim, as a box past the tensor's extent), then arrives on the full barrier.
  asynchrony   none: lock-step phases, one consumer iteration each (every consumer at once), then the
               producer's thread 0 and warp 1 issue whatever the releases allowed. A consumer's wait
               that would block, or find the barrier a phase further, raises (a broken schedule).
  wgmma        per-thread FMA loops marked `# CUDA: wgmma`, complete when they return.
  registers    the A operands CUDA keeps in registers (P^T for dV, dS^T for dK: a_frag) go through
               shared memory (sA), since a thread's partner holds the other half of its key's row
               (SPLIT_DIMS: none, CUDA's are in shared memory too).
  named bars   CUDA's kDsReady (every consumer), kStore + consumer (one warpgroup), kDqFree + 4 b and
               kDqFull + 4 b (the consumers and the dQ warp of sDqAcc buffer b; SPLIT_DIMS: b = it & 1, no
               kDqFree) are syncthreads.
  bulk reduce  the dQ warp's lane 0 adds sDqAcc's rows below seqlen_q element by element, dq_accum's
               columns (CUDA: one reduce of those rows, contiguous in sDqAcc as in the accumulator, whose rows
               are the compiled head dim wide; SPLIT_DIMS two, of the rows over sQ and over sdO; then a wait
               until the engine has read them, or with DETERMINISTIC until the adds have completed;
               SPLIT_DIMS without DETERMINISTIC gives sQ back once its rows are read, sdO after).
  swizzle      none: dq_accum's columns are plain here (CUDA's sDqAcc and accumulator chunks of 8 columns
               are swizzled by dq_accum_col, which the postprocess undoes).
  setmaxnreg   no counterpart.
Layout: a consumer's 128 threads hold its 64 keys two to a key (thread_layout(64, ., 128), proto/flash_fwd.py),
each half of the key's queries (S^T, dP^T) and dims (dK, dV); the dQ tile likewise two threads to a query row.
SPLIT_DIMS: the same over the consumer's 32 queries and 128 dims; its dQ share (64 queries x 128 dims) two
threads to a query row, dQ row r over row r % 32 of sQ[stage] (r < 32) or sdO[stage] (CUDA: 32 rows of fp32 fill
the stage's 64 rows of 16-bit elements).
The producer warpgroup's threads pass every barrier holding nothing (CUDA's producer has returned).

Arithmetic is proto/flash_bwd.py's: acc_t accumulation, dot products summed in order, P and dS not rounded to
16 bits (CUDA rounds them to T for the wgmma), one Philox call per dropout keep flag, math.tanh for the softcap.
"""

from __future__ import annotations

import functools
import math

from numba import config as numba_config
from numba import cuda, int32, uint64

from ..config import (DETERMINISTIC, PAGED, QUERY_SPLIT, SEQUSED, SM90_BWD_UNSERVED, SM90_BWD_VARLEN_UNSERVED, VARLEN,
                      sm90_split_dims)
from .dropout import keep
from .flash_bwd import LOG2E, backward_block, backward_pair, dq_turn, lse_to_log2_offset
from .flash_fwd import acc_type, load_tile, thread_layout, variant_flags
from .flash_fwd_sm90 import WARPGROUP, mbarrier_arrive, mbarrier_try_wait, mbarrier_wait
from .mask import dcap_of, m_block_range, n_block_range, needs_mask, score_mod, score_mod_init, visible
from .seqinfo import batch_index, seq_info

WG_KEYS = 64  # keys of one consumer warpgroup
DQ_TILE = 64  # dQ = dS K in 64 x 64 tiles


@functools.lru_cache(maxsize=None)
def make_flash_bwd_sm90(cfg):
    """The Hopper backward kernel for one KernelConfig (any dtype here; CUDA's is 16-bit only)."""
    if cfg.kernel != "flash_bwd_sm90":
        raise ValueError(f"make_flash_bwd_sm90 builds flash_bwd_sm90, not {cfg.kernel}")
    if cfg.variant & SM90_BWD_UNSERVED:
        names = [n for bit, n in ((SEQUSED, "seqused"), (PAGED, "paged")) if cfg.variant & bit]
        raise ValueError(f"flash_bwd_sm90 serves no KV cache: not {', '.join(names)}")
    if cfg.variant & VARLEN and cfg.variant & SM90_BWD_VARLEN_UNSERVED == SM90_BWD_VARLEN_UNSERVED:
        raise ValueError("flash_bwd_sm90 does not serve varlen with ALiBi and dropout together (CUDA's spills)")
    # kSplitDims (head_dim > 128): dK and dV over 64 keys would take 256 registers a thread in CUDA; the two
    # consumers share 64 keys, each taking half the queries of S^T, dP^T and half the dims of dK, dV, dQ
    SPLIT_DIMS = sm90_split_dims(cfg.head_dim)
    if SPLIT_DIMS:
        if cfg.block_n != WG_KEYS or cfg.warps != 12:
            raise ValueError(f"flash_bwd_sm90: head_dim > 128 (split dims) takes block_n {WG_KEYS} and warps 12 (a "
                             f"producer and two consumer warpgroups sharing the keys), got block_n={cfg.block_n}, "
                             f"warps={cfg.warps}")
    elif cfg.block_n <= 0 or cfg.block_n % WG_KEYS or cfg.warps != 4 * (1 + cfg.block_n // WG_KEYS):
        raise ValueError(f"flash_bwd_sm90: block_n must be a multiple of {WG_KEYS} and warps 4 * (1 + block_n / "
                         f"{WG_KEYS}) (a producer and one consumer warpgroup per {WG_KEYS} keys), got "
                         f"block_n={cfg.block_n}, warps={cfg.warps}")
    if cfg.head_dim <= 0 or cfg.head_dim % 64 or cfg.block_m <= 0 or cfg.block_m % 64:
        raise ValueError(f"flash_bwd_sm90: head_dim and block_m must be whole 64-column slabs, got "
                         f"head_dim={cfg.head_dim}, block_m={cfg.block_m}")
    if SPLIT_DIMS and (cfg.head_dim != 256 or cfg.block_m != 64):
        # CUDA: each consumer's dims whole slabs (d0's descriptors) and a wgmma N it has (128); dQ = dS K one
        # wgmma's 64 query rows, and sP^T, sdS^T rows of 64 queries (one 128-byte row a key)
        raise ValueError(f"flash_bwd_sm90: split dims take head_dim 256 and block_m 64, got head_dim={cfg.head_dim}, "
                         f"block_m={cfg.block_m}")
    HEAD_DIM = cfg.head_dim
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    CONSUMERS = cfg.warps // 4 - 1  # kConsumers
    DQ_TILES = (BLOCK_M // DQ_TILE) * (HEAD_DIM // DQ_TILE)  # kDqTiles
    if not SPLIT_DIMS and DQ_TILES != CONSUMERS:
        raise ValueError(f"flash_bwd_sm90: dQ takes one 64 x 64 tile per consumer, got {DQ_TILES} tiles for "
                         f"{CONSUMERS} consumers")
    STAGES = 2  # kStages
    IS_LOCAL, IS_SOFTCAP, IS_ALIBI, IS_DROPOUT, IS_VARLEN, TRANSFORM = variant_flags(cfg)
    IS_DETERMINISTIC = bool(cfg.variant & DETERMINISTIC)  # kIsDeterministic
    IS_QUERY_SPLIT = bool(cfg.variant & QUERY_SPLIT)  # kIsQuerySplit
    KEEP_DCAP = IS_SOFTCAP and not IS_DROPOUT  # kKeepDcap: the softcap's derivative kept from [5] to [7]
    if IS_QUERY_SPLIT and IS_DETERMINISTIC:
        raise ValueError("flash_bwd_sm90: QUERY_SPLIT does not take DETERMINISTIC (the turns count key blocks, not "
                         "halves of them)")
    if IS_QUERY_SPLIT and SPLIT_DIMS:
        raise ValueError("flash_bwd_sm90: QUERY_SPLIT does not take split dims (rank 0's partials are whole rows of "
                         "dK, dV)")
    QUERIES = BLOCK_M // 2 if SPLIT_DIMS else BLOCK_M  # kQueries: a consumer's queries of S^T
    # kQH, kHalves: steps [4]-[8] over halves of 64 queries in turn where a consumer has 128 (d = 64 at 128 x 128)
    QH = min(QUERIES, 64)
    HALVES = QUERIES // QH
    DIMS = HEAD_DIM // 2 if SPLIT_DIMS else HEAD_DIM  # kDims: a consumer's dims of dK, dV (and dQ)
    STORE_ROWS = BLOCK_N // 2 if SPLIT_DIMS else WG_KEYS  # kStoreRows: the dK, dV rows a consumer stores
    DQ_WARP = 2  # the producer warpgroup's warp that adds sDqAcc buffer 0 into dq_accum (DQ_WARP + b buffer b)
    DQ_BUFFERS = 2 if IS_DETERMINISTIC else 1  # kDqBuffers: sDqAcc's
    SIMULATED = bool(numba_config.ENABLE_CUDASIM)  # blocks one after another: a turn never comes by waiting
    ACC = acc_type(cfg.dtype)
    # A consumer thread's share: key wg_key0 + tid // TPR, queries (S^T) qh + lane + j * TPR of a half from qh,
    # dims (dK, dV) d0 + lane + j * TPR; of the dQ tile, query row tid // TPR, dims lane + j * TPR (SPLIT_DIMS: of
    # all 64 queries, d0 + lane + j * TPR)
    TPR, _, _, S_CPT = thread_layout(WG_KEYS, QH, WARPGROUP)
    Q_CPT = QUERIES // TPR  # of all the consumer's queries (sA's columns)
    D_CPT = thread_layout(WG_KEYS, DIMS, WARPGROUP)[3]
    DQ_CPT = thread_layout(BLOCK_M, DIMS, WARPGROUP)[3] if SPLIT_DIMS else thread_layout(DQ_TILE, DQ_TILE, WARPGROUP)[3]
    # the dQ tile two threads to a query row as the keys (dq_r = tid // TPR; columns lane + j * TPR)
    assert TPR == 2 and thread_layout(DQ_TILE, DQ_TILE, WARPGROUP)[0] == TPR
    # SPLIT_DIMS: dS^T and P^T in keys x queries tiles (CUDA's sdS^T over sdS's bytes, sP^T), their wgmmas' A
    # operands from shared memory (no sA), and no sDqAcc
    SDS_SHAPE = (2, BLOCK_N, BLOCK_M) if SPLIT_DIMS else (2, BLOCK_M, BLOCK_N)
    SPT_SHAPE = (2, BLOCK_N, BLOCK_M) if SPLIT_DIMS else (1, 1, 1)
    SA_SHAPE = (1, 1, 1) if SPLIT_DIMS else (2, BLOCK_N, BLOCK_M)
    DQ_ACC_SHAPE = (1, 1, 1) if SPLIT_DIMS else (DQ_BUFFERS, BLOCK_M, HEAD_DIM)
    # mbarriers: indices into `bars`, in the kernel's order; arrivals a phase
    KV_FULL = 0
    N_BARS = 1 + 4 * STAGES
    FULL_COUNT = 1  # kv_full, do_full: the producer's arrive.expect_tx (the bytes complete the phase)
    Q_FULL_COUNT = 1 + 32  # the TMA thread, and warp 1's lanes with LSE and D
    # every consumer thread (each has read the stage's LSE and D rows), lane 0 of every consumer warp;
    # SPLIT_DIMS: and the dQ warp, once it has added the dQ tile written over the stage
    Q_EMPTY_COUNT = 128 * CONSUMERS + SPLIT_DIMS
    DO_EMPTY_COUNT = 1 if SPLIT_DIMS else 4 * CONSUMERS

    @cuda.jit(device=True)
    def q_full(stage):
        return 1 + stage

    @cuda.jit(device=True)
    def do_full(stage):
        return 1 + STAGES + stage

    @cuda.jit(device=True)
    def q_empty(stage):
        return 1 + 2 * STAGES + stage

    @cuda.jit(device=True)
    def do_empty(stage):
        return 1 + 3 * STAGES + stage

    @cuda.jit(device=True)
    def block_coordinates(q, k, cu_seqlens_q, cu_seqlens_k, window_left, window_right):
        # [2] Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
        # (QUERY_SPLIT: x = 2 head_k + the block's rank in its cluster, and each rank takes a half of them)
        rank = cuda.blockIdx.x % 2 if IS_QUERY_SPLIT else 0  # CUDA: cluster_rank()
        head_k = cuda.blockIdx.x // 2 if IS_QUERY_SPLIT else cuda.blockIdx.x
        n_block, batch = backward_block(IS_DETERMINISTIC)
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch, q.shape[1],
                                                        k.shape[1])
        group = q.shape[2] // k.shape[2]
        m_block_first, m_block_end = m_block_range(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k,
                                                   BLOCK_M, BLOCK_N, n_block)
        if IS_QUERY_SPLIT:
            mid = m_block_first + (max(m_block_end - m_block_first, 0) + 1) // 2
            if rank == 0:
                m_block_end = mid
            else:
                m_block_first = mid
        return rank, head_k, batch, n_block, q_start, k_start, seqlen_q, seqlen_k, group, m_block_first, m_block_end

    @cuda.jit(device=True)
    def pair(it, head_k, group, m_block_first, m_block_end):  # (head, m_block) of pair it: backward_pair's order
        return backward_pair(IS_DETERMINISTIC, it, head_k, group, m_block_first, m_block_end)

    @cuda.jit(device=True)
    def producer(tile, bars, sK, sV, sQ, sdO, q, k, v, do, tma_batch, q_row0, k_row0, head_k, group, key_begin,
                 m_block_first, m_block_end, n_it):
        # [3] Producer: K and V, then the Q, dO tiles (TMA) and LSE, D rows of each query block into a free stage
        # Thread 0's copies in CUDA's order, from copy `tile` on: -1 K and V, 2 it the Q tile of pair it,
        # 2 it + 1 its dO tile. Returns the first copy it could not issue yet (its stage still in use: CUDA
        # blocks there in mbarrier_wait), or 2 n_it: all issued. Rows are the array's (TMA's box): from the
        # entry's row q_row0 / k_row0, zeros past the array only.
        head_dim = q.shape[3]
        if tile < 0:
            # CUDA: TMA, one box per slab
            load_tile(sK, k, tma_batch, k_row0 + key_begin, head_k, k.shape[1], head_dim, 0, 1)
            load_tile(sV, v, tma_batch, k_row0 + key_begin, head_k, k.shape[1], head_dim, 0, 1)
            mbarrier_arrive(bars, KV_FULL)
            tile = 0
        while tile < 2 * n_it:
            it = tile // 2
            stage = it % STAGES
            use = it // STAGES
            head, m_block = pair(it, head_k, group, m_block_first, m_block_end)
            # each tile waits until the consumers are done with the stage's last use of it
            if tile % 2 == 0:
                if use > 0 and not mbarrier_try_wait(bars, q_empty(stage), use - 1, Q_EMPTY_COUNT):
                    break
                load_tile(sQ[stage], q, tma_batch, q_row0 + m_block * BLOCK_M, head, q.shape[1], head_dim, 0, 1)
                mbarrier_arrive(bars, q_full(stage))
            else:
                if use > 0 and not mbarrier_try_wait(bars, do_empty(stage), use - 1, DO_EMPTY_COUNT):
                    break
                load_tile(sdO[stage], do, tma_batch, q_row0 + m_block * BLOCK_M, head, do.shape[1], head_dim, 0, 1)
                mbarrier_arrive(bars, do_full(stage))
            tile += 1
        return tile

    @cuda.jit(device=True)
    def producer_rows(it, bars, sLse, sD, lse, dsum, bidx, q_row0, head_k, group, m_block_first, m_block_end, n_it,
                      seqlen_q, lane):
        # The producer's warp 1, from pair `it` on: LSE as exp2's offset (lse_to_log2_offset: +inf for a row
        # that saw no key, so its P is 0) and D; rows past seqlen_q take offset +inf and D 0 (they add
        # nothing). Returns the first pair whose stage is still in use, or n_it.
        while it < n_it:
            stage = it % STAGES
            use = it // STAGES
            head, m_block = pair(it, head_k, group, m_block_first, m_block_end)
            if use > 0 and not mbarrier_try_wait(bars, q_empty(stage), use - 1, Q_EMPTY_COUNT):
                break
            for r in range(lane, BLOCK_M, 32):
                row = m_block * BLOCK_M + r
                if row < seqlen_q:
                    sLse[stage, r] = lse_to_log2_offset(lse[bidx, head, q_row0 + row])
                    sD[stage, r] = dsum[bidx, head, q_row0 + row]
                else:
                    sLse[stage, r] = math.inf
                    sD[stage, r] = 0
            mbarrier_arrive(bars, q_full(stage))
            it += 1
        return it

    @cuda.jit(device=True)
    def producer_turn(tile, rows_it, bars, sK, sV, sQ, sdO, sLse, sD, q, k, v, do, lse, dsum, bidx, q_start, k_start,
                      head_k, group, key_begin, m_block_first, m_block_end, n_it, seqlen_q):
        # The producer's thread 0 and warp 1 issue what the releases allowed (CUDA: they run beside the
        # consumers), then every thread waits until the copies have landed. Returns (tile, rows_it)
        if cuda.threadIdx.x == 0:
            tile = producer(tile, bars, sK, sV, sQ, sdO, q, k, v, do, bidx, q_start, k_start, head_k, group,
                            key_begin, m_block_first, m_block_end, n_it)
        if cuda.threadIdx.x // 32 == 1:
            rows_it = producer_rows(rows_it, bars, sLse, sD, lse, dsum, bidx, q_start, head_k, group, m_block_first,
                                    m_block_end, n_it, seqlen_q, cuda.threadIdx.x % 32)
        cuda.syncthreads()
        return tile, rows_it

    @cuda.jit(device=True)
    def zero_tails(a, b, first, rows, consumer, tid):
        # Varlen: rows first .. rows - 1 of two tiles (K and V, or a stage's Q and dO) past the sequence, the
        # next one's, set to zero by the consumers (CUDA: zero_tile_rows, fence_proxy_async, named barrier
        # kDsReady; here the caller's syncthreads)
        for e in range(consumer * WARPGROUP + tid, (rows - first) * HEAD_DIM, WARPGROUP * CONSUMERS):
            a[first + e // HEAD_DIM, e % HEAD_DIM] = 0
            b[first + e // HEAD_DIM, e % HEAD_DIM] = 0

    @cuda.jit(device=True)
    def issue_s_dp(it, half, acc_s, acc_dp, bars, sK, sV, sQ, sdO, key, qh, lane):
        # [4] S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory)
        # This half's queries from qh (SPLIT_DIMS: half of the block's, wgmma N = 32); the first half waits for the
        # stage's tiles
        stage = it % STAGES
        phase = it // STAGES
        if half == 0:
            mbarrier_wait(bars, q_full(stage), phase, Q_FULL_COUNT)
        for j in range(S_CPT):
            c = qh + lane + j * TPR
            x = ACC(0)
            for d in range(HEAD_DIM):  # CUDA: wgmma (K, Q from shared memory; fp32 in registers)
                x += sK[key, d] * sQ[stage, c, d]
            acc_s[j] = x
        if half == 0:
            mbarrier_wait(bars, do_full(stage), phase, FULL_COUNT)
        for j in range(S_CPT):
            c = qh + lane + j * TPR
            x = ACC(0)
            for d in range(HEAD_DIM):  # CUDA: wgmma (V, dO from shared memory)
                x += sV[key, d] * sdO[stage, c, d]
            acc_dp[j] = x

    @cuda.jit(device=True)
    def p_of(it, acc_s, dcap, sLse, col, qh, lane, row_begin, m_block, n_block, seqlen_q, seqlen_k, window_left,
             window_right, tanh_in, bias, score_log2, seed_lo, seed_hi, bh, offset, dropout_threshold):
        # [5] Score modifiers, mask, P^T = exp2(S^T * scale_log2 - LSE * log2(e)), dropout
        # This thread's scores: key col, queries row_begin + qh + lane + j * TPR
        shift = seqlen_k - seqlen_q
        if TRANSFORM:
            for j in range(S_CPT):
                x, dc = score_mod(IS_SOFTCAP, IS_ALIBI, tanh_in, bias, shift, acc_s[j], row_begin + qh + lane + j * TPR,
                                  col)
                acc_s[j] = x
                if KEEP_DCAP:
                    dcap[j] = dc  # the softcap's 1 - t^2 for [7] (CUDA: rounded to fp16, two to a register)
        if needs_mask(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, m_block, n_block):
            for j in range(S_CPT):
                if not visible(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k,
                               row_begin + qh + lane + j * TPR, col):
                    acc_s[j] = -math.inf
        stage = it % STAGES
        for j in range(S_CPT):
            acc_s[j] = math.exp2(acc_s[j] * score_log2 - sLse[stage, qh + lane + j * TPR])
        if IS_DROPOUT:
            # a dropped entry is kept as -P: dV reads max(P, 0) (its 1 / (1 - p) applied at the store), dS
            # tells kept from dropped by the sign
            for j in range(S_CPT):
                if not keep(seed_lo, seed_hi, bh, offset, dropout_threshold, row_begin + qh + lane + j * TPR, col):
                    acc_s[j] = -acc_s[j]

    @cuda.jit(device=True)
    def to_a_frag(acc, sA, which, key, qh, lane, relu):
        # CUDA's acc_to_a: a half's accumulator, queries from qh, as a wgmma's A operand (the half's slots of
        # a_frag, this thread's registers: P^T, then dS^T; relu: the dropped -P as 0)
        for j in range(S_CPT):
            x = acc[j]
            sA[which, key, qh + lane + j * TPR] = max(x, ACC(0)) if relu else x

    @cuda.jit(device=True)
    def store_keys_by_queries(tile, it, acc, key, q0, lane, relu):
        # SPLIT_DIMS: this consumer's queries of P^T (sPt) or dS^T (sdS), its acc_to_a fragments, into the
        # pair's keys x queries tile (by it & 1: one written while the other consumer may still read the last
        # pair's), where both consumers' wgmmas of [9] read them (CUDA: stmatrix, swizzled)
        for j in range(S_CPT):
            x = acc[j]
            tile[it & 1, key, q0 + lane + j * TPR] = max(x, ACC(0)) if relu else x

    @cuda.jit(device=True)
    def issue_dv(it, acc_dv, a_src, a_tile, sdO, key, d0, lane, r0, rows):
        # [6] dV += P^T dO (wgmma, P^T from registers)
        # P^T: a_src[a_tile], sA[0] (CUDA: a_frag, registers), SPLIT_DIMS sPt[it & 1] (CUDA: from shared memory
        # too, issued in [9]), its queries r0 .. r0 + rows - 1; this consumer's dims from d0
        stage = it % STAGES
        for j in range(D_CPT):
            c = d0 + lane + j * TPR
            a = acc_dv[j]
            for r in range(r0, r0 + rows):  # CUDA: wgmma (P^T from registers, dO from shared memory)
                a += a_src[a_tile, key, r] * sdO[stage, r, c]
            acc_dv[j] = a

    @cuda.jit(device=True)
    def ds_of(it, acc_s, acc_dp, dcap, sD, sLse, col, qh, lane, row_begin, seqlen_q, seqlen_k, bias, score_log2,
              dropout_scale):
        # [7] dS^T = P^T (dP^T - D)
        # D belongs to the query (column). Dropout: dL/dP is dP / (1 - p) where kept and 0 where dropped
        # (there acc_s = -P, so dS = -P * D = acc_s * D). Softcap: times 1 - tanh^2.
        stage = it % STAGES
        shift = seqlen_k - seqlen_q
        for j in range(S_CPT):
            d = sD[stage, qh + lane + j * TPR]
            if IS_DROPOUT:
                if acc_s[j] >= 0:
                    ds = acc_s[j] * (acc_dp[j] * dropout_scale - d)
                else:
                    ds = acc_s[j] * d
            else:
                ds = acc_s[j] * (acc_dp[j] - d)
            if KEEP_DCAP:
                ds *= dcap[j]
            elif IS_SOFTCAP:
                # with dropout, the softcap's 1 - t^2 from P (held score = (log2 P + LSE offset) / score_log2);
                # P = 0 (masked, underflowed) gives dS = 0
                pv = abs(acc_s[j])
                if pv == 0:
                    ds = ACC(0)
                else:
                    x = (math.log2(pv) + sLse[stage, qh + lane + j * TPR]) / score_log2
                    ds *= dcap_of(IS_ALIBI, bias, shift, x, row_begin + qh + lane + j * TPR, col)
            acc_dp[j] = ds

    @cuda.jit(device=True)
    def issue_dk(it, acc_dk, a_src, a_tile, sQ, key, d0, lane):
        # [8] dK += dS^T Q (wgmma, dS^T from registers)
        # dS^T: a_src[a_tile], sA[1] (CUDA: registers; kDkFromSmem, d = 128 with plain scores and no mask of key
        # blocks: sdS read transposed, and the next pair's S^T and dP^T issued while it runs), SPLIT_DIMS sdS[it & 1]
        # (CUDA: sdS^T, issued in [9]),
        # every query of it; this consumer's dims from d0
        stage = it % STAGES
        for j in range(D_CPT):
            c = d0 + lane + j * TPR
            a = acc_dk[j]
            for r in range(BLOCK_M):  # CUDA: wgmma (dS^T from registers, Q from shared memory)
                a += a_src[a_tile, key, r] * sQ[stage, r, c]
            acc_dk[j] = a

    @cuda.jit(device=True)
    def store_ds(it, sA, sdS, key, lane):
        # [9] dS into shared memory; dQ = dS K (wgmma) into sDqAcc, which the dQ warp adds into dQ_accum
        # dS (queries x keys) into sdS, this consumer's keys, all its queries' dS^T from sA[1] (CUDA: a_frag's,
        # by transposed 16-bit stores, swizzled)
        ds_tile = it & 1  # two sdS: one written while the other may still be read
        for j in range(Q_CPT):
            sdS[ds_tile, lane + j * TPR, key] = sA[1, key, lane + j * TPR]

    @cuda.jit(device=True)
    def issue_dq(it, acc_dq, sdS, sK, dq_row0, dq_col0, row, lane):
        # This consumer's 64 x 64 tile of dS K over all the block's keys: query row dq_row0 + row, dims
        # dq_col0 + lane + j * TPR (SPLIT_DIMS: 64 x 128, dims from d0; A is sdS^T read as dS, CUDA's transposed wgmma)
        ds_tile = it & 1
        if SPLIT_DIMS:
            for j in range(DQ_CPT):
                c = dq_col0 + lane + j * TPR
                a = ACC(0)
                for n in range(BLOCK_N):  # CUDA: wgmma (dS^T, K from shared memory, both transposed)
                    a += sdS[ds_tile, n, dq_row0 + row] * sK[n, c]
                acc_dq[j] = a
            return
        for j in range(DQ_CPT):
            c = dq_col0 + lane + j * TPR
            a = ACC(0)
            for n in range(BLOCK_N):  # CUDA: wgmma (dS, K from shared memory)
                a += sdS[ds_tile, dq_row0 + row, n] * sK[n, c]
            acc_dq[j] = a

    @cuda.jit(device=True)
    def tile_turn(it, head_k, group, m_block_first, m_block_end, n_block, seqlen_q, seqlen_k, window_left,
                  window_right):
        # pair it's dQ tile (head, m_block) and this key block's turn at it
        head, m_block = pair(it, head_k, group, m_block_first, m_block_end)
        return head, m_block, dq_turn(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                      m_block, n_block)

    @cuda.jit(device=True)
    def wait_turn(it, semaphore, batch, head_k, group, m_block_first, m_block_end, n_block, seqlen_q, seqlen_k,
                  window_left, window_right, lane):
        # DETERMINISTIC, pair it's dQ warp: wait for the tile's turn (the key blocks before this one have added);
        # the adds start after the syncthreads after this call (CUDA: the dQ warp's __syncwarp, then named barrier
        # kDqFull + 4 b)
        if lane == 0:
            head, m_block, turn = tile_turn(it, head_k, group, m_block_first, m_block_end, n_block, seqlen_q, seqlen_k,
                                            window_left, window_right)
            # An atomic read (CUDA: load_acquire; a plain load could be hoisted out of the loop). Under the
            # simulator blocks run one after another, np.ndindex order over (nheads_k, batch, n_blocks): key
            # blocks of an entry's kv head from first to last, so the turns waited for have all been given by now; one
            # that has not would never come (a broken order): raise rather than hang.
            while cuda.atomic.add(semaphore, (batch, head, m_block), 0) != turn:
                if SIMULATED:
                    raise RuntimeError("sm90 prototype: a dQ tile's turn was not given before its key block ran")

    @cuda.jit(device=True)
    def hand_on(it, semaphore, batch, head_k, group, m_block_first, m_block_end, n_block, seqlen_q, seqlen_k,
                window_left, window_right, lane):
        # Pair it's dQ warp, once its adds into the tile have completed (CUDA: its bulk_wait and fence): the next
        # key block's turn
        if lane == 0:
            head, m_block, turn = tile_turn(it, head_k, group, m_block_first, m_block_end, n_block, seqlen_q, seqlen_k,
                                            window_left, window_right)
            cuda.atomic.exch(semaphore, (batch, head, m_block), turn + 1)  # CUDA: store_release

    @cuda.jit(device=True)
    def add_dq_tile(sDqAcc, buffer, sQ, sdO, stage, dq_accum, bidx, q_row0, head, row_begin, seqlen_q, lane):
        # A dQ warp: sDqAcc buffer's rows below seqlen_q into the accumulator (CUDA: lane 0's one bulk reduce of
        # those rows, dq_accum's width); SPLIT_DIMS: the tile's rows over sQ[stage] and sdO[stage] (CUDA: a reduce
        # of each), then the stage goes back to the producer (CUDA: once the engine has read it)
        if lane == 0:
            for r in range(min(BLOCK_M, seqlen_q - row_begin)):
                for c in range(dq_accum.shape[3]):
                    if SPLIT_DIMS:
                        x = sQ[stage, r, c] if r < 32 else sdO[stage, r - 32, c]
                    else:
                        x = sDqAcc[buffer, r, c]
                    cuda.atomic.add(dq_accum, (bidx, head, q_row0 + row_begin + r, c), x)

    @cuda.jit(device=True)
    def release(bars, stage, tid):
        # dV, dK and dQ have completed (CUDA: wgmma_wait<0>): the stage's Q and dO go back to the producer
        mbarrier_arrive(bars, q_empty(stage))
        if tid % 32 == 0:
            mbarrier_arrive(bars, do_empty(stage))

    @cuda.jit
    def flash_bwd_sm90(q, k, v, do, lse, dsum, dk, dv, dq_accum, semaphore, partial, softmax_scale, scale_log2,
                       cu_seqlens_q, cu_seqlens_k, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride,
                       seed_lo, seed_hi, offset, dropout_threshold, dropout_scale):
        sK = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sV = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sQ = cuda.shared.array((STAGES, BLOCK_M, HEAD_DIM), ACC)
        sdO = cuda.shared.array((STAGES, BLOCK_M, HEAD_DIM), ACC)
        sdS = cuda.shared.array(SDS_SHAPE, ACC)  # SPLIT_DIMS: sdS^T, keys x queries
        sPt = cuda.shared.array(SPT_SHAPE, ACC)  # SPLIT_DIMS: sP^T (CUDA: p_tile), keys x queries
        sA = cuda.shared.array(SA_SHAPE, ACC)  # CUDA: a_frag in registers; 0 P^T, 1 dS^T
        sLse = cuda.shared.array((STAGES, BLOCK_M), ACC)  # LSE * log2(e): exp2 offsets
        sD = cuda.shared.array((STAGES, BLOCK_M), ACC)
        # the block's dQ tile (CUDA: fp32, rows of dq_accum_row_stride floats, their chunks of 8 columns swizzled
        # as the accumulator's: backward.cuh's dq_accum_col, against bank conflicts)
        sDqAcc = cuda.shared.array(DQ_ACC_SHAPE, ACC)
        bars = cuda.shared.array(N_BARS, int32)

        (rank, head_k, batch, n_block, q_start, k_start, seqlen_q, seqlen_k, group, m_block_first,
         m_block_end) = block_coordinates(q, k, cu_seqlens_q, cu_seqlens_k, window_left, window_right)
        key_begin = n_block * BLOCK_N
        if key_begin >= seqlen_k:
            return  # varlen: a shorter sequence than the grid's
        bidx = batch_index(IS_VARLEN, batch)  # CUDA: tma_batch, the entry's index in the arrays
        # CUDA: n_pairs() is evaluated by each role after setmaxnreg, not kept across it
        n_pairs = group * max(m_block_end - m_block_first, 0)
        n_it = n_pairs
        warpgroup = cuda.threadIdx.x // WARPGROUP
        nheads = q.shape[2]
        head_dim = q.shape[3]

        if cuda.threadIdx.x == 0:  # mbarrier_init: no arrivals yet
            for b in range(N_BARS):
                bars[b] = 0
        cuda.syncthreads()

        # Producer (CUDA: setmaxnreg.dec; thread 0 issues the copies, warp 1 the LSE and D rows, then the
        # warpgroup returns). Here they fill the ring now and go on after each phase below.
        # The copies have landed after it (CUDA: the consumers wait on kv_full, q_full, do_full)
        tile, rows_it = producer_turn(-1, 0, bars, sK, sV, sQ, sdO, sLse, sD, q, k, v, do, lse, dsum, bidx, q_start,
                                      k_start, head_k, group, key_begin, m_block_first, m_block_end, n_it, seqlen_q)

        # Consumers (CUDA: setmaxnreg.inc). consumer -1: the producer warpgroup, holding nothing.
        consumer = warpgroup - 1
        tid = cuda.threadIdx.x - WARPGROUP * warpgroup
        lane = tid % TPR
        wg_key0 = 0 if SPLIT_DIMS else WG_KEYS * consumer
        key = wg_key0 + tid // TPR  # this thread's key inside the block
        # SPLIT_DIMS: this consumer's first query of S^T and first dim of dK, dV and dQ
        q0 = QUERIES * consumer if SPLIT_DIMS else 0
        d0 = DIMS * consumer if SPLIT_DIMS else 0
        # this consumer's dQ tile: 64 query rows from dq_row0 x 64 dims from dq_col0
        dq_row0 = DQ_TILE * (consumer % (BLOCK_M // DQ_TILE))
        dq_col0 = DQ_TILE * (consumer // (BLOCK_M // DQ_TILE))
        dq_r = tid // TPR  # this thread's query row of the dQ tile (CUDA: warp w's rows 16 w .. 16 w + 15)

        acc_s = cuda.local.array(S_CPT, ACC)
        acc_dp = cuda.local.array(S_CPT, ACC)
        dcap = cuda.local.array(S_CPT if KEEP_DCAP else 1, ACC)
        acc_dk = cuda.local.array(D_CPT, ACC)
        acc_dv = cuda.local.array(D_CPT, ACC)
        acc_dq = cuda.local.array(DQ_CPT, ACC)
        for j in range(D_CPT):
            acc_dk[j] = 0
            acc_dv[j] = 0
        if consumer >= 0:
            mbarrier_wait(bars, KV_FULL, 0, FULL_COUNT)
            if IS_VARLEN and key_begin + BLOCK_N > seqlen_k:
                zero_tails(sK, sV, seqlen_k - key_begin, BLOCK_N, consumer, tid)
        if IS_VARLEN:
            cuda.syncthreads()

        for it in range(n_it):
            stage = it % STAGES
            head, m_block = pair(it, head_k, group, m_block_first, m_block_end)
            row_begin = m_block * BLOCK_M
            if IS_VARLEN:
                if consumer >= 0 and row_begin + BLOCK_M > seqlen_q:
                    mbarrier_wait(bars, q_full(stage), it // STAGES, Q_FULL_COUNT)
                    mbarrier_wait(bars, do_full(stage), it // STAGES, FULL_COUNT)
                    zero_tails(sQ[stage], sdO[stage], seqlen_q - row_begin, BLOCK_M, consumer, tid)
                cuda.syncthreads()
            # ScoreMod of this (batch, head): the transform's constants and exp2's scale
            slope = alibi_slopes[batch * alibi_batch_stride + head] if IS_ALIBI else ACC(0)
            _, tanh_in, bias, score_log2 = score_mod_init(IS_SOFTCAP, softmax_scale, softcap, slope, scale_log2,
                                                          ACC(LOG2E))
            for half in range(HALVES):  # [4]-[8], the half's queries from qh
                qh = q0 + QH * half
                if consumer >= 0:
                    issue_s_dp(it, half, acc_s, acc_dp, bars, sK, sV, sQ, sdO, key, qh, lane)
                    p_of(it, acc_s, dcap, sLse, key_begin + key, qh, lane, row_begin, m_block, n_block, seqlen_q,
                         seqlen_k, window_left, window_right, tanh_in, bias, score_log2, seed_lo, seed_hi,
                         uint64(batch * nheads + head), offset, dropout_threshold)
                    if SPLIT_DIMS:
                        store_keys_by_queries(sPt, it, acc_s, key, q0, lane, IS_DROPOUT)  # dV's wgmma in [9]
                    else:
                        to_a_frag(acc_s, sA, 0, key, qh, lane, IS_DROPOUT)
                cuda.syncthreads()  # every thread's P^T is in sA (CUDA: none, it stays in registers)
                if consumer >= 0:
                    if not SPLIT_DIMS:
                        issue_dv(it, acc_dv, sA, 0, sdO, key, d0, lane, qh, QH)
                    ds_of(it, acc_s, acc_dp, dcap, sD, sLse, key_begin + key, qh, lane, row_begin, seqlen_q, seqlen_k,
                          bias, score_log2, dropout_scale)
                    if SPLIT_DIMS:
                        store_keys_by_queries(sdS, it, acc_dp, key, q0, lane, False)
                    else:
                        to_a_frag(acc_dp, sA, 1, key, qh, lane, False)
                # and its dS^T (SPLIT_DIMS: CUDA's fence_proxy_async and named barrier kDsReady, both consumers'
                # halves of P^T and dS^T are in)
                cuda.syncthreads()
            if SPLIT_DIMS:
                # This consumer's dims of dQ = dS K, dV += P^T dO and dK += dS^T Q, all from shared memory
                if consumer >= 0:
                    issue_dq(it, acc_dq, sdS, sK, 0, d0, dq_r, lane)
                    issue_dv(it, acc_dv, sPt, it & 1, sdO, key, d0, lane, 0, BLOCK_M)
                    issue_dk(it, acc_dk, sdS, it & 1, sQ, key, d0, lane)
                # CUDA: wgmma_wait<0>, then named barrier kDsReady: no wgmma reads the stage any more, and its
                # share of the dQ tile goes over it (rows 0-31 over sQ, 32-63 over sdO)
                cuda.syncthreads()
                if consumer >= 0:
                    for j in range(DQ_CPT):
                        if dq_r < 32:
                            sQ[stage, dq_r, d0 + lane + j * TPR] = acc_dq[j]
                        else:
                            sdO[stage, dq_r - 32, d0 + lane + j * TPR] = acc_dq[j]
                    mbarrier_arrive(bars, q_empty(stage))  # LSE and D read
            else:
                if consumer >= 0:
                    issue_dk(it, acc_dk, sA, 1, sQ, key, d0, lane)
                    store_ds(it, sA, sdS, key, lane)
                # CUDA: fence_proxy_async, then named barrier kDsReady (every consumer's keys are in)
                cuda.syncthreads()
                if consumer >= 0:
                    issue_dq(it, acc_dq, sdS, sK, dq_row0, dq_col0, dq_r, lane)
                    release(bars, stage, tid)
                    # CUDA: after named barrier kDqFree + 4 b (its dQ warp has read buffer b's last pair)
                    for j in range(DQ_CPT):
                        sDqAcc[it % DQ_BUFFERS, dq_row0 + dq_r, dq_col0 + lane + j * TPR] = acc_dq[j]
            warp_id = cuda.threadIdx.x // 32
            dq_warp = warp_id == DQ_WARP + it % DQ_BUFFERS  # the dQ warp of this pair's buffer
            if IS_DETERMINISTIC and dq_warp:
                wait_turn(it, semaphore, batch, head_k, group, m_block_first, m_block_end, n_block, seqlen_q,
                          seqlen_k, window_left, window_right, cuda.threadIdx.x % 32)
            # CUDA: named barrier kDqFull + 4 b (the consumers arrive, the dQ warp syncs)
            cuda.syncthreads()
            if dq_warp:
                add_dq_tile(sDqAcc, it % DQ_BUFFERS, sQ, sdO, stage, dq_accum, bidx, q_start, head, row_begin,
                            seqlen_q, cuda.threadIdx.x % 32)
                if SPLIT_DIMS and cuda.threadIdx.x % 32 == 0:  # the stage's tiles go back to the producer
                    mbarrier_arrive(bars, q_empty(stage))
                    mbarrier_arrive(bars, do_empty(stage))
                if IS_DETERMINISTIC:
                    hand_on(it, semaphore, batch, head_k, group, m_block_first, m_block_end, n_block, seqlen_q,
                            seqlen_k, window_left, window_right, cuda.threadIdx.x % 32)
            cuda.syncthreads()  # end of the phase: the releases are in
            tile, rows_it = producer_turn(tile, rows_it, bars, sK, sV, sQ, sdO, sLse, sD, q, k, v, do, lse, dsum, bidx,
                                          q_start, k_start, head_k, group, key_begin, m_block_first, m_block_end, n_it,
                                          seqlen_q)

        # [10] Store dK * softmax_scale and dV
        # Through this consumer's rows of sK and sV, once every consumer's last dQ (which reads sK) has
        # completed (CUDA: named barrier kDsReady)
        cuda.syncthreads()
        if IS_QUERY_SPLIT:
            # Rank 0's accumulators into `partial` (CUDA: its sK .. sdO; then a cluster barrier, the partials
            # are in, and another before it exits, rank 1 has read them), rank 1 adds them to its own (CUDA:
            # after the first barrier, through the cluster's shared memory; then it arrives on the second)
            if rank == 0:
                if consumer >= 0:
                    for j in range(D_CPT):
                        partial[head_k, batch, n_block, 0, key, lane + j * TPR] = acc_dk[j]
                        partial[head_k, batch, n_block, 1, key, lane + j * TPR] = acc_dv[j]
                return
            if consumer >= 0:
                for j in range(D_CPT):
                    acc_dk[j] += partial[head_k, batch, n_block, 0, key, lane + j * TPR]
                    acc_dv[j] += partial[head_k, batch, n_block, 1, key, lane + j * TPR]
        dv_scale = dropout_scale if IS_DROPOUT else ACC(1)
        if consumer >= 0:
            for j in range(D_CPT):
                sK[key, d0 + lane + j * TPR] = acc_dk[j] * softmax_scale
                sV[key, d0 + lane + j * TPR] = acc_dv[j] * dv_scale
        # CUDA: named barrier kStore + consumer, the warpgroup's 128 threads (SPLIT_DIMS: kDsReady, both
        # consumers wrote every key's row; each then stores half of the rows)
        cuda.syncthreads()
        store_row0 = STORE_ROWS * consumer if SPLIT_DIMS else wg_key0
        if consumer >= 0:
            for e in range(tid, STORE_ROWS * HEAD_DIM, WARPGROUP):  # CUDA: 16-byte chunks
                r = store_row0 + e // HEAD_DIM
                c = e % HEAD_DIM
                if key_begin + r < seqlen_k and c < head_dim:
                    dk[bidx, k_start + key_begin + r, head_k, c] = sK[r, c]
                    dv[bidx, k_start + key_begin + r, head_k, c] = sV[r, c]

    return flash_bwd_sm90
