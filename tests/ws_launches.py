"""Where the warp-specialised kernel runs; it taken at every T there, and its launches counted.

`typedkv.projection.warp_specialized` runs the fused path from the T its measured table
(`typedkv.projection.tuning.Tuning.warp_specialized_faster`) gives. Its GPU tests
(tests/test_gpu_fused_ws.py, as fixtures), its sanitizer script
(tests/fused_ws_sample.py) and the two-GPU worker (tests/tp_worker.py, under
``torchrun``, where no pytest fixture runs) widen that table so that small calls
take the kernel, and count the kernel's launches so that a check of this kernel
cannot pass on another one. Both context managers put the module's attribute back
on exit. tests/test_fused_ws.py checks them on the CPU. `runs_here` is the condition
all of them (and tests/test_tp.py) skip on.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from typedkv.projection import tuning, warp_specialized


def runs_here() -> bool:
    """Whether the kernel can run here: a CUDA device of sm_90 and Triton 3.6's Gluon."""
    return torch.cuda.is_available() and warp_specialized.available() and torch.cuda.get_device_capability() == (9, 0)


@contextlib.contextmanager
def taken_everywhere(device_name: str) -> Iterator[None]:
    """The measured table widened to every T on the device named ``device_name`` (``torch.cuda.get_device_name``),
    this kernel's range alone: every other device and path as measured."""
    table = tuning.TUNING
    tuning.TUNING = {**table, **dict([tuning.measured(device_name, warp_specialized_faster=((1, math.inf),))])}
    try:
        yield
    finally:
        tuning.TUNING = table


@contextlib.contextmanager
def counted_launches() -> Iterator[list[int]]:
    """The token counts of the kernel's launches (dense and into pools), in order, while the block runs."""
    seen: list[int] = []
    launch = warp_specialized._launch_kernel

    def counted(hidden: Any, *args: Any) -> None:
        seen.append(hidden.shape[0])
        launch(hidden, *args)

    warp_specialized._launch_kernel = counted  # type: ignore[assignment]  # (the same call, counted)
    try:
        yield seen
    finally:
        warp_specialized._launch_kernel = launch
