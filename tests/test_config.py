"""KernelConfig and the heuristics: pure Python."""

import dataclasses
import re

import pytest

from cuflash import _compile, config


def test_template_name():
    c = config.choose_forward("bfloat16", 128, config.LOCAL)
    assert c.template_name.startswith("cuflash::flash_fwd<__nv_bfloat16, 128, ")
    assert c.template_name.endswith(", 1>")
    both = config.variant_bits(local=True, dropout=True, varlen=True)
    assert config.choose_forward("bfloat16", 128, both).template_name.endswith(", 25>")
    assert config.choose_forward("bfloat16", 128, both).label == "flash_fwd bfloat16 d=128 local dropout varlen"
    assert config.choose_forward("float32", 64, False).template_name.startswith("cuflash::flash_fwd_simt<float, 64, ")


def test_bounded_softcap_is_kept_by_the_bf16_mma_forward_alone():
    """BOUNDED (no running max in the softmax) reaches the bf16 mma.sync forward alone (forced on a Hopper GPU
    too); the Hopper forward (no faster with it), fp16 (P would overflow), SIMT, the decode kernel and the
    backward drop it."""
    v = config.variant_bits(softcap=True, bounded=True)
    assert v == config.SOFTCAP | config.BOUNDED
    assert config.choose_forward("bfloat16", 128, v).template_name.endswith(f", {v}>")
    assert config.choose_forward("bfloat16", 128, v, compute_capability=90, family="mma").variant == v
    assert config.choose_forward("bfloat16", 128, v, compute_capability=90).variant == config.SOFTCAP
    for dt in ("float16", "float32", "float64"):
        assert config.choose_forward(dt, 128, v).variant == config.SOFTCAP
    backward = config.choose_backward("bfloat16", 128, v, compute_capability=90)
    assert all(c.variant & config.BOUNDED == 0 for c in backward)
    assert all(c.variant & config.BOUNDED == 0 for c in config.choose_decode("bfloat16", 128, v, packed_rows=1))
    with pytest.raises(ValueError, match="ALiBi"):
        config.variant_bits(softcap=True, alibi=True, bounded=True)


@pytest.mark.parametrize("d,expected", [(8, 32), (32, 32), (40, 64), (80, 96), (128, 128), (136, 160), (256, 256)])
def test_head_dim_rounds_up(d, expected):
    assert config.choose_forward("float16", d, False).head_dim == expected


def test_head_dim_too_large():
    with pytest.raises(ValueError, match="head_dim must be <= 256, got 264"):
        config.choose_forward("float16", 264, False)


def test_unknown_dtype():
    with pytest.raises(TypeError, match="dtype must be one of"):
        config.choose_forward("int8", 64, False)


ONE_CONSUMER_64, WIDE_192 = (64, 128, 8), (64, 192, 8)


@pytest.mark.parametrize("d,full,causal", [
    (64, [(0, ONE_CONSUMER_64), (2047, ONE_CONSUMER_64), (2048, WIDE_192), (4095, WIDE_192), (4096, (128, 192, 12))],
     [(2047, ONE_CONSUMER_64), (2048, WIDE_192), (8191, WIDE_192), (8192, (128, 192, 12))]),
    (32, [(100, ONE_CONSUMER_64), (3000, WIDE_192), (5000, (128, 192, 12))],
     [(100, ONE_CONSUMER_64), (5000, WIDE_192), (9000, (128, 192, 12))]),
    (128, [(4095, (128, 128, 12)), (4096, (128, 176, 12))], [(8191, (128, 128, 12)), (8192, (128, 176, 12))]),
    (256, [(2047, (128, 64, 12)), (2048, (128, 80, 12))], None),
])
def test_hopper_forward_tile_by_key_count(d, full, causal):
    """_TILES_BY_KEYS: the tile of a key count, without and with the causal mask (None: as without), varlen too;
    the base tile with a window, a score modifier, dropout, a KV cache, or off Hopper; every tile gated."""
    def tile(variant, seqlen_k, cc=90, dtype="bfloat16"):
        cfg = config.choose_forward(dtype, d, variant, seqlen_k=seqlen_k, compute_capability=cc)
        return cfg.block_m, cfg.block_n, cfg.warps

    gated = config.all_configs()
    for variant, steps in ((0, full), (config.VARLEN, full), (config.LOCAL, causal or full)):
        for seqlen_k, expected in steps:
            assert tile(variant, seqlen_k) == expected, (variant, seqlen_k)
            cfg = config.choose_forward("float16", d, variant, seqlen_k=seqlen_k, compute_capability=90)
            assert cfg in gated, cfg
    base = config._TILES["flash_fwd_sm90"][config.compiled_head_dim(d, sorted(config._TILES["flash_fwd_sm90"]))]
    for variant in (config.LOCAL | config.WINDOW, config.SOFTCAP, config.ALIBI, config.DROPOUT, config.SEQUSED,
                    config.SEQUSED | config.PAGED):
        for seqlen_k, _ in full:
            assert tile(variant, seqlen_k) == base, (variant, seqlen_k)
    assert tile(0, 1 << 20, cc=80)[1] not in (176, 192, 80)


