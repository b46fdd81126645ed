"""Mirror of kernels_cu/softmax.cuh (struct OnlineSoftmax: init, update, rescale, finalize) for the prototypes.

The C++ struct holds row_max and row_sum in registers; here they are per-thread local arrays that the
kernel passes in, and the methods are device functions softmax_init / softmax_update /
softmax_finalize. As in C++, row_max is the running max of the raw (unscaled) scores. softmax.cuh's
second update(acc_s, scale_log2, correction), which leaves acc_o alone and returns its rescale factors
for a later rescale(acc_o, correction) (flash_fwd_sm90.cu: acc_o is still taking P V then), is
softmax_update_correction and softmax_rescale; softmax_update is the two in a row, as in C++.

Each thread owns `rpt` query rows of the tile (rows row0, row0 + row_stride, ...) and, within each,
every tpr-th column; acc_s[i, :] and acc_o[i, :] are its columns of row i. row_max is kept
all-reduced over the tpr threads of a row; row_sum stays a per-thread partial sum until
softmax_finalize, as in the CUDA kernel. The CUDA kernel reduces over a row's lanes with warp
shuffles (common.cuh warp_allreduce_*); the simulator has no shuffles, so here the partial values go
through a shared-memory scratch `red` of shape (block_m, tpr), fenced by syncthreads. Every thread
of the block must call these functions the same number of times (they contain barriers).

bounded (softmax.cuh kBounded, config.BOUNDED: a softcap of at most 50 bounds every logit): row_max stays 0
and the update is its step [5] alone, P = exp2(S * scale_log2), with every correction 1.

Values are stored into the caller's arrays, whose dtype is the accumulator type (float32 or
float64): that keeps the arithmetic in acc_t on the GPU and in the simulator alike.
"""

import math

from numba import cuda


@cuda.jit(device=True)
def softmax_init(row_max, row_sum, bounded):
    # [1] Start every row with row_max = -inf and row_sum = 0
    # (bounded: 0, for good)
    for i in range(row_max.shape[0]):
        row_max[i] = 0 if bounded else -math.inf
        row_sum[i] = 0


@cuda.jit(device=True)
def allreduce_max(red, vals, row0, row_stride, lane, tpr):
    # common.cuh warp_allreduce_max<4>, through shared memory: vals[i] <- max over the tpr threads
    # that share row row0 + i * row_stride.
    for i in range(vals.shape[0]):
        red[row0 + i * row_stride, lane] = vals[i]
    cuda.syncthreads()
    for i in range(vals.shape[0]):
        r = row0 + i * row_stride
        m = red[r, 0]
        for t in range(1, tpr):
            m = max(m, red[r, t])
        vals[i] = m
    cuda.syncthreads()  # red is reused by the next call


@cuda.jit(device=True)
def allreduce_sum(red, vals, row0, row_stride, lane, tpr):
    # vals[i] <- sum over the tpr threads that share row row0 + i * row_stride (fixed order).
    for i in range(vals.shape[0]):
        red[row0 + i * row_stride, lane] = vals[i]
    cuda.syncthreads()
    for i in range(vals.shape[0]):
        r = row0 + i * row_stride
        s = red[r, 0]
        for t in range(1, tpr):
            s += red[r, t]
        vals[i] = s
    cuda.syncthreads()


