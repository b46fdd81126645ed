"""Mirror of kernels_cu/flash_bwd.cu (and flash_bwd_simt.cu): the backward kernels in Numba-CUDA.

Three kernels, launched in this order on one stream, with the same grids as the CUDA ones:

    make_flash_bwd_preprocess(cfg): grid (ceil(seqlen_q / block_m), nheads, batch)
        kernel(do, o, dsum)                       dsum = D = rowsum(dO * O), acc_t, (batch, nheads, seqlen_q)
    make_flash_bwd_dkdv(cfg):       grid (ceil(seqlen_k / block_n), nheads_k, batch)
        kernel(q, k, v, do, lse, dsum, dk, dv, softmax_scale, scale_log2)
    make_flash_bwd_dq(cfg):         grid (ceil(seqlen_q / block_m), nheads, batch)
        kernel(q, k, v, do, lse, dsum, dq, softmax_scale, scale_log2)

block (warps * 32,) for each; softmax_scale and scale_log2 as acc_t scalars (see flash_fwd.py).
No atomics: dkdv loops over the group's query heads and every query block, dq over every key block,
each accumulating in per-thread arrays, so the gradients are deterministic by construction.

As in flash_fwd.py, tiles live in shared memory in acc_t and the MMAs are per-thread FMA loops
marked `# CUDA: mma.sync`. Each thread computes the S / P / dS elements tid, tid + nthreads, ...
of a (block_m, block_n) tile (no row reductions are needed: LSE is known), and shares them through
shared memory for the products that need whole rows or columns.

Rows that saw no key have LSE = -inf; lse_to_log2_offset turns it into the offset +inf so that
P = exp2(S * scale_log2 - LSE * log2(e)) comes out 0 (not exp2(+inf) or NaN) and every gradient they
touch stays 0. dK/dV visit query heads and blocks in increasing order, dQ key blocks in increasing
order, as flash_bwd.cu does.
"""

from __future__ import annotations

import functools
import math

from numba import cuda

from .flash_fwd import acc_type, load_tile, thread_layout
from .mask import block_needs_mask, ceil_div, col_limit, m_block_min, n_block_max

LOG2E = 1.4426950408889634  # log2(e), as in flash_bwd.cu


def smem_bytes(cfg) -> int:
    """Static shared memory of one backward prototype kernel (0 for the preprocess)."""
    d, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    e = 8 if cfg.dtype == "float64" else 4
    if cfg.kernel == "flash_bwd_preprocess":
        return 0
    # K, V tiles; Q, dO tiles; P/dS tile; LSE and D rows (dK/dV and dQ alike).
    return ((2 * bn + 2 * bm) * d + bm * bn + 2 * bm) * e


@functools.lru_cache(maxsize=None)
def make_flash_bwd_preprocess(cfg):
    # As in flash_bwd.cu, only dtype, block_m and warps: one kernel serves every head_dim.
    BLOCK_M = cfg.block_m
    NTHREADS = cfg.threads
    ACC = acc_type(cfg.dtype)

    @cuda.jit
    def flash_bwd_preprocess(do, o, dsum):
        # [1] Preprocess: D = rowsum(dO * O)
        m_block = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        seqlen_q = o.shape[1]
        head_dim = o.shape[3]
        # CUDA: one warp per row, lanes over head_dim, then warp_allreduce_sum; here one thread per row.
        for r in range(cuda.threadIdx.x, BLOCK_M, NTHREADS):
            row = m_block * BLOCK_M + r
            if row < seqlen_q:
                acc = ACC(0)
                for c in range(head_dim):
                    acc += ACC(do[batch, row, head, c]) * ACC(o[batch, row, head, c])
                dsum[batch, head, row] = acc

    return flash_bwd_preprocess


@cuda.jit(device=True)
def lse_to_log2_offset(lse):
    # LSE (natural log) -> the offset subtracted from S * scale_log2 in exp2; -inf (no visible key)
    # gives +inf, so P = exp2(finite or -inf - inf) = 0.
    if lse == -math.inf:
        return math.inf
    return lse * LOG2E


@cuda.jit(device=True)
def load_lse_d(sLse, sD, lse, dsum, batch, head, row_begin, seqlen_q, tid, nthreads):
    # LSE offsets and D of rows row_begin..; rows past seqlen_q take offset +inf and D = 0.
    for i in range(tid, sLse.shape[0], nthreads):
        row = row_begin + i
        if row < seqlen_q:
            sLse[i] = lse_to_log2_offset(lse[batch, head, row])
            sD[i] = dsum[batch, head, row]
        else:
            sLse[i] = math.inf
            sD[i] = 0


