"""Source assembly and kernel compilation.

`kernel(cfg)` returns a launchable `cupy.RawKernel`, loaded once per (config, device) from a module
compiled once per (source hash, instantiations, device) and kept in memory; CuPy's disk cache keeps
the binary across processes. A kernel for one target (KernelConfig.arch) runs on that compute capability
alone; the Hopper kernels' ("90a": CuPy would add its own -arch) are compiled here with NVRTC from
cuda-bindings into a cubin, kept on disk under cache_dir(), and loaded by CuPy. CuPy's disk cache keys on
the source string only, not on the files it `#include`s, so `source_text(filename)` inlines every
kernels_cu header into one string: an edited header can never run a stale binary.

`ptxas_reports(configs, arch)` compiles the same source with NVRTC from cuda-bindings, which needs no GPU
and no driver, and parses ptxas' resource report: the compile gate (tests/test_compile_gate.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
import re
import threading
from pathlib import Path

from .config import DEFAULT_SMEM_BYTES, KernelConfig

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()


def kernels_dir() -> Path:
    """kernels_cu/, from a source checkout, an editable install or an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "params.cuh").is_file():
            return candidate
    ref = importlib.resources.files("cuflash").joinpath("kernels_cu")
    if ref.joinpath("params.cuh").is_file():
        return Path(str(ref))
    raise FileNotFoundError("kernels_cu/ not found beside the cuflash package")


def _inline(path: Path, seen: set[str]) -> str:
    """The file's text with each `#include "x.cuh"` replaced by x.cuh's text, once per file."""
    out = []
    for line in path.read_text().splitlines(keepends=True):
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
            continue
        name = m.group(1)
        if name not in seen:
            seen.add(name)
            out.append(f"// ---- begin {name}\n{_inline(path.parent / name, seen)}// ---- end {name}\n")
    return "".join(out).replace("#pragma once\n", "")


@functools.lru_cache(maxsize=None)
def source_text(filename: str) -> str:
    """One self-contained translation unit for kernels_cu/<filename>."""
    return _inline(kernels_dir() / filename, {filename})


def source_hash(filename: str) -> str:
    return hashlib.sha256(source_text(filename).encode()).hexdigest()[:16]


def compile_options() -> tuple[str, ...]:
    """The NVRTC options of every kernel build: the runtime's (`module`, through cupy.RawModule) and
    the compile gate's (`nvrtc_compile`) alike, so that the gate checks the binary that runs. The gate
    adds only what it alone needs (`gate_options`); CuPy adds -arch for the current device.

    -ftz=true: fp32 subnormals flush to zero; exp2f becomes one ex2.approx.ftz.f32 (no subnormal fix-up)."""
    opts = ["-std=c++17", "-ftz=true"]
    if os.environ.get("CUFLASH_LINEINFO"):
        opts.append("-lineinfo")
    return tuple(opts)


# ------------------------------------------------------------------------------------------------
# Runtime: CuPy RawModule
# ------------------------------------------------------------------------------------------------

_modules: dict[tuple, object] = {}
_kernels: dict[tuple, object] = {}


def _device_key():
    import cupy

    dev = cupy.cuda.Device()
    return dev.id, dev.compute_capability


def module(filename: str, names: tuple[str, ...]):
    """A cupy.RawModule holding the given template instantiations of kernels_cu/<filename>."""
    import cupy

    key = (source_hash(filename), names, _device_key())
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = cupy.RawModule(code=source_text(filename), options=compile_options(), name_expressions=names)
            mod.compile()
            _modules[key] = mod
    return mod


def cache_dir() -> Path:
    """Where cubins built for one target are kept: $CUFLASH_CACHE_DIR, else ~/.cache/cuflash."""
    return Path(os.environ.get("CUFLASH_CACHE_DIR") or Path.home() / ".cache" / "cuflash")


