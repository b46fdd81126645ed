"""cuflash/_params.py mirrors kernels_cu/params.cuh byte for byte: the compiler checks every offset."""

import re

import numpy as np
import pytest

from cuflash import _compile, _params


def _fields(struct: str, dtype, prefix: str = "") -> list[tuple[str, int]]:
    """(C++ member path, byte offset) of every field, nested structs' fields included."""
    out = []
    for name, (sub, offset) in dtype.fields.items():
        out.append((f"{prefix}{name}", offset))
        if sub.fields:
            out += [(p, offset + o) for p, o in _fields(struct, sub, f"{prefix}{name}.")]
    return out


def _ptx(src: str, *options: str, arch: str = "compute_80") -> str:
    """PTX of src (for arch), options added to NVRTC's."""
    from cuda.bindings import nvrtc

    prog = _compile._check(nvrtc.nvrtcCreateProgram(src.encode(), b"probe.cu", 0, [], []))
    try:
        opts = [f"-arch={arch}".encode(), b"-std=c++17", *(o.encode() for o in options)]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _compile._check(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        _compile._check(nvrtc.nvrtcGetProgramLog(prog, log))
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        size = _compile._check(nvrtc.nvrtcGetPTXSize(prog))
        ptx = b" " * size
        _compile._check(nvrtc.nvrtcGetPTX(prog, ptx))
        return ptx.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_layouts_match_header():
    """The compiler's own offsets and sizes, read from a probe kernel's PTX: it stores each
    `&((T*)0)->field` (a constant after folding) to out[i] through a volatile pointer, so every
    store is a separate `st.volatile.global.u64 [out+8*i], value` (__builtin_offsetof would be
    simpler, but NVRTC 13.0 does not know it)."""
    pytest.importorskip("cuda.bindings")
    want = []
    for struct, dtype in (("FwdParams", _params.FWD_PARAMS), ("BwdParams", _params.BWD_PARAMS),
                          ("FwdSm90Params", _params.FWD_SM90_PARAMS), ("BwdSm90Params", _params.BWD_SM90_PARAMS),
                          ("DecodeParams", _params.DECODE_PARAMS), ("AppendParams", _params.APPEND_PARAMS)):
        want.append((f"sizeof({struct})", f"sizeof(cuflash::{struct})", dtype.itemsize))
        want += [(f"{struct}.{path}", f"(unsigned long long)&(((cuflash::{struct}*)0)->{path})", off)
                 for path, off in _fields(struct, dtype)]
    body = "\n".join(f"    out[{i}] = {expr};" for i, (_, expr, _) in enumerate(want))
    src = (_compile.source_text("params.cuh")
           + f"\n__global__ void cuflash_params_probe(volatile unsigned long long* out) {{\n{body}\n}}\n")
    ptx = _ptx(src)
    regs = {r: int(v) for r, v in re.findall(r"mov\.u64\s+(%rd\d+),\s*(\d+);", ptx)}
    got = {}
    for off, val in re.findall(r"st\.volatile\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", ptx):
        got[int(off or 0) // 8] = regs[val] if val.startswith("%") else int(val)
    assert len(got) == len(want), f"parsed {len(got)} stores of {len(want)} from the probe's PTX:\n{ptx}"
    bad = [f"{name}: header {got[i]}, _params.py {off}" for i, (name, _, off) in enumerate(want) if got[i] != off]
    assert not bad, "params.cuh and _params.py disagree:\n" + "\n".join(bad)


def test_field_count_matches_header():
    """Every field declared in the header is in the dtype (names and order)."""
    text = (_compile.kernels_dir() / "params.cuh").read_text()
    for struct, dtype in (("FwdParams", _params.FWD_PARAMS), ("BwdParams", _params.BWD_PARAMS),
                          ("FwdSm90Params", _params.FWD_SM90_PARAMS), ("BwdSm90Params", _params.BWD_SM90_PARAMS),
                          ("DecodeParams", _params.DECODE_PARAMS), ("AppendParams", _params.APPEND_PARAMS)):
        body = re.search(rf"struct {struct} \{{(.*?)\n\}};", text, re.S).group(1)
        body = re.sub(r"//[^\n]*", "", body)
        names = []
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            # drop the type (everything before the first name); names are separated by commas
            parts = [p.strip() for p in re.sub(r"^(const\s+)?(unsigned\s+)?(long long|\w+)\s*\**\s*", "", decl).split(",")]
            names += [p.lstrip("*").strip() for p in parts]
        assert names == list(dtype.names), f"{struct}: header {names} != dtype {list(dtype.names)}"


class _Dev:
    """A stand-in for a CuPy array: shape, strides, itemsize and a device pointer (no GPU needed)."""

    def __init__(self, shape, itemsize=2, ptr=4096):
        import math as _m

        self.shape, self.itemsize, self.ndim = tuple(shape), itemsize, len(shape)
        self.dtype = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}[itemsize]
        self.size = _m.prod(shape)
        st, acc = [], itemsize
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        self.strides = tuple(reversed(st))
        self.data = type("D", (), {"ptr": ptr})()

    def __getitem__(self, idx):  # x[None]: a leading axis of 1
        assert idx is None
        v = _Dev((1, *self.shape), self.itemsize, self.data.ptr)
        v.strides = (self.size * self.itemsize, *self.strides)
        return v


def test_variant_fields_are_packed():
    from cuflash import _params, _philox, config

    q, k = _Dev((2, 100, 4, 64)), _Dev((2, 120, 2, 64))
    lse = _Dev((2, 4, 100), 4)
    slopes = _Dev((2, 4), 4, ptr=8192)
    p = _params.fwd_params(q, k, k, q, lse, 0.125, True, window=(16, 3), softcap=5.0, alibi_slopes=slopes,
                           dropout_p=0.25, seed=2**40 + 3, offset=7)
    assert (int(p["window_left"]), int(p["window_right"])) == (16, 0)  # causal: right = 0
    assert float(p["softcap"]) == 5.0 and int(p["alibi_slopes"]) == 8192 and int(p["alibi_batch_stride"]) == 4
    assert int(p["seed"]) == 2**40 + 3 and int(p["offset"]) == 7
    assert int(p["dropout_threshold"]) == _philox.threshold(0.25) == 16384
    assert abs(float(p["dropout_scale"]) - 1 / 0.75) < 1e-6
    plain = _params.fwd_params(q, k, k, q, lse, 0.125, False)
    assert (int(plain["window_left"]), int(plain["window_right"])) == (_params.UNBOUNDED,) * 2
    assert int(plain["alibi_slopes"]) == 0 and int(plain["cu_seqlens_q"]) == 0
    assert _params.variant(True) == config.LOCAL and _params.variant(False) == 0
    assert _params.variant(True, None, window=(-1, 4)) == config.LOCAL  # causal folds it to (-1, 0)
    assert _params.variant(False, None, window=(-1, 4), softcap=1.0) == (config.LOCAL | config.WINDOW | config.SOFTCAP
                                                                          | config.BOUNDED)
    # BOUNDED: a softcap of at most BOUNDED_SOFTCAP without ALiBi
    cap = config.BOUNDED_SOFTCAP
    assert _params.variant(False, softcap=cap) == config.SOFTCAP | config.BOUNDED
    assert _params.variant(False, softcap=cap * 1.01) == config.SOFTCAP
    assert _params.variant(False, softcap=2.0, alibi_slopes=np.ones(2)) == config.SOFTCAP | config.ALIBI
    assert _params.variant(False, ("cu",), dropout_p=0.1) == config.DROPOUT | config.VARLEN


def test_varlen_params_are_packed():
    from cuflash import _params

    q, k, lse = _Dev((300, 4, 64)), _Dev((350, 2, 64)), _Dev((4, 300), 4)
    cu_q, cu_k = _Dev((4,), 4, ptr=111), _Dev((4,), 4, ptr=222)
    workspace = _Dev((1 << 20,), 1, ptr=1 << 20)
    p = _params.bwd_params(q[None], q[None], k[None], k[None], q[None], lse[None], q[None], k[None], k[None],
                           workspace, 0.125, False, (cu_q, cu_k, 200, 180), deterministic=True)
    f = p["fwd"]
    assert (int(f["batch"]), int(f["seqlen_q"]), int(f["seqlen_k"])) == (3, 200, 180)
    assert (int(f["cu_seqlens_q"]), int(f["cu_seqlens_k"])) == (111, 222)
    for name in ("q", "k", "v", "o", "lse"):
        assert int(f[f"{name}_batch_stride"]) == 0, name
    for name in ("do", "dq", "dk", "dv", "dsum", "dq_accum"):
        assert int(p[f"{name}_batch_stride"]) == 0, name
    assert int(f["q_row_stride"]) == 4 * 64 and int(f["lse_head_stride"]) == 300
    # the workspace: D [1, 4, 300] fp32, then the dQ accumulator [1, 4, 300, 64] fp32, then one semaphore per
    # (sequence, head, 64 rows of the longest sequence)
    assert int(p["dsum"]) == 1 << 20 and int(p["dsum_head_stride"]) == 300
    assert int(p["dq_accum_offset"]) == 4 * 300 * 4
    assert (int(p["dq_accum_head_stride"]), int(p["dq_accum_row_stride"])) == (300 * 64, 64)
    assert int(p["dq_semaphore_offset"]) == 4 * 300 * 4 + 4 * 300 * 64 * 4
    assert (int(p["dq_semaphore_batch_stride"]), int(p["dq_semaphore_head_stride"])) == (4 * 4, 4)
    layout = _params.workspace_layout(q[None], (cu_q, cu_k, 200, 180), deterministic=True)
    assert layout.nbytes == int(p["dq_semaphore_offset"]) + 3 * 4 * 4 * 4


def test_tensor_map_geometry():
    """The tensor maps of the Hopper kernels (cuflash/_tma.py): innermost first, byte strides, boxes of 64
    columns; a dimension of extent 1 gets a valid stride, an empty one is described as one row; a varlen
    call's packed arrays are one entry, a paged cache's pool has pages for entries."""
    from cuflash import _tma

    p = np.zeros((), dtype=_params.FWD_PARAMS)
    p["head_dim"], p["seqlen_q"], p["seqlen_k"], p["nheads"], p["nheads_k"], p["batch"] = 96, 300, 0, 8, 1, 2
    p["q_row_stride"], p["q_head_stride"], p["q_batch_stride"] = 8 * 96, 96, 300 * 8 * 96
    p["k_row_stride"], p["k_head_stride"], p["k_batch_stride"] = 96, 0, 1000 * 96
    assert _tma.geometry(p, "q", 128) == ((96, 300, 8, 2), (8 * 96 * 2, 96 * 2, 300 * 8 * 96 * 2), (64, 128, 1, 1))
    dims, strides, box = _tma.geometry(p, "k", 176)
    assert dims == (96, 1, 1, 2) and strides == (16, 16, 1000 * 96 * 2) and box == (64, 176, 1, 1)
    assert _params.FWD_SM90_PARAMS.fields["tma_q"][1] % 64 == 0
    # varlen: the packed array is one entry of all its rows (batch stride 0, so the batch dimension's stride
    # is only valid), whatever seqlen_q (the longest sequence) and batch (the sequences) say
    p["q_batch_stride"] = 0
    assert _tma.geometry(p, "q", 128, (700, 1)) == ((96, 700, 8, 1), (8 * 96 * 2, 96 * 2, 16), (64, 128, 1, 1))
    # a paged cache's pool: pages of 16 rows, 40 of them, the batch stride the page stride
    p["k_head_stride"], p["k_batch_stride"] = 96, 16 * 2 * 96
    p["nheads_k"] = 2
    assert _tma.geometry(p, "k", 16, (16, 40)) == ((96, 16, 2, 40), (96 * 2, 96 * 2, 16 * 2 * 96 * 2), (64, 16, 1, 1))
    # the backward's dout map: its pointer and strides from BwdParams, the rest from BwdParams.fwd
    pb = np.zeros((), dtype=_params.BWD_PARAMS)
    pb["fwd"] = p
    pb["do_row_stride"], pb["do_head_stride"], pb["do_batch_stride"] = 96, 300 * 96, 8 * 300 * 96
    assert _tma.geometry(pb, "do", 64) == ((96, 300, 8, 2), (96 * 2, 300 * 96 * 2, 8 * 300 * 96 * 2), (64, 64, 1, 1))
    assert _tma.geometry(pb, "q", 64)[:2] == _tma.geometry(p, "q", 64)[:2]
    assert _params.BWD_SM90_PARAMS.fields["tma_q"][1] % 64 == 0


def test_tensor_maps_follow_patched_pointers(monkeypatch):
    """A plan patches pointer runs (FWD_POINTERS: q, k, v, o, lse; BWD_POINTERS: dout, dq, dk, dv, dsum); each map
    is re-addressed to its own array's new pointer, once, and not at all when the pointer is unchanged."""
    from cuflash import _tma

    replaced = []

    class Driver:
        @staticmethod
        def cuTensorMapReplaceAddress(tensor_map, address):
            replaced.append((tensor_map, address))
            return 0

    monkeypatch.setattr(_tma, "_driver", lambda: Driver)
    monkeypatch.setattr(_tma, "encode", lambda *args: None)
    p = np.zeros((), dtype=_params.BWD_PARAMS)
    p["fwd"]["q"], p["fwd"]["k"], p["fwd"]["v"], p["dout"] = 0x1000, 0x2000, 0x3000, 0x4000
    p["fwd"]["head_dim"], p["fwd"]["seqlen_q"], p["fwd"]["seqlen_k"], p["fwd"]["batch"] = 64, 8, 8, 1
    sm90 = _tma.SM90Params(_params.BWD_SM90_PARAMS, p, "bfloat16", {"q": 64, "k": 128, "v": 128, "do": 64})
    maps = {n: sm90.raw[off:off + 1].ctypes.data for n in ("q", "k", "v", "do")
            for off in [_params.BWD_SM90_PARAMS.fields[f"tma_{n}"][1]]}
    sm90.follow(_params.FWD_POINTERS, (0x1000, 0x2100, 0x3100, 0x5000, 0x6000))  # q unchanged; o, lse have no map
    assert replaced == [(maps["k"], 0x2100), (maps["v"], 0x3100)]
    replaced.clear()
    sm90.follow(_params.BWD_POINTERS, (0x4100, 0x7000, 0x8000, 0x9000, 0xA000))
    sm90.follow(_params.BWD_POINTERS, (0x4100, 0x7000, 0x8000, 0x9000, 0xA000))  # the same again: nothing
    assert replaced == [(maps["do"], 0x4100)]
