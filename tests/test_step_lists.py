"""The numbered step comments that tie the kernels, their Numba prototypes and the NumPy backend together.

C++ `// [N] text` and Python `# [N] text` lines are extracted in file order and compared: a reader can
hold kernels_cu/flash_fwd.cu and cuflash/proto/flash_fwd.py side by side and find the same steps, in
the same order, with the same words. The texts are the contract's (fixed); a missing file fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels_cu"
PROTO = ROOT / "cuflash" / "proto"

FWD_STEPS = [
    (1, "Block coordinates: m_block, head, batch; the mask gives the key blocks to visit"),
    (2, "Load the Q tile"),
    (3, "S = Q K^T"),
    (4, "Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window"),
    (5, "Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)"),
    (6, "O += dropout(P) V"),
    (7, "Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, "
        "LSE = -inf"),
    (8, "Store O and LSE"),
]
BWD_STEPS = [
    (1, "Preprocess: D = rowsum(dO * O); zero the dQ accumulator and semaphores"),
    (2, "Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit"),
    (3, "Load the Q, dO tiles and LSE, D rows of one query block"),
    (4, "Recompute S = Q K^T, score modifiers, mask, P = exp2(S * scale_log2 - LSE * log2(e))"),
    (5, "dV += P^T dO"),
    (6, "dP = dO V^T"),
    (7, "dS = P * (dP - D)"),
    (8, "dK += dS^T Q"),
    (9, "dQ_accum += dS K: fp32 atomic adds, in key-block order when deterministic"),
    (10, "Store dK * softmax_scale and dV"),
    (11, "Postprocess: dQ = dQ_accum * softmax_scale in the input dtype"),
]
# kernels_cu/flash_bwd_simt.cu (fp32, fp64; after flash_bwd.cu's preprocess): dQ in a kernel of its own, no
# accumulator, deterministic by construction.
SIMT_BWD_STEPS = [
    (2, "dK/dV block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit"),
    *BWD_STEPS[2:8],  # [3] .. [8], word for word
    (9, "Store dK * softmax_scale and dV"),
    (10, "dQ block coordinates: m_block, head, batch; the mask gives the key blocks to visit"),
    (11, "Recompute S, P and dS = P * (dO V^T - D) for one key block"),
    (12, "dQ += dS K"),
    (13, "Store dQ * softmax_scale"),
]
# kernels_cu/flash_fwd_sm90.cu (Hopper: a producer warpgroup, consumer warpgroups) and cuflash/proto/flash_fwd_sm90.py:
# flash_fwd.cu's steps [1], [4] and [7] word for word.
SM90_FWD_STEPS = [
    FWD_STEPS[0],
    (2, "Producer: the Q tile, then K and V of each key block into a free stage of the ring (TMA)"),
    (3, "S = Q K^T (wgmma from shared memory)"),
    FWD_STEPS[3],
    (5, "Online softmax: update row_max and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2); acc_o's "
        "rescale waits for P V"),
    (6, "O += dropout(P) V (wgmma, P from registers)"),
    FWD_STEPS[6],
    (8, "Store O and LSE: O through this warpgroup's own rows of sQ (its last S = Q K^T has completed)"),
]
# kernels_cu/flash_bwd_sm90.cu (Hopper; between flash_bwd.cu's preprocess [1] and postprocess [11]) and
# cuflash/proto/flash_bwd_sm90.py: flash_bwd.cu's steps [2] and [10] word for word.
SM90_BWD_STEPS = [
    BWD_STEPS[1],
    (3, "Producer: K and V, then the Q, dO tiles (TMA) and LSE, D rows of each query block into a free stage"),
    (4, "S^T = K Q^T and dP^T = V dO^T (wgmma from shared memory)"),
    (5, "Score modifiers, mask, P^T = exp2(S^T * scale_log2 - LSE * log2(e)), dropout"),
    (6, "dV += P^T dO (wgmma, P^T from registers)"),
    (7, "dS^T = P^T (dP^T - D)"),
    (8, "dK += dS^T Q (wgmma, dS^T from registers)"),
    (9, "dS into shared memory; dQ = dS K (wgmma) into sDqAcc, which the dQ warp adds into dQ_accum"),
    BWD_STEPS[9],
]
# kernels_cu/flash_decode.cu (flash_decode [1] .. [10], flash_decode_combine [11], [12]) and cuflash/proto/flash_decode.py
DECODE_STEPS = [
    (1, "Block coordinates: packed query block, split, kv head, batch; the mask gives the key blocks, the split its "
        "share"),
    (2, "Load the Q tile: packed row r is query row r / group of head head_k * group + r % group"),
    (3, "Each warp: its slice of the first key blocks into its own ring of stages"),
    (4, "Wait for this warp's slice of the key block; refill the stage freed by the previous one"),
    (5, "S = Q K^T"),
    (6, "Score modifier (softcap); mask the sequence tail, the causal diagonal and the window"),
    (7, "Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)"),
    (8, "O += P V"),
    (9, "Merge the warps: row max, row sum and O of each warp through shared memory"),
    (10, "Store O and LSE, or this split's partial O and LSE"),
    (11, "Combine: the largest partial LSE, the splits' weights exp(lse_s - max) and their sum"),
    (12, "O = sum_s weight_s O_s / sum; LSE = max + log(sum); a row no split saw gives O = 0, LSE = -inf"),
]
# kernels_cu/mask.cuh and cuflash/proto/mask.py: one step per rule of Mask and ScoreMod, in functions of
# the same names (the mma.sync layout walks of mma.cuh have no prototype and no step).
MASK_STEPS = [
    (1, "Keys a row sees: [col_lo(row), col_hi(row)), inside the sequence and the window"),
    (2, "Key blocks a query block visits: [lo, hi), those some row of the block sees (lo >= hi: none)"),
    (3, "Query blocks that see a key block: [lo, hi) (the backward's loop)"),
    (4, "Does a tile hold a score some row must not see? (it crosses seqlen_k, or a window edge)"),
    (5, "Score modifiers: q.k -> softcap * tanh(scale * q.k / softcap) - slope * |i' - j|."),
]
# kernels_cu/seqinfo.cuh and cuflash/proto/seqinfo.py
SEQINFO_STEPS = [
    (1, "Sequence lengths and first rows of this batch entry: dense, or from cu_seqlens"),
    (2, "Key row j of this batch entry: dense, or through the page table"),
]
# kernels_cu/dropout.cuh and cuflash/proto/dropout.py (for_each_keep_t, the S^T walk, has no step)
DROPOUT_STEPS = [
    (1, "Draws: the 4 words of one Philox call, tile (row / 16, col / 16), lane (g, t)"),
    (2, "Keep flag of one score (SIMT kernels): a whole Philox call for one draw"),
    (3, "Keep flags of a warp's tile in the mma.sync C layout, one call per 16 x 16 (forward)"),
]
# kernels_cu/softmax.cuh (OnlineSoftmax init / update / finalize) and cuflash/proto/softmax.py
# (softmax_init / softmax_update / softmax_finalize).
SOFTMAX_STEPS = [
    (1, "Start every row with row_max = -inf and row_sum = 0"),
    (2, "Row max of the key block, reduced over the row's threads: m = max(row_max, max_j S)"),
    (3, "Offset m * scale_log2 for exp2, or 0 for a row that has seen no key (its P is 0, never NaN)"),
    (4, "Rescale acc_o and row_sum by exp2((old row_max - new row_max) * scale_log2), difference first"),
    (5, "P = exp2(S * scale_log2 - offset) in place of S; add the row sums of P to row_sum"),
    (6, "Reduce row_sum over the row's threads"),
    (7, "O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); row_sum = 0 gives O = 0, LSE = -inf"),
]

_CPP = re.compile(r"^\s*//\s*\[(\d+)\]\s+(.*?)\s*$")
_PY = re.compile(r"^\s*#\s*\[(\d+)\]\s+(.*?)\s*$")


def steps(path: Path) -> list[tuple[int, str]]:
    """The (N, text) step comments of a file, in order. A missing file fails the calling test."""
    assert path.is_file(), f"{path.relative_to(ROOT)} does not exist"
    pattern = _CPP if path.suffix in (".cu", ".cuh") else _PY
    out = []
    for line in path.read_text().splitlines():
        m = pattern.match(line)
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def _fmt(lst):
    return "\n".join(f"  [{n}] {t}" for n, t in lst) or "  (none)"


def assert_same(a: Path, b: Path, *, drop=()):
    sa = [s for s in steps(a) if s[0] not in drop]
    sb = steps(b)
    assert sa, f"{a.relative_to(ROOT)} has no step comments"
    assert sa == sb, (f"step comments differ\n{a.relative_to(ROOT)}:\n{_fmt(sa)}\n"
                      f"{b.relative_to(ROOT)}:\n{_fmt(sb)}")


@pytest.mark.parametrize("path,expected", [
    (KERNELS / "flash_fwd.cu", FWD_STEPS),
    (KERNELS / "flash_fwd_simt.cu", FWD_STEPS),
    (PROTO / "flash_fwd.py", FWD_STEPS),
    (KERNELS / "flash_fwd_sm90.cu", SM90_FWD_STEPS),
    (PROTO / "flash_fwd_sm90.py", SM90_FWD_STEPS),
    (KERNELS / "flash_bwd.cu", BWD_STEPS),
    (KERNELS / "flash_bwd_sm90.cu", SM90_BWD_STEPS),
    (PROTO / "flash_bwd_sm90.py", SM90_BWD_STEPS),
    (KERNELS / "flash_bwd_simt.cu", SIMT_BWD_STEPS),
    (PROTO / "flash_bwd.py", BWD_STEPS),
    (KERNELS / "flash_decode.cu", DECODE_STEPS),
    (PROTO / "flash_decode.py", DECODE_STEPS),
    (KERNELS / "mask.cuh", MASK_STEPS),
    (PROTO / "mask.py", MASK_STEPS),
    (KERNELS / "softmax.cuh", SOFTMAX_STEPS),
    (PROTO / "softmax.py", SOFTMAX_STEPS),
    (KERNELS / "seqinfo.cuh", SEQINFO_STEPS),
    (PROTO / "seqinfo.py", SEQINFO_STEPS),
    (KERNELS / "dropout.cuh", DROPOUT_STEPS),
    (PROTO / "dropout.py", DROPOUT_STEPS),
], ids=lambda x: x.name if isinstance(x, Path) else "")
def test_contract_steps(path, expected):
    """Every kernel file carries exactly the contract's steps, each once, in order."""
    assert expected, "an empty expected list would pass for a file without steps"
    got = steps(path)
    assert got, f"{path.relative_to(ROOT)} has no step comments"
    assert got == expected, f"{path.relative_to(ROOT)}:\n{_fmt(got)}\nexpected:\n{_fmt(expected)}"


