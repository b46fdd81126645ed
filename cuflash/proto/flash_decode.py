"""Mirror of kernels_cu/flash_decode.cu: attention over a KV cache for few query rows, in Numba-CUDA.

`make_flash_decode(cfg, stages)` and `make_flash_decode_combine(cfg)` turn KernelConfigs (config.choose_decode's
pair) into kernels the way the C++ templates do: head_dim, block_n, warps, the variant bits and the accumulator
type become closure constants. Launch them exactly like the CUDA kernels:

    flash_decode:          grid (m_blocks * num_splits, nheads_k, batch), block (warps * 32,)
                           m_blocks = ceil(seqlen_q * group / 16), group = nheads / nheads_k
        kernel[grid, block](q, k, v, o, lse, o_partial, lse_partial, num_splits, softmax_scale, scale_log2,
                            window_left, window_right, softcap, seqused_k, block_table)
    flash_decode_combine:  grid (ceil(batch * nheads * seqlen_q / warps),), block (warps * 32,)
        kernel[grid, block](o_partial, lse_partial, o, lse, num_splits)

q (batch, seqlen_q, nheads, head_dim), o like q, lse (batch, nheads, seqlen_q) in the accumulator type; k, v the
caches: dense (batch, capacity, nheads_k, head_dim), or with PAGED page pools (num_pages, page_size, nheads_k,
head_dim) and block_table int32 (batch, max_pages); seqused_k int32 (batch,) (SEQUSED always, as in CUDA: the
entry's key count, clamped to the capacity). window_left / window_right as proto/flash_fwd.py takes them
(mask.UNBOUNDED for -1), softcap acc_t. With num_splits > 1 the kernel writes o_partial, a flat acc_t array of
num_splits * batch * nheads * seqlen_q * cfg.head_dim elements ([split, batch, head, row, dim], the compiled head
dim as DecodeParams' kHeadDim), and lse_partial, num_splits * batch * nheads * seqlen_q elements; the combine
merges them into o and lse. With num_splits == 1 the partials are not touched (any 1-element arrays will do).

The algorithm is flash_decode.cu's, step for step: a block takes 16 packed rows (packed row r: query row r // group
of head head_k * group + r % group) of one kv head; the mask over the tile's query rows gives the key blocks
[n_lo, n_hi), and split j takes per_split = ceil((n_hi - n_lo) / num_splits) of them from n_lo + j * per_split;
warp w takes keys [w * warp_keys, (w + 1) * warp_keys) of each block_n-key block (warp_keys = block_n / warps)
with an online softmax of its own; the warps are merged once through shared memory; then o, lse, or the split's
partials.

Differences from the CUDA kernel:
- Work layout. A warp's lane (g = lane >> 2, t = lane & 3) owns packed rows g and g + 8, as in the mma.sync C
  layout, but columns t + 4 j of S (and of O) where CUDA's fragments hold 8 ni + 2 t + e: the same rows per
  thread, the same 4 threads per row, the columns permuted. Tiles are in shared memory in acc_t (Q's fragments
  are re-read from sQ rather than held in registers); the MMAs are per-thread FMA loops (`# CUDA: mma.sync`)
  summing sequentially; P goes through a per-warp shared tile sP before O += P V (CUDA keeps it in registers,
  rounded to 16 bits: here it is not rounded).
- Barriers. The row reductions that CUDA does with warp shuffles (the softmax's max over a quad, the merge's
  row sum) go through shared memory (softmax.py, with a per-warp scratch) fenced by block-wide syncthreads, and
  each key block starts with a syncthreads where CUDA has cp_async_wait and __syncwarp: every warp of a block has
  the same key count, so every thread meets the same barriers. CUDA's loop has no block barrier.
- The ring. Each warp has its ring of `stages` slots of (K, V) for its slice, filled with the same schedule as
  CUDA's cp.async groups (slices 0 .. stages - 2 before the loop, slice i + stages - 1 into slot
  (i + stages - 1) % stages at block i), but the loads are synchronous: the barrier at the top of each block
  stands in for the wait. stages defaults to config.decode_stages(cfg) (kStages); tests may pass 2 or 3.
- Shared memory. The merge's sO, sMax, sSum are arrays of their own (CUDA lays them over the ring), and the
  ring, sQ, sP are in acc_t: smem_bytes gives the total, which backends/numba.py fits in Numba's 48 KiB
  static limit on a GPU (fewer warps, narrower key blocks, two stages) or leaves the call to flash_fwd.
- Partials in acc_t (float64 for float64 inputs; CUDA's are fp32 for its 16-bit dtypes). Any dtype runs here
  (backends/numba.py also routes float32 / float64 calls here; CUDA's flash_decode is fp16 / bf16 only), bf16 as
  float32 copies. Stores skip columns past head_dim one by one (CUDA stores 16-byte chunks of a head_dim that
  is a multiple of 8).
- The softcap uses math.tanh (the library's tanh), not tanh_approx; exp / exp2 / log are Numba's libdevice ones.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, int32

from ..config import LOCAL, MAX_SPLITS, PAGED, SOFTCAP, decode_stages
from .flash_fwd import LOG2E, acc_type, load_keys
from .mask import ceil_div, key_block_range, score_mod, score_mod_init, tile_needs_mask, visible
from .seqinfo import seq_info, used_keys
from .softmax import allreduce_sum, softmax_init, softmax_update

BLOCK_M = 16  # kBlockM: one 16-row m-tile of packed rows, shared by every warp
WARP_LANES = 32
QUAD = 4  # threads per packed row (t = lane & 3); rows per lane: 2 (g, g + 8)


def warp_keys(cfg) -> int:
    return cfg.block_n // cfg.warps


def layout_ok(cfg) -> bool:
    """Can the prototype take cfg: 16 packed rows, an even share of the key block per warp that 4 threads per row
    divide, a head dim that 32 lanes (the combine) and 8-element chunks (the stores) divide."""
    return (cfg.block_m == BLOCK_M and cfg.warps >= 1 and cfg.block_n % cfg.warps == 0
            and warp_keys(cfg) % QUAD == 0 and warp_keys(cfg) > 0 and cfg.head_dim % 32 == 0)


def smem_bytes(cfg, stages: int = 0) -> int:
    """Static shared memory of flash_decode's prototype: sQ, each warp's ring of stages slots of (K, V), sP, the
    reduction scratch and the merge's sO, sMax, sSum, all in acc_t."""
    stages = stages or decode_stages(cfg)
    d, w, wk = cfg.head_dim, cfg.warps, warp_keys(cfg)
    elems = BLOCK_M * d + w * stages * 2 * wk * d + w * BLOCK_M * wk + w * BLOCK_M * QUAD + w * BLOCK_M * d + 2 * w * BLOCK_M
    return elems * (8 if cfg.dtype == "float64" else 4)


