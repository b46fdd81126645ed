// Element types, conversions, small math helpers shared by every kernel.
// Only cuda_fp16.h and cuda_bf16.h are included: they ship in every CUDA runtime wheel.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuflash {

// Accumulator type per storage type: fp32 for half/bf16/float, fp64 for double.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Two accumulator values packed into one 32-bit register of the 16-bit type (mma.sync A/B operands).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// 32-bit shared-state-space address of a generic pointer into shared memory (ldmatrix, cp.async).
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Dynamic shared memory one block may take on every target (sm_80's 163 KiB; config.SMEM_LIMIT[80]), and on
// compute capability 9.0 (227 KiB; config.SMEM_LIMIT[90]).
constexpr unsigned kSmemPortable = 166912;
constexpr unsigned kSmemSm90 = 232448;

__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double fast_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// Reductions over the `width` consecutive lanes that share one row of an mma.sync fragment.
template <int width, typename A>
__device__ __forceinline__ A warp_allreduce_max(A x) {
#pragma unroll
    for (int offset = width / 2; offset > 0; offset /= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <int width, typename A>
__device__ __forceinline__ A warp_allreduce_sum(A x) {
#pragma unroll
    for (int offset = width / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// x, opaque to the compiler. Thread-index arithmetic derived from the result is computed where it is
// used instead of being shared (common-subexpression elimination) with the same arithmetic done before
// a long loop, which would keep those values in registers across the whole loop. flash_bwd takes
// its thread index through this once per query block and once for the final store: without it NVRTC
// 12.9 spilled such values (tile-copy offsets and row predicates) for d = 64 causal on sm_80 and
// d = 128 on sm_90. Costs a few integer instructions per use; changes no arithmetic on data.
__device__ __forceinline__ int recompute(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// Global-memory reductions and flags of the backward's dQ accumulator (flash_bwd.cu).
// red_add2: addr[0] += a, addr[1] += b as fp32 reductions (no return value); addr 8-byte aligned.
// sm_90 has a vector form: one instruction, one L2 request for both.
__device__ __forceinline__ void red_add2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(addr, a);
    atomicAdd(addr + 1, b);
#endif
}
// A flag another block publishes with store_release after its writes: what the releasing thread wrote, and
// what the block's barriers ordered before the release, is visible to the block that load_acquire-s it.
__device__ __forceinline__ int load_acquire(const int* flag) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(int* flag, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(flag), "r"(v) : "memory");
}

}  // namespace cuflash
