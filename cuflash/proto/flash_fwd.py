"""Mirror of kernels_cu/flash_fwd.cu (and flash_fwd_simt.cu): the forward kernel in Numba-CUDA.

`make_flash_fwd(cfg)` turns a KernelConfig into a kernel the way the C++ template does: head_dim,
block_m, block_n, warps, the variant bits (cfg.variant: config.LOCAL, SOFTCAP, ALIBI, DROPOUT,
VARLEN, SEQUSED, PAGED) and the accumulator type become closure constants, so shared and local array shapes are
compile-time constants and unused variants fold away. Launch it exactly like the CUDA kernel:

    grid (ceil(seqlen_q / block_m), nheads, batch), block (warps * 32,)
    kernel[grid, block](q, k, v, o, lse, softmax_scale, scale_log2, *variant_args)

variant_args (FwdParams' variant fields, in this order; see cuflash/backends/numba.py):
    cu_seqlens_q, cu_seqlens_k   int32 (batch + 1,) with VARLEN (else any 1-element int32 array)
    window_left, window_right    ints, mask.UNBOUNDED for -1 (read with LOCAL)
    softcap                      acc_t (read with SOFTCAP)
    alibi_slopes                 acc_t 1-D array, slope of (b, h) at b * alibi_batch_stride + h (ALIBI)
    alibi_batch_stride           int (0: one row of nheads slopes)
    seed_lo, seed_hi, offset, dropout_threshold   uint64 (DROPOUT, dropout.py)
    dropout_scale                acc_t, 1 / (1 - dropout_p)
    seqused_k                    int32 (batch,) key counts with SEQUSED (else any 1-element int32 array)
    block_table                  int32 (batch, max_pages) with PAGED, k and v then page pools
                                 (num_pages, page_size, nheads_k, head_dim) (else any (1, 1) int32 array)
softmax_scale, scale_log2 (and the other floats) should be acc_t scalars (np.float32 / np.float64, as
the backend passes them) so that the kernel's arithmetic stays in acc_t; a Python float would promote it.

q (batch, seqlen_q, nheads, head_dim), k and v (batch, seqlen_k, nheads_k, head_dim), o like q and
lse (batch, nheads, seqlen_q) in the accumulator type; any strides. With VARLEN they are the packed
arrays as (1, total, heads, head_dim) views and lse (1, nheads, total_q), the grid is sized by the
longest sequence and each block takes its sequence's rows and lengths from seqinfo.py. The dense sizes
come from the array shapes (the CUDA kernel reads them from FwdParams). cfg.head_dim is the compiled
head dim: the tiles are that wide, zero-filled past the arrays' head_dim, which is never read or
written in global memory.

Differences from the CUDA kernel. Work layout: tiles live in shared memory in the accumulator type
(the conversion on load is exact); each thread owns rows and strided columns of acc_s / acc_o
(thread_layout); the row reductions that CUDA does with warp shuffles go through shared memory
(softmax.py); P goes through shared memory before O += P V, where CUDA keeps it in registers as the
next MMA's A operand. Arithmetic: float32 accumulation for 16-bit and float32 inputs, float64 for
float64, but dot products are summed sequentially (an MMA sums in a tree), P is not rounded to 16 bits
before P V (the tensor-core kernel rounds it), and the online-softmax correction is
exp2((old_max - new_max) * scale_log2) (see softmax.py for why). float16 arrays are read as they are;
bfloat16 ones arrive as float32 copies (cuflash/backends/numba.py: Numba has no bfloat16 array type).
Variants: the rules and their order are flash_fwd.cu's (mask.py, seqinfo.py, dropout.py), but a
thread does not hold its scores in the mma.sync C layout, so it takes one Philox call per keep flag
(dropout.py keep, as the SIMT kernels do) and the softcap uses math.tanh, not tanh_approx.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, uint64

from ..config import ALIBI, BOUNDED, DROPOUT, LOCAL, PAGED, SEQUSED, SOFTCAP, VARLEN, longest_first
from .dropout import keep
from .mask import n_block_range, needs_mask, score_mod, score_mod_init, visible
from .seqinfo import batch_index, key_row, seq_info, used_keys
from .softmax import softmax_finalize, softmax_init, softmax_update

LOG2E = 1.4426950408889634  # log2(e): exp2's scale is unit * LOG2E (ScoreMod::score_log2)


def acc_type(dtype: str):
    """acc_t<T> of common.cuh: float64 for float64 inputs, float32 for the others."""
    return cuda.float64 if dtype == "float64" else cuda.float32


def thread_layout(rows: int, cols: int, nthreads: int) -> tuple[int, int, int, int]:
    """How a block's threads share a (rows, cols) register tile: (tpr, row_stride, rpt, cpt).

    Thread tid owns rows tid // tpr + i * row_stride (i < rpt) and, in each, columns
    tid % tpr + j * tpr (j < cpt): tpr threads per row, rpt rows per thread, cpt columns per row.
    """
    if nthreads >= rows:
        if nthreads % rows:
            raise ValueError(f"{nthreads} threads cannot share {rows} rows evenly")
        tpr, row_stride, rpt = nthreads // rows, rows, 1
    else:
        if rows % nthreads:
            raise ValueError(f"{rows} rows cannot be shared by {nthreads} threads evenly")
        tpr, row_stride, rpt = 1, nthreads, rows // nthreads
    if cols % tpr:
        raise ValueError(f"{cols} columns cannot be shared by {tpr} threads per row")
    return tpr, row_stride, rpt, cols // tpr


def smem_bytes(cfg) -> int:
    """Static shared memory of the forward prototype: Q, K, V tiles, P tile, reduction scratch."""
    tpr = thread_layout(cfg.block_m, cfg.block_n, cfg.threads)[0]
    d, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    return ((bm + 2 * bn) * d + bm * bn + bm * tpr) * (8 if cfg.dtype == "float64" else 4)


@cuda.jit(device=True)
def load_tile(s, g, batch, row0, head, seqlen, head_dim, tid, nthreads):
    # copy.cuh's tile load (cp.async there): rows row0.. of g[batch, :, head, :] into s, converted to
    # acc_t. Rows past seqlen and columns past head_dim are zero-filled and never read from g.
    rows = s.shape[0]
    cols = s.shape[1]
    for e in range(tid, rows * cols, nthreads):
        r = e // cols
        c = e - r * cols
        if row0 + r < seqlen and c < head_dim:
            s[r, c] = g[batch, row0 + r, head, c]
        else:
            s[r, c] = 0


@cuda.jit(device=True)
def load_keys(s, g, is_paged, block_table, batch, bidx, k_start, key0, head, seqlen_k, head_dim, tid, nthreads):
    # copy.cuh's cp_async_keys: key rows key0.. of the entry into s. Dense: load_tile of the slab; paged:
    # each row through key_row, a row without a page (or past seqlen_k) zero-filled.
    if not is_paged:
        load_tile(s, g, bidx, k_start + key0, head, k_start + seqlen_k, head_dim, tid, nthreads)
        return
    rows = s.shape[0]
    cols = s.shape[1]
    for e in range(tid, rows * cols, nthreads):
        r = e // cols
        c = e - r * cols
        page = -1
        row = 0
        if key0 + r < seqlen_k and c < head_dim:
            page, row = key_row(is_paged, block_table, batch, bidx, k_start, key0 + r, g.shape[1], g.shape[0])
        if page >= 0:
            s[r, c] = g[page, row, head, c]
        else:
            s[r, c] = 0


def variant_flags(cfg):
    """(local, softcap, alibi, dropout, varlen) of cfg.variant, and transform = softcap or alibi
    (mask.cuh's kTransform: the scores pass through score_mod)."""
    v = cfg.variant
    local, softcap, alibi = bool(v & LOCAL), bool(v & SOFTCAP), bool(v & ALIBI)
    return local, softcap, alibi, bool(v & DROPOUT), bool(v & VARLEN), softcap or alibi


@functools.lru_cache(maxsize=None)
def make_flash_fwd(cfg):
    """The forward kernel for one KernelConfig (any dtype: the 16-bit MMA and SIMT kernels alike)."""
    HEAD_DIM = cfg.head_dim
    LONGEST_FIRST = longest_first(cfg.variant)  # mask.cuh query_block
    BLOCK_M = cfg.block_m
    BLOCK_N = cfg.block_n
    NTHREADS = cfg.threads
    IS_LOCAL, IS_SOFTCAP, IS_ALIBI, IS_DROPOUT, IS_VARLEN, TRANSFORM = variant_flags(cfg)
    IS_BOUNDED = bool(cfg.variant & BOUNDED)  # softmax.cuh kBounded: row_max stays 0
    IS_SEQUSED, IS_PAGED = bool(cfg.variant & SEQUSED), bool(cfg.variant & PAGED)
    ACC = acc_type(cfg.dtype)
    TPR, ROW_STRIDE, RPT, S_CPT = thread_layout(BLOCK_M, BLOCK_N, NTHREADS)
    O_CPT = thread_layout(BLOCK_M, HEAD_DIM, NTHREADS)[3]

    @cuda.jit
    def flash_fwd(q, k, v, o, lse, softmax_scale, scale_log2, cu_seqlens_q, cu_seqlens_k, window_left,
                  window_right, softcap, alibi_slopes, alibi_batch_stride, seed_lo, seed_hi, offset,
                  dropout_threshold, dropout_scale, seqused_k, block_table):
        # [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x if LONGEST_FIRST else cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        # the cache's capacity: k's rows, or (paged: k a page pool) max_pages * page_size
        capacity = block_table.shape[1] * k.shape[1] if IS_PAGED else k.shape[1]
        q_start, k_start, seqlen_q, seqlen_k = seq_info(IS_VARLEN, cu_seqlens_q, cu_seqlens_k, batch,
                                                        q.shape[1], capacity)
        seqlen_k = used_keys(IS_SEQUSED, seqused_k, batch, seqlen_k)
        row_begin = m_block * BLOCK_M
        if row_begin >= seqlen_q:
            return  # varlen: a shorter sequence than the grid's
        bidx = batch_index(IS_VARLEN, batch)
        nheads = q.shape[2]
        head_dim = q.shape[3]
        nheads_k = k.shape[2]
        head_k = head // (nheads // nheads_k)  # GQA
        shift = seqlen_k - seqlen_q
        n_block_min, n_block_end = n_block_range(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k,
                                                 BLOCK_M, BLOCK_N, m_block)
        # ScoreMod of this (batch, head): the held units' factor (the LSE's factor on the row max), the
        # transform's constants and exp2's scale
        slope = alibi_slopes[batch * alibi_batch_stride + head] if IS_ALIBI else ACC(0)
        lse_scale, tanh_in, bias, score_log2 = score_mod_init(IS_SOFTCAP, softmax_scale, softcap, slope, scale_log2,
                                                              ACC(LOG2E))
        bh = uint64(batch * nheads + head)  # dropout: Philox counter word 2

        # Thread tid owns rows row0 + i * ROW_STRIDE and columns lane + j * TPR (thread_layout).
        row0 = tid // TPR
        lane = tid % TPR

        sQ = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sK = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sV = cuda.shared.array((BLOCK_N, HEAD_DIM), ACC)
        sP = cuda.shared.array((BLOCK_M, BLOCK_N), ACC)
        sRed = cuda.shared.array((BLOCK_M, TPR), ACC)

        acc_s = cuda.local.array((RPT, S_CPT), ACC)
        acc_o = cuda.local.array((RPT, O_CPT), ACC)
        row_max = cuda.local.array(RPT, ACC)
        row_sum = cuda.local.array(RPT, ACC)
        tile_max = cuda.local.array(RPT, ACC)
        lse_rows = cuda.local.array(RPT, ACC)
        for i in range(RPT):
            for j in range(O_CPT):
                acc_o[i, j] = 0
        softmax_init(row_max, row_sum, IS_BOUNDED)

        # [2] Load the Q tile
        # rows q_start + row_begin.. of the (packed) array; the sequence ends at row q_start + seqlen_q
        load_tile(sQ, q, bidx, q_start + row_begin, head, q_start + seqlen_q, head_dim, tid, NTHREADS)

        # Key blocks in decreasing order, as in the CUDA kernel: the blocks that need masking (tail,
        # diagonal, window edge) come first.
        for n_block in range(n_block_end - 1, n_block_min - 1, -1):
            key0 = n_block * BLOCK_N
            cuda.syncthreads()  # the previous block is done with sK, sV, sP (and sQ is visible)
            load_keys(sK, k, IS_PAGED, block_table, batch, bidx, k_start, key0, head_k, seqlen_k, head_dim, tid,
                      NTHREADS)
            load_keys(sV, v, IS_PAGED, block_table, batch, bidx, k_start, key0, head_k, seqlen_k, head_dim, tid,
                      NTHREADS)
            cuda.syncthreads()

            # [3] S = Q K^T
            for i in range(RPT):
                r = row0 + i * ROW_STRIDE
                for j in range(S_CPT):
                    c = lane + j * TPR
                    s = ACC(0)
                    for d in range(HEAD_DIM):  # CUDA: mma.sync
                        s += sQ[r, d] * sK[c, d]
                    acc_s[i, j] = s

            # [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
            # acc_s[i, j]: query row row_begin + row0 + i * ROW_STRIDE, key key0 + lane + j * TPR (in the sequence)
            if TRANSFORM:
                for i in range(RPT):
                    row = row_begin + row0 + i * ROW_STRIDE
                    for j in range(S_CPT):
                        x, dcap = score_mod(IS_SOFTCAP, IS_ALIBI, tanh_in, bias, shift, acc_s[i, j], row,
                                            key0 + lane + j * TPR)
                        acc_s[i, j] = x
            if needs_mask(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, m_block, n_block):
                for i in range(RPT):
                    row = row_begin + row0 + i * ROW_STRIDE
                    for j in range(S_CPT):
                        if not visible(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, row,
                                       key0 + lane + j * TPR):
                            acc_s[i, j] = -math.inf

            # [5] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
            softmax_update(acc_s, acc_o, row_max, row_sum, tile_max, sRed, row0, ROW_STRIDE, lane, TPR, score_log2,
                           IS_BOUNDED)

            # [6] O += dropout(P) V
            # Dropped entries are 0 in P V only: row_sum, and so the LSE, keep them. O is scaled by
            # 1 / (1 - dropout_p) at the store.
            if IS_DROPOUT:
                for i in range(RPT):
                    row = row_begin + row0 + i * ROW_STRIDE
                    for j in range(S_CPT):
                        if not keep(seed_lo, seed_hi, bh, offset, dropout_threshold, row, key0 + lane + j * TPR):
                            acc_s[i, j] = 0
            for i in range(RPT):
                for j in range(S_CPT):
                    sP[row0 + i * ROW_STRIDE, lane + j * TPR] = acc_s[i, j]
            cuda.syncthreads()
            for i in range(RPT):
                r = row0 + i * ROW_STRIDE
                for j in range(O_CPT):
                    c = lane + j * TPR
                    a = acc_o[i, j]
                    for n in range(BLOCK_N):  # CUDA: mma.sync
                        a += sP[r, n] * sV[n, c]
                    acc_o[i, j] = a

        # [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
        # (softmax_scale here is lse_scale: the held units' factor, softcap with a softcap)
        softmax_finalize(acc_o, row_max, row_sum, lse_rows, sRed, row0, ROW_STRIDE, lane, TPR, lse_scale)

        # [8] Store O and LSE
        for i in range(RPT):
            row = row_begin + row0 + i * ROW_STRIDE
            if row < seqlen_q:
                for j in range(O_CPT):
                    c = lane + j * TPR
                    if c < head_dim:
                        if IS_DROPOUT:
                            o[bidx, q_start + row, head, c] = acc_o[i, j] * dropout_scale
                        else:
                            o[bidx, q_start + row, head, c] = acc_o[i, j]
                if lane == 0:
                    lse[bidx, head, q_start + row] = lse_rows[i]

    return flash_fwd
