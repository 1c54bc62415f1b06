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
mode, the median and lowest SM clock in MHz, median power in W and the reasons that lowered the clock.
First: the device's highest SM clock and its enforced power limit. The sampling is the bench's own
(`typedkv._gpu_state.GpuState`, a `Window` around each timed span).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from typedkv import _bench, _bench_e2e
from typedkv._gpu_state import GpuState, Window


def sustained(graph: torch.cuda.CUDAGraph, num_calls: int, seconds: float, window: Window) -> float:
    """Replays of ``graph`` back to back for ``seconds``: us per call over the last 70%, ``window`` open over it."""
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    warm_until = began + 0.3 * seconds
    while time.perf_counter() < warm_until:
        graph.replay()
        torch.cuda.synchronize()
    with window:
        start_event.record()
        replays = 0
        while time.perf_counter() < began + seconds:
            graph.replay()
            replays += 1
            if replays % 8 == 0:
                torch.cuda.synchronize()  # keep the host near the device: the window's clock samples are its own
        end_event.record()
        end_event.synchronize()
    return start_event.elapsed_time(end_event) * 1e3 / (replays * num_calls)


def burst(graph: torch.cuda.CUDAGraph, num_calls: int, window: Window) -> float:
    """The bench's timing of ``graph`` (five replays), ``window`` open over it."""
    with window:
        return _bench._replay_us(graph, num_calls, 5)


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
    device = torch.device("cuda")
    state = GpuState.open(device, interval_s=0.002)
    if state is None:
        print("clock_probe: NVML cannot be read here (nvidia-ml-py not installed, or no driver)")
        return
    print(f"device {torch.cuda.get_device_name(device)}; {state.limits()}", flush=True)
    bench = _bench_e2e.bench_draft(device)
    draft, flat = bench.draft, bench.flat
    materializers = _bench_e2e.path_materializers(bench)
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
                    for mode in ("cold", "burst"):
                        window = state.window()
                        measured[name, mode] = (burst(graph, num_calls, window), window.summary)
                    window = state.window()
                    measured[name, "sustained"] = (sustained(graph, num_calls, seconds, window), window.summary)
                for mode in ("cold", "burst", "sustained"):
                    for name in names:
                        us, read = measured[name, mode]
                        ratio = us / measured["mm", mode][0]
                        print(
                            f"{num_tokens:>6} {name:<14} {mode:<9} {us:>9.2f} {ratio:>6.3f} {_f(read.get('sm_mhz'))} "
                            f"{_f(read.get('sm_mhz_low'))} {_f(read.get('watts'), 6)}  "
                            f"{', '.join(read.get('reasons', [])) or '-'} ({read['samples']} samples)",
                            flush=True,
                        )
            del graphs, calls, inputs, gemm_out
            torch.cuda.empty_cache()
    finally:
        state.close()


def _f(value: Any, width: int = 5) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}}"


if __name__ == "__main__":
    main()
