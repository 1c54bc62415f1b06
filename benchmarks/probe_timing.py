"""What the GEMM probes (tma_probe.py, splitk_probe.py, persistent_probe.py) share: check each variant once, then time them.

Not part of the package; imported by those scripts (run as ``python benchmarks/NAME.py``, this
directory first on the path).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from typedkv import _bench

Variants = Mapping[str, Sequence[Callable[[], object]]]


def measure(
    label: str, variants: Variants, check: Callable[[str, Sequence[Callable[[], object]]], str], *,
    rounds: int = 3, replays: int = 10, min_calls: int = 20,
) -> tuple[dict[str, float], dict[str, str]]:  # fmt: skip
    """Each variant's median microseconds and ``check``'s verdict on it.

    ``check(name, calls)`` runs the variant's first call (as often as it needs) and returns what
    it found (its largest error, say); a variant whose check raises (a configuration that does not
    compile or fit) is reported under ``label`` and left out. The others are timed as
    `typedkv._bench` times (CUDA-graph replays over the rotating calls), each variant once per
    round, ``rounds`` rounds, so that the host's slow spells fall on all of them.
    """
    errors: dict[str, str] = {}
    for name, calls in variants.items():
        try:
            errors[name] = check(name, calls)
            torch.cuda.synchronize()
        except Exception as e:  # a configuration that does not compile or fit: skip it
            print(f"{label} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in errors}
    for _ in range(rounds):
        for name in errors:
            times[name].append(_bench.gpu_time_us(variants[name], replays=replays, min_calls=min_calls))
    return {name: statistics.median(t) for name, t in times.items()}, errors
