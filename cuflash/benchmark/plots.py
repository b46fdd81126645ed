"""--plot: latency and TFLOP/s against N (seqlen), peak memory against N, error against N.

Draws on a matplotlib Figure with the Agg canvas directly (no pyplot): no display needed, and no
global backend state is touched.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

LINESTYLE = {"fwd": "-", "bwd": ":", "fwd_bwd": "--"}


def _series(rows, y_key, modes, extra_key=None):
    """{(implementation, mode[, extra]): sorted [(N, y)]} from ok rows."""
    out = defaultdict(list)
    for r in rows:
        if r.get("status") != "ok" or r.get(y_key) is None or r["mode"] not in modes:
            continue
        key = (r["implementation"], r["mode"]) + ((r.get(extra_key),) if extra_key else ())
        out[key].append((r["shape"]["seqlen_q"], r[y_key]))
    return {k: sorted(v) for k, v in out.items()}


MARKER = {"float32": "^", "float16": "s", "bfloat16": "o", "float64": "D"}


def _draw(ax, series, colors, label_fn, marker_fn=lambda key: "o"):
    for key, pts in sorted(series.items()):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, LINESTYLE.get(key[1], "-"), marker=marker_fn(key), ms=4, color=colors(key[0]),
                lw=2.4 if key[0].startswith("cuflash") else 1.3, label=label_fn(key))


def plot(suites: dict, path: str | Path, title: str = "") -> list[str]:
    """Write the figure to path (PNG); returns the panel titles drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    impls = sorted({r["implementation"] for s in suites.values() for r in s.get("rows", [])})
    palette = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9"]
    impls.sort(key=lambda n: (not n.startswith("cuflash"), n))  # cuflash first: always C0
    colors = {name: palette[i % len(palette)] for i, name in enumerate(impls)}.get

    panels = []
    seq = suites.get("seqlen", {}).get("rows", [])
    if _series(seq, "ms_median", ("fwd", "fwd_bwd")):
        panels.append(("latency vs N (fwd solid, fwd+bwd dashed)", seq, "ms_median", "ms per call", True))
        panels.append(("TFLOP/s vs N (fwd solid, fwd+bwd dashed)", seq, "tflops", "TFLOP/s", False))
    mem = suites.get("memory", {}).get("rows", [])
    if _series(mem, "peak_bytes", ("fwd", "fwd_bwd")):
        panels.append(("peak memory vs N (fwd solid, fwd+bwd dashed)", mem, "peak_bytes", "bytes above inputs", True))
    acc = [r for r in suites.get("accuracy", {}).get("rows", []) if r.get("output") == "o"]
    if _series(acc, "max_abs_err", ("fwd",)):
        panels.append(("forward max abs error vs float64", acc, "max_abs_err", "max |o - o64|", True))

    ncols = 2 if len(panels) > 1 else 1
    nrows = max(1, (len(panels) + 1) // 2) if len(panels) > 1 else 1
    fig = Figure(figsize=(6.5 * ncols, 4.5 * nrows), constrained_layout=True)
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no plottable results", ha="center", va="center")
        ax.set_axis_off()
    for i, (ptitle, rows, key, ylabel, logy) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        if key == "max_abs_err":
            series = _series(rows, key, ("fwd",), extra_key="dtype")
            _draw(ax, series, colors, lambda k: f"{k[0]} {k[2]}", lambda k: MARKER.get(k[2], "o"))
        else:
            series = _series(rows, key, ("fwd", "fwd_bwd"))
            _draw(ax, series, colors, lambda k: f"{k[0]} {k[1]}")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return [p[0] for p in panels]
