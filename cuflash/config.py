"""Kernel configurations: which compiled kernel serves a call, and the heuristic that picks it.

Pure Python, testable without a GPU. A `KernelConfig` maps one-to-one to a C++ template
instantiation, e.g. ``cuflash::flash_fwd<__nv_bfloat16, 128, 128, 64, 8, 1>`` (bf16, head dim 128,
causal); template arguments are what changes the code's shape (dtype, head dim, tiles, warps, and
the variants it applies, `variant`), and everything else travels in the params struct (see
kernels_cu/params.cuh). A kernel takes only the template arguments
it uses (TEMPLATE_PARAMS): flash_bwd_preprocess has one instantiation per dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

# Head dims the kernels are compiled for; a call's head_dim (a multiple of 8) is rounded up to the
# next one and the kernel pads inside (it never reads past head_dim).
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIMS[-1]

DTYPES = ("float16", "bfloat16", "float32", "float64")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")

CTYPES = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# Shared memory a block may take on the devices we target (sm_80: 163 KiB, sm_90: 227 KiB opt-in).
SMEM_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
SM90_SMEM_PER_SM = 233_472  # an SM's; a block gets SMEM_LIMIT[90] of it at most
DEFAULT_SMEM_BYTES = 48 * 1024  # above this a launch must opt in (max_dynamic_shared_size_bytes)

# kernel name -> source file under kernels_cu/
SOURCES = {
    "flash_fwd": "flash_fwd.cu",
    "flash_fwd_sm90": "flash_fwd_sm90.cu",
    "flash_bwd_preprocess": "flash_bwd.cu",
    "flash_bwd": "flash_bwd.cu",
    "flash_bwd_sm90": "flash_bwd_sm90.cu",
    "flash_bwd_postprocess": "flash_bwd.cu",
    "flash_fwd_simt": "flash_fwd_simt.cu",
    "flash_bwd_dkdv_simt": "flash_bwd_simt.cu",
    "flash_bwd_dq_simt": "flash_bwd_simt.cu",
    "flash_decode": "flash_decode.cu",
    "flash_decode_combine": "flash_decode.cu",
    "kvcache_append": "kvcache_append.cu",
}


# Template parameters of each kernel, in order, as KernelConfig fields. A field a kernel does not take
# is 0 (or False) in its configs, so that one config is one instantiation.
_TEMPLATE_PARAMS = ("dtype", "head_dim", "block_m", "block_n", "warps", "variant")
TEMPLATE_PARAMS = {k: _TEMPLATE_PARAMS for k in SOURCES} | {
    # D = rowsum(dO * O) and dQ = dQ_accum * softmax_scale: any head dim, VARLEN alone
    "flash_bwd_preprocess": ("dtype", "block_m", "warps", "variant"),
    "flash_bwd_postprocess": ("dtype", "block_m", "warps", "variant"),
    # the split-KV merge: one warp per query row, any variant
    "flash_decode_combine": ("dtype", "head_dim", "warps"),
    # new rows into a KV cache: a copy, any head dim (4 warps: kAppendThreads)
    "kvcache_append": ("dtype",),
}


# kVariant bits (kernels_cu/mask.cuh): the variants a kernel instantiation applies; their values (the
# window, softcap, slopes, seed, cu_seqlens) travel in the params. A plain call pays for none of them.
LOCAL = 1  # causal and / or a sliding window
SOFTCAP = 2
ALIBI = 4
DROPOUT = 8
VARLEN = 16  # packed sequences: rows and lengths from cu_seqlens
WINDOW = 32  # with LOCAL: a sliding window, both bounds read at run time (LOCAL alone is causal, compiled in)
SEQUSED = 64  # KV cache: entry b has seqused_k[b] keys (clamped to the cache), not the array's extent
PAGED = 128  # KV cache in pages: key row j of entry b through block_table (forward only)
DETERMINISTIC = 256  # backward: the adds into each dQ tile in key-block order (semaphores), not as they come
# flash_bwd_sm90 on a small grid: each key block's query blocks split between the two blocks of a cluster
# (choose_backward sets it; not with DETERMINISTIC)
QUERY_SPLIT = 512
# With SOFTCAP and without ALIBI, a softcap of at most BOUNDED_SOFTCAP: every logit lies in [-softcap, softcap],
# so the online softmax (kernels_cu/softmax.cuh) subtracts no running max: P = e^logit stays within e^+-50,
# inside fp32's and bf16's range (not fp16's: 65504 is e^11). choose_forward keeps it for bf16 on flash_fwd alone
# (softcap forward 7-18 % faster on the H200; flash_fwd_sm90 gained nothing with it: bench/RESULTS.md, 2026-12-03 (b));
# the other kernels drop it.
BOUNDED = 1024
BOUNDED_SOFTCAP = 50.0
# flash_bwd on compute capability 9.0 where sm_80's shared memory holds one buffer of Q and dO (d >= 224): the
# block takes sm_90's budget (SMEM_LIMIT[90]), so two (choose_backward sets it; 1.07-1.10x at d = 256 on an H100,
# bench/RESULTS.md 2026-12-06 (n))
WIDE_SMEM = 2048
# the KV-cache entry point has no backward, and the backward reads the LSE: choose_backward drops them
FORWARD_ONLY = SEQUSED | PAGED | BOUNDED
BACKWARD_ONLY = DETERMINISTIC | QUERY_SPLIT | WIDE_SMEM  # choose_forward drops them
VARIANT_NAMES = {LOCAL: "local", SOFTCAP: "softcap", ALIBI: "alibi", DROPOUT: "dropout", VARLEN: "varlen",
                 WINDOW: "window", SEQUSED: "seqused", PAGED: "paged", DETERMINISTIC: "deterministic",
                 QUERY_SPLIT: "query_split", BOUNDED: "bounded", WIDE_SMEM: "wide_smem"}
ALL_VARIANTS = LOCAL | SOFTCAP | ALIBI | DROPOUT | VARLEN | WINDOW | DETERMINISTIC


def longest_first(variant: int, hopper: bool = False) -> bool:
    """Do the forward and dQ grids run query blocks last to first? (kernels_cu/mask.cuh query_block: causal
    without a window, where the last query blocks have the most key blocks to visit; hopper, the Hopper forward,
    with softcap, ALiBi and dropout too, which spill the other kernels' reversed index)."""
    return (variant & (LOCAL | WINDOW | (0 if hopper else SOFTCAP | ALIBI | DROPOUT))) == LOCAL


def variant_bits(*, local=False, softcap=False, alibi=False, dropout=False, varlen=False, window=False,
                 seqused=False, paged=False, deterministic=False, bounded=False) -> int:
    """kVariant of a call; window: its mask is a sliding window, not causal alone (implies local);
    paged implies seqused (a paged cache always has per-entry key counts); bounded: a softcap of at most
    BOUNDED_SOFTCAP without ALiBi (implies softcap)."""
    if bounded and alibi:
        raise ValueError("BOUNDED: ALiBi's bias has no lower bound")
    bits = ((LOCAL, local or window), (SOFTCAP, softcap or bounded), (ALIBI, alibi), (DROPOUT, dropout),
            (VARLEN, varlen), (WINDOW, window), (SEQUSED, seqused or paged), (PAGED, paged),
            (DETERMINISTIC, deterministic), (BOUNDED, bounded))
    return sum(bit for bit, on in bits if on)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    kernel: str  # a key of SOURCES
    dtype: str  # a member of DTYPES
    head_dim: int  # compiled head dim (a member of HEAD_DIMS); 0 where the kernel takes none
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile; 0 where the kernel takes none
    warps: int
    variant: int  # kVariant: a sum of LOCAL, SOFTCAP, ALIBI, DROPOUT, VARLEN, WINDOW, SEQUSED, PAGED, DETERMINISTIC,
    # QUERY_SPLIT, BOUNDED, WIDE_SMEM

    @property
    def source(self) -> str:
        return SOURCES[self.kernel]

    @property
    def family(self) -> str:
        """"sm90" (Hopper: TMA and wgmma, built for sm_90a), "simt" (fp32 / fp64) or "mma" (mma.sync, sm_80+)."""
        return self.kernel.rsplit("_", 1)[-1] if self.kernel.endswith(("_sm90", "_simt")) else "mma"

    @property
    def arch(self) -> str | None:
        """The one target this kernel runs on, or None (any): "90a", the Hopper kernels (built for sm_90a by NVRTC
        from cuda-bindings); "90", WIDE_SMEM (sm_90's shared memory; built by CuPy, as the others)."""
        return "90a" if self.family == "sm90" else "90" if self.variant & WIDE_SMEM else None

    def runs_on(self, compute_capability: int) -> bool:
        """Can the dispatcher return this config on a GPU of that compute capability? A config for one target (arch)
        runs there alone; a flash_bwd config left one buffer of Q and dO by sm_80's shared memory runs everywhere but
        on 9.0, where choose_backward gives it WIDE_SMEM instead (the compile gate builds neither for the other)."""
        if self.arch:
            return compute_capability == int(self.arch[:2])
        return not takes_wide_smem(self, compute_capability)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def label(self) -> str:
        """A short description for progress lines ("flash_fwd bfloat16 d=128"; no d= for kernels
        compiled for every head dim)."""
        names = [n for bit, n in VARIANT_NAMES.items() if self.variant & bit]
        return f"{self.kernel} {self.dtype}" + (f" d={self.head_dim}" if self.head_dim else "") + "".join(
            f" {n}" for n in names)

    @property
    def local(self) -> bool:
        """Causal and / or windowed: the mask's bounds are read at run time."""
        return bool(self.variant & LOCAL)

    @property
    def template_name(self) -> str:
        def arg(field):
            value = getattr(self, field)
            if field == "dtype":
                return CTYPES[value]
            return str(value)

        return f"cuflash::{self.kernel}<{', '.join(arg(f) for f in TEMPLATE_PARAMS[self.kernel])}>"

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the kernel needs; the kernels check it at entry (a trap if short)."""
        return smem_bytes(self)


# One row per (kernel, head_dim): (block_m, block_n, warps). Chosen so that every entry compiles
# without spills for sm_80 and sm_90 (tests/test_compile_gate.py checks it from the ptxas report).
_TILES: dict[str, dict[int, tuple[int, int, int]]] = {
    # Tensor-core rows: the fastest candidates measured on an H200 (bench/tile_sweep.py fwd-mma, bench/RESULTS.md
    # 2026-12-03 (e); d = 224 between its measured neighbours) among those that compile without spills for sm_80 and
    # sm_90 (NVRTC 13.0 and 12.x, what CI and the H200 build with). d = 128 keeps 128 x 32 x 4 for what
    # _TILES_BY_KEYS does not serve (windows, KV caches: 128 x 64 x 4 spills 32 bytes on sm_90 with a paged one);
    # d = 96 keeps it too: 128 x 64 x 4, 1.18-1.21x faster, spills 4 bytes on sm_90 with causal varlen. d = 256's
    # 64 x 64 x 4 was 1.05x faster causal but 0.97-0.98x without a mask (call 4 against call 3): not taken.
    "flash_fwd": {32: (128, 64, 4), 64: (128, 64, 4), 96: (128, 32, 4), 128: (128, 32, 4),
                  160: (128, 64, 8), 192: (64, 64, 4), 224: (64, 64, 4), 256: (128, 64, 8)},
    # Hopper: warps = 4 per warpgroup, a producer and one consumer per 64 query rows. Compiled for head dims
    # that are whole 64-column slabs (a call's head dim rounds up to the next; TMA fills the rest with zeros).
    "flash_fwd_sm90": {64: (128, 128, 12), 128: (128, 128, 12), 256: (128, 64, 12)},
    # Hopper backward: a producer and one consumer per 64 keys (d = 256: two sharing them, half the dims each); dQ
    # in 64 x 64 tiles, one per consumer (d = 256: 64 x 128). Head dims up to 128: dK and dV of 64 keys x the head
    # dim live in registers. d = 64 at 128 x 128 (FlashAttention-3's tile), a consumer's queries in two halves, for
    # every variant: 1.17-1.22x faster than 64 x 128 on an H200, deterministic 1.15-1.17x, the variants 1.07-1.17x
    # (bench/RESULTS.md, 2026-12-06 (t)).
    "flash_bwd_sm90": {64: (128, 128, 12), 128: (64, 128, 12), 256: (64, 64, 12)},
    "flash_bwd": {32: (128, 128, 8), 64: (128, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8),
                  160: (64, 64, 8), 192: (64, 64, 8), 224: (64, 64, 8), 256: (64, 64, 8)},
    # SIMT (float32 / float64): each row must fit both dtypes (double smem <= 163 KiB on sm_80, no spills)
    "flash_fwd_simt": {32: (64, 32, 4), 64: (64, 32, 4), 96: (32, 32, 4), 128: (32, 32, 4),
                       160: (32, 32, 4), 192: (32, 32, 8), 224: (32, 16, 8), 256: (32, 16, 8)},
    "flash_bwd_dkdv_simt": {32: (64, 32, 4), 64: (64, 32, 4), 96: (32, 32, 4), 128: (32, 32, 8),
                            160: (32, 16, 4), 192: (32, 16, 4), 224: (16, 16, 4), 256: (16, 16, 4)},
    "flash_bwd_dq_simt": {32: (64, 32, 4), 64: (64, 32, 4), 96: (32, 32, 4), 128: (32, 32, 4),
                          160: (32, 16, 4), 192: (32, 16, 4), 224: (16, 16, 4), 256: (16, 16, 4)},
    # Decoding (flash_decode.cu): 16 packed query rows; each warp streams 16 keys of every key block (one page
    # lookup per warp slice). Measured on the H200 (bench/RESULTS.md, 2026-12-01 (h)): at d = 64 128-key blocks
    # beat 64-key ones (4.04 against 3.87 TB/s; 4 warps of 32 keys did as well as 8 of 16), at d = 128 they did
    # not (2 stages there: 4.07-4.08 against 4.07-4.14); 32 keys a warp lost on 64-key pages (3.75 against 4.04)
    "flash_decode": {d: (16, 128, 8) if d <= 64 else (16, 64, 4) for d in HEAD_DIMS},
}


# Tiles for the score modifiers and dropout (SOFTCAP, ALIBI, DROPOUT: registers of their own) where the
# plain tile spills (compile gate): 8 warps, or smaller tiles. Same format as _TILES.
HEAVY = SOFTCAP | ALIBI | DROPOUT
_TILES_HEAVY: dict[str, dict[int, tuple[int, int, int]]] = {
    "flash_fwd": {128: (128, 32, 8), 160: (128, 32, 8), 256: (128, 32, 8)},
    "flash_bwd": {32: (64, 64, 4), 64: (64, 64, 4), 96: (64, 64, 8), 128: (64, 64, 8)},
    "flash_bwd_dkdv_simt": {64: (32, 32, 4)},
}

# The forwards without a window, score modifier, dropout or KV cache: the tile by the call's key count, per head
# dim, without and with the causal mask: (fewest keys, tile) steps, the last one the call reaches giving its tile
# (_TILES' below the first). Measured on the H200 against _TILES' tile (bench/RESULTS.md):
# - flash_fwd at d = 128, by mask alone (a step at 0 keys), 2026-12-03 (e): without a mask 128 x 64 x 4
#   (FlashAttention-2's tile), 1.03-1.06x; with the causal mask 128 x 64 x 8, 1.04-1.22x at N = 1024-8192, 1.04x at
#   16384 (without a mask it was 0.93-0.98x);
# - wider key blocks, so fewer barriers, waits and O rescales per query row: d = 128, FlashAttention-3's 176 keys
#   (hopper/tile_size.h), 2026-12-02 (d): non-causal 1.03x at N=8192, 1.12x at 16384, 0.96-0.97x at 512 and 1024;
#   2026-12-03 (c): causal 1.01-1.03x from 8192 keys, 0.99x at 2048 and 4096. d = 64, 192 keys, and d = 256, 80
#   keys, 2026-12-03 (c): 1.03-1.12x at N >= 2048, causal and not;
# - one consumer warpgroup (block_m 64), two blocks an SM, so that one block's prologue and epilogue run under the
#   other's main loop: d = 64, 2026-12-03 (c): 64 x 128 1.09-1.13x at N = 512 and 1024, 64 x 192 1.11-1.15x at
#   2048, and 128 x 192 1.02-1.04x faster than 64 x 192 at 8192; 2026-12-03 (d), at 4096: 128 x 192 1.02x faster
#   than 64 x 192 without a mask, 64 x 192 1.04x faster with the causal one (as fast at 8192).
_ONE_CONSUMER_D64 = ((0, (64, 128, 8)), (2048, (64, 192, 8)))
_TILES_BY_KEYS = {"flash_fwd_sm90": {64: ((*_ONE_CONSUMER_D64, (4096, (128, 192, 12))),
                                          (*_ONE_CONSUMER_D64, (8192, (128, 192, 12)))),
                                     128: (((4096, (128, 176, 12)),), ((8192, (128, 176, 12)),)),
                                     256: (((2048, (128, 80, 12)),), ((2048, (128, 80, 12)),))},
                  "flash_fwd": {128: (((0, (128, 64, 4)),), ((0, (128, 64, 8)),))}}

# flash_bwd where its grid would leave most SMs idle (fewer blocks than half of them, e.g. B=2 H=8 N=512 at
# d=128: 64 blocks of 64 x 128 on 132 SMs): a tile that makes twice as many blocks. Measured on the H200
# (bench/RESULTS.md, 2026-12-01, causal): N=512 takes 0.056 ms with it, 0.069 without. Not for the variants
# with registers of their own (HEAVY: _TILES_HEAVY's tiles already are small).
_TILES_SMALL_GRID = {"flash_bwd": {32: (64, 64, 4), 64: (64, 64, 4), 96: (64, 64, 4), 128: (64, 64, 4)}}

# flash_bwd_preprocess and flash_bwd_postprocess: (block_m, warps), whatever the head dim (they take none). 16 warps:
# at B2 H8 N512 the grid is 128 blocks, and with 4 warps each SM held too few loads in flight to stream O and dO
# (bench/RESULTS.md 2026-12-07 (x), H100, bf16 d = 128: preprocess 8.1 -> 7.0 us, postprocess 5.7 -> 5.4).
_PREPROCESS_TILE = (64, 16)
# DETERMINISTIC: one dQ semaphore per SEMAPHORE_ROWS query rows, as many as preprocess blocks (preprocess
# block i zeroes semaphore i); flash_bwd's block_m is a multiple of it and uses the first of them.
SEMAPHORE_ROWS = _PREPROCESS_TILE[0]
# The row bits that swizzle the fp32 dQ accumulator's 8-float chunks when flash_bwd_sm90 adds into it (backward.cuh's
# dq_accum_col and kDqSwizzleSm90: its shared-memory copy of a tile stores without bank conflicts); flash_bwd's 0.
DQ_SWIZZLE_SM90 = 3


def smem_bytes(cfg: KernelConfig) -> int:
    """Shared-memory layout of each kernel, in bytes (documented beside each kernel too)."""
    e = ITEMSIZE[cfg.dtype]
    d, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    pad = 8 if cfg.dtype in TENSOR_CORE_DTYPES else 1  # row padding (elements) against bank conflicts
    row = d + pad
    if cfg.kernel == "flash_fwd":  # Q tile, K tile, V tile
        return (bm + 2 * bn) * row * e
    if cfg.kernel == "flash_fwd_sm90":  # Sm90FwdSmem: 1024 alignment slack, Q, the stages of K and V, mbarriers
        stages = sm90_stages(cfg)
        return 1024 + (bm + 2 * stages * bn) * d * e + 8 * (1 + 4 * stages)
    if cfg.kernel in ("flash_bwd_preprocess", "flash_bwd_postprocess"):
        return 0
    if cfg.kernel == "flash_bwd_sm90":
        # Sm90BwdSmem: slack, K, V, 2 stages of Q and dO, 2 dS, LSE and D, sDqAcc (two deterministic); split dims
        # (d > 128): 2 P^T, no sDqAcc. Then the small block (exp2's scale, mbarriers), in the slack (at most 1008
        # bytes) where it would not fit after the tiles
        stages, split_dims = 2, sm90_split_dims(d)
        dq_acc = 0 if split_dims else bm * d * 4 * sm90_dq_buffers(cfg)
        tiles = ((2 * bn * d + 2 * stages * bm * d + (4 if split_dims else 2) * bm * bn) * e
                 + 2 * stages * bm * 4 + dq_acc)
        small = 8 + 8 * (1 + 4 * stages)
        return 1024 + tiles + small if 1024 + tiles + small <= SMEM_LIMIT[90] else 1008 + tiles
    if cfg.kernel == "flash_bwd":
        return flash_bwd_layout(cfg)[0]
    if cfg.kernel == "flash_decode":  # Q tile; per warp decode_stages slots of K and V (kWarpKeys = bn / warps rows)
        return bm * row * e + 2 * decode_stages(cfg) * bn * decode_ring_pitch(d) * e
    if cfg.kernel in ("flash_decode_combine", "kvcache_append"):
        return 0
    if cfg.kernel == "flash_fwd_simt":  # Q, K, V tiles (rows padded by 16 bytes); P tile (rows padded by 8)
        srow = d + 16 // e
        return (bm * srow + 2 * bn * srow + bm * (bn + 8)) * e
    if cfg.kernel in ("flash_bwd_dkdv_simt", "flash_bwd_dq_simt"):
        # Q, dO, K, V tiles (rows padded by 16 bytes); P (dkdv only) and dS tiles (rows padded by 8);
        # LSE and D rows
        srow = d + 16 // e
        ptiles = 2 if cfg.kernel == "flash_bwd_dkdv_simt" else 1
        return (2 * bm * srow + 2 * bn * srow + ptiles * bm * (bn + 8) + 2 * bm) * e
    raise ValueError(f"unknown kernel {cfg.kernel!r}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compiled_head_dim(head_dim: int, head_dims=HEAD_DIMS) -> int:
    for d in head_dims:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")


def _make(kernel: str, dtype: str, head_dim: int, variant: int) -> KernelConfig:
    d = compiled_head_dim(head_dim, sorted(_TILES[kernel]))
    heavy = _TILES_HEAVY.get(kernel, {}) if variant & HEAVY else {}
    bm, bn, warps = heavy.get(d) or _TILES[kernel][d]
    return KernelConfig(kernel, dtype, d, bm, bn, warps, int(variant))


def _per_row(kernel: str, dtype: str, variant: int) -> KernelConfig:
    """flash_bwd_preprocess or flash_bwd_postprocess: one instantiation per dtype, dense or varlen."""
    bm, warps = _PREPROCESS_TILE
    return KernelConfig(kernel, dtype, 0, bm, 0, warps, variant & VARLEN)


def dtype_name(dtype) -> str:
    """Canonical dtype name of a NumPy / ml_dtypes dtype, or a framework's (torch.bfloat16...)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:  # a framework dtype object: torch.float16 prints as "torch.float16"
            name = str(dtype).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(DTYPES)}, got {name}")
    return name


