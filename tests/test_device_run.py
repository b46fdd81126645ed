"""bench/device_run.sh, the one-call GPU run: a GPU suite that hangs (a kernel waiting forever on a barrier,
say) must end the stage with a failure, never pass silently or stall the call. Checked without a GPU: a
stand-in python3 on PATH answers the setup commands and hangs in pytest."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hanging_gpu_suite_fails_the_stage(tmp_path):
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$*" in *pytest*) exec sleep 60 ;; esac\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "TEST_SECONDS": "2"}
    run = subprocess.run(["bash", "bench/device_run.sh", "test"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=50)
    assert run.returncode != 0
    assert "stage test: exit 124" in (tmp_path / "out" / "gpu.txt").read_text()


def test_a_hung_test_stops_the_suite_early(tmp_path):
    """Once pytest's faulthandler has dumped a hung test's stacks, the suite is stopped: the stage fails at once
    instead of holding the machine until TEST_SECONDS."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$*" in *pytest*) echo "..Timeout (0:01:30)!"; exec sleep 60 ;; esac\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "TEST_SECONDS": "40"}
    run = subprocess.run(["bash", "bench/device_run.sh", "test"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode != 0
    assert "a test hung" in (tmp_path / "out" / "pytest_gpu.log").read_text()
    assert "stage test: exit 124" not in (tmp_path / "out" / "gpu.txt").read_text()
