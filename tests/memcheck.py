"""Run a script under compute-sanitizer's memcheck: the GPU suites' shared check that no kernel reads or
writes out of bounds (tests/fuzz_sample.py, tests/mla_fuzz_sample.py, tests/fused_sample.py,
tests/fused_ws_sample.py and the GPU suite's own script); synccheck on one kernel (tests/fused_ws_sample.py's
warp-specialised kernel: shared memory handed between warps by mbarriers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


def run_under_memcheck(
    script: Path, args: Sequence[str], done: str, timeout: int, tool: str = "memcheck", kernel: str | None = None
) -> None:
    """``python script *args`` under compute-sanitizer's ``tool``: exit status 0, ``done`` printed, and no error
    (racecheck: no hazard) reported.

    ``kernel``: only the kernels whose names contain it are checked (synccheck and racecheck slow every
    kernel they watch by orders of magnitude). Skips the calling test where compute-sanitizer is not installed.
    """
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed")
    only = ["--kernel-name", f"kns={kernel}"] if kernel is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sanitizer, "--tool", tool, *only, "--error-exitcode", "1", sys.executable, str(script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    clean = "RACECHECK SUMMARY: 0 hazards displayed" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert done in report and clean in report, report[-4000:]
