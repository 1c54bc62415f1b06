"""Does the fused path's time at small T depend on where the weights lie in memory (a developer script for the H200)?

Not part of the package. Usage: ``python benchmarks/placement_probe.py [T ...]`` (64 unless given).

At T = 64 four runs of the end-to-end bench on 2026-12-04 read the materializer at 1.048, 1.060,
1.074-1.079 and 1.098 of ``torch.mm``, every one at 1980 MHz with ``torch.mm`` at 22.8-23.4 µs, while
each run's rounds agreed within about 1%. Each run allocated its weights once. Here four copies of
the bench's weights, each its own allocation (so at other physical addresses), and a fifth that is
the first shifted by 8 KB plus 128 bytes within a larger allocation: per copy, ``torch.mm`` and the
materializer pinned to the fused path (dense), all ten alternated in each of seven rounds
(`typedkv._bench.paired_gpu_time_us`, four input sets in turn). Prints per copy the fused path's time
over ``torch.mm`` of the same copy and round (median, range) and ``torch.mm``'s µs. If the copies
differ by more than their rounds do, where the weights lie is one cause of the spread between runs.

``--inputs``: the first copy of the weights only, and five groups of input sets instead (each its own
four ``hidden`` / ``positions`` allocations, a spacer of a few MB between groups so they land
elsewhere): per group the fused path over ``torch.mm`` of the same inputs. The weights' copies did
not explain the spread between processes; this asks whether where the caller's inputs lie does.
Run on the H200 (2026-12-04, three processes in one device call): at T = 64 the groups of a process
agree within 1 point (1.054-1.064, 1.054-1.060, 1.039-1.049); between processes the fused path held
24.5-25.0 µs and ``torch.mm`` moved (23.4 µs in the first two, 23.5-23.7 in the third). No.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

from typedkv import KVMaterializer, _bench, _bench_e2e


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64]
    device = torch.device("cuda")
    bench = _bench_e2e.bench_draft(device)
    if "--inputs" in sys.argv:
        for num_tokens in tokens:
            _by_inputs(bench, num_tokens)
            torch.cuda.empty_cache()
        return
    copies = [bench.weight] + [bench.weight.clone() for _ in range(3)]
    # The fifth: the first copy's values 8 KB + 128 bytes further on within one allocation.
    shift = (8192 + 128) // bench.weight.element_size()
    room = torch.empty(bench.weight.numel() + shift, device=device, dtype=bench.weight.dtype)
    copies.append(room[shift:].view_as(bench.weight))
    copies[-1].copy_(bench.weight)
    for i, w in enumerate(copies):
        print(f"copy {i}: weight at 0x{w.data_ptr():x}", flush=True)
    for num_tokens in tokens:
        _one(bench, copies, num_tokens)
        torch.cuda.empty_cache()


def _one(bench: _bench_e2e.BenchDraft, copies: list[torch.Tensor], num_tokens: int) -> None:
    draft, device = bench.draft, bench.flat.device
    inputs = [_bench_e2e._inputs(draft, num_tokens, device) for _ in range(4)]
    out = torch.empty(num_tokens, bench.flat.shape[0], device=device, dtype=draft.dtype)
    calls: dict[str, list[Callable[[], None]]] = {}
    for i, w in enumerate(copies):
        m = KVMaterializer(w, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
        m.projection_path = "fused"
        flat = w.flatten(0, 1)
        calls[f"mm{i}"] = [_mm(x.hidden, flat, out) for x in inputs]
        calls[f"fused{i}"] = [_fused(m, x.hidden, x.positions) for x in inputs]
    rounds = _bench.paired_gpu_time_us(calls, rounds=7)
    for i in range(len(copies)):
        ratio = _bench_e2e.paired_ratio(rounds[f"fused{i}"], rounds[f"mm{i}"])
        print(
            f"T={num_tokens} copy {i}: fused / mm {ratio.median:.3f} ({ratio.low:.3f}-{ratio.high:.3f}), "
            f"mm {statistics.median(rounds[f'mm{i}']):.2f} us, fused {statistics.median(rounds[f'fused{i}']):.2f} us",
            flush=True,
        )


def _by_inputs(bench: _bench_e2e.BenchDraft, num_tokens: int) -> None:
    draft, device = bench.draft, bench.flat.device
    m = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
    m.projection_path = "fused"
    flat = bench.weight.flatten(0, 1)
    out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
    calls: dict[str, list[Callable[[], None]]] = {}
    spacers = []  # held to the end: each group's inputs then lie past every spacer before them
    for g in range(5):
        spacers.append(torch.empty((g + 1) * 3 * 2**20 + 128 * g, device=device, dtype=torch.uint8))
        inputs = [_bench_e2e._inputs(draft, num_tokens, device) for _ in range(4)]
        print(f"group {g}: hidden at " + ", ".join(f"0x{x.hidden.data_ptr():x}" for x in inputs), flush=True)
        calls[f"mm{g}"] = [_mm(x.hidden, flat, out) for x in inputs]
        calls[f"fused{g}"] = [_fused(m, x.hidden, x.positions) for x in inputs]
    rounds = _bench.paired_gpu_time_us(calls, rounds=7)
    for g in range(5):
        ratio = _bench_e2e.paired_ratio(rounds[f"fused{g}"], rounds[f"mm{g}"])
        print(
            f"T={num_tokens} inputs {g}: fused / mm {ratio.median:.3f} ({ratio.low:.3f}-{ratio.high:.3f}), "
            f"mm {statistics.median(rounds[f'mm{g}']):.2f} us, fused {statistics.median(rounds[f'fused{g}']):.2f} us",
            flush=True,
        )
    del spacers


def _mm(hidden: torch.Tensor, flat: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    def call() -> None:
        torch.mm(hidden, flat.t(), out=out)

    return call


def _fused(m: KVMaterializer, hidden: torch.Tensor, positions: torch.Tensor) -> Callable[[], None]:
    def call() -> None:
        m(hidden, positions)

    return call


if __name__ == "__main__":
    main()