def acc_dtype(name: str) -> str:
    """The accumulation (and LSE) dtype of an input dtype: float64 for float64, else float32."""
    return "float64" if name == "float64" else "float32"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a canonical name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def flash_bwd_layout(cfg: KernelConfig) -> tuple[int, int]:
    """(shared memory bytes, Q / dO buffers) of a flash_bwd config, as flash_bwd.cu lays it out: K, V tiles; dS^T's
    tile (and P^T's when warps share keys, unless it must take dS^T's: kAliasP); per buffer Q, dO, LSE, D. Two
    buffers where they fit the budget: sm_80's shared memory, or with WIDE_SMEM sm_90's (FlashBwdLayout)."""
    e, d, bm, bn, row = ITEMSIZE[cfg.dtype], cfg.head_dim, cfg.block_m, cfg.block_n, cfg.head_dim + 8
    budget = SMEM_LIMIT[90 if cfg.variant & WIDE_SMEM else 80]
    warp_keys = 32 if cfg.warps == bn // 16 and bn % 32 == 0 and d >= 96 else 16  # kWarpKeys
    p_in_smem = cfg.warps // (bn // warp_keys) > 1  # kWM > 1
    kv, tile, stage = 2 * bn * row * e, bn * (bm + 8) * e, 2 * bm * row * e + 2 * bm * 4
    alias_p = p_in_smem and kv + 2 * tile + 2 * stage > budget  # kAliasP: P^T in dS^T's tile
    fixed = kv + (2 if p_in_smem and not alias_p else 1) * tile
    stages = 2 if fixed + 2 * stage <= budget else 1  # kStages
    return fixed + stages * stage, stages


