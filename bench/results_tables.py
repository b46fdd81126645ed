"""Markdown tables from a `cuflash bench` JSON file, for bench/RESULTS.md and the README.

    python3 bench/results_tables.py bench/results/h200-2026-11-29.json > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys


def _impls(rows):
    out = []
    for r in rows:
        if r["implementation"] not in out:
            out.append(r["implementation"])
    return out


def speed(suite: dict, mode: str, key: str) -> str:
    """ms | TFLOP/s of cuflash, and each baseline's ms with cuflash's speedup over it."""
    rows = [r for r in suite["rows"] if r["mode"] == mode]
    impls = _impls(rows)
    xs = sorted({r["shape"][key] for r in rows})
    head = [key if key != "seqlen_q" else "N", "cuflash ms", "cuflash TFLOP/s"]
    head += [f"{i} TFLOP/s (cuflash x)" for i in impls if i != "cuflash"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for x in xs:
        def get(i):
            return next((r for r in rows if r["implementation"] == i and r["shape"][key] == x), None)
        c = get("cuflash")
        cells = [str(x), f"{c['ms_median']:.3f}", f"{c['tflops']:.0f}"]
        for i in impls:
            if i == "cuflash":
                continue
            r = get(i)
            if r is None or r["status"] != "ok":
                cells.append(r["status"] if r else "-")
            else:
                cells.append(f"{r['tflops']:.0f} ({r['ms_median'] / c['ms_median']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory(suite: dict) -> str:
    rows = suite["rows"]
    lines = ["| mode | N | cuflash peak MiB | conventional peak MiB | conventional / cuflash |", "|---|---:|---:|---:|---:|"]
    for mode in ("fwd", "fwd_bwd"):
        for n in sorted({r["shape"]["seqlen_q"] for r in rows}):
            c = next(r for r in rows if r["mode"] == mode and r["shape"]["seqlen_q"] == n and r["implementation"] == "cuflash")
            v = next(r for r in rows if r["mode"] == mode and r["shape"]["seqlen_q"] == n and r["implementation"] == "conventional")
            cv = f"{v['peak_bytes'] / 2**20:.1f}" if v["status"] == "ok" else v["status"]
            ratio = f"{v['peak_bytes'] / c['peak_bytes']:.1f}" if v["status"] == "ok" else "-"
            lines.append(f"| {mode} | {n} | {c['peak_bytes'] / 2**20:.1f} | {cv} | {ratio} |")
    return "\n".join(lines)


def accuracy(suite: dict) -> str:
    rows = [r for r in suite["rows"] if r.get("output") not in (None, "all")]
    lines = ["| dtype | output | N | cuflash max abs err | conventional max abs err | within rule |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        if r["implementation"] != "cuflash":
            continue
        conv = next((x for x in rows if x["implementation"] == "conventional" and x["dtype"] == r["dtype"]
                     and x["output"] == r["output"] and x["shape"] == r["shape"]), None)
        ce = f"{conv['max_abs_err']:.2e}" if conv else "-"
        lines.append(f"| {r['dtype']} | {r['output']} | {r['shape']['seqlen_q']} | {r['max_abs_err']:.2e} | {ce} | "
                     f"{r.get('within_rule')} |")
    repro = [r for r in suite["rows"] if r.get("output") == "all" and r["implementation"] == "cuflash"]
    for r in repro:
        lines.append(f"| {r['dtype']} | bitwise over {r['repeats']} calls ({r['mode']}) | {r['shape']['seqlen_q']} | "
                     f"{r['bitwise_reproducible']} | | |")
    return "\n".join(lines)


def launch(suite: dict) -> str:
    lines = ["| mode | N | device ms (events) | host enqueue ms | graph replay device ms | graph replay host ms |",
             "|---|---:|---:|---:|---:|---:|"]
    rows = suite["rows"]
    for mode in ("fwd", "bwd"):
        for n in sorted({r["shape"]["seqlen_q"] for r in rows}):
            c = next(r for r in rows if r["mode"] == mode and r["shape"]["seqlen_q"] == n and r["implementation"] == "cuflash")
            g = next((r for r in rows if r["mode"] == mode and r["shape"]["seqlen_q"] == n
                      and r["implementation"] == "cuflash-graph"), None)
            gd = f"{g['ms_median']:.4f}" if g and g["status"] == "ok" else "-"
            gh = f"{g['host_ms_median']:.4f}" if g and g["status"] == "ok" else "-"
            lines.append(f"| {mode} | {n} | {c['ms_median']:.4f} | {c['host_ms_median']:.4f} | {gd} | {gh} |")
    return "\n".join(lines)


def energy(suite: dict) -> str:
    lines = [f"idle power subtracted: {suite['idle_w']:.0f} W", "",
             "| mode | implementation | J / call | J / call above idle | W above idle |", "|---|---|---:|---:|---:|"]
    for r in suite["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['implementation']} | {r['status']} | | |")
            continue
        lines.append(f"| {r['mode']} | {r['implementation']} | {r['joules_per_call']:.2f} | "
                     f"{r['joules_per_call_above_idle']:.2f} | {r['avg_power_above_idle_w']:.0f} |")
    return "\n".join(lines)


def main(path: str) -> None:
    doc = json.load(open(path))
    s = doc["suites"]
    out = []
    for mode in ("fwd", "bwd", "fwd_bwd"):
        out += [f"### seqlen, {mode}", "", speed(s["seqlen"], mode, "seqlen_q"), ""]
    out += ["### headdim, fwd", "", speed(s["headdim"], "fwd", "head_dim"), ""]
    out += ["### memory", "", memory(s["memory"]), ""]
    out += ["### accuracy", "", accuracy(s["accuracy"]), ""]
    out += ["### launch", "", launch(s["launch"]), ""]
    out += ["### energy", "", energy(s["energy"]), ""]
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
