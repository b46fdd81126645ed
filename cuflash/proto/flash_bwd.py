"""Mirror of kernels_cu/flash_bwd.cu: the backward kernels in Numba-CUDA, for every dtype.

Three kernels, launched in this order on one stream, with the same grids as the CUDA ones:

    make_flash_bwd_preprocess(cfg):  grid (ceil(seqlen_q / block_m), nheads, batch)
        kernel(do, o, dsum, dq_accum, semaphore, cu_seqlens_q, cu_seqlens_k)
    make_flash_bwd(cfg):             grid config.backward_grid: (nheads_k, ceil(seqlen_k / block_n), batch),
                                     deterministic (nheads_k, batch, ceil(seqlen_k / block_n))
        kernel(q, k, v, do, lse, dsum, dk, dv, dq_accum, semaphore, softmax_scale, scale_log2, *variant_args)
    make_flash_bwd_postprocess(cfg): grid (ceil(seqlen_q / block_m), nheads, batch)
        kernel(dq_accum, dq, softmax_scale, cu_seqlens_q, cu_seqlens_k)

block (warps * 32,) for each; softmax_scale and scale_log2 as acc_t scalars and variant_args as for
the forward (flash_fwd.py). Workspace arrays, in acc_t (float64 for float64, else float32):
dsum = D = rowsum(dO * O), (slabs, nheads, rows) like lse, and dq_accum (slabs, nheads, rows, head_dim),
where dense slabs = batch, rows = seqlen_q and varlen slabs = 1, rows = total_q; semaphore int32
(entries, nheads, blocks), one per query block of each sequence (deterministic mode). With VARLEN
every array is a packed (1, total, ...) view and the grids are sized by the longest sequences.

One pass over key blocks, as in flash_bwd.cu: flash_bwd owns one key block, loops over the (query head
of the group, query block of the mask) pairs in backward_pair's order, accumulates dK and dV in
per-thread arrays and adds dQ's share dS K into dq_accum with atomic adds: as they come, or
(DETERMINISTIC) in a fixed order of key blocks, first to last (dq_turn), each dQ tile's turn kept by its
semaphore. The preprocess zeroes dq_accum and the semaphores; the postprocess writes
dQ = dq_accum * softmax_scale in the output dtype. fp32 / fp64 run these kernels too (the CUDA library
runs flash_bwd_simt.cu's there; the prototype has no SIMT variant).

Variants as in flash_bwd.cu: the mask gives each key block's query blocks, S passes through score_mod
and the mask before P is recomputed (exp2's scale from score_mod_init: the held units'), and a softcap
multiplies dS by 1 - tanh^2. Dropout regenerates the forward's keep flags (one Philox call per score):
dV takes the dropped P (a dropped entry is held as -P, as in flash_bwd.cu, and dV reads max(P, 0)),
scaled by 1 / (1 - p) at the store; dL/dP is dP / (1 - p) where kept and 0 where dropped.

As in flash_fwd.py, tiles live in shared memory in acc_t and the MMAs are per-thread FMA loops
marked `# CUDA: mma.sync`. Each thread computes the S / P / dS elements tid, tid + nthreads, ...
of a (block_m, block_n) tile (no row reductions are needed: LSE is known), and shares them through
shared memory for the products that need whole rows or columns.

Rows that saw no key have LSE = -inf; lse_to_log2_offset turns it into the offset +inf so that
P = exp2(S * scale_log2 - LSE * log2(e)) comes out 0 (not exp2(+inf) or NaN) and every gradient they
touch stays 0 (their dq_accum rows keep the preprocess's zeros).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, uint64

from ..config import DETERMINISTIC, VARLEN
from .dropout import keep
from .flash_fwd import acc_type, load_tile, thread_layout, variant_flags
from .mask import m_block_range, n_block_range, needs_mask, score_mod, score_mod_init, visible
from .seqinfo import batch_index, seq_info

LOG2E = 1.4426950408889634  # log2(e), as in flash_bwd.cu


def smem_bytes(cfg) -> int:
    """Static shared memory of one backward prototype kernel (0 for the preprocess and postprocess)."""
    d, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    e = 8 if cfg.dtype == "float64" else 4
    if cfg.kernel in ("flash_bwd_preprocess", "flash_bwd_postprocess"):
        return 0
    # K, V tiles; Q, dO tiles; P/dS tile; LSE and D rows.
    return ((2 * bn + 2 * bm) * d + bm * bn + 2 * bm) * e


@functools.lru_cache(maxsize=None)
def make_flash_bwd_preprocess(cfg):
    # As in flash_bwd.cu, only dtype, block_m, warps and VARLEN: one kernel serves every head_dim.
    BLOCK_M = cfg.block_m
    NTHREADS = cfg.threads
    ACC = acc_type(cfg.dtype)
    IS_VARLEN = bool(cfg.variant & VARLEN)

    @cuda.jit
    def flash_bwd_preprocess(do, o, dsum, dq_accum, semaphore, cu_seqlens_q, cu_seqlens_k):
        # [1] Preprocess: D = rowsum(dO * O); zero the dQ accumulator and semaphores
        m_block = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch, o.shape[1], 0)
        bidx = batch_index(IS_VARLEN, batch)
        head_dim = o.shape[3]
        # flash_bwd.cu zeroes semaphore m_block (its block_m is SEMAPHORE_ROWS, flash_bwd's a multiple);
        # the prototype's flash_bwd tiles may be smaller (the backend's fit), so that it has more
        # semaphores than this grid has blocks: a grid-stride loop zeroes them all.
        if tid == 0:
            for j in range(m_block, semaphore.shape[2], cuda.gridDim.x):
                semaphore[batch, head, j] = 0
        for e in range(tid, BLOCK_M * head_dim, NTHREADS):
            row = m_block * BLOCK_M + e // head_dim
            if row < seqlen_q:
                dq_accum[bidx, head, q_start + row, e % head_dim] = 0
        # CUDA: a group of lanes per row, 16 bytes a lane, summed over the group by shuffles; here one thread a row.
        for r in range(tid, BLOCK_M, NTHREADS):
            row = m_block * BLOCK_M + r
            if row < seqlen_q:
                acc = ACC(0)
                for c in range(head_dim):
                    acc += ACC(do[bidx, q_start + row, head, c]) * ACC(o[bidx, q_start + row, head, c])
                dsum[bidx, head, q_start + row] = acc

    return flash_bwd_preprocess


@cuda.jit(device=True)
def lse_to_log2_offset(lse):
    # LSE (natural log) -> the offset subtracted from S * scale_log2 in exp2; -inf (no visible key)
    # gives +inf, so P = exp2(finite or -inf - inf) = 0.
    if lse == -math.inf:
        return math.inf
    return lse * LOG2E


@cuda.jit(device=True)
def backward_block(deterministic):
    # backward.cuh's: (n_block, batch) of this block in config.backward_grid's grid
    if deterministic:
        return cuda.blockIdx.z, cuda.blockIdx.y
    return cuda.blockIdx.y, cuda.blockIdx.z


@cuda.jit(device=True)
def backward_pair(deterministic, it, head_k, group, m_block_first, m_block_end):
    # backward.cuh's: a key block's pair `it` is query head hq = it % group at the i-th query block
    # (i = it // group) from the first, or (deterministic) from the last. Deterministic: key blocks add into
    # each dQ tile first to last (dq_turn), and a block's i-th pair is a tile every block before it in line
    # visited at its i-th pair or earlier, so a block lags the one before it by about a pair.
    head = head_k * group + it % group
    i = it // group
    return head, (m_block_end - 1 - i if deterministic else m_block_first + i)


@cuda.jit(device=True)
def dq_turn(is_local, window_left, window_right, seqlen_q, seqlen_k, block_m, block_n, m_block, n_block):
    # backward.cuh's: key block n_block's turn at dQ tile m_block, the count of key blocks before it in the
    # tile's range (each of them visits it: m_block_range and n_block_range agree)
    n_first, _ = n_block_range(is_local, window_left, window_right, seqlen_q, seqlen_k, block_m, block_n, m_block)
    return n_block - n_first


@cuda.jit(device=True)
def load_lse_d(sLse, sD, lse, dsum, bidx, head, row_begin, q_start, seqlen_q, tid, nthreads):
    # LSE offsets and D of rows row_begin.. of the sequence (array rows q_start + row_begin..); rows
    # past seqlen_q take offset +inf and D = 0.
    for i in range(tid, sLse.shape[0], nthreads):
        row = row_begin + i
        if row < seqlen_q:
            sLse[i] = lse_to_log2_offset(lse[bidx, head, q_start + row])
            sD[i] = dsum[bidx, head, q_start + row]
        else:
            sLse[i] = math.inf
            sD[i] = 0


@functools.lru_cache(maxsize=None)
def make_flash_bwd(cfg):
    HEAD_DIM = cfg.head_dim
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    NTHREADS = cfg.threads
    IS_LOCAL, IS_SOFTCAP, IS_ALIBI, IS_DROPOUT, IS_VARLEN, TRANSFORM = variant_flags(cfg)
    IS_DETERMINISTIC = bool(cfg.variant & DETERMINISTIC)
    ACC = acc_type(cfg.dtype)
    # dK, dV accumulators: a (block_n, head_dim) tile; dQ's share: a (block_m, head_dim) tile;
    # S/P/dS: elements tid + i * NTHREADS.
    TPR, ROW_STRIDE, RPT, CPT = thread_layout(BLOCK_N, HEAD_DIM, NTHREADS)
    TPR_Q, ROW_STRIDE_Q, RPT_Q, CPT_Q = thread_layout(BLOCK_M, HEAD_DIM, NTHREADS)
    S_EPT = -(-(BLOCK_M * BLOCK_N) // NTHREADS)
    CAP_EPT = S_EPT if IS_SOFTCAP else 1  # the softcap derivative's tile

    @cuda.jit
    def flash_bwd(q, k, v, do, lse, dsum, dk, dv, dq_accum, semaphore, softmax_scale, scale_log2, cu_seqlens_q,
                  cu_seqlens_k, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride, seed_lo,
                  seed_hi, offset, dropout_threshold, dropout_scale):
        # [2] Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
        head_k = cuda.blockIdx.x
        n_block, batch = backward_block(IS_DETERMINISTIC)
        tid = cuda.threadIdx.x
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch,
                                                        q.shape[1], k.shape[1])
        key_begin = n_block * BLOCK_N
        if key_begin >= seqlen_k:
            return  # varlen: a shorter sequence than the grid's
        bidx = batch_index(IS_VARLEN, batch)
        nheads = q.shape[2]
        head_dim = q.shape[3]
        nheads_k = k.shape[2]
        group = nheads // nheads_k  # GQA: query heads head_k * group .. + group share this kv head
        shift = seqlen_k - seqlen_q
        m_block_first, m_block_end = m_block_range(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k,
                                                   BLOCK_M, BLOCK_N, n_block)
        row0 = tid // TPR
        lane = tid % TPR
        row0_q = tid // TPR_Q
        lane_q = tid % TPR_Q

        sK = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sV = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sQ = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sdO = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sP = cuda.shared.array((BLOCK_M, BLOCK_N), ACC)
        sdS = sP  # one buffer: P, then dS once every thread is done with P
        sLse = cuda.shared.array(BLOCK_M, ACC)  # LSE * log2(e): exp2 offsets
        sD = cuda.shared.array(BLOCK_M, ACC)

        acc_s = cuda.local.array(S_EPT, ACC)
        acc_dp = cuda.local.array(S_EPT, ACC)
        acc_cap = cuda.local.array(CAP_EPT, ACC)  # d logit / d(scale * S): the softcap's 1 - tanh^2
        acc_dk = cuda.local.array((RPT, CPT), ACC)
        acc_dv = cuda.local.array((RPT, CPT), ACC)
        for i in range(RPT):
            for j in range(CPT):
                acc_dk[i, j] = 0
                acc_dv[i, j] = 0

        load_tile(sK, k, bidx, k_start + key_begin, head_k, k_start + seqlen_k, head_dim, tid, NTHREADS)
        load_tile(sV, v, bidx, k_start + key_begin, head_k, k_start + seqlen_k, head_dim, tid, NTHREADS)

        # DETERMINISTIC: the tile added into at the last pair (handed on an iteration late) and its turn
        pending = -1
        pending_head = 0
        pending_turn = 0
        # The (query head, query block) pairs this key block visits, in backward_pair's order
        for it in range(group * max(m_block_end - m_block_first, 0)):
            head, m_block = backward_pair(IS_DETERMINISTIC, it, head_k, group, m_block_first, m_block_end)
            # ScoreMod of this (batch, head): the transform's constants and exp2's scale (score_mod_init)
            slope = alibi_slopes[batch * alibi_batch_stride + head] if IS_ALIBI else ACC(0)
            _, tanh_in, bias, score_log2 = score_mod_init(IS_SOFTCAP, softmax_scale, softcap, slope, scale_log2,
                                                          ACC(LOG2E))
            bh = uint64(batch * nheads + head)  # dropout: Philox counter word 2
            row_begin = m_block * BLOCK_M
            cuda.syncthreads()  # the previous query block is done with sQ, sdO, sdS
            # [3] Load the Q, dO tiles and LSE, D rows of one query block
            load_tile(sQ, q, bidx, q_start + row_begin, head, q_start + seqlen_q, head_dim, tid, NTHREADS)
            load_tile(sdO, do, bidx, q_start + row_begin, head, q_start + seqlen_q, head_dim, tid, NTHREADS)
            load_lse_d(sLse, sD, lse, dsum, bidx, head, row_begin, q_start, seqlen_q, tid, NTHREADS)
            cuda.syncthreads()

            # [4] Recompute S = Q K^T, score modifiers, mask, P = exp2(S * scale_log2 - LSE * log2(e))
            masked = needs_mask(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                m_block, n_block)
            for i in range(S_EPT):
                e = tid + i * NTHREADS
                if e < BLOCK_M * BLOCK_N:
                    r = e // BLOCK_N
                    c = e - r * BLOCK_N
                    row = row_begin + r
                    col = key_begin + c
                    s = ACC(0)
                    for d in range(HEAD_DIM):  # CUDA: mma.sync
                        s += sQ[r, d] * sK[c, d]
                    acc_s[i] = s
                    if TRANSFORM:
                        x, dcap = score_mod(IS_SOFTCAP, IS_ALIBI, tanh_in, bias, shift, acc_s[i], row, col)
                        acc_s[i] = x
                        if IS_SOFTCAP:
                            acc_cap[i] = dcap
                    if masked:
                        if not visible(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, row, col):
                            acc_s[i] = -math.inf
                    acc_s[i] = math.exp2(acc_s[i] * score_log2 - sLse[r])
                    # a dropped entry is kept as -P: dV reads max(P, 0) (its 1 / (1 - p) applied at the
                    # store), dS below tells kept from dropped by the sign
                    if IS_DROPOUT:
                        if not keep(seed_lo, seed_hi, bh, offset, dropout_threshold, row, col):
                            acc_s[i] = -acc_s[i]
                        sP[r, c] = max(acc_s[i], ACC(0))
                    else:
                        sP[r, c] = acc_s[i]
            cuda.syncthreads()

            # [5] dV += P^T dO
            for i in range(RPT):
                n = row0 + i * ROW_STRIDE
                for j in range(CPT):
                    c = lane + j * TPR
                    a = acc_dv[i, j]
                    for r in range(BLOCK_M):  # CUDA: mma.sync
                        a += sP[r, n] * sdO[r, c]
                    acc_dv[i, j] = a

            # [6] dP = dO V^T
            for i in range(S_EPT):
                e = tid + i * NTHREADS
                if e < BLOCK_M * BLOCK_N:
                    r = e // BLOCK_N
                    c = e - r * BLOCK_N
                    dp = ACC(0)
                    for d in range(HEAD_DIM):  # CUDA: mma.sync
                        dp += sdO[r, d] * sV[c, d]
                    acc_dp[i] = dp

            # [7] dS = P * (dP - D)
            # Dropout: dL/dP is dP / (1 - p) where kept and 0 where dropped (there acc_s = -P, so
            # dS = -P * D = acc_s * D). Softcap: times 1 - tanh^2.
            for i in range(S_EPT):
                e = tid + i * NTHREADS
                if e < BLOCK_M * BLOCK_N:
                    r = e // BLOCK_N
                    if IS_DROPOUT:
                        if acc_s[i] >= 0:
                            ds = acc_s[i] * (acc_dp[i] * dropout_scale - sD[r])
                        else:
                            ds = acc_s[i] * sD[r]
                    else:
                        ds = acc_s[i] * (acc_dp[i] - sD[r])
                    if IS_SOFTCAP:
                        ds *= acc_cap[i]
                    acc_dp[i] = ds
            cuda.syncthreads()  # every thread is done reading P ([5]): overwrite it with dS
            for i in range(S_EPT):
                e = tid + i * NTHREADS
                if e < BLOCK_M * BLOCK_N:
                    r = e // BLOCK_N
                    sdS[r, e - r * BLOCK_N] = acc_dp[i]
            # DETERMINISTIC: hand the previous tile on (an iteration late; no fence: the release is cumulative
            # over the adds the barriers since ordered before it), then wait for this tile's turn
            if IS_DETERMINISTIC:
                turn = dq_turn(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, m_block,
                               n_block)
                if pending >= 0:
                    cuda.syncthreads()  # CUDA: a barrier ptxas needs there (flash_bwd.cu)
                    if tid == 0:
                        cuda.atomic.exch(semaphore, (batch, pending_head, pending), pending_turn + 1)  # store_release
                if tid == 0:
                    # an atomic read (load_acquire in flash_bwd.cu): a plain load could be hoisted out of
                    # the loop. Under the simulator blocks run one after another, np.ndindex order over
                    # (nheads_k, batch, n_blocks): key blocks of an entry's kv head from first to last, so the
                    # turns waited for have all been given when a block gets here.
                    while cuda.atomic.add(semaphore, (batch, head, m_block), 0) != turn:
                        pass
                pending = m_block
                pending_head = head
                pending_turn = turn
            cuda.syncthreads()  # sdS (and the semaphore) for every thread

            # [8] dK += dS^T Q
            for i in range(RPT):
                n = row0 + i * ROW_STRIDE
                for j in range(CPT):
                    c = lane + j * TPR
                    a = acc_dk[i, j]
                    for r in range(BLOCK_M):  # CUDA: mma.sync
                        a += sdS[r, n] * sQ[r, c]
                    acc_dk[i, j] = a

            # [9] dQ_accum += dS K: fp32 atomic adds, in key-block order when deterministic
            # (in acc_t: float64 for float64)
            for i in range(RPT_Q):
                r = row0_q + i * ROW_STRIDE_Q
                row = row_begin + r
                for j in range(CPT_Q):
                    c = lane_q + j * TPR_Q
                    a = ACC(0)
                    for n in range(BLOCK_N):  # CUDA: mma.sync
                        a += sdS[r, n] * sK[n, c]
                    if row < seqlen_q and c < head_dim:
                        cuda.atomic.add(dq_accum, (bidx, head, q_start + row, c), a)

        if IS_DETERMINISTIC and pending >= 0:
            cuda.syncthreads()  # every thread's adds into the last tile are issued
            if tid == 0:
                cuda.atomic.exch(semaphore, (batch, pending_head, pending), pending_turn + 1)  # store_release

        # [10] Store dK * softmax_scale and dV
        # (dV times 1 / (1 - p) with dropout)
        for i in range(RPT):
            row = key_begin + row0 + i * ROW_STRIDE
            if row < seqlen_k:
                for j in range(CPT):
                    c = lane + j * TPR
                    if c < head_dim:
                        dk[bidx, k_start + row, head_k, c] = acc_dk[i, j] * softmax_scale
                        if IS_DROPOUT:
                            dv[bidx, k_start + row, head_k, c] = acc_dv[i, j] * dropout_scale
                        else:
                            dv[bidx, k_start + row, head_k, c] = acc_dv[i, j]

    return flash_bwd


@functools.lru_cache(maxsize=None)
def make_flash_bwd_postprocess(cfg):
    # As the preprocess: only dtype, block_m, warps and VARLEN.
    BLOCK_M = cfg.block_m
    NTHREADS = cfg.threads
    IS_VARLEN = bool(cfg.variant & VARLEN)

    @cuda.jit
    def flash_bwd_postprocess(dq_accum, dq, softmax_scale, cu_seqlens_q, cu_seqlens_k):
        # [11] Postprocess: dQ = dQ_accum * softmax_scale in the input dtype
        m_block = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch, dq.shape[1], 0)
        bidx = batch_index(IS_VARLEN, batch)
        head_dim = dq.shape[3]
        for e in range(cuda.threadIdx.x, BLOCK_M * head_dim, NTHREADS):
            row = m_block * BLOCK_M + e // head_dim
            if row < seqlen_q:
                c = e % head_dim
                dq[bidx, q_start + row, head, c] = dq_accum[bidx, head, q_start + row, c] * softmax_scale

    return flash_bwd_postprocess