def takes_wide_smem(cfg: KernelConfig, compute_capability: int) -> bool:
    """Does choose_backward give this flash_bwd config WIDE_SMEM on that compute capability? On 9.0, where sm_80's
    shared memory leaves it one buffer of Q and dO (d >= 224)."""
    return (compute_capability == 90 and cfg.kernel == "flash_bwd" and not cfg.variant & WIDE_SMEM
            and flash_bwd_layout(cfg)[1] == 1)


def choose_forward(dtype, head_dim: int, variant: int, *, seqlen_k: int = 0, compute_capability: int = 0,
                   family: str | None = None) -> KernelConfig:
    """The forward config of a call; variant: variant_bits(...) (LOCAL alone for a causal call).

    16-bit dtypes on compute capability 9.0 take the Hopper kernel (flash_fwd_sm90: every variant, varlen,
    KV caches dense or paged); elsewhere the mma.sync kernel. family: forced_family(), where a caller forces
    one ("mma" on a Hopper GPU; "sm90" raises elsewhere). seqlen_k, where given, gives a call without
    window or score modifier _TILES_BY_KEYS's tile; not a KV cache's, whose dense and paged calls read
    the same keys in the same blocks (the same bits), and paged key blocks are powers of two."""
    dt = dtype_name(dtype)
    variant &= ~BACKWARD_ONLY
    if dt not in TENSOR_CORE_DTYPES:
        return _make("flash_fwd_simt", dt, head_dim, variant & ~BOUNDED)
    hopper = compute_capability == 90
    if family == "sm90" and not hopper:
        raise ValueError("the sm90 kernel family cannot serve this call: it needs compute capability 9.0")
    kernel = "flash_fwd_sm90" if hopper and family != "mma" else "flash_fwd"
    if dt != "bfloat16" or kernel != "flash_fwd":
        variant &= ~BOUNDED
    cfg = _make(kernel, dt, head_dim, variant)
    by_keys = _TILES_BY_KEYS.get(cfg.kernel, {}).get(cfg.head_dim)
    if by_keys and not variant & (HEAVY | WINDOW | FORWARD_ONLY):
        for fewest, (bm, bn, warps) in by_keys[1 if variant & LOCAL else 0]:
            if seqlen_k >= fewest:
                cfg = dataclasses.replace(cfg, block_m=bm, block_n=bn, warps=warps)
    return cfg


