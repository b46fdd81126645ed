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
// - kBounded, with kSoftcap and without kAlibi, bf16 and a softcap of at most 50 (config.BOUNDED_SOFTCAP;
//   flash_fwd alone): every logit lies in [-softcap, softcap], so the online softmax subtracts no running
//   max (softmax.cuh). bf16 only: fp16's P would overflow above e^11.
// - kAlibi: -slope * |i' - j| is added to the logit (after the softcap).
// - kDropout: dropout.cuh.
// - kVarlen: each batch entry's rows and lengths come from cu_seqlens (seqinfo.cuh).
// - kSeqused, kPaged: a KV cache's key counts and pages (seqinfo.cuh; forward kernels only).
// - kDeterministic, kQuerySplit, kWideSmem: how a backward runs, not what it computes (flash_bwd.cu,
//   flash_bwd_sm90.cu).
// The kernels hold scores in units of their own, a constant factor off the logit, so that the factor
// rides on exp2's scale (ScoreMod::score_log2) and the LSE's (lse_scale) instead of costing a multiply
// per score: q.k (logit / softmax_scale) without a softcap, as plain attention; tanh's t (logit /
// softcap) with one.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

// kVariant bits (cuflash/config.py: LOCAL, SOFTCAP, ALIBI, DROPOUT, VARLEN, WINDOW, SEQUSED, PAGED,
// DETERMINISTIC, QUERY_SPLIT, BOUNDED, WIDE_SMEM).
constexpr int kLocal = 1;
constexpr int kSoftcap = 2;
constexpr int kAlibi = 4;
constexpr int kDropout = 8;
constexpr int kVarlen = 16;
constexpr int kWindow = 32;  // with kLocal: a sliding window, its bounds from the params
constexpr int kSeqused = 64;  // KV cache: key counts from seqused_k (seqinfo.cuh)
constexpr int kPaged = 128;   // KV cache in pages: key rows through block_table (seqinfo.cuh KeyRows)
constexpr int kDeterministic = 256;  // backward: dQ tiles summed in key-block order (flash_bwd.cu)
constexpr int kQuerySplit = 512;  // flash_bwd_sm90: a key block's query blocks split over a cluster of two
constexpr int kBounded = 1024;    // with kSoftcap: the logits' bound replaces the softmax's running max
constexpr int kWideSmem = 2048;   // flash_bwd on compute capability 9.0: its shared memory budget is sm_90's

template <typename T>
constexpr bool kIsBf16 = false;
template <>
constexpr bool kIsBf16<__nv_bfloat16> = true;

// A window bound of -1 (unbounded) as the params hold it (cuflash/_params.py writes it): far enough
// that no row + shift + bound overflows.
constexpr int kUnbounded = 1 << 30;

// The query block of this thread block, longest first: under a causal mask the last query blocks
// visit the most key blocks, so the grid launches them first and its tail is short blocks. Causal
// without a window (a window's blocks are alike); in the mma.sync and SIMT kernels not with softcap,
// ALiBi or dropout either: they sit at the register limit and the reversed index spills there. The
// Hopper forward (kHopper) has the registers. config.longest_first says the same.
template <int kVariant, bool kHopper = false>
__device__ __forceinline__ int query_block() {
    constexpr int kOrdered = kLocal | kWindow | (kHopper ? 0 : kSoftcap | kAlibi | kDropout);
    constexpr bool kLongestFirst = (kVariant & kOrdered) == kLocal;
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
        const int row0 = m_block * kBlockM;
        key_block_range<kBlockN>(row0, min(row0 + kBlockM, seqlen_q), lo, hi);
    }
    // The same for query rows [row0, row1) (flash_decode: the rows of a packed GQA tile)
    template <int kBlockN>
    __device__ __forceinline__ void key_block_range(int row0, int row1, int& lo, int& hi) const {
        const int c0 = col_lo(row0), c1 = col_hi(row1 - 1);
        lo = c0 / kBlockN;
        hi = c1 > c0 ? ceil_div(c1, kBlockN) : lo;
    }

    // [3] Query blocks that see a key block: [lo, hi) (the backward's loop)
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
        const int row0 = m_block * kBlockM;
        return tile_needs_mask(row0, min(row0 + kBlockM, seqlen_q), n_block * kBlockN, (n_block + 1) * kBlockN);
    }
    // The same for query rows [row0, row1) and keys [col0, col1)
    __device__ __forceinline__ bool tile_needs_mask(int row0, int row1, int col0, int col1) const {
        if (col1 > seqlen_k) return true;
        if (!kIsLocal) return false;
        return col1 - 1 > row0 + shift + right() || (kHasWindow && col0 < row1 - 1 + shift - left());
    }
};

