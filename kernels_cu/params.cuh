// Runtime arguments of every kernel, passed by value as `const __grid_constant__ FwdParams p`.
// cuflash/_params.py mirrors these structs byte for byte (NumPy structured dtypes with align=True):
// change both together; tests/test_params.py compares the two layouts.
//
// Strides are int64 and counted in elements, so any layout whose last dimension is contiguous runs
// without a copy and no index can overflow 32 bits. Tensors are indexed [batch, row, head, dim] for
// q/k/v/o (and their gradients) and [batch, head, row] for lse and d.
#pragma once

namespace cuflash {

struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    void* lse;  // acc_t (float, or double for fp64 inputs), [batch, head, row]

    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;  // lse row stride is 1

    double softmax_scale;  // scale applied to Q K^T
    double scale_log2;     // softmax_scale * log2(e): the kernels use exp2

    int batch;
    int nheads;
    int nheads_k;          // nheads % nheads_k == 0; query head h reads kv head h / (nheads / nheads_k)
    int seqlen_q;          // varlen: the longest sequence (the grid's extent); each block reads its own
    int seqlen_k;
    int head_dim;          // actual head dim; the kernel is compiled for kHeadDim >= head_dim

    // Attention variants (seqinfo.cuh, mask.cuh, dropout.cuh). Which of them a kernel applies is its
    // template argument kVariant; these are their run-time values.
    const int* cu_seqlens_q;       // varlen: (batch + 1) first rows of the packed sequences; null when dense
    const int* cu_seqlens_k;
    const float* alibi_slopes;     // [batch, head] with alibi_batch_stride (0 for one row of nheads)
    long long alibi_batch_stride;
    unsigned long long seed;       // dropout: the Philox key
    double dropout_scale;          // 1 / (1 - dropout_p); double, exact for the fp64 kernels
    int window_left;               // row i sees keys i' - left .. i' + right (i' = i + seqlen_k - seqlen_q);
    int window_right;              // unbounded: kUnbounded (mask.cuh) where the API says -1; causal is right = 0
    float softcap;                 // > 0: scores become softcap * tanh(score / softcap)
    unsigned int dropout_threshold; // a score is kept iff its 16-bit Philox draw is >= this: floor(p * 65536)
    unsigned int offset;           // dropout: the fourth Philox counter word

    // KV cache (seqinfo.cuh). kSeqused: entry b has min(max(seqused_k[b], 0), seqlen_k) keys, seqlen_k the
    // cache's capacity. kPaged: k / v are page pools [page, row, head, dim] (batch stride = page stride)
    // and key row j of entry b is row j % page_size of page block_table[b * block_table_batch_stride +
    // j / page_size]; a page outside [0, num_pages) is never read (its rows load as zeros).
    const int* seqused_k;
    const int* block_table;
    long long block_table_batch_stride;
    int page_size;
    int num_pages;
};

struct BwdParams {
    FwdParams fwd;         // q, k, v, o, lse and their strides, as in the forward call

    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    void* dsum;            // the workspace (config.BackwardWorkspace); at offset 0 D = rowsum(dO * O), acc_t,
                           // [batch, head, row], written by preprocess

    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long dsum_batch_stride, dsum_head_stride;  // dsum row stride is 1

    // Tensor-core backward (flash_bwd): byte offsets into the workspace, -1 where absent. The fp32 dQ
    // accumulator [batch, head, row, dim] (row stride: the compiled head dim; its 8-float chunks swizzled by
    // the row bits dq_accum_swizzle, backward.cuh's dq_accum_col), zeroed by preprocess, summed into by
    // flash_bwd(_sm90), converted by postprocess; with kDeterministic one int semaphore per (entry, head, 64
    // query rows), zeroed by preprocess: how many key blocks have added into that dQ tile.
    long long dq_accum_offset, dq_semaphore_offset;
    long long dq_accum_batch_stride, dq_accum_head_stride, dq_accum_row_stride;
    long long dq_semaphore_batch_stride, dq_semaphore_head_stride;
    int dq_accum_swizzle;  // kDqSwizzleSm90 for flash_bwd_sm90, 0 (none) for flash_bwd
};

// Decoding over a KV cache (flash_decode.cu): FwdParams (k, v: the caches; kSeqused, and kPaged for page
// pools) and the split-KV partials. With num_splits > 1 each split of an entry's keys writes its own O
// (normalized over its keys) and LSE, fp32, and flash_decode_combine merges them into o and lse.
struct DecodeParams {
    FwdParams fwd;
    float* o_partial;    // [split, batch, head, row, kHeadDim] (the compiled head dim), contiguous
    float* lse_partial;  // [split, batch, head, row]; -inf: that split saw no key of the row
    int num_splits;      // 1: flash_decode writes o and lse itself (no partials, no combine); at most kMaxSplits
};
constexpr int kMaxSplits = 128;  // config.MAX_SPLITS (flash_decode_combine's lanes hold kMaxSplits / 32 LSEs each)

// The append of new rows to a KV cache (kvcache_append.cu). k, v: the caches, as FwdParams' (dense [batch, row,
// head, dim], or page pools [page, row, head, dim] through block_table); k_new, v_new [batch, row, head, dim]
// (null: no rows to write). Entry b's rows start at cache_seqlens[b], or at `start` where cache_seqlens is null;
// counts (null: not written) gets each entry's keys after the append of seqlen_new rows.
struct AppendParams {
    const void* k_new;
    const void* v_new;
    void* k;
    void* v;
    const int* cache_seqlens;
    const int* block_table;
    int* counts;
    long long start;
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long block_table_batch_stride;
    long long capacity;    // key rows an entry can hold: the dense cache's rows, or max_pages * page_size
    int seqlen_new;
    int nheads_k;
    int head_dim;
    int page_size;
    int num_pages;
};

// The Hopper forward (flash_fwd_sm90.cu) reads q, k and v through the bulk tensor copy engine: FwdParams
// plus one tensor map per array, encoded on the host (cuflash/_tma.py). A CUtensorMap is 128 opaque bytes,
// 64-byte aligned.
struct alignas(64) TensorMap {
    unsigned long long raw[16];
};

struct FwdSm90Params {
    FwdParams fwd;
    TensorMap tma_q, tma_k, tma_v;  // [batch, head, row, dim] boxes of 64 columns x the tile's rows
};

// The Hopper backward (flash_bwd_sm90.cu): BwdParams and the maps of q, k, v and dout.
struct BwdSm90Params {
    BwdParams bwd;
    TensorMap tma_q, tma_k, tma_v, tma_do;
};

}  // namespace cuflash