def choose_backward(dtype, head_dim: int, variant: int, *, key_slabs: int = 0, seqlen_k: int = 0,
                    sms: int = 0, compute_capability: int = 0,
                    family: str | None = None) -> tuple[KernelConfig, KernelConfig, KernelConfig]:
    """The three launches of one backward call, in order. key_slabs (batch * nheads_k), seqlen_k and sms
    (the GPU's multiprocessors), where given, let a small problem take _TILES_SMALL_GRID's tile.

    fp16 / bf16: (flash_bwd_preprocess, flash_bwd, flash_bwd_postprocess): D and a zeroed fp32 dQ
    accumulator; one pass over key blocks (dK, dV, and dQ added into the accumulator); dQ converted. On
    compute capability 9.0 the middle one is flash_bwd_sm90, except for what it does not serve
    (sm90_serves_backward), with QUERY_SPLIT where query_split says so; family as for choose_forward. flash_bwd
    there takes WIDE_SMEM where sm_80's shared memory would leave it one buffer of Q and dO.
    fp32 / fp64: (flash_bwd_preprocess, flash_bwd_dkdv_simt, flash_bwd_dq_simt): dQ in a kernel of its own,
    deterministic without DETERMINISTIC (which they drop)."""
    dt = dtype_name(dtype)
    variant &= ~(FORWARD_ONLY | QUERY_SPLIT | WIDE_SMEM)  # the latter two are this function's to set
    pre = _per_row("flash_bwd_preprocess", dt, variant)  # D = rowsum(dO * O): any head_dim, dense or varlen
    if dt not in TENSOR_CORE_DTYPES:
        variant &= ~DETERMINISTIC
        return pre, _make("flash_bwd_dkdv_simt", dt, head_dim, variant), _make("flash_bwd_dq_simt", dt, head_dim, variant)
    post = _per_row("flash_bwd_postprocess", dt, variant)
    hopper = compute_capability == 90 and sm90_serves_backward(head_dim, variant)
    if family == "sm90" and not hopper:
        raise ValueError("the sm90 kernel family cannot serve this backward: "
                         + ("it needs compute capability 9.0" if compute_capability != 90
                            else "KV caches, varlen with ALiBi and dropout, and varlen "
                                 "built by NVRTC 12 run on the mma family"))
    if hopper and family != "mma":
        main = _make("flash_bwd_sm90", dt, head_dim, variant)
        if sms and not variant & DETERMINISTIC and query_split(main, key_slabs * ceil_div(seqlen_k, main.block_n),
                                                               sms):
            main = dataclasses.replace(main, variant=variant | QUERY_SPLIT)
        return pre, main, post
    main = _make("flash_bwd", dt, head_dim, variant)
    small = _TILES_SMALL_GRID["flash_bwd"].get(main.head_dim)
    if small and not variant & HEAVY and key_slabs * ceil_div(seqlen_k, main.block_n) < sms // 2:
        main = dataclasses.replace(main, block_m=small[0], block_n=small[1], warps=small[2])
    if takes_wide_smem(main, compute_capability):
        main = dataclasses.replace(main, variant=variant | WIDE_SMEM)
    return pre, main, post


