// Which (query row, key column) pairs take part, and what becomes of a score: the variants' seam.
// Mirrored by cuflash/_mask.py (the NumPy backend and the reference) and cuflash/proto/mask.py.
//
// A kernel instantiation applies the variants in its template argument kVariant (bits below); their
// values come from FwdParams at run time. Query row i sits at key position i' = i + seqlen_k -
// seqlen_q (the diagonal aligned bottom-right, as in FlashAttention 2.1+):
// - kLocal: row i sees keys i' - left .. i' + right (-1: unbounded); causal is right = 0. Key blocks
//   that no row of a query block sees are skipped (Mask::n_block_range), not masked. kLocal alone is
//   causal, its bounds compiled in; kLocal | kWindow reads both bounds from the params.
// - kSoftcap: the logit s = softmax_scale * q.k becomes softcap * tanh(s / softcap).
// - kAlibi: -slope * |i' - j| is added to the logit (after the softcap).
// - kDropout: dropout.cuh.
// - kVarlen: each batch entry's rows and lengths come from cu_seqlens (seqinfo.cuh).
// - kSeqused, kPaged: a KV cache's key counts and pages (seqinfo.cuh; forward kernels only).
// Without kSoftcap / kAlibi the kernels keep scores in q.k units and fold softmax_scale into exp2's
// scale; with either, ScoreMod turns them into logits and exp2's scale is log2(e).
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// kVariant bits (cuflash/config.py: LOCAL, SOFTCAP, ALIBI, DROPOUT, VARLEN, WINDOW, SEQUSED, PAGED).
constexpr int kLocal = 1;
constexpr int kSoftcap = 2;
constexpr int kAlibi = 4;
constexpr int kDropout = 8;
constexpr int kVarlen = 16;
constexpr int kWindow = 32;  // with kLocal: a sliding window, its bounds from the params
constexpr int kSeqused = 64;  // KV cache: key counts from seqused_k (seqinfo.cuh)
constexpr int kPaged = 128;   // KV cache in pages: key rows through block_table (seqinfo.cuh KeyRows)

// A window bound of -1 (unbounded) as the params hold it (cuflash/_params.py writes it): far enough
// that no row + shift + bound overflows.
constexpr int kUnbounded = 1 << 30;

// The query block of this thread block, longest first: under a causal mask the last query blocks
// visit the most key blocks, so the grid launches them first and its tail is short blocks. Causal
// alone (a window's blocks are alike), and not with softcap, ALiBi or dropout: those kernels sit at
// the register limit and the reversed index spills there. config.longest_first says the same.
template <int kVariant>
__device__ __forceinline__ int query_block() {
    constexpr bool kLongestFirst = (kVariant & (kLocal | kWindow | kSoftcap | kAlibi | kDropout)) == kLocal;
    return kLongestFirst ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
}

template <int kVariant>
struct Mask {
    static constexpr bool kIsLocal = (kVariant & kLocal) != 0;
    // kLocal alone is causal: right = 0 and no left bound, fixed at compile time. kWindow: both
    // bounds from the params (causal folded in by the host).
    static constexpr bool kHasWindow = kIsLocal && (kVariant & kWindow) != 0;
    const FwdParams& p;  // window_left / window_right are read where used: constant-bank operands, no registers
    int seqlen_q, seqlen_k;
    int shift;           // seqlen_k - seqlen_q: row i sits at key position i + shift

    // seqlen_q, seqlen_k: the batch entry's (SeqInfo)
    __device__ __forceinline__ Mask(const FwdParams& p_, int seqlen_q_, int seqlen_k_)
        : p(p_), seqlen_q(seqlen_q_), seqlen_k(seqlen_k_), shift(seqlen_k_ - seqlen_q_) {}
    // The window in keys; the host writes kUnbounded for -1
    __device__ __forceinline__ int left() const { return kHasWindow ? p.window_left : kUnbounded; }
    __device__ __forceinline__ int right() const { return kHasWindow ? p.window_right : 0; }

    // [1] Keys a row sees: [col_lo(row), col_hi(row)), inside the sequence and the window
    __device__ __forceinline__ int col_lo(int row) const { return kHasWindow ? max(0, row + shift - left()) : 0; }
    __device__ __forceinline__ int col_hi(int row) const {
        return kIsLocal ? min(seqlen_k, row + shift + right() + 1) : seqlen_k;
    }
    // The same test per score, as the key's offset from the row's diagonal: col - row in [shift - left,
    // shift + right] (fewer live values than col_lo / col_hi in the kernels' element loops).
    __device__ __forceinline__ bool visible(int row, int col) const {
        if (!kIsLocal) return col < seqlen_k;
        const int off = col - row;
        return col < seqlen_k && (!kHasWindow || off >= shift - left()) && off <= shift + right();
    }