def cubin_path(key) -> Path:
    """The disk-cache file of a target build, key (source hash, names, arch): keyed by NVRTC's version too, as
    CuPy's own cache is, so that another NVRTC (an upgrade) builds its own binary rather than loading the old one."""
    digest = hashlib.sha256(repr((key, compile_options(), nvrtc_version())).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.cubin"


def target_module(filename: str, names: tuple[str, ...], arch: str):
    """(cupy.RawModule, {name: lowered name}) of names from kernels_cu/<filename> built for sm_<arch>."""
    import cupy

    key = (source_hash(filename), names, arch)
    with _lock:
        hit = _modules.get(key)
        if hit is None:
            path = cubin_path(key)
            names_path = path.with_suffix(".json")
            if not (path.is_file() and names_path.is_file()):
                _, lowered, cubin = _nvrtc(filename, list(names), arch)
                path.parent.mkdir(parents=True, exist_ok=True)
                for dst, data in ((path, cubin), (names_path, json.dumps(lowered).encode())):
                    tmp = dst.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_bytes(data)
                    os.replace(tmp, dst)  # another process may be writing the same file
            hit = _modules[key] = (cupy.RawModule(path=str(path)), json.loads(names_path.read_text()))
    return hit


def kernel(cfg: KernelConfig):
    """The launchable kernel for cfg, compiled at its first use on this device."""
    device = _device_key()
    key = (cfg, device)
    k = _kernels.get(key)
    if k is not None:
        return k
    if cfg.arch and device[1] != cfg.arch[:2]:
        raise RuntimeError(f"{cfg.template_name} is built for sm_{cfg.arch}; this GPU is sm_{device[1]}")
    _check_smem(cfg)
    if cfg.arch and cfg.arch.endswith("a"):  # an architecture-specific target, which CuPy's -arch cannot name
        mod, lowered = target_module(cfg.source, (cfg.template_name,), cfg.arch)
        k = mod.get_function(lowered[cfg.template_name])
    else:
        mod = module(cfg.source, (cfg.template_name,))
        k = mod.get_function(cfg.template_name)
    if cfg.smem_bytes > DEFAULT_SMEM_BYTES:
        k.max_dynamic_shared_size_bytes = cfg.smem_bytes
    _kernels[key] = k
    return k


def _check_smem(cfg: KernelConfig) -> None:
    """A config that needs more shared memory than this device grants fails here, by name."""
    import cupy

    limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    if cfg.smem_bytes > limit:
        raise RuntimeError(
            f"{cfg.template_name} needs {cfg.smem_bytes} bytes of shared memory per block; this GPU "
            f"grants {limit} (head_dim {cfg.head_dim} is not supported on it yet)"
        )


def precompile(configs: list[KernelConfig], jobs: int = 1, progress=None) -> int:
    """Compile configs into CuPy's disk cache, `jobs` processes at a time. Returns how many.
    Configs that need more shared memory than this device grants, or that it never runs (runs_on), are left out.
    `progress(cfg, done, total)`, if given, is called once per config as it finishes compiling."""
    import cupy

    dev = cupy.cuda.Device()
    limit = dev.attributes["MaxSharedMemoryPerBlockOptin"]
    configs = [c for c in configs if c.smem_bytes <= limit and c.runs_on(int(dev.compute_capability))]
    total = len(configs)
    if jobs <= 1:
        for done, cfg in enumerate(configs, 1):
            kernel(cfg)
            if progress is not None:
                progress(cfg, done, total)
        return total
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_precompile_one, dataclasses.astuple(c)): c for c in configs}
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            fut.result()
            if progress is not None:
                progress(futures[fut], done, total)
    for cfg in configs:  # load into this process from the disk cache
        kernel(cfg)
    return total


def _precompile_one(fields: tuple) -> None:
    kernel(KernelConfig(*fields))


# ------------------------------------------------------------------------------------------------
# Compile gate: NVRTC from cuda-bindings, no GPU needed
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    name: str  # the template name
    arch: int | str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_static: int
    log: str
    # ptxas serialized the wgmmas (any of its C75xx warnings that say so: C7512, too few registers to keep them in
    # flight; C7515, other instructions write an in-flight wgmma's accumulators; C7520, NVRTC 12.9's varlen backward)
    serialized: bool = False


