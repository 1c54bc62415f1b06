"""The bench's host-time section alone, for an A/B of two checkouts (a developer script for a CUDA machine).

Not part of the package. Usage: ``python benchmarks/host_ratios.py LABEL``, with PYTHONPATH
naming the checkout to measure. Prints one line per public call: ``LABEL name ratio us``, the
ratio as `typedkv bench` reports it (the median over rounds of the call's host microseconds over a
bare ``kernel[grid]`` launch of the K/V kernel timed beside it, `_bench.paired_host_time_us`), then
the bare launch.
Checkouts before 2026-12-02 have no ``*_t64`` lines (`KVMaterializer`'s calls at T = 64).
"""

from __future__ import annotations

import sys

import torch

from typedkv import _bench


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    host = _bench.host_overhead(torch.device("cuda"))
    for key, ratio in host.items():
        if key.endswith("_vs_bare") and key != "debug_vs_bare":
            name = key.removesuffix("_vs_bare")
            print(f"{label} {name:>38} {ratio:6.3f} {host.get(f'{name}_us', 0.0):8.2f} us", flush=True)
    print(f"{label} {'bare_launch':>38} {'':6} {host['bare_launch_us']:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
