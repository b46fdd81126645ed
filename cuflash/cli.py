"""The `cuflash` command: version, what this machine can run, kernel pre-compilation, benchmarks."""

from __future__ import annotations

import importlib
import os
import platform

import click

from . import __version__
from ._interop import gpu_status
from .benchmark.command import ProgressBar, bench, parse_dtype


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cuflash")
def main() -> None:
    """cuflash: exact FlashAttention for NumPy/CuPy code."""


def _backend_status() -> dict[str, tuple[bool, str]]:
    out = {}
    for name in ("cuda", "numba", "numpy"):
        try:
            mod = importlib.import_module(f"cuflash.backends.{name}")
            out[name] = mod.available()
        except Exception as e:  # an optional dependency missing or broken
            out[name] = (False, f"{type(e).__name__}: {e}")
    return out


def info_dict() -> dict:
    info: dict = {"cuflash": __version__, "python": platform.python_version()}
    import numpy

    info["numpy"] = numpy.__version__
    ok, why = gpu_status()
    try:
        import cupy

        info["cupy"] = cupy.__version__
        info["kernel_cache"] = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
        try:
            info["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        except Exception as e:
            info["nvrtc"] = f"unavailable ({type(e).__name__})"
        if ok:
            dev = cupy.cuda.Device()
            props = cupy.cuda.runtime.getDeviceProperties(dev.id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            info["gpu"] = name
            info["compute_capability"] = f"{props['major']}.{props['minor']}"
            info["multiprocessors"] = props["multiProcessorCount"]
            rt = cupy.cuda.runtime.runtimeGetVersion()
            drv = cupy.cuda.runtime.driverGetVersion()
            info["cuda_runtime"] = f"{rt // 1000}.{rt % 1000 // 10}"
            info["cuda_driver"] = f"{drv // 1000}.{drv % 1000 // 10}"
    except Exception as e:
        info["cupy"] = f"not importable ({type(e).__name__}: {e})"
    if not ok:
        info["gpu"] = f"none ({why})"
    info["backends"] = {k: ("yes" if v[0] else f"no: {v[1]}") for k, v in _backend_status().items()}
    return info


@main.command()
def info() -> None:
    """GPU, CUDA and CuPy versions, kernel cache, and which backends can run here (or why not)."""
    d = info_dict()
    backends = d.pop("backends")
    width = max(map(len, d))
    for k, v in d.items():
        click.echo(f"{k:<{width}}  {v}")
    click.echo("backends:")
    for k, v in backends.items():
        click.echo(f"  {k:<6} {v}")


@main.command("compile")
@click.option("--jobs", "-j", type=click.IntRange(1, 256), default=os.cpu_count() or 1, show_default=True,
              help="Parallel compiler processes.")
@click.option("--dtype", "dtypes", multiple=True, metavar="DTYPE",
              callback=lambda ctx, param, values: tuple(parse_dtype(ctx, param, v) for v in values),
              help="Only these dtypes, as `cuflash bench --dtype` names them (repeatable; default all).")
def compile_cmd(jobs: int, dtypes: tuple[str, ...]) -> None:
    """Compile every shipped kernel config into CuPy's disk cache (later calls start at once)."""
    import time

    from rich.console import Console

    from . import _compile, config

    ok, why = gpu_status()
    if not ok:
        raise click.ClickException(f"no GPU to compile for: {why}")
    cfgs = [c for c in config.all_configs() if not dtypes or c.dtype in dtypes]
    t0 = time.perf_counter()
    with ProgressBar(Console(), len(cfgs)) as bar:  # a bar on a terminal, nothing elsewhere
        n = _compile.precompile(cfgs, jobs=jobs, progress=lambda cfg, done, total: bar.advance(
            "compiled", cfg.label, completed=done))
    click.echo(f"compiled {n} kernel configs in {time.perf_counter() - t0:.1f} s ({jobs} jobs)")


main.add_command(bench)  # `cuflash bench` lives in its own package


if __name__ == "__main__":  # pragma: no cover
    main()