def kv_box_rows(cfg: KernelConfig, page_size: int) -> int:
    """flash_fwd_sm90 on a paged cache: the rows of one K or V box (flash_fwd_sm90.cu's kv_box_rows), the
    largest power of two dividing both page_size and block_n."""
    return min(page_size & -page_size, cfg.block_n)


# flash_bwd_sm90 serves dense and varlen batches (a KV cache has no backward), with every variant (the
# softcap's derivative kept from [5] to [7] as fp16 pairs, or with dropout recovered from P at [7]) but varlen with
# ALiBi and dropout together: at d = 128 those spill (4 to 40 bytes, NVRTC 13.0), as the same variants dense
# do not. And varlen only where NVRTC 13 or newer builds it: NVRTC 12.9's builds spill (8 to 96 bytes at
# d = 64 and 128, for every varlen variant but the plain and deterministic ones).
SM90_BWD_UNSERVED = SEQUSED | PAGED
SM90_BWD_VARLEN_UNSERVED = ALIBI | DROPOUT
SM90_BWD_VARLEN_NVRTC = 13  # against _compile.nvrtc_major(), the NVRTC that builds the Hopper kernels


def sm90_dq_buffers(cfg: KernelConfig) -> int:
    """flash_bwd_sm90's sDqAcc buffers (kDqBuffers): two deterministic, one dQ warp adding each, so that one's wait
    for a tile's turn and for its adds to land runs under the other's pair."""
    return 2 if cfg.variant & DETERMINISTIC else 1