@cuda.jit(device=True)
def merged(sMax, sSum, r, nwarps, scale_log2, neg_inf, zero):
    # Row r of the block: M = max over the warps of row_max, L = sum_w exp2((max_w - M) * scale_log2) sum_w;
    # a warp that saw no key of the row (max_w = -inf) adds 0 * sum_w: 0, or NaN where its scores were NaN.
    # neg_inf, zero: -inf and 0 in acc_t.
    m = neg_inf
    for w in range(nwarps):
        m = max(m, sMax[w, r])
    l = zero
    for w in range(nwarps):
        mw = sMax[w, r]
        weight = zero
        if mw != -math.inf:
            weight = math.exp2((mw - m) * scale_log2)
        l += weight * sSum[w, r]
    return m, l


@functools.lru_cache(maxsize=None)
def make_flash_decode(cfg, stages: int = 0):
    """flash_decode for one KernelConfig (cfg.block_m 16; SEQUSED implied) and ring depth (0: decode_stages)."""
    if not layout_ok(cfg):
        raise ValueError(f"flash_decode prototype: no thread layout for {cfg}")
    HEAD_DIM = cfg.head_dim
    BLOCK_N = cfg.block_n
    NWARPS = cfg.warps
    NTHREADS = cfg.threads
    WARP_KEYS = warp_keys(cfg)  # kWarpKeys: keys of each key block one warp takes
    STAGES = stages or decode_stages(cfg)  # kStages
    if STAGES < 2:
        raise ValueError("flash_decode: a ring of at least 2 stages (a slot is refilled while the next is read)")
    S_CPT = WARP_KEYS // QUAD  # columns of a warp's S per thread (CUDA: kNTilesS * 2)
    O_CPT = HEAD_DIM // QUAD  # columns of O per thread (CUDA: kNTilesO * 2)
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks per row in CUDA's stores
    IS_LOCAL, IS_SOFTCAP, IS_PAGED = bool(cfg.variant & LOCAL), bool(cfg.variant & SOFTCAP), bool(cfg.variant & PAGED)
    TRANSFORM = IS_SOFTCAP  # Mod::kTransform: ALiBi is not served here
    ACC = acc_type(cfg.dtype)

    @cuda.jit
    def flash_decode(q, k, v, o, lse, o_partial, lse_partial, num_splits, softmax_scale, scale_log2, window_left,
                     window_right, softcap, seqused_k, block_table):
        sQ = cuda.shared.array((BLOCK_M, HEAD_DIM), ACC)
        sRing = cuda.shared.array((NWARPS, STAGES, 2, WARP_KEYS, HEAD_DIM), ACC)  # per warp: slots of K, V
        sP = cuda.shared.array((NWARPS, BLOCK_M, WARP_KEYS), ACC)
        sRed = cuda.shared.array((NWARPS, BLOCK_M, QUAD), ACC)  # the quads' reductions (CUDA: shuffles)
        sO = cuda.shared.array((NWARPS, BLOCK_M, HEAD_DIM), ACC)  # [warp][packed row][dim] (CUDA: over the ring)
        sMax = cuda.shared.array((NWARPS, BLOCK_M), ACC)  # [warp][packed row]: row_max (held units)
        sSum = cuda.shared.array((NWARPS, BLOCK_M), ACC)  # [warp][packed row]: row_sum
        tid = cuda.threadIdx.x
        warp = tid // WARP_LANES
        lane = tid % WARP_LANES
        g = lane >> 2
        t = lane & 3
        red = sRed[warp]

        # [1] Block coordinates: packed query block, split, kv head, batch; the mask gives the key blocks, the split its share
        m_blocks = cuda.gridDim.x // num_splits
        m_block = cuda.blockIdx.x % m_blocks
        split = cuda.blockIdx.x // m_blocks
        head_k = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        # the cache's capacity: k's rows, or (paged: k a page pool) max_pages * page_size
        capacity = block_table.shape[1] * k.shape[1] if IS_PAGED else k.shape[1]
        q_start, k_start, seqlen_q, seqlen_k = seq_info(False, seqused_k, seqused_k, batch, q.shape[1], capacity)
        seqlen_k = used_keys(True, seqused_k, batch, seqlen_k)
        head_dim = q.shape[3]
        nheads = q.shape[2]
        group = nheads // k.shape[2]
        packed_rows = seqlen_q * group
        r0 = m_block * BLOCK_M
        r1 = min(r0 + BLOCK_M, packed_rows)
        row_lo = r0 // group  # the query rows of the tile
        row_hi = (r1 - 1) // group + 1
        shift = seqlen_k - seqlen_q
        # no per-head term: ALiBi is not served here
        lse_scale, tanh_in, bias, score_log2 = score_mod_init(IS_SOFTCAP, softmax_scale, softcap, ACC(0), scale_log2,
                                                              ACC(LOG2E))
        n_lo, n_hi = key_block_range(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, BLOCK_N, row_lo, row_hi)
        per_split = ceil_div(max(n_hi - n_lo, 0), num_splits)
        n_begin = n_lo + split * per_split
        n_count = max(min(n_hi, n_begin + per_split) - n_begin, 0)

        # [2] Load the Q tile: packed row r is query row r / group of head head_k * group + r % group
        for e in range(tid, BLOCK_M * HEAD_DIM, NTHREADS):
            r = e // HEAD_DIM
            col = e - r * HEAD_DIM
            pr = r0 + r
            if pr < packed_rows and col < head_dim:
                sQ[r, col] = q[batch, q_start + pr // group, head_k * group + pr % group, col]
            else:
                sQ[r, col] = 0

        # [3] Each warp: its slice of the first key blocks into its own ring of stages
        # (load_stage(i) of CUDA, inline: the slice of key block n_begin + i into slot i % STAGES. A slice wholly
        # past the keys loads zeros, reading nothing: P V then meets 0, never stale values.)
        for i in range(STAGES - 1):
            if i < n_count:
                key0 = (n_begin + i) * BLOCK_N + warp * WARP_KEYS
                live = key0 < seqlen_k
                slot = sRing[warp, i % STAGES]
                load_keys(slot[0], k, IS_PAGED, block_table, batch, batch, k_start, key0 if live else 0, head_k,
                          seqlen_k if live else 0, head_dim, lane, WARP_LANES)
                load_keys(slot[1], v, IS_PAGED, block_table, batch, batch, k_start, key0 if live else 0, head_k,
                          seqlen_k if live else 0, head_dim, lane, WARP_LANES)
            # CUDA commits a cp.async group here, empty ones too

        # Q (CUDA: the oldest cp.async group) has landed for every thread, and so for all after the barrier
        cuda.syncthreads()
        # The query rows of this thread's two packed rows g and g + 8 (the mask's rows)
        q_row = cuda.local.array(2, int32)
        q_row[0] = (r0 + g) // group
        q_row[1] = (r0 + g + 8) // group

        acc_s = cuda.local.array((2, S_CPT), ACC)
        acc_o = cuda.local.array((2, O_CPT), ACC)
        row_max = cuda.local.array(2, ACC)
        row_sum = cuda.local.array(2, ACC)
        tile_max = cuda.local.array(2, ACC)
        for h in range(2):
            for j in range(O_CPT):
                acc_o[h, j] = 0
        softmax_init(row_max, row_sum, False)

        for i in range(n_count):
            # [4] Wait for this warp's slice of the key block; refill the stage freed by the previous one
            # (the barrier stands in for cp_async_wait<kStages - 2> and __syncwarp: slice i has landed, and every
            # thread is done reading slot (i - 1) % STAGES, refilled next)
            cuda.syncthreads()
            if i + STAGES - 1 < n_count:
                key0 = (n_begin + i + STAGES - 1) * BLOCK_N + warp * WARP_KEYS
                live = key0 < seqlen_k
                slot = sRing[warp, (i + STAGES - 1) % STAGES]
                load_keys(slot[0], k, IS_PAGED, block_table, batch, batch, k_start, key0 if live else 0, head_k,
                          seqlen_k if live else 0, head_dim, lane, WARP_LANES)
                load_keys(slot[1], v, IS_PAGED, block_table, batch, batch, k_start, key0 if live else 0, head_k,
                          seqlen_k if live else 0, head_dim, lane, WARP_LANES)
            key0 = (n_begin + i) * BLOCK_N + warp * WARP_KEYS
            sK = sRing[warp, i % STAGES, 0]
            sV = sRing[warp, i % STAGES, 1]

            # [5] S = Q K^T
            for h in range(2):
                r = g + 8 * h
                for j in range(S_CPT):
                    c = t + QUAD * j
                    s = ACC(0)
                    for d in range(HEAD_DIM):  # CUDA: mma.sync
                        s += sQ[r, d] * sK[c, d]
                    acc_s[h, j] = s

            # [6] Score modifier (softcap); mask the sequence tail, the causal diagonal and the window
            # acc_s[h, j]: packed row g + 8h (query row q_row[h]), key key0 + t + 4j
            if TRANSFORM:
                for h in range(2):
                    for j in range(S_CPT):
                        x, dcap = score_mod(IS_SOFTCAP, False, tanh_in, bias, shift, acc_s[h, j], g + 8 * h,
                                            key0 + t + QUAD * j)
                        acc_s[h, j] = x
            if tile_needs_mask(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, row_lo, row_hi, key0,
                               key0 + WARP_KEYS):
                for h in range(2):
                    for j in range(S_CPT):
                        if not visible(IS_LOCAL, window_left, window_right, seqlen_q, seqlen_k, q_row[h],
                                       key0 + t + QUAD * j):
                            acc_s[h, j] = -math.inf

            # [7] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
            softmax_update(acc_s, acc_o, row_max, row_sum, tile_max, red, g, 8, t, QUAD, score_log2, False)

            # [8] O += P V
            # (P through this warp's sP: CUDA passes it in registers as the A operand, rounded to 16 bits)
            for h in range(2):
                for j in range(S_CPT):
                    sP[warp, g + 8 * h, t + QUAD * j] = acc_s[h, j]
            cuda.syncthreads()
            for h in range(2):
                r = g + 8 * h
                for j in range(O_CPT):
                    c = t + QUAD * j
                    a = acc_o[h, j]
                    for n in range(WARP_KEYS):  # CUDA: mma.sync
                        a += sP[warp, r, n] * sV[n, c]
                    acc_o[h, j] = a

        # [9] Merge the warps: row max, row sum and O of each warp through shared memory
        cuda.syncthreads()  # CUDA: cp_async_wait<0> (only empty groups can be left), then the barrier
        allreduce_sum(red, row_sum, g, 8, t, QUAD)  # CUDA: warp_allreduce_sum<4>
        if t == 0:
            for h in range(2):
                sMax[warp, g + 8 * h] = row_max[h]
                sSum[warp, g + 8 * h] = row_sum[h]
        cuda.syncthreads()
        # Every warp scales its O by exp2((max_w - M) * scale_log2) / L; L = 0 (no warp saw a key) gives O = 0,
        # LSE = -inf.
        for h in range(2):
            m, l = merged(sMax, sSum, g + 8 * h, NWARPS, score_log2, ACC(-math.inf), ACC(0))
            mine = row_max[h]
            f = ACC(0)
            if l != 0:  # a NaN L makes f NaN
                if mine != -math.inf:
                    f = math.exp2((mine - m) * score_log2)
                f = f / l
            for j in range(O_CPT):
                sO[warp, g + 8 * h, t + QUAD * j] = acc_o[h, j] * f
        cuda.syncthreads()

        # [10] Store O and LSE, or this split's partial O and LSE
        partial = num_splits > 1
        nbatch = cuda.gridDim.z
        for c in range(tid, BLOCK_M * CHUNKS, NTHREADS):
            r = c // CHUNKS
            col = (c % CHUNKS) * 8
            pr = r0 + r
            if pr >= packed_rows or col >= head_dim:
                continue
            # partial_row(pr): [split, batch, head, row] of packed row pr
            prow = ((split * nbatch + batch) * nheads + head_k * group + pr % group) * seqlen_q + pr // group
            for e in range(8):
                val = ACC(0)
                for w in range(NWARPS):
                    val += sO[w, r, col + e]
                if partial:
                    o_partial[prow * HEAD_DIM + col + e] = val
                elif col + e < head_dim:
                    o[batch, q_start + pr // group, head_k * group + pr % group, col + e] = val
        if tid < BLOCK_M and r0 + tid < packed_rows:
            pr = r0 + tid
            m, l = merged(sMax, sSum, tid, NWARPS, score_log2, ACC(-math.inf), ACC(0))
            lse_val = ACC(-math.inf)
            if l != 0:
                lse_val = m * lse_scale + math.log(l)
            if partial:
                lse_partial[((split * nbatch + batch) * nheads + head_k * group + pr % group) * seqlen_q
                            + pr // group] = lse_val
            else:
                lse[batch, head_k * group + pr % group, q_start + pr // group] = lse_val

    return flash_decode


@functools.lru_cache(maxsize=None)
def make_flash_decode_combine(cfg):
    """flash_decode_combine for one KernelConfig (cfg.head_dim: the partials' row length; cfg.warps rows per
    block, one warp per (batch, head, query row)). The warp's reductions and broadcasts, shuffles in CUDA, go
    through a row of shared memory per warp between block barriers (the simulator has neither shuffles nor
    __syncwarp); so a warp past the rows does not return early but skips the work and keeps to the barriers."""
    HEAD_DIM = cfg.head_dim
    NWARPS = cfg.warps
    PER_LANE = HEAD_DIM // WARP_LANES  # kPerLane
    ROUNDS = MAX_SPLITS // WARP_LANES  # kRounds
    PREFETCH = min(16, 64 // PER_LANE)  # kPrefetch
    if HEAD_DIM % WARP_LANES:
        raise ValueError("flash_decode_combine: 32 lanes over the head dim")
    ACC = acc_type(cfg.dtype)

    @cuda.jit
    def flash_decode_combine(o_partial, lse_partial, o, lse, num_splits):
        red = cuda.shared.array((NWARPS, WARP_LANES), ACC)  # one row per warp: its shuffles
        warp = cuda.threadIdx.x // WARP_LANES
        lane = cuda.threadIdx.x % WARP_LANES
        nbatch, seqlen_q, nheads, head_dim = o.shape
        rows = nbatch * nheads * seqlen_q  # one split's [batch, head, row]
        idx = cuda.blockIdx.x * NWARPS + warp
        active = idx < rows
        row = idx % seqlen_q
        head = idx // seqlen_q % nheads
        batch = idx // (seqlen_q * nheads)

        # [11] Combine: the largest partial LSE, the splits' weights exp(lse_s - max) and their sum
        # A NaN partial makes the row NaN, as unsplit: the max keeps it, and every weight takes it.
        x = cuda.local.array(ROUNDS, ACC)
        for r in range(ROUNDS):
            s = WARP_LANES * r + lane
            x[r] = lse_partial[s * rows + idx] if active and s < num_splits else -math.inf
        early = cuda.local.array((PREFETCH, PER_LANE), ACC)  # the first splits' O, loaded with the LSEs
        for j in range(PREFETCH):
            for e in range(PER_LANE):
                ok = active and j < num_splits and lane + WARP_LANES * e < head_dim
                early[j, e] = o_partial[(j * rows + idx) * HEAD_DIM + lane + WARP_LANES * e] if ok else 0
        m = x[0]
        for r in range(1, ROUNDS):
            if x[r] > m or x[r] != x[r]:
                m = x[r]
        red[warp, lane] = m  # the warp's max (__shfl_xor_sync)
        cuda.syncthreads()
        for i in range(WARP_LANES):
            y = red[warp, i]
            if y > m or y != y:
                m = y
        cuda.syncthreads()
        empty = m == -math.inf
        w = cuda.local.array(ROUNDS, ACC)
        l = ACC(0)
        for r in range(ROUNDS):
            w[r] = 0 if empty else math.exp(x[r] - m)
            l += w[r]
        red[warp, lane] = l  # the warp's sum (warp_allreduce_sum)
        cuda.syncthreads()
        l = ACC(0)
        for i in range(WARP_LANES):
            l += red[warp, i]
        cuda.syncthreads()

        # [12] O = sum_s weight_s O_s / sum; LSE = max + log(sum); a row no split saw gives O = 0, LSE = -inf
        acc = cuda.local.array(PER_LANE, ACC)
        for e in range(PER_LANE):
            acc[e] = 0
        inv = ACC(1) / l if not empty else ACC(0)
        for r in range(ROUNDS):
            n = min(WARP_LANES, num_splits - WARP_LANES * r)
            red[warp, lane] = w[r] * inv  # split 32 r + j's weight, broadcast from lane j (__shfl_sync)
            cuda.syncthreads()
            if active and not empty and r == 0:  # a weight past num_splits is 0, its O 0
                for j in range(PREFETCH):
                    for e in range(PER_LANE):
                        acc[e] += red[warp, j] * early[j, e]
            if active and not empty:
                for j in range(PREFETCH if r == 0 else 0, n):
                    wj = red[warp, j]
                    base = ((WARP_LANES * r + j) * rows + idx) * HEAD_DIM + lane
                    for e in range(PER_LANE):
                        if lane + WARP_LANES * e < head_dim:  # flash_decode writes these columns only
                            acc[e] += wj * o_partial[base + WARP_LANES * e]
            cuda.syncthreads()
        if active:
            for e in range(PER_LANE):
                if lane + WARP_LANES * e < head_dim:
                    o[batch, row, head, lane + WARP_LANES * e] = acc[e]
            if lane == 0:
                if not empty:
                    lse[batch, head, row] = m + math.log(l)
                else:
                    lse[batch, head, row] = -math.inf

    return flash_decode_combine
