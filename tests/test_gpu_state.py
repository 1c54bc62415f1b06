"""The bench's record of the GPU's clock and power (`typedkv.tools.gpu_state`), against a scripted NVML."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from typedkv.tools import bench_e2e, gpu_state


def _fake_nvml(clocks: list[int], reasons: int = 0x4) -> SimpleNamespace:
    """An NVML whose SM clock reads ``clocks`` in turn (the last one repeated), at 690 W, with ``reasons``."""
    read = iter(clocks)
    last = [clocks[-1]]

    def clock(handle: str, kind: int) -> int:
        assert handle == "gpu0" and kind == 1
        last[0] = next(read, last[0])
        return last[0]

    return SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetPowerUsage=lambda handle: 690_000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: reasons,
        nvmlDeviceGetMaxClockInfo=lambda handle, kind: 1980,
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: 700_000,
    )


def test_summary_of_samples() -> None:
    """Median and lowest clock, median power, the share held at the power limit, every reason seen once."""
    samples = [(1980, 120.0, 0), (1500, 690.0, 0x4), (1550, 695.0, 0x4 | 0x40), (1400, 700.0, 0x4)]
    assert gpu_state.summary(samples) == {
        "samples": 4,
        "sm_mhz": 1525.0,
        "sm_mhz_low": 1400,
        "watts": 692.5,
        "at_power_limit": 0.75,
        "reasons": ["power limit", "hardware thermal"],
    }
    assert gpu_state.summary([]) == {"samples": 0}


def test_samples_only_inside_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread reads the device while a window is open and not after; the window's summary is what it read."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([1500, 1400, 1600]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    state = gpu_state.GpuState.open(torch.device("cuda", 0))
    assert state is not None
    try:
        assert state.limits() == {"max_sm_mhz": 1980.0, "power_limit_w": 700.0}
        with state.window() as window:
            assert window.summary == {}  # filled when the window closes
            deadline = time.monotonic() + 5
            while len(state._samples) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        sampled = window.summary
        assert sampled["samples"] >= 3
        assert sampled["sm_mhz_low"] == 1400 and sampled["at_power_limit"] == 1.0
        assert sampled["reasons"] == ["power limit"] and sampled["watts"] == 690.0
        closed_at = len(state._samples)
        time.sleep(0.05)
        assert len(state._samples) == closed_at  # nothing read between windows
    finally:
        state.close()
    assert not any(t.name == "typedkv-gpu-state" and t.is_alive() for t in threading.enumerate())


def test_nothing_to_read_gives_no_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA device, no ``pynvml``, an NVML that finds no driver, or a renumbered device not found: None."""
    assert gpu_state.GpuState.open(torch.device("cpu")) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert gpu_state.GpuState.open(torch.device("cuda", 0)) is None

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=no_driver))
    assert gpu_state.GpuState.open(torch.device("cuda", 0)) is None
    renumbered = _fake_nvml([1500])
    renumbered.nvmlDeviceGetCount = lambda: 1
    renumbered.nvmlDeviceGetUUID = lambda handle: "GPU-another-one"
    monkeypatch.setitem(sys.modules, "pynvml", renumbered)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="this-one"))
    assert gpu_state.GpuState.open(torch.device("cuda", 0)) is None
    renumbered.nvmlDeviceGetUUID = lambda handle: "GPU-this-one"
    found = gpu_state.GpuState.open(torch.device("cuda", 0))
    assert found is not None
    found.close()


def test_end_to_end_rows_record_the_gpu_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a sampler each row holds what was read while its rounds were timed (not while its graphs were
    captured), and the table prints it."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([1545]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    state = gpu_state.GpuState.open(torch.device("cuda", 0))
    assert state is not None

    def timer(calls: Any, sampling: Any = None) -> dict[str, list[float]]:
        assert not state._open.is_set()  # graphs would be captured here: not sampled
        with sampling:
            deadline = time.monotonic() + 5
            while not state._samples and time.monotonic() < deadline:
                time.sleep(0.01)
        return {impl: [10.0, 11.0] for impl in calls}

    tiny = bench_e2e.Draft(num_layers=2, num_kv_heads=2, head_dim=64, hidden=64, num_heads=4, dtype=torch.float32)
    try:
        result = bench_e2e.run_e2e(timer, torch.device("cpu"), (1, 5), tiny, gpu_state=state)
        result["gpu"] = state.limits()
    finally:
        state.close()
    for row in result["rows"]:
        assert row["gpu"]["sm_mhz"] == 1545 and row["gpu"]["at_power_limit"] == 1.0
    table = bench_e2e.e2e_table(result)
    assert "highest SM clock 1980.0 MHz, power limit 700.0 W" in table
    assert "  1545 (1545) MHz   690.0 W  100%  power limit" in table
    del result["rows"][0]["gpu"], result["rows"][1]["gpu"]
    assert "the GPU while each T was timed" not in bench_e2e.e2e_table(result)


def test_a_failing_query_ends_the_sampling_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NVML query that raises stops the thread; the window then reads no samples and the bench goes on."""
    nvml = _fake_nvml([1500])

    def gone(handle: str) -> int:
        raise RuntimeError("GPU is lost")

    nvml.nvmlDeviceGetPowerUsage = gone
    nvml.nvmlDeviceGetEnforcedPowerLimit = gone
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    state = gpu_state.GpuState.open(torch.device("cuda", 0))
    assert state is not None
    with state.window() as window:
        state._thread.join(timeout=5)
    assert not state._thread.is_alive() and window.summary == {"samples": 0}
    assert state.limits() == {}  # the bench prints "?" for them
    state.close()


@pytest.mark.gpu
def test_reads_the_real_gpu_cuda() -> None:
    """On a CUDA machine with NVML: the limits and a window over a few matrix products read plausible values."""
    pytest.importorskip("pynvml")
    state = gpu_state.GpuState.open(torch.device("cuda"))
    assert state is not None
    try:
        limits = state.limits()
        assert limits["max_sm_mhz"] >= 500 and limits["power_limit_w"] > 50
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        with state.window() as window:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                for _ in range(20):
                    a @ a  # the products are the load; their results are not used
                torch.cuda.synchronize()
        read = window.summary
        assert read["samples"] >= 10
        assert 100 <= read["sm_mhz_low"] <= read["sm_mhz"] <= limits["max_sm_mhz"]
        assert 0 < read["watts"] and 0 <= read["at_power_limit"] <= 1
    finally:
        state.close()
