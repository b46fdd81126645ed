"""The decode suite of `cuflash bench`: its cells and byte counts, the page pool it builds (checked against
flash_attn_with_kvcache on the NumPy backend), its GPU code path run on the CPU with fake implementations
and clocks, the report table, and the skip line without a GPU. CPU only and fast.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.benchmark import SUITES, decode, report, timing
from cuflash.benchmark.suites import (Runner, Settings, cell_count, kernel_configs, suite_cases, suite_params,
                                      total_steps)
from test_bench_cli import FakeClock, document_and_text, invoke, run_without_a_gpu

GiB = 2**30


def shapes(p):
    return [(c["batch"], c["nheads"], c["nheads_k"], c["seqlen_k"], c["head_dim"], c["page_size"]) for c in p["cells"]]


def test_decode_params_and_cells():
    assert SUITES[-2:] == ("train", "decode")  # last: the suites before it keep their time under the caps
    p = suite_params("decode", Settings(suites=("decode",)), "gpu")
    assert shapes(p) == [(8, 32, 8, 32768, 128, None), (8, 32, 8, 32768, 128, 16), (8, 32, 8, 32768, 128, 64),
                         (8, 32, 8, 32768, 128, 256), (1, 32, 8, 131072, 128, None), (64, 32, 8, 4096, 128, None),
                         (8, 16, 16, 16384, 64, None)]
    assert (p["dtype"], p["causal"], p["seqlen_q"], p["modes"], p["rounds"]) == ("bfloat16", False, 1, ["fwd"], 3)
    assert p["implementations"] == ["cuflash", "cuflash-append", "torch-flash", "torch-cudnn", "copy"]
    assert "far above the L2" in p["method"] and "2 x those bytes" in p["method"]
    cells = decode.cells(p)
    assert [c.kv_bytes for c in cells] == [GiB] * 4 + [GiB // 2, GiB, GiB // 2]  # 2 B len H_kv d itemsize
    assert [c.num_pages for c in cells[:4]] == [0, 16384, 4096, 1024]
    assert cells[2].cache == "paged 64" and cells[2].dense == cells[0] and cells[0].cache == "dense"
    assert cells[2].label == "B=8 H=32 Hkv=8 L=32768 d=128 paged 64"
    assert cells[2].extra() == {"nheads_k": 8, "page_size": 64, "cache": "paged 64", "kv_bytes": GiB}
    c = suite_cases("decode", p)[4]
    assert (c.batch, c.nheads, c.seqlen_q, c.seqlen_k, c.head_dim, c.causal) == (1, 32, 1, 131072, 128, False)
    assert cell_count("decode", p, 6) == 7 * 5 * 3
    q = suite_params("decode", Settings(quick=True, dtype="float16", backends=("cuflash", "torch-cudnn")), "gpu")
    assert shapes(q) == [(8, 32, 8, 32768, 128, None), (8, 32, 8, 32768, 128, 64)]
    assert q["dtype"] == "float16" and q["implementations"] == ["cuflash", "cuflash-append", "torch-cudnn", "copy"]
    assert q["rounds"] == 1
    # the options that shape other suites leave decode's shapes alone
    assert shapes(suite_params("decode", Settings(batch=2, heads=4, head_dim=64, seqlens=(512,)), "gpu")) == shapes(p)


def test_decode_kernel_configs():
    from cuflash import config

    cfgs = kernel_configs(Settings(suites=("decode",)), ["decode"])
    seq, paged = config.variant_bits(seqused=True), config.variant_bits(paged=True)
    assert {(c.kernel, c.dtype, c.head_dim, c.variant) for c in cfgs} == {
        ("flash_decode", "bfloat16", 128, seq), ("flash_decode", "bfloat16", 128, paged),
        ("flash_decode", "bfloat16", 64, seq), ("flash_decode_combine", "bfloat16", 128, 0),
        ("flash_decode_combine", "bfloat16", 64, 0)}
    # float32 takes the SIMT forward
    cfgs = kernel_configs(Settings(suites=("decode",), dtype="float32"), ["decode"])
    assert {c.kernel for c in cfgs} == {"flash_fwd_simt"}
    assert kernel_configs(Settings(suites=("decode",), backends=("torch-flash",)), ["decode"]) == []


def test_bandwidth_and_copy_fractions():
    cell = decode.cells(suite_params("decode", Settings(), "gpu"))[0]
    assert decode.bandwidth(cell, "cuflash", 0.5) == {"bytes_per_call": GiB, "tb_per_s": pytest.approx(GiB / 5e8)}
    assert decode.bandwidth(cell, "copy", 1.0)["bytes_per_call"] == 2 * GiB
    assert decode.bandwidth(cell, "copy", None)["tb_per_s"] is None
    rows = _rows(cell, {"copy": 1.0, "cuflash": 0.8, "torch-flash": 0.4, "torch-cudnn": None})
    decode.add_copy_fractions(rows)
    fr = {r["implementation"]: r.get("copy_fraction") for r in rows}
    # the copy moves 2 GiB (read + write) in 1 ms: 2.15 TB/s; cuflash reads 1 GiB in 0.8 ms: 1.34 TB/s
    assert fr == {"copy": 1.0, "cuflash": pytest.approx(0.625), "torch-flash": pytest.approx(1.25),
                  "torch-cudnn": None}
    other = _rows(decode.cells(suite_params("decode", Settings(), "gpu"))[1], {"cuflash": 0.5})  # no copy row
    decode.add_copy_fractions(rows + other)
    assert "copy_fraction" not in other[0]


def _rows(cell, ms: dict) -> list[dict]:
    out = []
    for impl, t in ms.items():
        if t is None:
            out.append(report.make_row(cell.case.shape(), cell.dtype, False, impl, "fwd", status="unavailable",
                                       reason="no kernel", **cell.extra()))
            continue
        extra = {"gqa": "enable_gqa"} if impl.startswith("torch-") else {}
        out.append(report.make_row(cell.case.shape(), cell.dtype, False, impl, "fwd", ms_median=t, ms_min=t * 0.99,
                                   ms_max=t * 1.02, n_runs=10, n_input_sets=1, layout="x", host_us_median=25.0, **extra, **cell.extra(),
                                   **decode.bandwidth(cell, impl, t)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_pool_is_the_dense_cache(dtype):
    """The paged cells' pool and block table hold the dense cache's keys: flash_attn_with_kvcache over them
    (NumPy backend) returns the dense call's output bit for bit."""
    from cuflash import flash_attn_with_kvcache
    from cuflash.config import numpy_dtype

    b, n, hk, h, d, page = 2, 64, 2, 4, 16, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(numpy_dtype(dtype))
               for s in ((b, 1, h, d), (b, n, hk, d), (b, n, hk, d)))
    perm = rng.permutation(b * n // page).astype(np.int32)
    kp, vp = decode.page_pool(k, perm, page), decode.page_pool(v, perm, page)
    bt = perm.reshape(b, -1)
    for e in range(b):
        for j in range(n):
            assert np.array_equal(kp[bt[e, j // page], j % page], k[e, j])
    seqlens = np.full((b,), n, np.int32)
    dense = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, backend="numpy")
    paged = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=bt, backend="numpy")
    assert np.array_equal(np.asarray(dense).view(np.uint8), np.asarray(paged).view(np.uint8))


# ------------------------------------------------------------------------------------------------
# The suite's GPU code path, on the CPU with fakes


class FakeDecode:
    clock = "fake"

    def __init__(self, name):
        self.name = name

    def available(self):
        return (False, "torch not importable (test)") if self.name == "torch-cudnn" else (True, "")

    def context(self):
        import contextlib

        return contextlib.nullcontext()

    def calls(self, cell, data):
        data.used.append((cell.cache, self.name))
        extra = {"gqa": "enable_gqa" if cell.nheads != cell.nheads_k else "none (H_kv = H)"} \
            if self.name.startswith("torch-") else {}
        return [lambda: sum(range(200))], {"layout": "fake", **extra}


class FakeData:
    made: list = []

    def __init__(self, cell, seed):
        self.cell, self.used = cell, []
        FakeData.made.append(self)


@pytest.fixture
def fakes(monkeypatch):
    from cuflash import _compile
    from cuflash.benchmark import memory

    monkeypatch.setattr(decode, "implementations", lambda names: [FakeDecode(n) for n in names])
    monkeypatch.setattr(decode, "Data", FakeData)
    monkeypatch.setattr(timing, "clock", lambda kind: FakeClock())
    monkeypatch.setattr(memory, "free_gpu_caches", lambda: None)
    monkeypatch.setattr(_compile, "precompile", lambda cfgs, jobs, progress: None)
    FakeData.made = []


def test_decode_suite_with_fakes(fakes):
    steps = []
    s = Settings(suites=("decode",), repeats=10, warmup=1, cell_seconds=0.05)
    out = Runner(s, advance=lambda suite, text: steps.append(suite)).run("gpu")
    suite = out["decode"]
    assert suite["status"] == "partial", suite.get("traceback")  # torch-cudnn unavailable
    assert len(steps) == total_steps(s, "gpu") - len(kernel_configs(s, ["decode"])) == 35 * 3
    # one Data per dense shape: the paged cells reuse the first shape's; each cell's implementations in 3 rounds
    assert [d.cell.page_size for d in FakeData.made] == [None] * 4
    impls = ["cuflash", "cuflash-append", "torch-flash", "copy"]
    assert FakeData.made[0].used == [(c, i) for c in ("dense", "paged 16", "paged 64", "paged 256") for _ in range(3)
                                     for i in impls]
    rows = suite["rows"]
    assert all(len(r["round_ms"]) == 3 and r["ms_median"] == sorted(r["round_ms"])[1] for r in rows
               if r["status"] == "ok")
    assert [r["implementation"] for r in rows] == ["cuflash", "cuflash-append", "torch-flash", "torch-cudnn", "copy"] * 7
    assert [r["family"] for r in rows[:5]] == ["mma", "mma", "torch-flash", "cudnn", "memcpy"]
    for r in rows:
        assert (r["mode"], r["causal"], r["shape"]["seqlen_q"]) == ("fwd", False, 1) and "kv_bytes" in r
        if r["implementation"] == "torch-cudnn":
            assert (r["status"], r["reason"]) == ("unavailable", "torch not importable (test)")
            continue
        assert r["status"] == "ok" and r["n_runs"] == 10 and r["copy_fraction"] > 0 and r["host_us_median"] > 0
        assert r["tb_per_s"] == pytest.approx(r["bytes_per_call"] / (r["ms_median"] * 1e-3) / 1e12)
    assert rows[4]["copy_fraction"] == 1.0 and rows[4]["bytes_per_call"] == 2 * rows[4]["kv_bytes"]
    assert [r["cache"] for r in rows[::5]] == ["dense", "paged 16", "paged 64", "paged 256"] + ["dense"] * 3
    doc, text = document_and_text(s, out)
    assert "decode (gpu, partial" in text and "one query row over a KV cache" in text
    assert "cuflash (mma) ms" in text and "8x32x8x32768x128" in text and "paged 256" in text
    assert "decode: not run" in text and "torch-cudnn: unavailable: torch not importable (test)" in text
    assert "decode: copy " in text and "(read + written)" in text and "of the copy's (K and V read)" in text
    # a validator rule of the suite
    rows[0]["tb_per_s"] = None
    assert any("tb_per_s" in e for e in report.validate(report.document(doc["meta"], out)))


def test_median_rounds():
    def row(impl, ms, status="ok", page=None):
        return {"shape": {"batch": 1}, "dtype": "bfloat16", "page_size": page, "implementation": impl,
                "status": status, "ms_median": ms}

    rounds = [row("cuflash", 2.0), row("copy", 5.0), row("cuflash", 1.0), row("copy", 4.0, "error"),
              row("cuflash", 3.0), row("copy", 6.0), row("cuflash", 9.0, page=16), row("cuflash", 7.0, page=16)]
    out = decode.median_rounds(rounds)
    assert [(r["implementation"], r["page_size"], r["status"], r["ms_median"]) for r in out] == [
        ("cuflash", None, "ok", 2.0), ("copy", None, "error", 4.0), ("cuflash", 16, "ok", 7.0)]
    assert out[0]["round_ms"] == [2.0, 1.0, 3.0] and out[2]["round_ms"] == [9.0, 7.0] and "round_ms" not in out[1]
    # rounds the time budget skipped: left out while another round ran ok; the row itself where none did
    out = decode.median_rounds([row("cuflash", 2.0), row("cuflash", 1.0), row("cuflash", None, "skipped"),
                                row("copy", None, "skipped"), row("copy", None, "skipped")])
    assert [(r["implementation"], r["status"], r["ms_median"]) for r in out] == [
        ("cuflash", "ok", 1.0), ("copy", "skipped", None)]
    assert out[0]["round_ms"] == [2.0, 1.0]


def test_decode_table_from_rows():
    p = suite_params("decode", Settings(), "gpu")
    cells = decode.cells(p)
    rows = _rows(cells[0], {"cuflash": 0.5, "torch-flash": 0.4, "torch-cudnn": 0.3, "copy": 0.6})
    rows += _rows(cells[3], {"cuflash": 0.55, "torch-flash": None, "torch-cudnn": 0.3, "copy": 0.6})
    rows[1]["gqa"] = "expanded K/V heads to 32 (enable_gqa refused: x)"
    rows[0].update(kernel="flash_decode", num_splits=2)
    decode.add_copy_fractions(rows)
    suite = {"platform": "gpu", "status": "partial", "reason": None, "seconds": 12.0, "params": p, "rows": rows}
    meta = report.make_meta({}, "gpu", None, argv=["cuflash"])
    assert report.validate(report.document(meta, {"decode": suite})) == []
    t, host, not_run = report.tables("decode", suite)
    assert t.header == ["B x H x H_kv x len x d", "cache", "splits", "K + V", "copy TB/s", "cuflash (mma) ms",
                        "cuflash TB/s (of copy)", "torch-flash ms", "torch-flash TB/s (of copy)",
                        "torch-cudnn (cudnn) ms", "torch-cudnn TB/s (of copy)"]
    # copy: 2 GiB in 0.6 ms = 3.58 TB/s; cuflash: 1 GiB in 0.5 ms = 2.15 TB/s = 60% of it
    assert t.rows[0] == ["8x32x8x32768x128", "dense", "2", "1.0 GiB", "3.58", "0.500", "2.15 (60%)", "0.400",
                         "2.68 (75%)", "0.300", "3.58 (100%)"]
    assert t.rows[1][:3] == ["8x32x8x32768x128", "paged 256", ""] and t.rows[1][7:9] == ["unavailable", ""]
    assert host.header == ["B x H x H_kv x len x d", "cache", "cuflash", "torch-flash", "torch-cudnn"]
    assert host.rows == [["8x32x8x32768x128", "dense", "25.0", "25.0", "25.0"],
                         ["8x32x8x32768x128", "paged 256", "25.0", "unavailable", "25.0"]]
    assert t.caption == p["method"] and not_run.rows == [["torch-flash: unavailable: no kernel"]]
    lines = report.summary_lines("decode", suite)
    assert lines[0] == "decode: cuflash 1.95-2.15 TB/s, 55%-60% of the copy's (K and V read)"
    assert "decode: torch-flash GQA through expanded K/V heads to 32 (enable_gqa refused: x)" in lines
    assert "decode: copy 3.58-3.58 TB/s (read + written)" in lines
    md = report.markdown({"decode": suite})
    assert "| 8x32x8x32768x128 | dense | 2 | 1.0 GiB | 3.58 | 0.500 | 2.15 (60%) |" in md
    assert "| 8x32x8x32768x128 | paged 256 | 25.0 | unavailable | 25.0 |" in md


def test_cli_skips_decode_without_a_gpu(monkeypatch, tmp_path):
    lines, doc = run_without_a_gpu(monkeypatch, "decode", tmp_path / "d.json")
    assert lines[1] == ("decode (cpu, skipped): it times flash_attn_with_kvcache over KV caches of 0.5-1 GiB on a "
                        "CUDA GPU; this run is on the CPU")
    d = doc["suites"]["decode"]
    assert (d["status"], d["rows"], len(d["params"]["cells"])) == ("skipped", [], 2)
    assert invoke(["--help"]).output.count("decode") >= 2  # --suite lists it; --batch says its shapes are fixed