def _cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h: the pip CUDA runtime wheel, else a local toolkit."""
    dirs = []
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cu12/include", "cuda_runtime/include"):
                p = Path(base) / sub
                if (p / "cuda_fp16.h").is_file():
                    dirs.append(str(p))
    except ImportError:
        pass
    for p in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        if p and (Path(p) / "include" / "cuda_fp16.h").is_file():
            dirs.append(str(Path(p) / "include"))
    return dirs


def _check(result):
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC: {err}")
    return rest[0] if len(rest) == 1 else rest


def gate_options(arch) -> tuple[str, ...]:
    """compile_options() plus what only the gate needs: the target, ptxas' resource report, and the
    CUDA headers (CuPy finds them itself at run time)."""
    return (*compile_options(), f"-arch=sm_{arch}", "--ptxas-options=-v", *(f"-I{d}" for d in _cuda_include_dirs()))


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of cuda-bindings' NVRTC, which builds the sm_90a kernels; (0, 0) where it is missing."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return 0, 0
    major, minor = _check(nvrtc.nvrtcVersion())
    return int(major), int(minor)


def nvrtc_major() -> int:
    """The major version of cuda-bindings' NVRTC; 0 where it is missing."""
    return nvrtc_version()[0]


def nvrtc_compile(filename: str, names: list[str], arch) -> tuple[str, dict[str, str]]:
    """Compile names from kernels_cu/<filename> to a cubin for sm_<arch> (80, 90, "90a"); returns (log, lowered)."""
    log, lowered, _ = _nvrtc(filename, names, arch)
    return log, lowered


def _nvrtc(filename: str, names: list[str], arch) -> tuple[str, dict[str, str], bytes]:
    """(log, lowered names, cubin) of names from kernels_cu/<filename> compiled for sm_<arch>."""
    from cuda.bindings import nvrtc

    src = source_text(filename).encode()
    prog = _check(nvrtc.nvrtcCreateProgram(src, filename.encode(), 0, [], []))
    try:
        for n in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, n.encode()))
        opts = gate_options(arch)
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog))
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf))
        log = buf.decode(errors="replace").rstrip("\x00 ")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed to compile {filename} for sm_{arch}:\n{log}")
        lowered = {n: _check(nvrtc.nvrtcGetLoweredName(prog, n.encode())).decode() for n in names}
        cubin = b" " * _check(nvrtc.nvrtcGetCUBINSize(prog))
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return log, lowered, cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_FN = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_REG = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")
_SERIALIZED = re.compile(r"\(C75\d\d\)[^\n]*wgmma\.mma_async instructions are serialized[^\n]*function '(\S+)'")


def ptxas_reports(configs: list[KernelConfig], arch, jobs: int = 1) -> list[PtxasReport]:
    """ptxas resource usage of each config, compiled for sm_<arch>: one NVRTC program per source file, or with
    jobs > 1 one per share of its configs, `jobs` processes at a time (ptxas runs on one core a program)."""
    by_file: dict[str, list[str]] = {}
    for c in configs:
        by_file.setdefault(c.source, []).append(c.template_name)
    programs = []
    for filename, names in by_file.items():
        shares = max(1, min(jobs, len(names)))
        programs += [(filename, names[i::shares]) for i in range(shares)]  # every jobs-th: heavy ones spread
    if jobs > 1 and len(programs) > 1:
        import concurrent.futures

        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            reports = list(pool.map(_program_reports, *zip(*programs), [arch] * len(programs)))
    else:
        reports = [_program_reports(filename, names, arch) for filename, names in programs]
    by_name = {r.name: r for rs in reports for r in rs}
    return [by_name[c.template_name] for c in configs]


def _program_reports(filename: str, names: list[str], arch) -> list[PtxasReport]:
    log, lowered = nvrtc_compile(filename, names, arch)
    sections = _split_log(log)
    serialized = set(_SERIALIZED.findall(log))
    out = []
    for n in names:
        text = sections.get(lowered[n])
        if text is None:
            raise RuntimeError(f"no ptxas report for {n} in:\n{log}")
        out.append(dataclasses.replace(_parse(n, arch, text), serialized=lowered[n] in serialized))
    return out


def _split_log(log: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    current = None
    for line in log.splitlines():
        m = _FN.search(line)
        if m:
            current = m.group(1)
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def _parse(name: str, arch: int, text: str) -> PtxasReport:
    reg = _REG.search(text)
    spill = _SPILL.search(text)
    smem = _SMEM.search(text)
    return PtxasReport(
        name=name,
        arch=arch,
        registers=int(reg.group(1)) if reg else 0,
        stack_bytes=int(spill.group(1)) if spill else 0,
        spill_stores=int(spill.group(2)) if spill else 0,
        spill_loads=int(spill.group(3)) if spill else 0,
        smem_static=int(smem.group(1)) if smem else 0,
        log=text,
    )