def sm90_split_dims(head_dim: int) -> bool:
    """Does flash_bwd_sm90 split the head dim over its consumers (Sm90BwdSmem::kSplitDims)? Over 128: dK and dV
    of 64 keys would take 256 registers a thread, so two consumers share a block's 64 keys, half the dims each."""
    return head_dim > 128


def query_split(cfg: KernelConfig, blocks: int, sms: int) -> bool:
    """Does flash_bwd_sm90's grid of `blocks` key blocks run faster with each split over a cluster of two
    (QUERY_SPLIT)? Under a causal mask alone the first key blocks visit every query block: halving them halves
    the grid's longest path, where the blocks fit one wave. Otherwise (a sliding window's blocks are alike too)
    twice as many only help where they still fit one wave (sms / 2 clusters: the H200's 132 SMs pair up)."""
    if sm90_split_dims(cfg.head_dim):  # rank 0's partials would be rows of dK, dV split over two consumers
        return False
    return 2 * blocks <= sms or ((cfg.variant & (LOCAL | WINDOW)) == LOCAL and blocks <= sms)


def backward_grid(cfg: KernelConfig, nheads_k: int, seqlen_k: int, batch: int) -> tuple[int, int, int]:
    """flash_bwd's and flash_bwd_sm90's grid (backward.cuh's backward_block reads it): (nheads_k, key blocks,
    batch), batch by batch with key blocks slowest within an entry, so that the blocks resident at once are
    many key blocks of one entry's heads and share each Q, dO and dQ tile in L2. DETERMINISTIC: (nheads_k,
    batch, key blocks), key blocks slowest of all, as before 2026-12-02: each dQ tile's turn passes from key
    block to key block, and with every entry's first key blocks resident at once their chains run side by side
    rather than one entry's deeper (a model of the schedule: 8 % longer at B=2 H=8 N=4096 causal the other way).
    QUERY_SPLIT doubles x (clusters of two blocks)."""
    x = nheads_k * (2 if cfg.variant & QUERY_SPLIT else 1)
    n_blocks = ceil_div(seqlen_k, cfg.block_n)
    return (x, batch, n_blocks) if cfg.variant & DETERMINISTIC else (x, n_blocks, batch)


def sm90_serves_backward(head_dim: int, variant: int) -> bool:
    """Does flash_bwd_sm90 serve a backward call? (else flash_bwd does; README Limits lists these)"""
    from . import _compile  # its NVRTC version: read only for varlen

    return (head_dim <= max(_TILES["flash_bwd_sm90"]) and not variant & SM90_BWD_UNSERVED
            and not (variant & VARLEN and (variant & SM90_BWD_VARLEN_UNSERVED == SM90_BWD_VARLEN_UNSERVED
                                           or _compile.nvrtc_major() < SM90_BWD_VARLEN_NVRTC)))


# Decoding over a KV cache (flash_decode, flash_attn_with_kvcache): the query heads of a GQA group are packed
# into 16-row tiles (seqlen_q * group rows per kv head), and the keys split over up to MAX_SPLITS blocks. Up
# to DECODE_MAX_ROWS packed rows the decode kernel serves a call (beyond, flash_fwd's 128-row tiles do,
# unless num_splits > 1 is asked for); ALiBi (a slope per packed row) and fp32 / fp64 take flash_fwd(_simt).
DECODE_MAX_ROWS = 64
MAX_SPLITS = 128
DECODE_UNSERVED = ALIBI | DROPOUT | VARLEN


