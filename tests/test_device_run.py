"""bench/device_run.sh, the one-call GPU run: a GPU suite that hangs (a kernel waiting forever on a barrier,
say) must end the stage with a failure, never pass silently or stall the call. Checked without a GPU: a
stand-in python3 on PATH answers the setup commands and hangs in pytest."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stand_in_python(tmp_path, script: str) -> Path:
    """A python3 at tmp_path/bin running the shell script (its arguments in $*); returns its folder, for PATH."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\n{script}")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake.parent


def _run_test_stage(tmp_path, pytest_script: str, test_seconds: int, timeout: int):
    """bench/device_run.sh test, with a stand-in python3 that runs pytest_script for pytest (exits 0 otherwise)."""
    bin_dir = _stand_in_python(tmp_path, f'case "$*" in *pytest*) {pytest_script} ;; esac\nexit 0\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "TEST_SECONDS": str(test_seconds)}
    run = subprocess.run(["bash", "bench/device_run.sh", "test"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return run, (tmp_path / "out" / "gpu.txt").read_text()


def test_hanging_gpu_suite_fails_the_stage(tmp_path):
    run, gpu_txt = _run_test_stage(tmp_path, "exec sleep 60", test_seconds=2, timeout=50)
    assert run.returncode != 0
    assert "stage test: exit 124" in gpu_txt


def test_a_hung_test_stops_the_suite_early(tmp_path):
    """Once pytest's faulthandler has dumped a hung test's stacks, the suite is stopped: the stage fails at once
    instead of holding the machine until TEST_SECONDS."""
    run, gpu_txt = _run_test_stage(tmp_path, 'echo "..Timeout (0:01:30)!"; exec sleep 60', test_seconds=40,
                                   timeout=30)
    assert run.returncode != 0
    assert "a test hung" in (tmp_path / "out" / "pytest_gpu.log").read_text()
    assert "stage test: exit 124" not in gpu_txt


def test_gpu_suite_runs_every_file_once_in_concurrent_groups(tmp_path):
    """The suite's groups name existing files, and the last group runs every other file: no file twice, none left."""
    run, gpu_txt = _run_test_stage(tmp_path, 'echo "1 passed"', test_seconds=20, timeout=30)
    assert run.returncode == 0 and "stage test: exit 0" in gpu_txt
    sections = (tmp_path / "out" / "pytest_gpu.log").read_text().split("== pytest -m gpu ")[1:]
    named = [a.split("\n")[0].split() for a in sections[:-1]]
    rest = sections[-1].split("\n")[0].split()
    assert len(sections) >= 2 and rest[0] == "tests"
    files = [f for group in named for f in group]
    assert all((ROOT / f).is_file() for f in files) and len(set(files)) == len(files)
    assert sorted(rest[1:]) == sorted(f"--ignore={f}" for f in files)


def test_ab_runs_each_stage_on_both_trees_and_packs_the_outputs(tmp_path):
    """bench/ab.sh: every stage runs in OLD's folder with OLD first on the import path, then in this tree; the
    outputs come back in one tarball (the device tool returns at most 8 files)."""
    import tarfile

    bin_dir = _stand_in_python(tmp_path, 'echo "cwd=$PWD path=$PYTHONPATH args=$*"\n')
    old = tmp_path / "old"
    old.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "OLD": str(old), "PYTHONPATH": "/site", "BENCH_ARGS": "--family mma --backends cuflash,torch-flash"}
    run = subprocess.run(["bash", "bench/ab.sh", "causal", "headdim", "det", "decode", "det-mma"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not run.stderr, run.stderr  # no command of the script failed
    with tarfile.open(tmp_path / "out" / "ab.tgz") as tar:
        logs = {m.name.lstrip("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    for stage, args in (("compile", "-m cuflash compile"), ("causal", "--suite seqlen"), ("headdim", "--suite headdim"),
                        ("det", "deterministic"), ("decode", "--suite decode")):
        assert f"cwd={old} path={old}:/site" in logs[f"{stage}-old.log"] and args in logs[f"{stage}-old.log"]
        assert f"cwd={ROOT} path={ROOT}:/site" in logs[f"{stage}-new.log"] and args in logs[f"{stage}-new.log"]
    assert logs["ab.txt"].count("exit 0") == 12
    assert logs["det-old.log"].rstrip().endswith("det-old.json") and logs["det-mma-new.log"].rstrip().endswith(" mma")
    # BENCH_ARGS last on the `cuflash bench` stages (a later option wins), nowhere else
    for stage in ("causal", "headdim", "decode"):
        assert logs[f"{stage}-new.log"].rstrip().endswith("--family mma --backends cuflash,torch-flash")
    assert "--family" not in logs["det-new.log"] and "--family" not in logs["compile-new.log"]


def test_targets_stage_runs_every_family_dtype_and_mask(tmp_path):
    """bench/device_run.sh targets: each family's seqlen suite and head-dim sweep for bf16 and fp16, causal and
    not, against its baselines, and its deterministic ratio, each into its own JSON and log; a failing run fails
    the stage."""
    # echoes its arguments; `bench/deterministic.py ... mma` fails, as one crashed run would
    bin_dir = _stand_in_python(tmp_path, 'echo "args=$*"\ncase "$*" in *deterministic.py*mma) exit 3 ;; esac\nexit 0\n')
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out)}
    run = subprocess.run(["bash", "bench/device_run.sh", "targets"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0 and "stage targets: exit 3" in (out / "gpu.txt").read_text()
    for family, baselines in (("sm90", "cuflash,torch-flash,torch-cudnn"), ("mma", "cuflash,torch-flash")):
        for dtype in ("bf16", "fp16"):
            for mask in ("causal", "no-causal"):
                name = out / f"bench-{family}-{dtype}-{mask}"
                args = (name.with_suffix(".log")).read_text()
                assert f"--family {family} --suite seqlen,headdim --dtype {dtype} --{mask} " in args
                assert f"--backends {baselines} --json {name}.json" in args
        det = (out / f"det-{family}.log").read_text().strip()
        assert det == f"args=bench/deterministic.py {out}/det-{family}.json {family}"
