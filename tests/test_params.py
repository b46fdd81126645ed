"""cuflash/_params.py mirrors kernels_cu/params.cuh byte for byte: the compiler checks every offset."""

import pytest

from cuflash import _compile, _params


def _asserts(struct: str, dtype, prefix: str = "") -> list[str]:
    out = [f"static_assert(sizeof(cuflash::{struct}) == {dtype.itemsize}, \"sizeof {struct}\");"] if not prefix else []
    for name, (sub, offset) in dtype.fields.items():
        path = f"{prefix}{name}"
        out.append(f"static_assert(__builtin_offsetof(cuflash::{struct}, {path}) == {offset}, \"{path}\");")
        if sub.fields:  # nested struct: its fields at offset + their own offset
            for n2, (_, o2) in sub.fields.items():
                out.append(
                    f"static_assert(__builtin_offsetof(cuflash::{struct}, {path}.{n2}) == {offset + o2}, \"{path}.{n2}\");"
                )
    return out


def test_layouts_match_header(tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings")
    lines = ['#include "params.cuh"']
    lines += _asserts("FwdParams", _params.FWD_PARAMS)
    lines += _asserts("BwdParams", _params.BWD_PARAMS)
    lines += ["__global__ void cuflash_params_probe() {}"]
    (tmp_path / "probe.cu").write_text("\n".join(lines) + "\n")
    (tmp_path / "params.cuh").write_text((_compile.kernels_dir() / "params.cuh").read_text())
    monkeypatch.setattr(_compile, "kernels_dir", lambda: tmp_path)
    _compile.source_text.cache_clear()
    try:
        log, _ = _compile.nvrtc_compile("probe.cu", [], 90)  # raises with the failed assertion's name
    finally:
        _compile.source_text.cache_clear()


def test_field_count_matches_header():
    """Every field declared in the header is in the dtype (names and order)."""
    import re

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