@pytest.mark.parametrize("cpp,py", [
    ("flash_fwd.cu", "flash_fwd.py"),
    ("flash_fwd_sm90.cu", "flash_fwd_sm90.py"),
    ("flash_bwd_sm90.cu", "flash_bwd_sm90.py"),
    ("flash_bwd.cu", "flash_bwd.py"),
    ("flash_decode.cu", "flash_decode.py"),
    ("mask.cuh", "mask.py"),
    ("softmax.cuh", "softmax.py"),
    ("seqinfo.cuh", "seqinfo.py"),
    ("dropout.cuh", "dropout.py"),
])
def test_prototype_mirrors_kernel(cpp, py):
    assert_same(KERNELS / cpp, PROTO / py)


def test_simt_forward_mirrors_tensor_core_forward():
    assert_same(KERNELS / "flash_fwd.cu", KERNELS / "flash_fwd_simt.cu")


def test_simt_backward_shares_the_tensor_core_steps():
    """flash_bwd_simt.cu's dK/dV kernel takes flash_bwd.cu's steps [3] to [8] word for word."""
    shared = [s for s in steps(KERNELS / "flash_bwd.cu") if 3 <= s[0] <= 8]
    assert shared and shared == [s for s in steps(KERNELS / "flash_bwd_simt.cu") if 3 <= s[0] <= 8]


