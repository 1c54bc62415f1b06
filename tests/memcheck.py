"""Run a script under compute-sanitizer's memcheck: the GPU suites' shared check that no kernel reads or
writes out of bounds (tests/fuzz_sample.py, tests/mla_fuzz_sample.py, tests/fused_sample.py, and the
GPU suite's own script)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


def run_under_memcheck(script: Path, args: Sequence[str], done: str, timeout: int) -> None:
    """``python script *args`` under memcheck: exit status 0, ``done`` printed, and no error reported.

    Skips the calling test where compute-sanitizer is not installed.
    """
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer is not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [tool, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, str(script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    assert done in report and "ERROR SUMMARY: 0 errors" in report, report[-4000:]
