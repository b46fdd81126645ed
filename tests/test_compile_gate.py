"""Compile gate: the kernel configs of config.all_configs() compile with NVRTC (cuda-bindings, no GPU or driver needed)
for sm_80 and sm_90 where they run (KernelConfig.runs_on: a config built for one target, KernelConfig.arch, for that
alone: the Hopper kernels for sm_90a, WIDE_SMEM for sm_90; the flash_bwd configs those replace on 9.0 for sm_80
alone), with no register spills, no stack frame, and shared memory within the device's limit. all_configs() is a
sample of what the heuristics can return (per dtype and head dim: no variant, causal, every variant at once, and
some KV-cache and tile sets); tools/config_sweep.py compiles all of it (bf16 on 2026-12-07: 19 configs outside the
sample spill under NVRTC 13.0, 9 of the Hopper ones under 13.5; bench/RESULTS.md, 2026-12-07 (y) and (z))."""

import dataclasses
import os

import pytest

from cuflash import _compile, config

pytest.importorskip("cuda.bindings")

ARCHS = (80, 90)
# (target, source file): every config for its own target (KernelConfig.arch) or for each of ARCHS
TARGETS = sorted({(c.arch or str(a), c.source) for c in config.all_configs() for a in ARCHS if c.runs_on(a)})


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(arch, source):
        if (arch, source) not in cache:
            cfgs = [c for c in config.all_configs()
                    if c.source == source and (c.arch or arch) == arch and c.runs_on(int(arch[:2]))]
            cache[arch, source] = list(zip(cfgs, _compile.ptxas_reports(cfgs, arch, jobs=os.cpu_count() or 1)))
        return cache[arch, source]

    return get


@pytest.mark.parametrize(("arch", "source"), TARGETS)
def test_compiles_without_spills(reports, arch, source):
    rows = reports(arch, source)
    assert rows, f"no configs for {source}"
    bad = [
        f"{r.name}: {r.spill_stores} B spill stores, {r.spill_loads} B spill loads, {r.stack_bytes} B stack"
        for _, r in rows
        if r.spill_stores or r.spill_loads or r.stack_bytes
    ]
    assert not bad, f"sm_{arch}:\n" + "\n".join(bad)


@pytest.mark.parametrize(("arch", "source"), [t for t in TARGETS if t[0] == "90a"])
def test_wgmma_stays_asynchronous(reports, arch, source):
    """ptxas serializes a kernel's wgmmas (warnings C7512, C7515, C7520, ...) when it lacks the registers to keep them
    in flight or other instructions write their accumulators meanwhile: correct, and far slower. No config may."""
    bad = [r.name for _, r in reports(arch, source) if r.serialized]
    assert not bad, f"sm_{arch}: wgmma serialized in\n" + "\n".join(bad)


def test_serialization_warnings_are_read(monkeypatch):
    """Both of ptxas' serialization warnings mark their function, and only it (a log in ptxas' words, no NVRTC)."""
    names = {"f<0>": "_Z1fILi0E", "f<1>": "_Z1fILi1E", "f<2>": "_Z1fILi2E"}

    def warning(code, why, fn):
        return (f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                f"due to {why} function '{fn}'\n")

    log = (warning("C7512", "insufficient register resources for the", names["f<1>"])
           + warning("C7515", "non wgmma instructions defining accumulator registers of a wgmma between start and "
                     "end of the pipeline stage in the", names["f<2>"])
           + "".join(f"ptxas info    : Compiling entry function '{m}' for 'sm_90a'\n"
                     "ptxas info    : Used 168 registers, used 16 barriers\n" for m in names.values()))
    monkeypatch.setattr(_compile, "nvrtc_compile", lambda filename, names_, arch: (log, names))
    cfgs = [type("Cfg", (), {"source": "k.cu", "template_name": n})() for n in names]
    assert [r.serialized for r in _compile.ptxas_reports(cfgs, "90a")] == [False, True, True]


def test_programs_in_shares_report_as_one():
    """ptxas_reports with jobs > 1 (one NVRTC program per share of a file's configs, in processes) gives what one
    program per file gives, in the configs' order."""
    cfgs = [c for c in config.all_configs() if c.kernel in ("kvcache_append", "flash_bwd_preprocess")][:7]
    assert len({c.source for c in cfgs}) == 2

    def without_log(reports):  # (the log holds compile times)
        return [dataclasses.replace(r, log="") for r in reports]

    assert without_log(_compile.ptxas_reports(cfgs, "80", jobs=3)) == without_log(_compile.ptxas_reports(cfgs, "80"))


@pytest.mark.parametrize(("arch", "source"), TARGETS)
def test_shared_memory_within_limit(reports, arch, source):
    limit = config.SMEM_LIMIT[int(arch[:2])]
    over = [
        f"{r.name}: {r.smem_static} static + {c.smem_bytes} dynamic > {limit}"
        for c, r in reports(arch, source)
        if r.smem_static + c.smem_bytes > limit
    ]
    assert not over, f"sm_{arch}:\n" + "\n".join(over)


def test_every_kernel_is_covered():
    kernels = {c.kernel for c in config.all_configs()}
    assert kernels == set(config.SOURCES), f"kernels without configs: {set(config.SOURCES) - kernels}"


def test_wgmma_header_is_generated():
    """kernels_cu/wgmma.cuh is what tools/gen_wgmma.py writes (edit the generator, not the header)."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parent.parent / "tools" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", tool)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.OUT.read_text() == gen.main()
