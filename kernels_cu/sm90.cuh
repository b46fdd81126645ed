// Hopper (sm_90a) building blocks: mbarriers, the bulk tensor copy engine (TMA), wgmma descriptors and
// fences, register reallocation. Used by the *_sm90 kernels, which are compiled for sm_90a only.
//
// Shared tiles that TMA fills and wgmma reads use the 128-byte swizzle: a tile of R rows x C columns of
// 16-bit elements is stored as C / 64 slabs of [R][64] (one 128-byte row per tile row), and inside each
// group of 8 rows (1024 bytes) the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Tiles start on
// 1024-byte boundaries, where the swizzle pattern repeats.
#pragma once
#include "common.cuh"

namespace cuflash {

// mbarrier: a shared-memory barrier that completes a phase when `count` threads have arrived and every
// byte a TMA copy announced (expect_tx) has landed. Waiters name the phase parity they wait for.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the copy engine and the other threads (before a __syncthreads).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrive, and announce `bytes` more bytes that TMA copies will bring before this phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// A box of a 4-D tensor (coordinates innermost first) into shared memory at dst, completing on bar.
// The tensor map (a CUtensorMap, encoded on the host: cuflash/_tma.py) lies in the kernel's parameters.
// Elements outside the tensor's extent arrive as zeros and still count towards the barrier's bytes.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const void* tensor_map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(
            dst),
        "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// dst[i] += src[i] for `bytes` bytes of floats (a multiple of 16; both 16-byte aligned), from shared to global
// memory by the copy engine: the issuing thread goes on at once. Its reduces are grouped per thread: commit
// closes a group, bulk_wait_read<N> waits until at most N groups still read shared memory (the source may be
// written again), bulk_wait<N> until at most N are unfinished (their adds are done in global memory).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                     __cvta_generic_to_global(dst)),
                 "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8 x 8 tiles of 16-bit elements from registers (each in the mma.sync fragment layout: lane l holds row
// l / 4, columns 2 (l % 4) and + 1 of tile i in r[i]) into shared memory transposed: lanes 8 i .. 8 i + 7 give
// the addresses of tile i's stored rows (its columns), 16 contiguous bytes each.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// The same, stored as they are: lanes 8 i .. 8 i + 7 give the addresses of tile i's rows.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}

// wgmma shared-memory matrix descriptor of a 128-byte-swizzled tile (see the top of this file): start
// address, leading and stride byte offsets (both >> 4), swizzle mode 1 (128 bytes) in bits 62-63.
//   K-major operand (Q, K): lbo unused (16), sbo = 1024 (the next 8 rows); step along K by adding 32 bytes
//   (16 columns) to the start, along slabs by the slab's size.
//   N-major operand (V in P V): lbo = the slab size (the next 64 columns of N), sbo = 1024 (the next 8
//   rows of K); step along K by adding 16 rows (2048 bytes).
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32) | (1ull << 62);
}

// wgmma runs asynchronously: fence before the first wgmma that reads registers written since the last
// one, commit the issued ones as a group, wait until at most N groups are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The compiler sees a wgmma's accumulators written when the instruction is issued; this keeps it from
// moving their reads (or writes) across the wait that really completes them.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&acc)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[i][e])::"memory");
}

// Shared memory written by ordinary stores (the generic proxy) that a wgmma or TMA (the async proxy) reads
// next: each writing thread fences, then the threads synchronize.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Registers per thread of the warpgroup from here on (a multiple of 8 in [24, 256]); the kernel must have a
// register cap at entry (__launch_bounds__). The .inc waits until the block's pool holds the
// registers it asks for, which only the .dec of other warpgroups returns: what all warpgroups ask for in
// the end must fit in what the launch gave them (launch_regs per thread), or the .inc waits forever.
__host__ __device__ constexpr int launch_regs(int threads) { return 65536 / threads / 8 * 8; }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Rows [row0, rows) of a 128-byte-swizzled tile (`slabs` slabs of 64 columns, slab_bytes apart) set to zero by
// 16-byte stores, thread `thread` of `threads` taking every threads-th chunk: a row's 8 chunks are the whole
// row, whatever the swizzle. For the rows a varlen tile holds past its sequence (TMA zero-fills only past the
// array); wgmma reads them after a fence_proxy_async and a barrier of the readers.
__device__ __forceinline__ void zero_tile_rows(unsigned tile, unsigned slab_bytes, int slabs, int row0, int rows,
                                               int thread, int threads) {
#pragma unroll 1
    for (int c = thread; c < (rows - row0) * 8 * slabs; c += threads) {
        const int r = row0 + c / (8 * slabs), slab = c / 8 % slabs, chunk = c % 8;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tile + slab * slab_bytes + r * 128 + chunk * 16),
                     "r"(0u) : "memory");
    }
}

// Thread block clusters: the blocks of a cluster (__cluster_dims__) run at once, on neighbouring SMs, and
// reach each other's shared memory. cluster_rank is this block's place in its cluster; cluster_map gives the
// address in block `rank`'s shared memory of what lies at `addr` in this one's (for ld.shared::cluster and
// remote mbarrier arrivals). cluster_arrive and cluster_wait are the two halves of a barrier of the cluster's
// threads that have not exited (release, acquire at cluster scope); cluster_sync both: a block whose shared
// memory another reads must not exit before that one's arrival.
__device__ __forceinline__ unsigned cluster_rank() {  // volatile: read again where used, not kept in a register
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ unsigned cluster_map(unsigned addr, unsigned rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
__device__ __forceinline__ float2 ld_cluster_f32x2(unsigned cluster_addr) {
    float2 x;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(x.x), "=f"(x.y) : "r"(cluster_addr) : "memory");
    return x;
}

// Barrier over `threads` threads (a multiple of 32) under id (1..15; 0 is __syncthreads): sync waits for the
// others, arrive counts this warp in and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace cuflash
