"""The runtime build (cupy.RawModule) and the compile gate (NVRTC from cuda-bindings) pass NVRTC the
same options, so that the gate checks the binary that runs. No GPU needed: CuPy is replaced by a
stand-in that records what it is given."""

import sys
import types

import pytest

from cuflash import _compile, config

# What only the gate adds: the target (CuPy picks the device's), ptxas' report, the CUDA headers.
GATE_ONLY_PREFIXES = ("-arch=sm_", "--ptxas-options=", "-I")


@pytest.fixture(params=[False, True], ids=["default", "lineinfo"])
def lineinfo(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("CUFLASH_LINEINFO", "1")
    else:
        monkeypatch.delenv("CUFLASH_LINEINFO", raising=False)
    return request.param


def runtime_options(monkeypatch, cfg) -> tuple[str, ...]:
    """The options _compile.module hands to cupy.RawModule for cfg."""
    seen = []

    class RawModule:
        def __init__(self, *, code, options, name_expressions):
            assert name_expressions == (cfg.template_name,)
            seen.append(tuple(options))

        def compile(self):
            pass

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule))
    monkeypatch.setattr(_compile, "_device_key", lambda: (0, "90"))
    monkeypatch.setattr(_compile, "_modules", {})
    _compile.module(cfg.source, (cfg.template_name,))
    assert len(seen) == 1
    return seen[0]


def test_runtime_uses_compile_options(monkeypatch, lineinfo):
    cfg = config.choose_forward("bfloat16", 64, True)
    opts = runtime_options(monkeypatch, cfg)
    assert opts == _compile.compile_options()
    assert "-ftz=true" in opts
    assert ("-lineinfo" in opts) == lineinfo


@pytest.mark.parametrize("arch", [80, 90])
def test_gate_compiles_with_the_runtime_options(monkeypatch, lineinfo, arch):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    cfg = config.choose_backward("float16", 64, False)[0]  # the preprocess kernel: quick to compile
    runtime = runtime_options(monkeypatch, cfg)

    seen = []
    real = nvrtc.nvrtcCompileProgram

    def spy(prog, n, opts):
        seen.append(tuple(o.decode() for o in opts))
        return real(prog, n, opts)

    monkeypatch.setattr(nvrtc, "nvrtcCompileProgram", spy)
    (report,) = _compile.ptxas_reports([cfg], arch)
    assert report.name == cfg.template_name
    assert len(seen) == 1
    gate = seen[0]
    assert tuple(o for o in gate if not o.startswith(GATE_ONLY_PREFIXES)) == runtime
    assert f"-arch=sm_{arch}" in gate


def test_cubin_cache_keys_on_nvrtc_version(monkeypatch, tmp_path):
    """A Hopper kernel's cached cubin belongs to the NVRTC that built it: another version (an upgrade) builds its own
    file rather than loading that one; the same version finds the same file."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    key = ("0" * 64, ("cuflash::flash_fwd_sm90<...>",), "90a")
    paths = {}
    for version in ((13, 0), (13, 5), (13, 0)):
        monkeypatch.setattr(_compile, "nvrtc_version", lambda v=version: v)
        paths.setdefault(version, set()).add(_compile.cubin_path(key))
    assert all(len(p) == 1 for p in paths.values())
    assert paths[13, 0] != paths[13, 5]
    assert all(p.parent == tmp_path for ps in paths.values() for p in ps)
