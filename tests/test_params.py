"""cuflash/_params.py mirrors kernels_cu/params.cuh byte for byte: the compiler checks every offset."""

import re

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


def _ptx(src: str) -> str:
    from cuda.bindings import nvrtc

    prog = _compile._check(nvrtc.nvrtcCreateProgram(src.encode(), b"probe.cu", 0, [], []))
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, 2, [b"-arch=compute_80", b"-std=c++17"])
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
    for struct, dtype in (("FwdParams", _params.FWD_PARAMS), ("BwdParams", _params.BWD_PARAMS)):
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
    for struct, dtype in (("FwdParams", _params.FWD_PARAMS), ("BwdParams", _params.BWD_PARAMS)):
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
