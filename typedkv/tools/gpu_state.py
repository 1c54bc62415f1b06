"""The GPU's SM clock and power while the bench times something, read through NVML where it is installed.

A GEMM of the bench's end-to-end section draws the board's power limit within milliseconds, and the
driver lowers the SM clock to stay under it, which slows the GEMM by a fifth or so
(docs/decisions/013-end-to-end-timing.md). Memory-bound work slows less than the GEMM, so every
ratio to ``torch.mm`` depends on how long the GPU ran at its limit, and a second machine whose chip
holds a lower clock at the same power reads other ratios from the same code. The bench records, for each row it times,
the SM clock and power it sampled meanwhile and the share of samples the driver held at the power
limit, so that two runs' tables can be told apart by the state they were measured in.

Only reads: NVML's queries change nothing on the device. Without NVML (``nvidia-ml-py``, imported
as ``pynvml``) or without a CUDA device there is nothing to read and nothing is recorded. The SM
clock is read as it is at each sample; the power is NVML's reading, which the driver averages
over up to a second, so short bursts read low.
"""

from __future__ import annotations

import importlib
import os
import statistics
import threading
import time
from contextlib import suppress
from types import TracebackType
from typing import Any

import torch

# NVML's clock-event reason bits (nvml.h, nvmlClocksEventReason*), the ones that lower the clock.
REASONS = {
    0x4: "power limit",
    0x8: "hardware slowdown",
    0x20: "software thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
}
POWER_LIMIT = 0x4


def _nvml() -> Any:
    """The ``pynvml`` module, initialised, or None where it is not installed or finds no driver."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # not installed, or no NVML library / driver on this machine
        return None
    return nvml


def _shutdown(nvml: Any) -> None:
    """Release `_nvml`'s initialisation (NVML counts them); quietly, as the sampling is optional."""
    with suppress(Exception):
        nvml.nvmlShutdown()


def _nvml_index(nvml: Any, cuda_index: int) -> int | None:
    """NVML's index of CUDA device ``cuda_index``: the same unless ``CUDA_VISIBLE_DEVICES`` renumbers them.

    Renumbered, the device is found by its UUID (None where none matches: nothing is recorded).
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return cuda_index
    uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    for index in range(nvml.nvmlDeviceGetCount()):
        if uuid in str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))):
            return index
    return None


class Window:
    """A span of sampling: entered, the sampler reads the device; left, ``summary`` holds what it read.

    ``summary`` is `summary`'s dict (empty until the window is left).
    """

    def __init__(self, state: GpuState) -> None:
        self._state = state
        self.summary: dict[str, Any] = {}

    def __enter__(self) -> Window:
        self._state._begin()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.summary = self._state._end()


class GpuState:
    """A thread that samples one GPU's SM clock, power and clock-event reasons while a `Window` is open.

    Parameters
    ----------
    nvml : module
        ``pynvml``, initialised (`open` finds it).
    index : int
        The device's NVML index (`_nvml_index`).
    interval_s : float
        Seconds between samples while a window is open (each sample is four NVML queries).
    """

    def __init__(self, nvml: Any, index: int, interval_s: float = 0.005) -> None:
        self._nvml = nvml
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        # Renamed from "throttle" to "event" reasons in later NVML releases; either reads the same bits.
        self._reasons = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self._interval = interval_s
        self._samples: list[tuple[int, float, int]] = []
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="typedkv-gpu-state", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, device: torch.device, interval_s: float = 0.005) -> GpuState | None:
        """A sampler of ``device`` (a sample every ``interval_s`` in a window), or None where it is no CUDA
        device or NVML is not available."""
        if device.type != "cuda":
            return None
        nvml = _nvml()
        if nvml is None:
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            found = _nvml_index(nvml, index)
            if found is not None:
                return cls(nvml, found, interval_s)
        except Exception:  # an NVML without this device or these queries: record nothing
            pass
        _shutdown(nvml)
        return None

    def limits(self) -> dict[str, float]:
        """The device's highest SM clock (MHz) and the power limit the driver enforces (W); empty if NVML fails."""
        nvml = self._nvml
        try:
            return {
                "max_sm_mhz": float(nvml.nvmlDeviceGetMaxClockInfo(self._handle, nvml.NVML_CLOCK_SM)),
                "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000.0,
            }
        except Exception:  # the bench goes on without them
            return {}

    def _sample(self) -> tuple[int, float, int]:
        nvml = self._nvml
        clock = int(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        power = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        return clock, power, int(self._reasons(self._handle))

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._open.wait(0.1):
                continue
            try:
                sample = self._sample()
            except Exception:  # the driver stopped answering: the windows from here on read no samples
                return
            with self._lock:
                if self._open.is_set():
                    self._samples.append(sample)
            time.sleep(self._interval)

    def window(self) -> Window:
        """A `Window`: sampling while it is entered, its ``summary`` once it is left."""
        return Window(self)

    def _begin(self) -> None:
        with self._lock:
            self._samples = []
        self._open.set()

    def _end(self) -> dict[str, Any]:
        self._open.clear()
        with self._lock:
            return summary(self._samples)

    def close(self) -> None:
        """Stop the thread and release NVML."""
        self._stop.set()
        self._thread.join()
        _shutdown(self._nvml)


def summary(samples: list[tuple[int, float, int]]) -> dict[str, Any]:
    """Median and lowest SM clock, median power, the share of samples held at the power limit, the reasons seen.

    ``samples``: ``(SM clock MHz, power W, clock-event reason bits)`` each. Empty: ``{"samples": 0}``.
    """
    if not samples:
        return {"samples": 0}
    seen = 0
    for _, _, reasons in samples:
        seen |= reasons
    return {
        "samples": len(samples),
        "sm_mhz": statistics.median(s[0] for s in samples),
        "sm_mhz_low": min(s[0] for s in samples),
        "watts": round(statistics.median(s[1] for s in samples), 1),
        "at_power_limit": round(sum(1 for s in samples if s[2] & POWER_LIMIT) / len(samples), 2),
        "reasons": [name for bit, name in REASONS.items() if seen & bit],
    }
