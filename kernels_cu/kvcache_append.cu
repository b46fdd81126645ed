// Writing new key and value rows into a KV cache, in place, before flash_attn_with_kvcache attends over it;
// and each entry's key count after the append, which the attention kernels read (FwdParams::seqused_k).
//
// Grid (seqlen_new, or 1 without rows to write, batch): block (r, b) copies row r of k_new[b] and v_new[b] (every
// head) to logical cache row start_b + r, start_b = cache_seqlens[b] (or AppendParams::start for every entry);
// dense caches hold logical row j at row j of the entry, paged ones at row j % page_size of page block_table[b, j /
// page_size] (seqinfo.cuh's KeyRows). Values are not trusted: a row outside [0, capacity), or on a page outside
// [0, num_pages), is not written, so no value reaches outside the caches (api.flash_attn_with_kvcache).
// The NumPy path of the same append is api._append_on_host.
#include "params.cuh"
#include "common.cuh"

namespace cuflash {

constexpr int kAppendThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kAppendThreads) kvcache_append(const __grid_constant__ AppendParams a) {
    const int r = blockIdx.x, batch = blockIdx.y;
    const long long start = a.cache_seqlens ? a.cache_seqlens[batch] : a.start;

    // [1] The entry's keys after the append, clamped to [-1, 2**31 - 1] (the kernels clamp it to the capacity)
    if (a.counts && r == 0 && threadIdx.x == 0)
        a.counts[batch] = static_cast<int>(min(max(start + a.seqlen_new, -1LL), 2147483647LL));
    if (!a.k_new || r >= a.seqlen_new) return;  // no rows to write (they are in the cache already, or none)

    // [2] Where new row r goes: its cache row, or nowhere
    const long long j = start + r;
    if (j < 0 || j >= a.capacity) return;
    long long slab = batch, row = j;
    if (a.block_table) {
        const int page = a.block_table[batch * a.block_table_batch_stride + j / a.page_size];
        if (page < 0 || page >= a.num_pages) return;
        slab = page;
        row = j % a.page_size;
    }

    // [3] Copy the row, every head: in 16-byte chunks where every row start and the head dim are 16-byte aligned
    // (the caches a plan serves), else element by element. __restrict__: the new rows and the caches never
    // overlap, so the loads may all be issued before the stores.
    const T* __restrict__ k_new =
        static_cast<const T*>(a.k_new) + batch * a.k_new_batch_stride + r * a.k_new_row_stride;
    const T* __restrict__ v_new =
        static_cast<const T*>(a.v_new) + batch * a.v_new_batch_stride + r * a.v_new_row_stride;
    T* __restrict__ k = static_cast<T*>(a.k) + slab * a.k_batch_stride + row * a.k_row_stride;
    T* __restrict__ v = static_cast<T*>(a.v) + slab * a.v_batch_stride + row * a.v_row_stride;
    constexpr int kVec = 16 / sizeof(T);
    const bool wide = ((reinterpret_cast<unsigned long long>(k_new) | reinterpret_cast<unsigned long long>(v_new) |
                        reinterpret_cast<unsigned long long>(k) | reinterpret_cast<unsigned long long>(v)) % 16 == 0) &&
                      (a.head_dim | a.k_new_head_stride | a.v_new_head_stride | a.k_head_stride | a.v_head_stride) %
                              kVec == 0;
    if (wide) {
        const int chunks = a.head_dim / kVec;
        for (int i = threadIdx.x; i < a.nheads_k * chunks; i += kAppendThreads) {
            const int h = i / chunks, c = (i % chunks) * kVec;
            const uint4 kx = *reinterpret_cast<const uint4*>(k_new + h * a.k_new_head_stride + c);
            const uint4 vx = *reinterpret_cast<const uint4*>(v_new + h * a.v_new_head_stride + c);
            *reinterpret_cast<uint4*>(k + h * a.k_head_stride + c) = kx;
            *reinterpret_cast<uint4*>(v + h * a.v_head_stride + c) = vx;
        }
    } else {
        for (int i = threadIdx.x; i < a.nheads_k * a.head_dim; i += kAppendThreads) {
            const int h = i / a.head_dim, c = i % a.head_dim;
            k[h * a.k_head_stride + c] = k_new[h * a.k_new_head_stride + c];
            v[h * a.v_head_stride + c] = v_new[h * a.v_new_head_stride + c];
        }
    }
}

}  // namespace cuflash
