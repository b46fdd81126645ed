// Where one batch entry's rows live and how many there are: every kernel's per-batch offsets.
// Mirrored by cuflash/proto/seqinfo.py.
//
// Dense: entry b has seqlen_q query rows and seqlen_k key rows starting at b * batch_stride.
// Varlen (kIsVarlen: the kVarlen bit of kVariant, mask.cuh): the arrays are packed (batch stride 0) and sequence b is
// rows cu_seqlens[b] .. cu_seqlens[b + 1]; params.seqlen_q / seqlen_k are then only the longest
// lengths, which size the grid. Either way row r of entry b is at b * batch_stride + (start + r) *
// row_stride, and its LSE at b * lse_batch_stride + (q_start + r).
// KV cache (forward only): with kSeqused entry b has min(max(seqused_k[b], 0), seqlen_k) keys, so that
// no device value can make a kernel read past the cache; with kPaged its key rows come through the
// page table (KeyRows below).
#pragma once
#include "params.cuh"

namespace cuflash {

template <bool kIsVarlen, bool kIsSeqused = false>
struct SeqInfo {
    int q_start, k_start;    // first row of the entry in the (packed) tensors; 0 when dense
    int seqlen_q, seqlen_k;  // this entry's lengths

    __device__ __forceinline__ SeqInfo(const FwdParams& p, int batch) {
        // [1] Sequence lengths and first rows of this batch entry: dense, or from cu_seqlens
        if (kIsVarlen) {
            q_start = p.cu_seqlens_q[batch];
            seqlen_q = p.cu_seqlens_q[batch + 1] - q_start;
        } else {
            q_start = 0;
            seqlen_q = p.seqlen_q;
        }
        if (kIsVarlen) {
            k_start = p.cu_seqlens_k[batch];
            seqlen_k = p.cu_seqlens_k[batch + 1] - k_start;
        } else {
            k_start = 0;
            seqlen_k = p.seqlen_k;
        }
        if (kIsSeqused) seqlen_k = min(max(p.seqused_k[batch], 0), seqlen_k);
    }

    // Element offset of (entry, query row 0) in a [batch, row, head, dim] tensor (q, o, dO, dQ).
    __device__ __forceinline__ long long q_offset(int batch, long long batch_stride, long long row_stride) const {
        return batch * batch_stride + q_start * row_stride;
    }
    // The same for key rows (k, v, dK, dV).
    __device__ __forceinline__ long long k_offset(int batch, long long batch_stride, long long row_stride) const {
        return batch * batch_stride + k_start * row_stride;
    }
    // Element offset of (entry, head, query row 0) in a [batch, head, row] tensor (lse, D).
    __device__ __forceinline__ long long row_offset(int batch, int head, long long batch_stride,
                                                    long long head_stride) const {
        return batch * batch_stride + head * head_stride + q_start;
    }
};

// Where key row j of a batch entry lives in k or v (one head). Dense: base + j * row_stride, base the
// entry's row 0 (SeqInfo::k_offset). Paged: row j % page_size of page pages[j / page_size], base the
// pool's page 0; a page outside [0, num_pages) gives no row (the tile loads zero-fill it, never read).
template <bool kIsPaged, typename T>
struct KeyRows {
    static constexpr bool kPaged = kIsPaged;
    // References into the params (constant-bank operands where used, as the kernels read p: no registers)
    const FwdParams& p;
    const long long& page_stride;
    const long long& row_stride;
    const T* base;
    const int* pages;  // paged: this entry's row of block_table

    // batch_stride, row_stride: the tensor's fields of p (k's or v's); base already at the head
    __device__ __forceinline__ KeyRows(const FwdParams& p_, const T* base_, const long long& batch_stride,
                                       const long long& row_stride_, int batch)
        : p(p_), page_stride(batch_stride), row_stride(row_stride_), base(base_),
          pages(kIsPaged ? p_.block_table + batch * p_.block_table_batch_stride : nullptr) {}

    // [2] Key row j of this batch entry: dense, or through the page table
    __device__ __forceinline__ bool row(int j, const T*& src) const {
        if constexpr (!kIsPaged) {
            src = base + j * row_stride;
            return true;
        } else {
            const int page = pages[j / p.page_size];
            if (page < 0 || page >= p.num_pages) return false;
            src = base + page * page_stride + (j % p.page_size) * row_stride;
            return true;
        }
    }
};

// The K or V rows of one (entry, kv head) from the tensor's fields of p: the entry's slab, or (kIsPaged)
// pages of the pool, whose batch stride is the page stride.
template <bool kIsPaged, typename T, class Seq>
__device__ __forceinline__ KeyRows<kIsPaged, T> key_rows(const FwdParams& p, const Seq& seq, const void* tensor,
                                                         const long long& batch_stride, const long long& row_stride,
                                                         long long head_stride, int batch, int head_k) {
    const T* base = static_cast<const T*>(tensor) + (kIsPaged ? 0 : seq.k_offset(batch, batch_stride, row_stride)) +
                    head_k * head_stride;
    return KeyRows<kIsPaged, T>(p, base, batch_stride, row_stride, batch);
}

}  // namespace cuflash