def test_sm90_forward_shares_the_tensor_core_steps():
    """flash_fwd_sm90.cu takes flash_fwd.cu's steps [1], [4] and [7] word for word."""
    shared = [s for s in steps(KERNELS / "flash_fwd.cu") if s[0] in (1, 4, 7)]
    assert len(shared) == 3 and shared == [s for s in steps(KERNELS / "flash_fwd_sm90.cu") if s[0] in (1, 4, 7)]


def test_sm90_backward_shares_the_tensor_core_steps():
    """flash_bwd_sm90.cu takes flash_bwd.cu's steps [2] and [10] word for word."""
    shared = [s for s in steps(KERNELS / "flash_bwd.cu") if s[0] in (2, 10)]
    assert len(shared) == 2 and shared == [s for s in steps(KERNELS / "flash_bwd_sm90.cu") if s[0] in (2, 10)]


def test_numpy_backend_steps_are_a_subsequence():
    """cuflash/backends/numpy.py may skip steps (it has no tiles to load) but not reorder or reword."""
    ref = steps(KERNELS / "flash_fwd.cu") + steps(KERNELS / "flash_bwd.cu")
    got = steps(ROOT / "cuflash" / "backends" / "numpy.py")
    assert got, "cuflash/backends/numpy.py has no step comments"
    it = iter(ref)
    missing = [s for s in got if s not in it]  # consumes `it`: an in-order subsequence test
    assert not missing, f"not in order in flash_fwd.cu + flash_bwd.cu:\n{_fmt(missing)}\nnumpy.py:\n{_fmt(got)}"