@cuda.jit(device=True)
def softmax_update_correction(acc_s, correction, row_max, row_sum, red, row0, row_stride, lane, tpr, scale_log2,
                              bounded):
    """One key block of the online softmax, acc_o left alone (softmax.cuh update(acc_s, scale_log2, correction)).

    New row_max = max(old row_max, this block's row max); row_sum is rescaled by, and correction[i]
    set to, exp2((old - new) * scale_log2), the factor softmax_rescale applies to acc_o row i; acc_s
    becomes P = exp2(S * scale_log2 - row_max * scale_log2) and its row sums are added to row_sum.
    correction (rpt elements) holds the reduced row max until it takes the factor. A row whose max is
    still -inf (all its keys masked so far) subtracts 0 instead, so P = 0 and its factor is
    exp2(-inf) = 0, never NaN (C++ takes 1 there: either leaves that row's acc_o and row_sum at 0).
    bounded: step 5 alone, no offset, correction 1 (every thread takes this branch alike: no barrier is skipped
    by some and not others).
    """
    if bounded:
        for i in range(acc_s.shape[0]):
            correction[i] = 1
            for j in range(acc_s.shape[1]):
                acc_s[i, j] = math.exp2(acc_s[i, j] * scale_log2)
                row_sum[i] += acc_s[i, j]
        return
    # [2] Row max of the key block, reduced over the row's threads: m = max(row_max, max_j S)
    for i in range(acc_s.shape[0]):
        m = row_max[i]
        for j in range(acc_s.shape[1]):
            m = max(m, acc_s[i, j])
        correction[i] = m
    allreduce_max(red, correction, row0, row_stride, lane, tpr)
    for i in range(acc_s.shape[0]):
        m_new = correction[i]
        # [3] Offset m * scale_log2 for exp2, or 0 for a row that has seen no key (its P is 0, never NaN)
        if m_new == -math.inf:
            correction[i] = 0  # subtract 0 instead of -inf (stored through the array: stays acc_t)
        max_scaled = correction[i] * scale_log2
        # [4] Rescale acc_o and row_sum by exp2((old row_max - new row_max) * scale_log2), difference first
        # (old - new) first: exactly 0 when the max did not move, so the correction is exactly 1.
        # exp2(row_max * scale_log2 - max_scaled) is not: contracted into an FMA it keeps the rounding
        # error of max_scaled, a bias of the same sign at every key block (LSE off by ~5e-6 in fp32
        # after 40 blocks, measured on an emulation of this kernel; ~7e-7 this way). acc_o's share of the
        # rescale is softmax_rescale's.
        correction[i] = math.exp2((row_max[i] - correction[i]) * scale_log2)
        row_max[i] = m_new
        row_sum[i] *= correction[i]
        # [5] P = exp2(S * scale_log2 - offset) in place of S; add the row sums of P to row_sum
        for j in range(acc_s.shape[1]):
            acc_s[i, j] = math.exp2(acc_s[i, j] * scale_log2 - max_scaled)
            row_sum[i] += acc_s[i, j]


@cuda.jit(device=True)
def softmax_rescale(acc_o, correction):
    # softmax.cuh rescale: acc_o row i *= correction[i] (softmax_update_correction's factors)
    for i in range(acc_o.shape[0]):
        for j in range(acc_o.shape[1]):
            acc_o[i, j] *= correction[i]


@cuda.jit(device=True)
def softmax_update(acc_s, acc_o, row_max, row_sum, tile_max, red, row0, row_stride, lane, tpr, scale_log2, bounded):
    """One key block of the online softmax: softmax_update_correction, then softmax_rescale of acc_o.

    tile_max is a scratch local array of rpt elements (it ends holding the rescale factors).
    """
    softmax_update_correction(acc_s, tile_max, row_max, row_sum, red, row0, row_stride, lane, tpr, scale_log2,
                              bounded)
    softmax_rescale(acc_o, tile_max)


@cuda.jit(device=True)
def softmax_finalize(acc_o, row_max, row_sum, lse_rows, red, row0, row_stride, lane, tpr, softmax_scale):
    """O /= row_sum and LSE = row_max * softmax_scale + log(row_sum), per owned row.

    row_sum is first all-reduced over the row's threads. A row that saw no key (row_sum == 0,
    row_max == -inf) gets O = 0 and LSE = -inf.
    """
    # [6] Reduce row_sum over the row's threads
    allreduce_sum(red, row_sum, row0, row_stride, lane, tpr)
    # [7] O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); row_sum = 0 gives O = 0, LSE = -inf
    for i in range(acc_o.shape[0]):
        if row_sum[i] > 0:
            lse_rows[i] = row_max[i] * softmax_scale + math.log(row_sum[i])
            inv_sum = 1.0 / row_sum[i]
        else:
            lse_rows[i] = -math.inf
            inv_sum = 0.0
        for j in range(acc_o.shape[1]):
            acc_o[i, j] *= inv_sum
