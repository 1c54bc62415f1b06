"""The GPU's clocks and power while ``torch.mm`` and `KVMaterializer` run (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/clock_probe.py [--seconds S] [--idle S] [T ...]``.
The end-to-end ratios move by up to 10% between device calls on the same code (T = 64 read 1.035 to
1.09 each / ``torch.mm``; T = 1024 0.96 to 1.10; benchmarks/NOTES.md), while each call's rounds agree
within 1-2%. This asks whether the machines differ in clock: a kernel bound by its instructions
slows with the SM clock where one bound by memory does not. Only reads the GPU's state (NVML);
changes nothing.

For each T (64 and 1024 unless given), the end-to-end bench's draft and calls (dense outputs,
`typedkv._bench_e2e`): ``torch.mm`` alone, the materializer's default path, GEMM + kernel and the fused path, each
captured in one CUDA graph as the bench captures it. Then, three rounds, the variants alternated:

- **burst**: the bench's own timing (five replays, `typedkv._bench._replay_us`), the SM clock sampled
  meanwhile;
- **sustained**: replays back to back for ``--seconds`` (1.0), the time per call over the last 70%,
  the SM clock, power and the clock-event reasons sampled every ~2 ms over the same window;
- **cold**: ``--idle`` seconds (0.3) with the GPU idle, then the bench's burst: a burst short enough to
  end before the power limit pulls the clock down times the variant at the clock it starts at.

Each line: T, variant, mode, microseconds per call, its ratio to ``torch.mm`` of the same round and
mode, the median and lowest SM clock in MHz, median power in W and the event reasons seen. First: the
device's maximum SM and memory clocks, its enforced power limit and the idle clocks.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import torch

from typedkv import KVMaterializer, _bench, _bench_e2e

try:
    import pynvml  # nvidia-ml-py
except ImportError:  # pragma: no cover - the device image has it
    pynvml = None

# NVML's clock-event reason bits (nvml.h, nvmlClocksEventReason*).
REASONS = {
    0x1: "idle",
    0x2: "app-clocks",
    0x4: "sw-power-cap",
    0x8: "hw-slowdown",
    0x10: "sync-boost",
    0x20: "sw-thermal",
    0x40: "hw-thermal",
    0x80: "hw-power-brake",
    0x100: "display",
}


class Sampler:
    """A thread reading the SM clock (MHz), power (W) and event reasons every ``interval`` s while on."""

    def __init__(self, index: int, interval: float = 0.002) -> None:
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval = interval
        self.samples: list[tuple[float, int, float, int]] = []
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _reasons(self) -> int:
        get = (
            getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return int(get(self.handle))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.05):
                clock = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
                power = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
                self.samples.append((time.perf_counter(), clock, power, self._reasons()))
                time.sleep(self.interval)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Median and lowest clock, median power and the reasons of the samples taken in ``[start, end]``."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {"mhz": None, "mhz_low": None, "watts": None, "reasons": "", "samples": 0}
        reasons = 0
        for s in inside:
            reasons |= s[3]
        names = ",".join(name for bit, name in REASONS.items() if reasons & bit) or "-"
        return {
            "mhz": statistics.median(s[1] for s in inside),
            "mhz_low": min(s[1] for s in inside),
            "watts": round(statistics.median(s[2] for s in inside), 1),
            "reasons": names,
            "samples": len(inside),
        }

    def on(self) -> None:
        self._on.set()

    def off(self) -> None:
        self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._on.set()
        self._thread.join()


def sustained(graph: torch.cuda.CUDAGraph, num_calls: int, seconds: float) -> tuple[float, float, float]:
    """Replays of ``graph`` back to back for ``seconds``: (us per call over the last 70%, window start, end)."""
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    warm_until = began + 0.3 * seconds
    while time.perf_counter() < warm_until:
        graph.replay()
        torch.cuda.synchronize()
    window_start = time.perf_counter()
    start_event.record()
    replays = 0
    while time.perf_counter() < began + seconds:
        graph.replay()
        replays += 1
        if replays % 8 == 0:
            torch.cuda.synchronize()  # keep the host near the device: the window's clock samples are its own
    end_event.record()
    end_event.synchronize()
    window_end = time.perf_counter()
    return start_event.elapsed_time(end_event) * 1e3 / (replays * num_calls), window_start, window_end


def main() -> None:
    args = sys.argv[1:]
    seconds = 1.0
    if "--seconds" in args:
        at = args.index("--seconds")
        seconds = float(args[at + 1])
        del args[at : at + 2]
    idle = 0.3
    if "--idle" in args:
        at = args.index("--idle")
        idle = float(args[at + 1])
        del args[at : at + 2]
    tokens = [int(a) for a in args] or [64, 1024]
    if pynvml is None:
        print("clock_probe: pynvml (nvidia-ml-py) is not installed")
        return
    pynvml.nvmlInit()
    device = torch.device("cuda")
    index = torch.cuda.current_device()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    print(
        f"device {torch.cuda.get_device_name(device)}; max SM "
        f"{pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)} MHz, max memory "
        f"{pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)} MHz, enforced power limit "
        f"{pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000:.0f} W; now SM "
        f"{pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)} MHz, memory "
        f"{pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)} MHz, "
        f"{pynvml.nvmlDeviceGetPowerUsage(handle) / 1000:.0f} W, "
        f"{pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)} C",
        flush=True,
    )
    draft, _, rotary, weight, norm, flat = _bench_e2e.bench_draft(device)
    materializers = {}
    for path in ("auto", "gemm", "fused"):
        materializers[path] = KVMaterializer(weight, norm, 1e-6, rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
        materializers[path].projection_path = path
    sampler = Sampler(index)
    print(f"{'T':>6} {'variant':<14} {'mode':<9} {'us':>9} {'/ mm':>6} {'MHz':>5} {'low':>5} {'W':>6}  reasons")
    try:
        for num_tokens in tokens:
            sets = 4 if num_tokens <= _bench_e2e.ROTATE_UP_TO else 1
            inputs = [_bench_e2e._inputs(draft, num_tokens, device) for _ in range(sets)]
            gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
            calls = _bench_e2e._calls(inputs, flat, gemm_out, materializers, None)
            names = ["mm", "typedkv", "typedkv_gemm", "typedkv_fused"]
            graphs = {name: _bench._captured(calls[name], 20) for name in names}
            for round_index in range(3):
                measured: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
                for name in _bench.round_order(names, round_index):
                    graph, num_calls = graphs[name]
                    time.sleep(idle)
                    sampler.on()
                    began = time.perf_counter()
                    cold = _bench._replay_us(graph, num_calls, 5)
                    measured[name, "cold"] = (cold, sampler.window(began, time.perf_counter()))
                    began = time.perf_counter()
                    burst = _bench._replay_us(graph, num_calls, 5)
                    measured[name, "burst"] = (burst, sampler.window(began, time.perf_counter()))
                    us, start, end = sustained(graph, num_calls, seconds)
                    sampler.off()
                    measured[name, "sustained"] = (us, sampler.window(start, end))
                for mode in ("cold", "burst", "sustained"):
                    for name in names:
                        us, state = measured[name, mode]
                        ratio = us / measured["mm", mode][0]
                        print(
                            f"{num_tokens:>6} {name:<14} {mode:<9} {us:>9.2f} {ratio:>6.3f} {_f(state['mhz'])} "
                            f"{_f(state['mhz_low'])} {_f(state['watts'], 6)}  {state['reasons']} "
                            f"({state['samples']} samples)",
                            flush=True,
                        )
            del graphs, calls, inputs, gemm_out
            torch.cuda.empty_cache()
    finally:
        sampler.close()
        pynvml.nvmlShutdown()


def _f(value: Any, width: int = 5) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}}"


if __name__ == "__main__":
    main()