def choose_decode(dtype, head_dim: int, variant: int, *, packed_rows: int, num_splits: int = 0,
                  family: str | None = None, smem_limit: int | None = None) -> tuple[KernelConfig, KernelConfig] | None:
    """(flash_decode, flash_decode_combine) configs of a KV-cache call, or None where flash_fwd serves it:
    another dtype, a variant in DECODE_UNSERVED, more than DECODE_MAX_ROWS packed rows (seqlen_q * group)
    without num_splits > 1, family "sm90" (flash_fwd_sm90 serves the call), or a block that needs more shared
    memory than smem_limit (the device's, where given: sm_86 / sm_89 grant 99 KiB)."""
    dt = dtype_name(dtype)
    if (dt not in TENSOR_CORE_DTYPES or variant & DECODE_UNSERVED or family == "sm90"
            or (packed_rows > DECODE_MAX_ROWS and num_splits <= 1)):
        return None
    main = _make("flash_decode", dt, head_dim, (variant | SEQUSED) & ~BOUNDED)
    if smem_limit is not None and main.smem_bytes > smem_limit:
        return None
    return main, KernelConfig("flash_decode_combine", dt, main.head_dim, 0, 0, 4, 0)


def choose_append(dtype) -> KernelConfig:
    """kvcache_append's config for caches of this dtype."""
    return KernelConfig("kvcache_append", dtype_name(dtype), 0, 0, 0, 4, 0)


def decode_ring_pitch(head_dim: int) -> int:
    """flash_decode's K / V ring rows (decode_ring_pitch in flash_decode.cu): the head dim rounded up to 64
    elements (128-byte rows)."""
    return ceil_div(head_dim, 64) * 64


def decode_stages(cfg: KernelConfig) -> int:
    """flash_decode's kStages (decode_stages in flash_decode.cu): 3 where the block fits in sm_80's shared
    memory, else 2."""
    q = cfg.block_m * (cfg.head_dim + 8) * 2
    return 3 if q + 2 * 3 * cfg.block_n * decode_ring_pitch(cfg.head_dim) * 2 <= SMEM_LIMIT[80] else 2


def decode_splits(tiles: int, key_blocks: int, sms: int, page_size: int = 0) -> int:
    """num_splits=0's choice: tiles (batch * nheads_k * packed query blocks) that leave more than a fifth of the
    sms idle are split, into the fewest splits whose blocks fill their last round of sms within 95 % of the
    fullest possible; at most one key block per split and MAX_SPLITS. Rounds of one block per SM, not of the
    blocks an SM can hold: the blocks stream memory alike, and an SM with two of them takes twice as long
    (bench/decode_splits.py). Page pools with pages under 64 keys (page_size; 0: a dense cache) are the exception:
    each 16 keys a warp copies wait on a page-table read first, and a second block per SM hides that wait, so
    their rounds are of two blocks per SM (pages of 16, 8 x 32 x 8 x 32768 x 128: 283 -> 254 us from 2 splits to
    4; B = 1: 144 -> 135 us from 16 to 32; RESULTS 2026-12-03 (f))."""
    slots = 2 * sms if 0 < page_size < 64 else sms
    if tiles <= 0 or tiles >= 0.8 * slots:
        return 1
    top = max(1, min(MAX_SPLITS, key_blocks))
    fill = [tiles * s / (ceil_div(tiles * s, slots) * slots) for s in range(1, top + 1)]
    best = max(fill)
    return next(s for s, f in enumerate(fill, 1) if f >= 0.95 * best)


def sm90_blocks_per_sm(cfg: KernelConfig) -> int:
    """flash_fwd_sm90's blocks per SM (kSm90BlocksPerSm): two where one consumer warpgroup has the block
    (block_m 64), one where its consumers take turns."""
    return 2 if cfg.block_m == 64 else 1