@functools.lru_cache(maxsize=None)
def make_flash_bwd_dkdv(cfg):
    HEAD_DIM = cfg.head_dim
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    NTHREADS = cfg.threads
    IS_CAUSAL = cfg.causal
    ACC = acc_type(cfg.dtype)
    # dK, dV accumulators: a (block_n, head_dim) tile; S/P/dS: elements tid + i * NTHREADS.
    TPR, ROW_STRIDE, RPT, CPT = thread_layout(BLOCK_N, HEAD_DIM, NTHREADS)
    S_EPT = -(-(BLOCK_M * BLOCK_N) // NTHREADS)

    @cuda.jit
    def flash_bwd_dkdv(q, k, v, do, lse, dsum, dk, dv, softmax_scale, scale_log2):
        # [2] dK/dV block coordinates: n_block, kv head, batch; causal skips query blocks above the diagonal
        n_block = cuda.blockIdx.x
        head_k = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        seqlen_q = q.shape[1]
        nheads = q.shape[2]
        head_dim = q.shape[3]
        seqlen_k = k.shape[1]
        nheads_k = k.shape[2]
        group = nheads // nheads_k  # GQA: query heads head_k * group .. + group share this kv head
        m_block_first = m_block_min(IS_CAUSAL, BLOCK_M, BLOCK_N, n_block, seqlen_q, seqlen_k)
        m_block_end = ceil_div(seqlen_q, BLOCK_M)
        row0 = tid // TPR
        lane = tid % TPR

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
        acc_dk = cuda.local.array((RPT, CPT), ACC)
        acc_dv = cuda.local.array((RPT, CPT), ACC)
        for i in range(RPT):
            for j in range(CPT):
                acc_dk[i, j] = 0
                acc_dv[i, j] = 0

        key_begin = n_block * BLOCK_N
        load_tile(sK, k, batch, key_begin, head_k, seqlen_k, head_dim, tid, NTHREADS)
        load_tile(sV, v, batch, key_begin, head_k, seqlen_k, head_dim, tid, NTHREADS)

        for hq in range(group):
            head = head_k * group + hq
            for m_block in range(m_block_first, m_block_end):
                row_begin = m_block * BLOCK_M
                cuda.syncthreads()  # the previous query block is done with sQ, sdO, sdS
                # [3] Load the Q, dO tiles and LSE, D rows of one query block
                load_tile(sQ, q, batch, row_begin, head, seqlen_q, head_dim, tid, NTHREADS)
                load_tile(sdO, do, batch, row_begin, head, seqlen_q, head_dim, tid, NTHREADS)
                load_lse_d(sLse, sD, lse, dsum, batch, head, row_begin, seqlen_q, tid, NTHREADS)
                cuda.syncthreads()

                # [4] Recompute S = Q K^T, mask, P = exp2(S * scale_log2 - LSE * log2(e))
                needs_mask = block_needs_mask(IS_CAUSAL, BLOCK_M, BLOCK_N, m_block, n_block, seqlen_q, seqlen_k)
                for i in range(S_EPT):
                    e = tid + i * NTHREADS
                    if e < BLOCK_M * BLOCK_N:
                        r = e // BLOCK_N
                        c = e - r * BLOCK_N
                        s = ACC(0)
                        for d in range(HEAD_DIM):  # CUDA: mma.sync
                            s += sQ[r, d] * sK[c, d]
                        acc_s[i] = s
                        if needs_mask:
                            if key_begin + c >= col_limit(IS_CAUSAL, row_begin + r, seqlen_q, seqlen_k):
                                acc_s[i] = -math.inf
                        acc_s[i] = math.exp2(acc_s[i] * scale_log2 - sLse[r])
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
                for i in range(S_EPT):
                    e = tid + i * NTHREADS
                    if e < BLOCK_M * BLOCK_N:
                        r = e // BLOCK_N
                        acc_dp[i] = acc_s[i] * (acc_dp[i] - sD[r])
                cuda.syncthreads()  # every thread is done reading P ([5]): overwrite it with dS
                for i in range(S_EPT):
                    e = tid + i * NTHREADS
                    if e < BLOCK_M * BLOCK_N:
                        r = e // BLOCK_N
                        sdS[r, e - r * BLOCK_N] = acc_dp[i]
                cuda.syncthreads()

                # [8] dK += dS^T Q
                for i in range(RPT):
                    n = row0 + i * ROW_STRIDE
                    for j in range(CPT):
                        c = lane + j * TPR
                        a = acc_dk[i, j]
                        for r in range(BLOCK_M):  # CUDA: mma.sync
                            a += sdS[r, n] * sQ[r, c]
                        acc_dk[i, j] = a

        # [9] Store dK * softmax_scale and dV
        for i in range(RPT):
            row = key_begin + row0 + i * ROW_STRIDE
            if row < seqlen_k:
                for j in range(CPT):
                    c = lane + j * TPR
                    if c < head_dim:
                        dk[batch, row, head_k, c] = acc_dk[i, j] * softmax_scale
                        dv[batch, row, head_k, c] = acc_dv[i, j]

    return flash_bwd_dkdv


@functools.lru_cache(maxsize=None)
def make_flash_bwd_dq(cfg):
    HEAD_DIM = cfg.head_dim
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    NTHREADS = cfg.threads
    IS_CAUSAL = cfg.causal
    ACC = acc_type(cfg.dtype)
    TPR, ROW_STRIDE, RPT, CPT = thread_layout(BLOCK_M, HEAD_DIM, NTHREADS)
    S_EPT = -(-(BLOCK_M * BLOCK_N) // NTHREADS)

    @cuda.jit
    def flash_bwd_dq(q, k, v, do, lse, dsum, dq, softmax_scale, scale_log2):
        # [10] dQ block coordinates: m_block, head, batch; causal skips key blocks above the diagonal
        m_block = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        seqlen_q = q.shape[1]
        nheads = q.shape[2]
        head_dim = q.shape[3]
        seqlen_k = k.shape[1]
        nheads_k = k.shape[2]
        head_k = head // (nheads // nheads_k)  # GQA
        n_block_end = n_block_max(IS_CAUSAL, BLOCK_M, BLOCK_N, m_block, seqlen_q, seqlen_k)
        row_begin = m_block * BLOCK_M
        row0 = tid // TPR
        lane = tid % TPR

        sQ = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sdO = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sK = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sV = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sdS = cuda.shared.array((BLOCK_M, BLOCK_N), ACC)
        sLse = cuda.shared.array(BLOCK_M, ACC)  # LSE * log2(e): exp2 offsets
        sD = cuda.shared.array(BLOCK_M, ACC)

        acc_s = cuda.local.array(S_EPT, ACC)
        acc_dp = cuda.local.array(S_EPT, ACC)
        acc_dq = cuda.local.array((RPT, CPT), ACC)
        for i in range(RPT):
            for j in range(CPT):
                acc_dq[i, j] = 0

        # Q, dO tiles and LSE, D rows of this query block, loaded once.
        load_tile(sQ, q, batch, row_begin, head, seqlen_q, head_dim, tid, NTHREADS)
        load_tile(sdO, do, batch, row_begin, head, seqlen_q, head_dim, tid, NTHREADS)
        load_lse_d(sLse, sD, lse, dsum, batch, head, row_begin, seqlen_q, tid, NTHREADS)

        for n_block in range(n_block_end):
            key0 = n_block * BLOCK_N
            cuda.syncthreads()  # the previous key block is done with sK, sV, sdS
            load_tile(sK, k, batch, key0, head_k, seqlen_k, head_dim, tid, NTHREADS)
            load_tile(sV, v, batch, key0, head_k, seqlen_k, head_dim, tid, NTHREADS)
            cuda.syncthreads()

            # [11] Recompute S, P and dS = P * (dO V^T - D) for one key block
            needs_mask = block_needs_mask(IS_CAUSAL, BLOCK_M, BLOCK_N, m_block, n_block, seqlen_q, seqlen_k)
            for i in range(S_EPT):
                e = tid + i * NTHREADS
                if e < BLOCK_M * BLOCK_N:
                    r = e // BLOCK_N
                    c = e - r * BLOCK_N
                    s = ACC(0)
                    dp = ACC(0)
                    for d in range(HEAD_DIM):  # CUDA: mma.sync (two of them: Q K^T and dO V^T)
                        s += sQ[r, d] * sK[c, d]
                        dp += sdO[r, d] * sV[c, d]
                    acc_s[i] = s
                    if needs_mask:
                        if key0 + c >= col_limit(IS_CAUSAL, row_begin + r, seqlen_q, seqlen_k):
                            acc_s[i] = -math.inf
                    acc_s[i] = math.exp2(acc_s[i] * scale_log2 - sLse[r])
                    acc_dp[i] = acc_s[i] * (dp - sD[r])
                    sdS[r, c] = acc_dp[i]
            cuda.syncthreads()

            # [12] dQ += dS K
            for i in range(RPT):
                r = row0 + i * ROW_STRIDE
                for j in range(CPT):
                    c = lane + j * TPR
                    a = acc_dq[i, j]
                    for n in range(BLOCK_N):  # CUDA: mma.sync
                        a += sdS[r, n] * sK[n, c]
                    acc_dq[i, j] = a

        # [13] Store dQ * softmax_scale
        for i in range(RPT):
            row = row_begin + row0 + i * ROW_STRIDE
            if row < seqlen_q:
                for j in range(CPT):
                    c = lane + j * TPR
                    if c < head_dim:
                        dq[batch, row, head, c] = acc_dq[i, j] * softmax_scale

    return flash_bwd_dq
