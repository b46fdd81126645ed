// What the tensor-core backward kernels (flash_bwd.cu, flash_bwd_sm90.cu) share: the LSE as exp2's offset,
// and where the workspace (config.BackwardWorkspace) keeps the dQ accumulator and semaphores.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// LSE (natural log) -> the offset subtracted from S * scale_log2 in exp2; -inf (the row saw no key) gives
// +inf, so that P = exp2(finite or -inf - inf) = 0, never NaN.
__device__ __forceinline__ float lse_to_log2_offset(float lse) {
    return lse == neg_inf<float>() ? -neg_inf<float>() : lse * 1.4426950408889634f;
}

// The dQ accumulator's rows of (entry, head) and the entry's dQ semaphores of that head (workspace offsets
// in bytes from dsum; params.cuh).
template <class Seq>
__device__ __forceinline__ float* dq_accum_rows(const BwdParams& p, const Seq& seq, int batch, int head) {
    return reinterpret_cast<float*>(static_cast<char*>(p.dsum) + p.dq_accum_offset) +
           seq.q_offset(batch, p.dq_accum_batch_stride, p.dq_accum_row_stride) + head * p.dq_accum_head_stride;
}
__device__ __forceinline__ int* dq_semaphores(const BwdParams& p, int batch, int head) {
    return reinterpret_cast<int*>(static_cast<char*>(p.dsum) + p.dq_semaphore_offset) +
           batch * p.dq_semaphore_batch_stride + head * p.dq_semaphore_head_stride;
}

}  // namespace cuflash
