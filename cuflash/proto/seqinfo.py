"""Mirror of kernels_cu/seqinfo.cuh: where one batch entry's rows live and how many there are.

Dense: entry b has seqlen_q query rows and seqlen_k key rows (the arrays' extents), at batch index b
of the (batch, row, head, dim) arrays. Varlen (is_varlen: config.VARLEN): the arrays are packed as
(1, total, head, dim) views (lse and D as (1, head, total_q)) and sequence b is rows cu_seqlens[b] ..
cu_seqlens[b + 1]; the grid is sized by the longest lengths and blocks past a sequence's end return.

seqinfo.cuh's struct SeqInfo becomes seq_info, returning (q_start, k_start, seqlen_q, seqlen_k); its
offset helpers become batch_index (which batch index of the arrays the entry uses) plus the starts,
which the kernels add to the row indices: row r of the entry is [batch_index, start + r, head, :].
"""

from numba import cuda


@cuda.jit(device=True)
def seq_info(is_varlen, cu_seqlens_q, cu_seqlens_k, batch, seqlen_q, seqlen_k):
    # seqlen_q, seqlen_k: the dense lengths (the arrays' extents); unused with is_varlen.
    # [1] Sequence lengths and first rows of this batch entry: dense, or from cu_seqlens
    if is_varlen:
        q_start = cu_seqlens_q[batch]
        seqlen_q = cu_seqlens_q[batch + 1] - q_start
        k_start = cu_seqlens_k[batch]
        seqlen_k = cu_seqlens_k[batch + 1] - k_start
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k


@cuda.jit(device=True)
def batch_index(is_varlen, batch):
    # The batch index of the entry in the arrays: 0 for the packed (1, total, ...) views (batch stride 0).
    if is_varlen:
        return 0
    return batch