// The softcap's tanh, three ways (ScoreMod's kTanh):
// - kTanhApprox, the tensor-core forward kernels: tanh.approx.f32, one op of the multi-function unit (relative
//   error about 2^-11). 1 - 2 / (e^2x + 1) took two, and with the softmax's exp2 that unit bound the forward
//   (1.6x plain attention's time on the H200). Its error in a logit, at most softcap * 2^-11, is below what
//   rounding q.k to 16 bits costs a materialized implementation (the accuracy rule's baseline); the GPU tests'
//   softcap cases cover tanh's linear, curved and saturated ranges, and the LSE to 1e-4.
// - kTanhExp2, the tensor-core backward kernels: 1 - 2 / (e^2x + 1) from u = 2x log2(e) (folded into
//   ScoreMod::tanh_in), one ex2 and one fast reciprocal, exact to about 1e-7: the derivative 1 - t^2 needs t
//   exact where tanh saturates, and the backward's GEMMs leave that unit time to spare.
// - kTanhLibrary, the SIMT kernels (fp32 / fp64 outputs): the library's tanh.
// All saturate to +-1, no NaN.
enum TanhKind { kTanhApprox, kTanhExp2, kTanhLibrary };

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float tanh_exp2(float u) { return 1.f - __fdividef(2.f, exp2f(u) + 1.f); }

// The score transform of kSoftcap / kAlibi for one (batch, head), its tanh computed as kTanh says.
// Held units (header): logit = unit * held, unit = softcap with a softcap, else softmax_scale. Every
// per-score constant is folded here once, so a score costs one multiply into tanh and one FFMA of ALiBi.
template <typename A, int kVariant, TanhKind kTanh>
struct ScoreMod {
    static constexpr bool kIsSoftcap = (kVariant & kSoftcap) != 0;
    static constexpr bool kTransform = (kVariant & (kSoftcap | kAlibi)) != 0;
    static constexpr bool kIsBounded = (kVariant & kBounded) != 0;  // OnlineSoftmax's kBounded
    static_assert(!kIsBounded || (kVariant & (kSoftcap | kAlibi)) == kSoftcap,
                  "kBounded: a softcap without ALiBi (whose bias has no lower bound) bounds the logit");
    A unit;         // logit per held unit: softcap, or softmax_scale
    A tanh_in;      // q.k -> tanh's argument scale / softcap, times 2 log2(e) for kTanhExp2
    A bias;         // ALiBi slope per held unit: slope / unit
    A score_log2_;  // exp2's scale: unit * log2(e)
    int shift;

    __device__ __forceinline__ ScoreMod(const FwdParams& p, int batch, int head, int shift_) : shift(shift_) {
        const A scale = static_cast<A>(p.softmax_scale);
        unit = kIsSoftcap ? static_cast<A>(p.softcap) : scale;
        tanh_in = kIsSoftcap ? scale / unit * (kTanh == kTanhExp2 ? A(2.8853900817779268) : A(1)) : A(0);
        const A slope = (kVariant & kAlibi) ? static_cast<A>(p.alibi_slopes[batch * p.alibi_batch_stride + head]) : A(0);
        // |bias| <= 2^100 (2^1000): bias * |i' - j| stays finite, so a masked -inf stays -inf (and such
        // a slope leaves every off-diagonal P 0 either way)
        const A b = slope / unit, big = sizeof(A) == 4 ? A(1.2676506002282294e30) : A(1.0715086071862673e301);
        bias = b > big ? big : b < -big ? -big : b;  // NaN stays NaN
        score_log2_ = kIsSoftcap ? unit * A(1.4426950408889634) : static_cast<A>(p.scale_log2);
    }

    // exp2's scale for the scores the kernel holds, and the LSE's factor on the row max.
    __device__ __forceinline__ A score_log2(const FwdParams& p) const {
        return kTransform ? score_log2_ : static_cast<A>(p.scale_log2);
    }
    __device__ __forceinline__ A lse_scale() const { return unit; }

    // [5] Score modifiers: q.k -> softcap * tanh(scale * q.k / softcap) - slope * |i' - j|.
    // In held units: t = tanh(scale * q.k / softcap) (else q.k), minus (slope / unit) * |i' - j|.
    // dcap receives d logit / d(scale * q.k) = 1 - t^2 (1 without a softcap).
    __device__ __forceinline__ A apply(A s, int row, int col, A& dcap) const {
        dcap = A(1);
        if constexpr (!kTransform) return s;
        A x = s;
        if constexpr (kIsSoftcap) {
            if constexpr (kTanh == kTanhApprox) x = tanh_approx(s * tanh_in);
            else if constexpr (kTanh == kTanhExp2) x = tanh_exp2(s * tanh_in);
            else x = tanh(s * tanh_in);
            dcap = A(1) - x * x;
        }
        // i' - j in ints: a tile's differences repeat (rows g and g + 8, columns c and c + 8), so the
        // compiler converts each distinct one once; the abs rides on the FFMA
        if constexpr ((kVariant & kAlibi) != 0) x = fma(-bias, fabs(static_cast<A>(row + shift - col)), x);
        return x;
    }
    // apply's dcap again from its result x (what a kernel can recover from P, not keeping dcap in registers):
    // ALiBi's bias undone, then 1 - t^2
    __device__ __forceinline__ A dcap_of(A x, int row, int col) const {
        if constexpr ((kVariant & kAlibi) != 0) x = fma(bias, fabs(static_cast<A>(row + shift - col)), x);
        return A(1) - x * x;
    }
};

}  // namespace cuflash