def test_one_consumer_blocks_take_half_an_sm():
    """flash_fwd_sm90 with one consumer: two blocks an SM, each its half of the shared memory (Sm90FwdSmem)."""
    one = config.KernelConfig("flash_fwd_sm90", "bfloat16", 64, 64, 128, 8, 0)
    two = dataclasses.replace(one, block_m=128, warps=12)
    assert (config.sm90_blocks_per_sm(one), config.sm90_blocks_per_sm(two)) == (2, 1)
    assert 2 * (one.smem_bytes + 1024) <= config.SM90_SMEM_PER_SM < 2 * (two.smem_bytes + 1024)
    assert (config.sm90_stages(one), config.sm90_stages(two)) == (3, 4)


def test_paged_boxes_tile_the_key_blocks():
    """flash_fwd_sm90 on a paged cache: boxes of the largest power of two dividing the page size and the key
    block, so that whole boxes tile a block and none crosses a page."""
    cfg = config.choose_forward("bfloat16", 128, config.SEQUSED | config.PAGED, compute_capability=90)
    for page_size, rows in ((16, 16), (48, 16), (64, 64), (96, 32), (256, cfg.block_n), (1024, cfg.block_n)):
        got = config.kv_box_rows(cfg, page_size)
        assert got == rows and cfg.block_n % got == 0 and page_size % got == 0, (page_size, got)


