"""`cuflash bench`: the click command (registered on the `cuflash` group by cuflash/cli.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..config import DTYPES, dtype_name
from . import SUITES
from .baselines import GPU_IMPLS, TORCH_BACKENDS

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "fp64": "float64"}
CPU_WHAT = "running the NumPy backend against materialized NumPy at small N (memory slope and accuracy)"


def detect_gpu() -> tuple[bool, str]:
    """(a CUDA GPU is usable through CuPy, why not). Tests monkeypatch this."""
    from .._interop import gpu_status

    return gpu_status()


# ------------------------------------------------------------------------------------------------
# Option parsing (pure; each raises click.BadParameter with one clear message)
# ------------------------------------------------------------------------------------------------


def _split(values) -> list[str]:
    if isinstance(values, str):
        values = [values]
    return [v.strip() for item in values or () for v in str(item).split(",") if v.strip()]


def parse_suites(ctx, param, value) -> tuple[str, ...]:
    names = _split(value)
    if not names:
        return ("seqlen",)
    out: list[str] = []
    for n in names:
        n = n.lower()
        if n == "all":
            out.extend(SUITES)
        elif n in SUITES:
            out.append(n)
        else:
            raise click.BadParameter(f"unknown suite {n!r}; choose from {', '.join(SUITES)} or all")
    return tuple(s for s in SUITES if s in out)  # canonical order, no duplicates


def parse_seqlens(ctx, param, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    out = []
    for v in _split(value):
        try:
            n = int(v)
        except ValueError:
            raise click.BadParameter(f"{v!r} is not an integer; give a comma list such as 512,1024,2048") from None
        if n < 1:
            raise click.BadParameter(f"sequence lengths must be positive, got {n}")
        out.append(n)
    if not out:
        raise click.BadParameter("give at least one sequence length, e.g. 512,1024")
    return tuple(sorted(set(out)))


def parse_backends(ctx, param, value) -> tuple[str, ...]:
    names = _split(value)
    if not names:
        return GPU_IMPLS
    out: list[str] = []
    for n in names:
        n = n.lower()
        if n == "all":
            out.extend(GPU_IMPLS)
        elif n == "torch":
            out.extend(TORCH_BACKENDS)
        elif n in GPU_IMPLS:
            out.append(n)
        elif f"torch-{n}" in TORCH_BACKENDS:
            out.append(f"torch-{n}")
        else:
            raise click.BadParameter(f"unknown backend {n!r}; choose from {', '.join(GPU_IMPLS)}, torch or all")
    return tuple(b for b in GPU_IMPLS if b in out)


def parse_dtype(ctx, param, value) -> str | None:
    if value is None:
        return None
    v = value.lower()
    try:
        return dtype_name(DTYPE_ALIASES.get(v, v))
    except TypeError:
        raise click.BadParameter(f"{value!r} is not a dtype; choose from {', '.join(DTYPES)} "
                                 f"(or {', '.join(DTYPE_ALIASES)})") from None


def parse_head_dim(ctx, param, value) -> int | None:
    if value is None:
        return None
    if value < 8 or value > 256 or value % 8:
        raise click.BadParameter(f"head_dim must be a multiple of 8 between 8 and 256, got {value}")
    return value


def parse_png(ctx, param, value) -> str | None:
    if value is not None and not value.lower().endswith(".png"):
        raise click.BadParameter(f"the plot is written as PNG: give a path ending in .png, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


@click.command("bench")
@click.option("--suite", "suites", multiple=True, callback=parse_suites, metavar="NAME[,NAME...]",
              help=f"Suites to run (repeatable or comma list): {', '.join(SUITES)}, or all. Default: seqlen.")
@click.option("--dtype", callback=parse_dtype, default=None, metavar="DTYPE",
              help="bfloat16 | float16 | float32 | float64 (bf16, fp16, fp32, fp64). Default: bfloat16 "
                   "(float32 on the CPU). The accuracy suite always covers float32, float16, bfloat16.")
@click.option("--causal/--no-causal", default=True, show_default=True, help="Causal (bottom-right) mask.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Batch size (default 2; accuracy 1; CPU 1; train 4). The headdim suite is fixed: B=1, H*d=1024; "
                   "decode's shapes are fixed (only --dtype and --quick apply).")
@click.option("--heads", type=click.IntRange(min=1), default=None,
              help="Heads (default 8; accuracy 4; CPU 2; train 1024 / head dim).")
@click.option("--head-dim", type=int, callback=parse_head_dim, default=None,
              help="Head dim, a multiple of 8 up to 256 (default 128; CPU 64; train 64).")
@click.option("--seqlens", callback=parse_seqlens, default=None, metavar="N[,N...]",
              help="Sequence lengths for seqlen, memory, launch and accuracy (energy, variants and train use the "
                   "largest). "
                   "Default: seqlen 512..16384 doubling; launch B1 H8 N128 d64, B2 H8 N4096 d128, "
                   "B4 H16 N8192 d128 (--seqlens, --batch or --heads replace these shapes).")
@click.option("--backends", callback=parse_backends, default=None, metavar="NAME[,NAME...]",
              help=f"Implementations: {', '.join(GPU_IMPLS)}; torch = its four SDPA backends; all (default).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Write every result, with min/max and metadata, to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), callback=parse_png, default=None,
              metavar="PATH.png", help="Write latency/TFLOP/s vs N and memory vs N (matplotlib) to this PNG.")
@click.option("--quick", is_flag=True,
              help="Few N, 10 repeats, at most 2 warm-up calls: a smoke test (over --repeats, --warmup).")
@click.option("--repeats", type=click.IntRange(min=10), default=20, show_default=True,
              help="Timed runs per figure (at least 10; fewer for slow calls, within --cell-seconds).")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True, help="Untimed calls first.")
@click.option("--cell-seconds", type=click.FloatRange(min=0.0), default=0.5, show_default=True,
              help="Time budget of one timed figure; slower calls get fewer runs, never under 10.")
@click.option("--max-suite-seconds", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              help="Wall-time cap per suite: cells left when it runs out are recorded as skipped.")
@click.option("--max-seconds", type=click.FloatRange(min=1.0), default=300.0, show_default=True,
              help="Wall-time cap of the whole run (precompile included); later cells are recorded as skipped.")
@click.option("--energy-window", type=click.FloatRange(min=2.0), default=2.0, show_default=True,
              help="Seconds of repeated calls per energy figure (NVML's counter updates every ~100 ms).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--cpu", "force_cpu", is_flag=True, help="Run the no-GPU path (NumPy backend) even with a GPU.")
@click.option("--family", type=click.Choice(["mma", "sm90"]), default=None,
              help="Force cuflash's 16-bit kernels to one family (cuflash.kernel_family): mma (mma.sync, any GPU "
                   "from sm_80) or sm90 (Hopper). Default: the fastest that serves each call. Rows say which ran.")
def bench(suites, dtype, causal, batch, heads, head_dim, seqlens, backends, json_path, plot_path, quick, repeats,
          warmup, cell_seconds, max_suite_seconds, max_seconds, energy_window, seed, force_cpu, family):
    """Benchmark cuflash against materialized attention and PyTorch's SDPA backends.

    Figures are the median of >= 10 timed runs after warm-up (CUDA events); the JSON keeps min and
    max. The launch suite reports host time per cached call beside torch SDPA's; the decode suite the
    KV-cache read bandwidth of one query row against torch SDPA's and a device copy's; the train suite
    times a GPT training step with each attention and attention's share of it. Without a GPU (or with
    --cpu) it runs the memory and accuracy suites of the NumPy backend against materialized NumPy at
    small N instead, whatever --suite says (train and decode are skipped, with one line each).
    """
    from rich.console import Console

    from .report import document, make_meta, render, validate, write_json
    from .suites import Runner, Settings, compute_capability, total_steps

    if plot_path:
        require_matplotlib()
    for option, path in (("--json", json_path), ("--plot", plot_path)):
        if path:
            require_writable(option, path)
    if quick:
        repeats, warmup, cell_seconds = 10, min(warmup, 2), min(cell_seconds, 0.2)
    settings = Settings(suites=suites, dtype=dtype, causal=causal, batch=batch, heads=heads, head_dim=head_dim,
                        seqlens=seqlens, backends=backends, quick=quick, repeats=repeats, warmup=warmup,
                        max_suite_seconds=max_suite_seconds, max_seconds=max_seconds, cell_seconds=cell_seconds,
                        energy_window=energy_window, seed=seed, force_cpu=force_cpu, family=family)
    console = Console(width=None if sys.stdout.isatty() else 150)

    gpu_ok, why = (False, "--cpu") if force_cpu else detect_gpu()
    platform = "gpu" if gpu_ok else "cpu"
    if not gpu_ok:  # one line (and one for options a GPU run alone takes), then the CPU suites
        click.echo(f"--cpu: {CPU_WHAT}" if force_cpu else f"no CUDA GPU visible ({why}): {CPU_WHAT}")
        ctx = click.get_current_context()
        unused = [f"--{n}" for n in ("family", "backends")
                  if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]
        if unused:
            click.echo(f"{' and '.join(unused)} apply to GPU runs: not used here")

    cc = compute_capability() if gpu_ok else 0
    with ProgressBar(console, total_steps(settings, platform, cc)) as bar:
        runner = Runner(settings, advance=bar.advance)
        result = runner.run(platform)

    meta = make_meta(settings.options(), platform, None if gpu_ok else why, notes=runner.notes)
    doc = document(meta, result)
    problems = validate(doc)
    if problems:  # a bug in this package: still write what we have, and say so
        click.echo("warning: results do not match the JSON schema: " + "; ".join(problems[:5]), err=True)
    render(console, doc["suites"])
    if json_path:
        write_json(doc, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        from .plots import plot

        gpu = (meta.get("gpu") or {}).get("name") or "CPU (NumPy backend)"
        plot(doc["suites"], plot_path, title=f"cuflash {meta['cuflash_version']} on {gpu}")
        click.echo(f"wrote {plot_path}")
    errors = [n for n, s in doc["suites"].items() if s["status"] == "error"]
    if errors:
        raise click.ClickException(f"suite(s) {', '.join(errors)} failed: see 'reason' in the output")


def require_writable(option: str, path: str) -> None:
    """--json / --plot: the file can be written, checked before anything runs (failing after the run would lose
    it). Its folder is made, as writing it would."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        existed = target.exists()
        with open(target, "a"):
            pass
        if not existed:
            target.unlink()
    except OSError as e:
        raise click.ClickException(f"{option} {path}: cannot be written ({e.strerror or e})") from None


def require_matplotlib() -> None:
    """--plot needs matplotlib (the bench extra): say so before anything runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException('--plot needs matplotlib, which the bench extra installs: '
                                   'pip install "cuflash[bench]"') from None


class ProgressBar:
    """A rich progress bar (what runs now, steps done, time elapsed and left) where the console is a
    terminal; nothing at all otherwise. `advance(what, text)` is called as each step starts."""

    def __init__(self, console, total: int):
        self.bar = None
        self.done = 0
        if console.is_terminal and total > 0:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console,
                                transient=True)
            self.task = self.bar.add_task("starting", total=total)

    def advance(self, what: str, text: str, completed: int | None = None) -> None:
        if self.bar is not None:
            done = self.done if completed is None else completed
            self.bar.update(self.task, completed=done, description=f"{what}: {text}"[:70])
            self.done = done + 1

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