    // [2] Key blocks a query block visits: [lo, hi), those some row of the block sees (lo >= hi: none)
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void n_block_range(int m_block, int& lo, int& hi) const {
        const int row0 = m_block * kBlockM, row1 = min(row0 + kBlockM, seqlen_q);
        const int c0 = col_lo(row0), c1 = col_hi(row1 - 1);
        lo = c0 / kBlockN;
        hi = c1 > c0 ? ceil_div(c1, kBlockN) : lo;
    }

    // [3] Query blocks that see a key block: [lo, hi) (the dK/dV kernel's loop)
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void m_block_range(int n_block, int& lo, int& hi) const {
        const int col0 = n_block * kBlockN, col1 = min(col0 + kBlockN, seqlen_k);
        const int r0 = kIsLocal ? max(0, col0 - right() - shift) : 0;
        const int r1 = kHasWindow ? min(seqlen_q, col1 - 1 + left() - shift + 1) : seqlen_q;
        lo = r0 / kBlockM;
        hi = r1 > r0 ? ceil_div(r1, kBlockM) : lo;
    }

    // [4] Does a tile hold a score some row must not see? (it crosses seqlen_k, or a window edge)
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
        const int col0 = n_block * kBlockN, col1 = col0 + kBlockN;
        if (col1 > seqlen_k) return true;
        if (!kIsLocal) return false;
        const int row0 = m_block * kBlockM, row1 = min(row0 + kBlockM, seqlen_q);
        return col1 - 1 > row0 + shift + right() || (kHasWindow && col0 < row1 - 1 + shift - left());
    }
};

// Natural exp of 2x and tanh from it: 1 - 2 / (e^2x + 1), one ex2 and one fast reciprocal, exact to
// about 1e-7 absolute (what a logit needs; tanhf is several times longer). Saturates to +-1, no NaN.
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - __fdividef(2.f, exp2f(x * 2.8853900817779268f) + 1.f);
}

// The score transform of kSoftcap / kAlibi for one (batch, head). kFast: tanh_fast (tensor-core
// kernels, 16-bit outputs) rather than the library's tanh (SIMT kernels, fp32 / fp64 outputs).
template <typename A, int kVariant, bool kFast>
struct ScoreMod {
    static constexpr bool kTransform = (kVariant & (kSoftcap | kAlibi)) != 0;
    A scale;        // softmax_scale
    A softcap, inv_softcap;
    A slope;        // ALiBi slope of this (batch, head)
    int shift;

    __device__ __forceinline__ ScoreMod(const FwdParams& p, int batch, int head, int shift_)
        : scale(static_cast<A>(p.softmax_scale)), softcap(static_cast<A>(p.softcap)),
          inv_softcap((kVariant & kSoftcap) ? A(1) / static_cast<A>(p.softcap) : A(0)),
          slope((kVariant & kAlibi) ? static_cast<A>(p.alibi_slopes[batch * p.alibi_batch_stride + head]) : A(0)),
          shift(shift_) {}

    // exp2's scale for the scores the kernel holds, and the LSE's factor on the row max.
    __device__ __forceinline__ A score_log2(const FwdParams& p) const {
        return kTransform ? A(1.4426950408889634) : static_cast<A>(p.scale_log2);
    }
    __device__ __forceinline__ A lse_scale() const { return kTransform ? A(1) : scale; }

    // [5] Score modifiers: q.k -> softcap * tanh(scale * q.k / softcap) - slope * |i' - j|.
    // dcap receives d logit / d(scale * q.k) = 1 - tanh^2 (1 without a softcap).
    __device__ __forceinline__ A apply(A s, int row, int col, A& dcap) const {
        dcap = A(1);
        if constexpr (!kTransform) return s;
        A x = s * scale;
        if constexpr ((kVariant & kSoftcap) != 0) {
            A t;
            if constexpr (kFast) t = tanh_fast(x * inv_softcap);
            else t = tanh(x * inv_softcap);
            x = softcap * t;
            dcap = A(1) - t * t;
        }
        if constexpr ((kVariant & kAlibi) != 0) x -= slope * static_cast<A>(abs(row + shift - col));
        return x;
    }
};

}  // namespace cuflash
