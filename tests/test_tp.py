"""Tensor parallelism: KV heads sharded across two ranks, typedkv called on each (`tests/tp_worker.py`).

Each rank writes its pool shard with a ``KVMaterializer`` built from its heads'
weight rows; the pools gathered from both ranks must be, bit for bit, the pool one
process writes with all heads. The worker runs under ``torch.distributed.run``
(two processes): on two CUDA devices over NCCL (``gpu`` marker, ``nox -s tp``), and
on the CPU over gloo, so that the suite proves the sharding on every run -- the
PyTorch reference path, or the Triton kernel when ``TRITON_INTERPRET=1`` (fewer
tokens then: the interpreter takes about 14 ms per token and layer).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_worker import CASES, runs_of
from ws_launches import runs_here

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "tp_worker.py"
RANKS = 2
TIMEOUT_S = 300
# As typedkv reads it.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def run_worker(*args: str, runs: int = len(CASES)) -> str:
    """``torch.distributed.run`` of the worker on `RANKS` processes; fails with its output unless every case passed.

    ``--standalone`` rendezvouses on a free local port, so parallel runs do not collide.
    The launcher and its workers get a session of their own: a run past the timeout is
    killed whole, not leaving workers behind.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
        str(WORKER), *args,
    ]  # fmt: skip
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        # The workers import this checkout's typedkv, installed or not (a script's own folder is on
        # its path, not the repository root).
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", "")))},
    ) as launcher:  # fmt: skip
        try:
            output, _ = launcher.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output, _ = launcher.communicate()
            pytest.fail(f"{' '.join(command)}: no result after {TIMEOUT_S} s\n{output}")
    assert launcher.returncode == 0, f"{' '.join(command)}: exit status {launcher.returncode}\n{output}"
    # Every rank reported every case: a worker that checked nothing cannot pass.
    passed = re.findall(r"^rank \d+/\d+ .*: OK, bit for bit$", output, re.MULTILINE)
    assert len(passed) == RANKS * runs, output
    return output


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason=f"needs {RANKS} CUDA devices")
def test_two_gpu_tensor_parallel() -> None:
    """Two CUDA ranks over NCCL, on each projection path: the gathered pool shards are the full-head pool, bit for bit."""
    paths = ("auto", "fused", "gemm", "op", "mla")
    run_worker("--backend", "nccl", "--device", "cuda", "--paths", ",".join(paths), runs=runs_of(paths))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason=f"needs {RANKS} CUDA devices")
@pytest.mark.skipif(not runs_here(), reason="the warp-specialised kernel runs on sm_90 with Triton 3.6's Gluon")
def test_two_gpu_tensor_parallel_warp_specialised() -> None:
    """The same with heads of 128 and the warp-specialised kernel taken at every T it can run.

    Each rank holds two heads: one of the kernel's two-head tiles a layer's K or V.
    """
    output = run_worker(
        "--backend", "nccl", "--device", "cuda", "--head-dim", "128", "--hidden", "256", "--ws-everywhere",
    )  # fmt: skip
    # The cases it can run (NeoX over the whole head, no FP8 pool) took it: not a test of the other kernel alone.
    launches = re.search(r"^tp_worker: (\d+) launches of the warp-specialised kernel", output, re.MULTILINE)
    assert launches is not None and int(launches[1]) > 0, output


def test_two_cpu_ranks_tensor_parallel() -> None:
    """Two CPU ranks over gloo: the same check, on the reference path or the interpreted kernel."""
    paths = ("auto", "op", "mla")
    tokens = ("--tokens", "11") if INTERPRETED else ()
    run_worker("--backend", "gloo", "--device", "cpu", "--paths", ",".join(paths), *tokens, runs=runs_of(paths))