def sm90_stages(cfg: KernelConfig) -> int:
    """Sm90FwdSmem::kStages: the stages of K and V that fit beside Q in a block's share of sm_90's shared memory
    (228 KiB an SM, less 1 KiB the system keeps per block), up to 4."""
    q, kv = cfg.block_m * cfg.head_dim * 2, cfg.block_n * cfg.head_dim * 2
    limit = SM90_SMEM_PER_SM // sm90_blocks_per_sm(cfg) - 1024
    return min(4, (limit - 1024 - q - 8 * (1 + 4 * 4)) // (2 * kv))


# Kernel families a caller can force (benchmarks, tests): kernel_family("mma") runs the mma.sync kernels on a
# Hopper GPU. None: each call takes the fastest family that serves it.
FORCEABLE_FAMILIES = ("mma", "sm90")
_forced_family: str | None = None


def forced_family() -> str | None:
    return _forced_family


@contextlib.contextmanager
def kernel_family(name: str | None):
    """Within the block, the GPU kernels of 16-bit calls come from family `name` ("mma" or "sm90"; None: the
    default choice). Process-wide (not per thread); the plan cache keys on it."""
    global _forced_family
    if name is not None and name not in FORCEABLE_FAMILIES:
        raise ValueError(f"kernel family must be one of {', '.join(FORCEABLE_FAMILIES)} or None, got {name!r}")
    saved, _forced_family = _forced_family, name
    try:
        yield
    finally:
        _forced_family = saved


@dataclasses.dataclass(frozen=True)
class BackwardWorkspace:
    """Byte layout of one backward call's workspace: a single allocation from the caller's allocator.

    D = rowsum(dO * O) (acc dtype, [batch, head, row]) at offset 0; for the tensor-core kernels the fp32 dQ
    accumulator [batch, head, row, compiled head dim] at dq_accum_offset, and with DETERMINISTIC one int32
    semaphore per (entry, head, query block of 64 rows) at dq_semaphore_offset (-1: absent). With varlen
    D and dQ_accum are packed as lse is ([1, head, total_q]) while the semaphores are per sequence."""
    nbytes: int
    dq_accum_offset: int
    dq_semaphore_offset: int


def backward_workspace(dtype, head_dim: int, nheads: int, slabs: int, rows: int, entries: int, max_seqlen_q: int,
                       deterministic: bool) -> BackwardWorkspace:
    """slabs, rows: D's [slabs, nheads, rows] (dense: batch, seqlen_q; varlen: 1, total_q); entries,
    max_seqlen_q: the grid's (dense: batch, seqlen_q; varlen: sequences, longest)."""
    dt = dtype_name(dtype)
    align = lambda n: -(-n // 16) * 16  # noqa: E731: every region 16-byte aligned (vector zeroing)
    dsum = align(slabs * nheads * rows * ITEMSIZE[acc_dtype(dt)])
    if dt not in TENSOR_CORE_DTYPES:
        return BackwardWorkspace(dsum, -1, -1)
    accum = align(slabs * nheads * rows * compiled_head_dim(head_dim) * 4)
    sems = align(entries * nheads * ceil_div(max_seqlen_q, SEMAPHORE_ROWS) * 4) if deterministic else 0
    return BackwardWorkspace(dsum + accum + sems, dsum, dsum + accum if deterministic else -1)


# The instantiations the compile gate and `cuflash compile` build per (dtype, head dim): plain, causal,
# and every variant at once (the most registers; other combinations compile on first use).
GATED_VARIANTS = (0, LOCAL, ALL_VARIANTS)  # (choose_forward drops DETERMINISTIC)
# The KV-cache entry point (forward only, no dropout or varlen): a paged cache alone, and every variant
# it can combine, dense and paged. PAGED is not in ALL_VARIANTS: with dropout on top (a combination no
# entry point makes) the d=64 tensor-core forward spills on sm_90.
KVCACHE_VARIANTS = LOCAL | WINDOW | SOFTCAP | ALIBI | SEQUSED | PAGED
GATED_FORWARD_VARIANTS = (SEQUSED | PAGED, KVCACHE_VARIANTS & ~PAGED, KVCACHE_VARIANTS)
# flash_decode: a dense and a paged cache alone, and every variant it serves, dense and paged.
GATED_DECODE_VARIANTS = (SEQUSED, SEQUSED | PAGED, KVCACHE_VARIANTS & ~(ALIBI | PAGED), KVCACHE_VARIANTS & ~ALIBI)
# flash_fwd bf16 with BOUNDED: every variant it combines with, and the KV cache's.
GATED_BOUNDED_VARIANTS = (ALL_VARIANTS & ~ALIBI | BOUNDED, KVCACHE_VARIANTS & ~ALIBI | BOUNDED)


# The key counts where _TILES_BY_KEYS changes a tile (all_configs takes the tile of each)
_KEY_STEPS = sorted({keys for by_dim in _TILES_BY_KEYS.values() for by_mask in by_dim.values() for steps in by_mask
                     for keys, _ in steps})


def all_configs() -> list[KernelConfig]:
    """The configs the compile gate checks and `cuflash compile` builds: kvcache_append for every dtype, then
    (GATED_VARIANTS, with the backward's small-grid tiles and its WIDE_SMEM configs, and GATED_FORWARD_VARIANTS for
    the forward (bf16: GATED_BOUNDED_VARIANTS too), GATED_DECODE_VARIANTS for flash_decode (with
    its combine); the Hopper kernels' for GATED_VARIANTS (the forward's also without WINDOW: causal with every
    score modifier), ALL_VARIANTS less what they do not serve (the
    backward: dense, and varlen without ALiBi or without dropout), and the backward's QUERY_SPLIT plain, causal
    and with those but DETERMINISTIC)."""
    out: list[KernelConfig] = [choose_append(dt) for dt in DTYPES]
    for dt in DTYPES:
        for d in HEAD_DIMS:
            for variant in GATED_VARIANTS:
                cfgs = [choose_forward(dt, d, variant), *choose_backward(dt, d, variant),
                        choose_backward(dt, d, variant, key_slabs=1, seqlen_k=1, sms=1 << 20)[1],  # small grids
                        choose_backward(dt, d, variant, compute_capability=90, family="mma")[1]]  # WIDE_SMEM
                out.extend(c for c in cfgs if c not in out)
            bounded = GATED_BOUNDED_VARIANTS if dt == "bfloat16" else ()
            out.extend(c for c in (choose_forward(dt, d, v) for v in GATED_FORWARD_VARIANTS + bounded) if c not in out)
            decode = [choose_decode(dt, d, v, packed_rows=1) for v in GATED_DECODE_VARIANTS]
            out.extend(c for pair in decode if pair for c in pair if c not in out)
            hopper = [choose_forward(dt, d, v, compute_capability=90)
                      for v in (0, LOCAL, ALL_VARIANTS & ~VARLEN, ALL_VARIANTS, KVCACHE_VARIANTS & ~PAGED,
                                KVCACHE_VARIANTS)]
            # without a window, causal with every score modifier: the Hopper forward's query blocks reversed
            # (mask.cuh query_block), dense, varlen and over KV caches
            hopper += [c for c in (choose_forward(dt, d, v & ~WINDOW, compute_capability=90)
                                   for v in (ALL_VARIANTS & ~VARLEN, ALL_VARIANTS, KVCACHE_VARIANTS & ~PAGED,
                                             KVCACHE_VARIANTS)) if c.family == "sm90"]
            hopper += [choose_forward(dt, d, v, compute_capability=cc, seqlen_k=keys)  # _TILES_BY_KEYS'
                       for cc in (0, 90) for v in (0, LOCAL, VARLEN, LOCAL | VARLEN) for keys in _KEY_STEPS]
            # the most registers flash_bwd_sm90 serves: every variant dense, and varlen without ALiBi or without
            # dropout (those Hopper configs alone: where it does not serve the head dim, mma.sync ones)
            bwd_all = ALL_VARIANTS & ~(SM90_BWD_UNSERVED | VARLEN)
            bwd_varlen = [ALL_VARIANTS & ~(SM90_BWD_UNSERVED | bit) for bit in (ALIBI, DROPOUT)]
            for split in ({}, {"key_slabs": 1, "seqlen_k": 1, "sms": 1 << 20}):  # and QUERY_SPLIT
                det = DETERMINISTIC if split else 0  # QUERY_SPLIT does not take it
                hopper += [choose_backward(dt, d, v & ~det, compute_capability=90, **split)[1]
                           for v in (0, LOCAL, bwd_all)]
                hopper += [c for c in (choose_backward(dt, d, v & ~det, compute_capability=90, **split)[1]
                                       for v in bwd_varlen) if c.family == "sm90"]
            out.extend(c for c in hopper if c not in out)
    return out