def test_frozen_and_hashable():
    c = config.choose_forward("float16", 64, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_m = 1
    assert len({c, config.choose_forward("float16", 64, False)}) == 1


def test_backward_configs():
    pre, dkdv, dq = config.choose_backward("float64", 96, config.LOCAL)
    assert (pre.kernel, dkdv.kernel, dq.kernel) == ("flash_bwd_preprocess", "flash_bwd_dkdv_simt", "flash_bwd_dq_simt")
    pre, main, post = config.choose_backward("bfloat16", 96, config.LOCAL | config.SOFTCAP | config.VARLEN)
    assert (main.kernel, post.kernel) == ("flash_bwd", "flash_bwd_postprocess")
    assert main.variant == config.LOCAL | config.SOFTCAP | config.VARLEN
    assert pre.variant == post.variant == config.VARLEN  # the per-row kernels take the varlen bit alone
    # DETERMINISTIC: the tensor-core kernel's, dropped by the forward and the SIMT kernels (deterministic anyway)
    assert config.choose_backward("float16", 64, config.DETERMINISTIC)[1].variant == config.DETERMINISTIC
    assert config.choose_backward("float32", 64, config.DETERMINISTIC)[1].variant == 0
    assert config.choose_forward("float16", 64, config.DETERMINISTIC).variant == 0


def test_small_grids_take_the_small_backward_tile():
    """flash_bwd takes _TILES_SMALL_GRID's tile where its grid (batch * nheads_k key blocks per head) has
    fewer blocks than half the SMs, and never for the HEAVY variants or the SIMT kernels."""
    big = config.choose_backward("bfloat16", 128, config.LOCAL)[1]
    assert (big.block_m, big.block_n, big.warps) == (64, 128, 8)
    small = config.choose_backward("bfloat16", 128, config.LOCAL, key_slabs=16, seqlen_k=512, sms=132)[1]
    assert (small.block_m, small.block_n, small.warps, small.variant) == (64, 64, 4, config.LOCAL)
    assert config.choose_backward("bfloat16", 128, config.LOCAL, key_slabs=16, seqlen_k=1024, sms=132)[1] == big
    heavy = config.choose_backward("float16", 128, config.ALIBI)[1]
    assert config.choose_backward("float16", 128, config.ALIBI, key_slabs=1, seqlen_k=64, sms=132)[1] == heavy
    simt = config.choose_backward("float32", 64, 0)[1]
    assert config.choose_backward("float32", 64, 0, key_slabs=1, seqlen_k=64, sms=132)[1] == simt
    assert small in config.all_configs()  # compiled by `cuflash compile`, checked by the compile gate


def test_semaphores_cover_every_query_block():
    """flash_bwd uses semaphore m_block of (entry, head); preprocess block i zeroes semaphore i, so flash_bwd's
    block_m must be a multiple of SEMAPHORE_ROWS (its blocks are then no more than the preprocess's)."""
    for dt in config.TENSOR_CORE_DTYPES:
        for d in config.HEAD_DIMS:
            for v in config.GATED_VARIANTS:
                pre, main, _ = config.choose_backward(dt, d, v)
                assert pre.block_m == config.SEMAPHORE_ROWS and main.block_m % config.SEMAPHORE_ROWS == 0


def test_preprocess_is_one_kernel_per_dtype():
    """D = rowsum(dO * O) takes no head dim, key tile or mask: every dense backward call of a dtype shares
    it, and every varlen one another."""
    for dt in config.DTYPES:
        for varlen in (0, config.VARLEN):
            pres = {config.choose_backward(dt, d, v | varlen)[0] for d in range(8, 257, 8)
                    for v in range(config.VARLEN)}
            assert len(pres) == 1, pres
        assert len([c for c in config.all_configs() if c.kernel == "flash_bwd_preprocess" and c.dtype == dt]) == 2
    pre = config.choose_backward("float16", 128, config.LOCAL)[0]
    assert pre.template_name == "cuflash::flash_bwd_preprocess<__half, 64, 16, 0>"
    assert (pre.head_dim, pre.block_n, pre.variant, pre.smem_bytes) == (0, 0, 0, 0)


def test_template_names_match_the_kernels_template_parameters():
    """Each __global__ kernel's template parameter list, read from kernels_cu/, is TEMPLATE_PARAMS[kernel]
    (T -> dtype, kHeadDim -> head_dim, ...), and template_name gives one argument per parameter."""
    fields = {"T": "dtype", "kHeadDim": "head_dim", "kBlockM": "block_m", "kBlockN": "block_n",
              "kNWarps": "warps", "kVariant": "variant"}
    args = r"\((?:[^()]|\([^()]*\))*\)"  # an attribute's arguments, one level of parentheses inside
    kernel_re = re.compile(rf"template <([^>]*)>\s*__global__ void (?:__cluster_dims__{args}\s*)?__launch_bounds__{args}"
                           r"\s*(\w+)\(")
    found = {}
    for source in set(config.SOURCES.values()):
        for params, name in kernel_re.findall((_compile.kernels_dir() / source).read_text()):
            found[name] = tuple(fields[p.split()[-1]] for p in params.split(","))
    assert set(found) == set(config.SOURCES)
    assert found == config.TEMPLATE_PARAMS
    for c in config.all_configs():
        args = c.template_name.removeprefix(f"cuflash::{c.kernel}<").removesuffix(">").split(", ")
        assert len(args) == len(config.TEMPLATE_PARAMS[c.kernel]), c.template_name


def test_all_configs_are_distinct_instantiations():
    names = [c.template_name for c in config.all_configs()]
    assert len(names) == len(set(names))


def test_all_configs_cover_every_choice():
    cfgs = set(config.all_configs())
    for dt in config.DTYPES:
        for d in range(8, 257, 8):
            for causal in (False, True):
                assert config.choose_forward(dt, d, causal) in cfgs
                assert set(config.choose_backward(dt, d, causal)) <= cfgs


def test_tiles_are_consistent():
    for c in config.all_configs():
        assert c.block_m % 16 == 0 and c.block_n % 16 == 0 or c.kernel.endswith("simt"), c
        assert c.threads <= 1024 and c.smem_bytes >= 0
        assert c.smem_bytes <= config.SMEM_LIMIT[int(c.arch[:2]) if c.arch else 80], c


def test_hopper_forward_choice():
    """flash_fwd_sm90 serves every 16-bit call (dense, varlen, KV caches dense or paged) on compute capability
    9.0 only; kernel_family forces a family."""
    on_h100 = lambda dt, v=0: config.choose_forward(dt, 128, v, compute_capability=90)  # noqa: E731
    assert on_h100("bfloat16").kernel == "flash_fwd_sm90" and on_h100("bfloat16").family == "sm90"
    assert on_h100("float32").family == "simt"
    assert config.choose_forward("bfloat16", 128, 0, compute_capability=80).family == "mma"
    assert on_h100("float16", config.VARLEN | config.LOCAL).family == "sm90"
    for v in (config.SEQUSED | config.SOFTCAP, config.SEQUSED | config.PAGED, config.KVCACHE_VARIANTS):
        assert on_h100("float16", v).family == "sm90", v
    assert config.choose_forward("float16", 96, 0, compute_capability=90).head_dim == 128  # whole 64-column slabs
    assert config.choose_forward("float16", 200, 0, compute_capability=90).head_dim == 256
    assert config.choose_forward("bfloat16", 128, 0, compute_capability=90, family="mma").family == "mma"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        config.choose_forward("bfloat16", 128, 0, compute_capability=80, family="sm90")
    with config.kernel_family("mma"):
        assert config.forced_family() == "mma"
    assert config.forced_family() is None
    with pytest.raises(ValueError, match="kernel family"):
        with config.kernel_family("simd"):
            pass


def test_hopper_backward_choice(monkeypatch):
    """flash_bwd_sm90 is the middle launch of 16-bit backwards on compute capability 9.0, every head dim,
    deterministic or not, every variant, varlen too (built by NVRTC 13 or newer) but for varlen with ALiBi
    and dropout together. The rest run flash_bwd."""
    monkeypatch.setattr(_compile, "nvrtc_major", lambda: 13)
    def main(dt="bfloat16", d=128, v=0, cc=90, **kw):
        return config.choose_backward(dt, d, v, compute_capability=cc, **kw)[1]

    pre, mid, post = config.choose_backward("float16", 128, config.LOCAL, compute_capability=90)
    assert (pre.kernel, mid.kernel, post.kernel) == ("flash_bwd_preprocess", "flash_bwd_sm90", "flash_bwd_postprocess")
    assert mid.family == "sm90" and mid.arch == "90a" and mid.threads == 384
    assert main(d=40).head_dim == 64 and main(d=96).head_dim == 128  # whole 64-column slabs
    assert main(d=64, v=config.SOFTCAP | config.DROPOUT).family == "sm90"
    assert main(v=config.SOFTCAP | config.ALIBI | config.DROPOUT).family == "sm90"
    assert main(v=config.DETERMINISTIC | config.LOCAL).variant == config.DETERMINISTIC | config.LOCAL
    assert main(d=64, v=config.DETERMINISTIC).family == "sm90" and main(v=config.DROPOUT).family == "sm90"
    assert main(v=config.VARLEN | config.LOCAL).family == "sm90"
    assert main(d=64, v=config.VARLEN | config.SOFTCAP | config.ALIBI | config.DETERMINISTIC).family == "sm90"
    for d, v in ((128, config.VARLEN | config.ALIBI | config.DROPOUT), (64, config.ALL_VARIANTS)):
        assert main(d=d, v=v).kernel == "flash_bwd", (d, v)
    assert main(cc=80).kernel == "flash_bwd" and main(family="mma").kernel == "flash_bwd"
    assert main("float32").family == "simt"
    with pytest.raises(ValueError, match="sm90 kernel family cannot serve this backward"):
        main(v=config.VARLEN | config.ALIBI | config.DROPOUT, family="sm90")
    # NVRTC 12.9 builds the varlen Hopper backward with spills: varlen runs on flash_bwd there, dense does not
    monkeypatch.setattr(_compile, "nvrtc_major", lambda: 12)
    assert main(v=config.VARLEN | config.LOCAL).kernel == "flash_bwd" and main(v=config.LOCAL).family == "sm90"
    # block_m / 64 * head_dim / 64 dQ tiles of 64 x 64: one per consumer
    for d in (64, 128):
        c = main(d=d)
        assert c.block_n == 64 * (c.warps // 4 - 1) and (c.block_m // 64) * (d // 64) == c.warps // 4 - 1
        assert c.smem_bytes <= config.SMEM_LIMIT[90]
    # d = 256 (and 160-224, padded to it): split dims, two consumers sharing 64 keys, deterministic too
    for d in (160, 256):
        c = main(d=d, v=config.DETERMINISTIC | config.SOFTCAP)
        assert (c.kernel, c.head_dim, c.block_m, c.block_n, c.warps) == ("flash_bwd_sm90", 256, 64, 64, 12)
        assert c.smem_bytes <= config.SMEM_LIMIT[90]


def test_small_hopper_backward_grids_split_query_blocks():
    """QUERY_SPLIT where flash_bwd_sm90's grid fits one wave twice over, or once under a causal mask (whose first
    key blocks visit every query block: the longest path halves); never deterministic, never a larger grid."""
    def main(v=0, blocks=1, **kw):  # blocks: batch * nheads_k * key blocks of 128
        return config.choose_backward("bfloat16", 128, v, key_slabs=blocks, seqlen_k=128, sms=132,
                                      compute_capability=90, **kw)[1]

    split = lambda c: bool(c.variant & config.QUERY_SPLIT)  # noqa: E731
    assert split(main(blocks=66)) and not split(main(blocks=67))
    assert split(main(config.LOCAL, blocks=132)) and not split(main(config.LOCAL, blocks=133))
    assert split(main(config.LOCAL | config.SOFTCAP | config.DROPOUT, blocks=8))
    # a sliding window's blocks are alike: split only where twice as many fit one wave
    assert split(main(config.LOCAL | config.WINDOW, blocks=66))
    assert not split(main(config.LOCAL | config.WINDOW, blocks=100))
    assert not split(main(config.QUERY_SPLIT, blocks=1000))  # a caller's bit is dropped
    assert not split(main(config.DETERMINISTIC, blocks=8)) and not split(main(config.LOCAL | config.DETERMINISTIC))
    assert not split(config.choose_backward("bfloat16", 128, 0, compute_capability=90)[1])  # no grid given
    assert main(family="mma", blocks=8).kernel == "flash_bwd"
    assert config.choose_forward("bfloat16", 128, config.QUERY_SPLIT, compute_capability=90).variant == 0
    # d = 256 splits its head dim over the consumers instead: never a cluster
    assert not split(config.choose_backward("bfloat16", 256, config.LOCAL, key_slabs=1, seqlen_k=64, sms=132,
                                            compute_capability=90)[1])


def test_wide_smem_backward_on_hopper():
    """flash_bwd on compute capability 9.0 takes WIDE_SMEM where sm_80's shared memory holds one buffer of Q and dO
    (d >= 224): two buffers in sm_90's, built for sm_90 alone; nowhere else, and a caller's bit is dropped."""
    def main(d, v=config.LOCAL, cc=90):
        return config.choose_backward("bfloat16", d, v, compute_capability=cc, family="mma")[1]

    for d in (224, 256):
        for v in (0, config.LOCAL, config.DETERMINISTIC, config.SOFTCAP | config.DROPOUT | config.VARLEN):
            wide, narrow = main(d, v), main(d, v, cc=80)
            assert wide.variant == narrow.variant | config.WIDE_SMEM and not narrow.variant & config.WIDE_SMEM
            assert config.flash_bwd_layout(narrow)[1] == 1 and config.flash_bwd_layout(wide)[1] == 2
            assert config.SMEM_LIMIT[80] < wide.smem_bytes <= config.SMEM_LIMIT[90]
            assert (wide.arch, narrow.arch) == ("90", None)
            assert wide in config.all_configs() or v not in config.GATED_VARIANTS
        assert main(d, config.ALL_VARIANTS) in config.all_configs()
    for d in (32, 64, 128, 192):  # two buffers within sm_80's already: the same config on both
        assert main(d) == main(d, cc=80) and config.flash_bwd_layout(main(d))[1] == 2
    assert main(256, config.WIDE_SMEM, cc=80).variant == 0
    # runs_on: where the dispatcher can return each (the compile gate builds a config for those targets alone)
    for d in (224, 256, 128):
        wide, narrow = main(d), main(d, cc=80)
        assert narrow.runs_on(80) and narrow.runs_on(86) and narrow.runs_on(90) == (wide == narrow)
        assert wide.runs_on(90) and wide.runs_on(80) == (wide == narrow)
    assert config.choose_backward("bfloat16", 256, 0, compute_capability=90)[1].kernel == "flash_bwd_sm90"
    assert config.choose_forward("bfloat16", 256, config.WIDE_SMEM, compute_capability=90).variant == 0


def test_backward_grid():
    """(nheads_k [x2 split], key blocks, batch), and (nheads_k, batch, key blocks) when deterministic: the order
    backward.cuh's backward_block reads, for flash_bwd and flash_bwd_sm90 alike."""
    for kernel, v in (("flash_bwd", 0), ("flash_bwd_sm90", 0), ("flash_bwd_sm90", config.LOCAL)):
        cfg = config.KernelConfig(kernel, "bfloat16", 128, 64, 128, 8 if kernel == "flash_bwd" else 12, v)
        det = dataclasses.replace(cfg, variant=v | config.DETERMINISTIC)
        assert config.backward_grid(cfg, 4, 1000, 3) == (4, 8, 3)  # ceil(1000 / 128) key blocks
        assert config.backward_grid(det, 4, 1000, 3) == (4, 3, 8)
    split = config.KernelConfig("flash_bwd_sm90", "bfloat16", 128, 64, 128, 12, config.QUERY_SPLIT)
    assert config.backward_grid(split, 4, 128, 2) == (8, 1, 2)


def test_longest_first_is_causal_without_a_window():
    """The forward and dQ grids run query blocks last to first only for a causal mask (mask.cuh
    query_block): a window's blocks are alike, and in the mma.sync and SIMT kernels the heavy variants have no
    registers to spare; the Hopper forward takes them too."""
    lf = config.longest_first
    for hopper in (False, True):
        assert lf(config.LOCAL, hopper) and lf(config.LOCAL | config.VARLEN, hopper)
        assert not lf(0, hopper) and not lf(config.VARLEN, hopper) and not lf(config.LOCAL | config.WINDOW, hopper)
    for bit in (config.SOFTCAP, config.ALIBI, config.DROPOUT, config.SOFTCAP | config.ALIBI | config.DROPOUT):
        assert not lf(config.LOCAL | bit), bit
        assert lf(config.LOCAL | bit, hopper=True), bit
    assert not lf(config.ALIBI | config.DROPOUT, hopper=True)


def test_decode_choice():
    """flash_decode serves 16-bit KV-cache calls of up to DECODE_MAX_ROWS packed rows (more with num_splits > 1),
    not ALiBi, fp32 / fp64 or a forced sm90 family; its combine is one config per (dtype, head dim)."""
    seq = config.variant_bits(seqused=True)
    main, combine = config.choose_decode("bfloat16", 100, seq, packed_rows=4)
    assert (main.kernel, main.head_dim, main.block_m, main.block_n, main.warps, main.variant) == (
        "flash_decode", 128, 16, 64, 4, seq)
    assert config.choose_decode("bfloat16", 64, seq, packed_rows=4)[0].block_n == 128
    assert (combine.kernel, combine.head_dim, combine.warps) == ("flash_decode_combine", 128, 4)
    assert combine.template_name == "cuflash::flash_decode_combine<__nv_bfloat16, 128, 4>"
    assert main.family == "mma" and combine.smem_bytes == 0
    assert config.choose_decode("float16", 64, config.variant_bits(local=True, softcap=True, paged=True),
                                packed_rows=64) is not None
    for dtype, bits, rows, splits, family in (("float32", seq, 1, 0, None), ("bfloat16", seq | config.ALIBI, 1, 0, None),
                                               ("bfloat16", seq, 65, 0, None), ("bfloat16", seq, 65, 1, None),
                                               ("bfloat16", seq, 1, 0, "sm90")):
        assert config.choose_decode(dtype, 64, bits, packed_rows=rows, num_splits=splits, family=family) is None
    assert config.choose_decode("bfloat16", 64, seq, packed_rows=65, num_splits=2) is not None
    assert config.choose_decode("bfloat16", 64, seq, packed_rows=1, family="mma") is not None
    # a device without the shared memory (sm_86 / sm_89: 99 KiB) keeps flash_fwd
    assert config.choose_decode("bfloat16", 128, seq, packed_rows=1, smem_limit=config.SMEM_LIMIT[90]) is not None
    assert config.choose_decode("bfloat16", 128, seq, packed_rows=1, smem_limit=config.SMEM_LIMIT[86]) is None
    # stages: 3 where the block fits in sm_80's shared memory (d <= 192), else 2; smem as flash_decode.cu lays it out
    for d in config.HEAD_DIMS:
        cfg = config.choose_decode("float16", d, seq, packed_rows=1)[0]
        assert config.decode_stages(cfg) == (3 if d <= 192 else 2)
        ring_pitch = -(-d // 64) * 64  # K and V rows: 128-byte multiples (the swizzled ring)
        assert config.decode_ring_pitch(d) == ring_pitch
        assert cfg.smem_bytes == (16 * (d + 8) + 2 * config.decode_stages(cfg) * cfg.block_n * ring_pitch) * 2 \
            <= config.SMEM_LIMIT[80]


def _kernel_constants(filename: str, exprs: list[str]) -> list[int]:
    """The values of constant expressions in kernels_cu/<filename>'s scope, read back from a probe kernel
    compiled with the file's source (NVRTC, to PTX; the Hopper kernels' for compute_90a, the target of their
    __cluster_dims__)."""
    pytest.importorskip("cuda.bindings")
    from test_params import _ptx

    body = "\n".join(f"    out[{i}] = {e};" for i, e in enumerate(exprs))
    src = _compile.source_text(filename) + f"\n__global__ void probe(volatile int* out) {{\n{body}\n}}\n"
    ptx = _ptx(src, *(f"-I{d}" for d in _compile._cuda_include_dirs()),
               arch="compute_90a" if filename.endswith("_sm90.cu") else "compute_80")
    regs = dict(re.findall(r"mov\.u32\s+(%r\d+),\s*(\d+);", ptx))
    got = {int(off or 0) // 4: int(regs.get(v, v)) for off, v in
           re.findall(r"st\.volatile\.global\.u32\s+\[%rd\d+(?:\+(\d+))?\],\s*(%r\d+|\d+);", ptx)}
    assert len(got) == len(exprs), ptx[-2000:]
    return [got[i] for i in range(len(exprs))]


def test_decode_stages_match_the_kernel():
    """config.decode_stages and decode_ring_pitch (and so smem_bytes) are flash_decode.cu's: a kernel launched
    with less shared memory than its own layout traps."""
    tiles = [(d, bn) for d in config.HEAD_DIMS for bn in (64, 128)]
    got = _kernel_constants("flash_decode.cu", [f"cuflash::decode_stages({d}, {bn})" for d, bn in tiles] +
                            [f"cuflash::decode_ring_pitch({d})" for d in config.HEAD_DIMS])
    for (d, bn), stages in zip(tiles, got):
        cfg = config.KernelConfig("flash_decode", "float16", d, 16, bn, 4, config.SEQUSED)
        assert stages == config.decode_stages(cfg) in (2, 3), (d, bn)
    assert got[len(tiles):] == [config.decode_ring_pitch(d) for d in config.HEAD_DIMS]
    assert _kernel_constants("flash_decode.cu", ["cuflash::kMaxSplits"]) == [config.MAX_SPLITS]


def test_flash_bwd_layout_matches_the_kernel():
    """config.flash_bwd_layout (and so smem_bytes) of every flash_bwd config, WIDE_SMEM's included, is the kernel's
    FlashBwdLayout (kBytes, kStages: the kernel traps with less); the budgets and the bits are config's."""
    cfgs = [c for c in config.all_configs() if c.kernel == "flash_bwd"]
    assert any(c.variant & config.WIDE_SMEM for c in cfgs)
    layout = "cuflash::FlashBwdLayout<{c.head_dim}, {c.block_m}, {c.block_n}, {c.warps}, {c.variant}>::"
    exprs = [layout.format(c=c) + field for c in cfgs for field in ("kBytes", "kStages")]
    got = _kernel_constants("flash_bwd.cu", exprs + ["cuflash::kSmemPortable", "cuflash::kSmemSm90",
                                                     "cuflash::kWideSmem", "cuflash::kQuerySplit"])
    for i, c in enumerate(cfgs):
        assert (got[2 * i], got[2 * i + 1]) == config.flash_bwd_layout(c), c
    assert got[-4:] == [config.SMEM_LIMIT[80], config.SMEM_LIMIT[90], config.WIDE_SMEM, config.QUERY_SPLIT]


@pytest.mark.parametrize("kernel,layout", [("flash_fwd_sm90", "Sm90FwdSmem<{d}, {bm}, {bn}>"),
                                           ("flash_bwd_sm90", "Sm90BwdSmem<{d}, {bm}, {bn}, 2, {dq}>")])
def test_sm90_smem_matches_the_kernel(kernel, layout):
    """config.smem_bytes of each Hopper tile is the kernel's own layout's kBytes (the kernel traps with less)."""
    cfgs = {(c.head_dim, c.block_m, c.block_n, config.sm90_dq_buffers(c)): c
            for c in config.all_configs() if c.kernel == kernel}
    exprs = [f"cuflash::{layout.format(d=d, bm=bm, bn=bn, dq=dq)}::kBytes" for d, bm, bn, dq in cfgs]
    for cfg, kbytes in zip(cfgs.values(), _kernel_constants(f"{kernel}.cu", exprs)):
        assert cfg.smem_bytes == kbytes <= config.SMEM_LIMIT[90], cfg


def test_dq_swizzle_matches_the_kernels():
    """The swizzle backward_launches sets for flash_bwd_sm90 (which traps on another), and what it does: chunks of 8
    columns trade places within their row's groups of 32 (the postprocess reads them back)."""
    expr = ["cuflash::kDqSwizzleSm90"] + [f"cuflash::dq_accum_col({r}, {c}, 3)" for r in range(4) for c in (0, 8, 37)]
    got = _kernel_constants("flash_bwd_sm90.cu", expr)
    assert got[0] == config.DQ_SWIZZLE_SM90
    assert got[1:] == [c ^ (8 * r) for r in range(4) for c in (0, 8, 37)]


@pytest.mark.parametrize("tiles,key_blocks,sms,page_size,want", [
    (8, 2048, 132, 0, 16),  # B=1, 8 kv heads, 131k keys: 128 blocks, within 95 % of 264 (two full rounds)
    (64, 512, 132, 0, 2),  # B=8, 8 kv heads: 128 blocks
    (512, 64, 132, 0, 1),  # B=64: four rounds already
    (128, 256, 132, 0, 1),  # 128 of 132 SMs busy: not split
    (8, 3, 132, 0, 3),  # never more splits than key blocks
    (0, 10, 132, 0, 1),
    (64, 512, 132, 64, 2),  # pages of 64 keys: as a dense cache
    (64, 512, 132, 16, 4),  # pages of 16: rounds of two blocks per SM, 256 of 264
    (8, 2048, 132, 16, 32),  # B=1, pages of 16: 256 blocks
    (128, 256, 132, 16, 2),  # 128 blocks leave half of the 264 slots idle: 2 splits, 256
    (512, 64, 132, 16, 1),  # two rounds of two already
])
def test_decode_splits(tiles, key_blocks, sms, page_size, want):
    assert config.decode_splits(tiles, key_blocks, sms, page_size) == want


def test_runs_on_is_where_the_dispatcher_returns_a_config():
    """Every gated config runs on some target; the Hopper kernels and WIDE_SMEM on 9.0 alone; a flash_bwd config the
    dispatcher replaces on 9.0 (one buffer in sm_80's shared memory) everywhere else."""
    for c in config.all_configs():
        on = {cc for cc in (80, 86, 89, 90) if c.runs_on(cc)}
        if c.arch:
            assert on == {90}, c
        elif c.kernel == "flash_bwd" and config.flash_bwd_layout(c)[1] == 1:
            assert on == {80, 86, 89}, c
            wide = config.choose_backward(c.dtype, c.head_dim, c.variant, compute_capability=90, family="mma")[1]
            assert wide != c and wide.variant == c.variant | config.WIDE_SMEM
        else:
            assert on == {80, 86, 89, 90}, c
