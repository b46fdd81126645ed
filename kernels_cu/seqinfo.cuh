// Where one batch entry's rows live and how many there are: every kernel's per-batch offsets.
// Mirrored by cuflash/proto/seqinfo.py.
//
// Dense: entry b has seqlen_q query rows and seqlen_k key rows starting at b * batch_stride.
// Varlen (kIsVarlen: the kVarlen bit of kVariant, mask.cuh): the arrays are packed (batch stride 0) and sequence b is
// rows cu_seqlens[b] .. cu_seqlens[b + 1]; params.seqlen_q / seqlen_k are then only the longest
// lengths, which size the grid. Either way row r of entry b is at b * batch_stride + (start + r) *
// row_stride, and its LSE at b * lse_batch_stride + (q_start + r).
#pragma once
#include "params.cuh"

namespace cuflash {

template <bool kIsVarlen>
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

}  // namespace cuflash
