"""Mirror of kernels_cu/seqinfo.cuh: where one batch entry's rows live and how many there are.

Dense: entry b has seqlen_q query rows and seqlen_k key rows (the arrays' extents), at batch index b
of the (batch, row, head, dim) arrays. Varlen (is_varlen: config.VARLEN): the arrays are packed as
(1, total, head, dim) views (lse and D as (1, head, total_q)) and sequence b is rows cu_seqlens[b] ..
cu_seqlens[b + 1]; the grid is sized by the longest lengths and blocks past a sequence's end return.

seqinfo.cuh's struct SeqInfo becomes seq_info, returning (q_start, k_start, seqlen_q, seqlen_k); its
offset helpers become batch_index (which batch index of the arrays the entry uses) plus the starts,
which the kernels add to the row indices: row r of the entry is [batch_index, start + r, head, :].

KV cache (forward only): used_keys is SeqInfo's seqused_k clamp (with SEQUSED entry b has
min(max(seqused_k[b], 0), capacity) keys), a function of its own so that the backward prototypes'
seq_info calls stay as they are; key_row is KeyRows::row (with PAGED, key row j of entry b is row
j % page_size of page block_table[b, j // page_size], k and v being page pools).
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
def used_keys(is_seqused, seqused_k, batch, seqlen_k):
    # seqlen_k: the capacity (dense: the cache's extent; paged: max_pages * page_size)
    if is_seqused:
        return min(max(seqused_k[batch], 0), seqlen_k)
    return seqlen_k


@cuda.jit(device=True)
def batch_index(is_varlen, batch):
    # The batch index of the entry in the arrays: 0 for the packed (1, total, ...) views (batch stride 0).
    if is_varlen:
        return 0
    return batch


@cuda.jit(device=True)
def key_row(is_paged, block_table, batch, bidx, k_start, j, page_size, num_pages):
    # (first index, row) of key row j of the entry in a [batch or page, row, head, dim] array; (-1, 0)
    # for a page outside [0, num_pages), which is never read.
    # [2] Key row j of this batch entry: dense, or through the page table
    if not is_paged:
        return bidx, k_start + j
    page = block_table[batch, j // page_size]
    if page < 0 or page >= num_pages:
        return -1, 0
    return page, j % page_size