def test_prototype_mma_markers():
    """Each tensor-core MMA of the kernels is a per-thread FMA loop marked `# CUDA: mma.sync`."""
    for name, at_least in (("flash_fwd.py", 2), ("flash_bwd.py", 6), ("flash_decode.py", 2)):
        n = (PROTO / name).read_text().count("# CUDA: mma.sync")
        assert n >= at_least, f"{name}: {n} `# CUDA: mma.sync` markers, expected >= {at_least}"


def test_sm90_prototype_names():
    """proto/flash_fwd_sm90.py keeps the kernel's names for its roles, barriers and pipeline pieces, and marks
    its two wgmma products (S = Q K^T, P V) as `# CUDA: wgmma` FMA loops."""
    cu = (KERNELS / "flash_fwd_sm90.cu").read_text()
    py = (PROTO / "flash_fwd_sm90.py").read_text()
    for name in ("producer", "consumer", "k_full", "v_full", "k_empty", "v_empty", "issue_s", "softmax_of",
                 "issue_pv", "release", "to_p_frag", "correction", "n_blocks", "n_block_end", "use"):
        assert re.search(rf"\b{name}\b", cu), f"flash_fwd_sm90.cu has no {name}"
        assert re.search(rf"\b{name}\b", py), f"proto/flash_fwd_sm90.py has no {name}"
    for name in ("issue_s", "softmax_of", "issue_pv", "release", "to_p_frag", "producer"):
        assert re.search(rf"^    def {name}\(", py, re.M), f"proto/flash_fwd_sm90.py defines no {name}"
    assert py.count("# CUDA: wgmma") >= 2


def test_sm90_backward_prototype_names():
    """proto/flash_bwd_sm90.py keeps the kernel's names for its roles, barriers and pipeline pieces, and marks
    its five wgmma products (S^T = K Q^T, dP^T = V dO^T, dV, dK, dQ) as `# CUDA: wgmma` FMA loops."""
    cu = (KERNELS / "flash_bwd_sm90.cu").read_text()
    py = (PROTO / "flash_bwd_sm90.py").read_text()
    for name in ("producer", "consumer", "kv_full", "q_full", "do_full", "q_empty", "do_empty", "n_it", "n_pairs",
                 "use", "phase", "m_block_first", "m_block_end", "wg_key0", "dq_row0", "dq_col0", "ds_tile",
                 "dcap_of", "dcap", "acc_dk", "acc_dv", "acc_dq", "lse_to_log2_offset", "sDqAcc"):
        assert re.search(rf"\b{name}\b", cu), f"flash_bwd_sm90.cu has no {name}"
        assert re.search(rf"\b{name}\b", py), f"proto/flash_bwd_sm90.py has no {name}"
    for name in ("q_full", "do_full", "q_empty", "do_empty", "producer"):
        assert re.search(rf"^    def {name}\(", py, re.M), f"proto/flash_bwd_sm90.py defines no {name}"
    assert py.count("# CUDA: wgmma") >= 5


def test_decode_prototype_names():
    """proto/flash_decode.py keeps the kernel's names for its coordinates, split arithmetic and merge, and defines
    both kernels under their names."""
    cu = (KERNELS / "flash_decode.cu").read_text()
    py = (PROTO / "flash_decode.py").read_text()
    for name in ("m_blocks", "m_block", "split", "head_k", "packed_rows", "row_lo", "row_hi", "n_lo", "n_hi",
                 "per_split", "n_begin", "n_count", "key0", "q_row", "acc_s", "acc_o", "sO", "sMax", "sSum",
                 "merged", "partial", "o_partial", "lse_partial", "rows", "idx"):
        assert re.search(rf"\b{name}\b", cu), f"flash_decode.cu has no {name}"
        assert re.search(rf"\b{name}\b", py), f"proto/flash_decode.py has no {name}"
    for name in ("flash_decode", "flash_decode_combine"):
        assert re.search(rf"^    def {name}\(", py, re.M), f"proto/flash_decode.py defines no {name}"


def test_prototype_mask_names():
    """proto/mask.py defines mask.cuh's rules under the same names."""
    cuh = (KERNELS / "mask.cuh").read_text()
    py = (PROTO / "mask.py").read_text()
    for name in ("col_lo", "col_hi", "visible", "n_block_range", "key_block_range", "m_block_range", "needs_mask",
                 "tile_needs_mask"):
        assert re.search(rf"\b{name}\s*\(", cuh), f"mask.cuh has no {name}"
        assert re.search(rf"^def {name}\(", py, re.M), f"proto/mask.py has no {name}"
