"""The bench's host-time section alone, for an A/B of two checkouts (a developer script for a CUDA machine).

Not part of the package. Usage: ``python benchmarks/host_ratios.py LABEL``, with PYTHONPATH
naming the checkout to measure. Prints one line per public call: ``LABEL name ratio us``, the
ratio as `typedkv bench` reports it (the call's host microseconds over a bare ``kernel[grid]``
launch of the K/V kernel timed right after it, in the same process), then the bare launch.
A checkout whose bench has no ``*_t64`` lines (`KVMaterializer`'s calls at T = 64, where its
fused kernel loads the weight by TMA; added 2026-12-02) gets them timed here the same way.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from typedkv import _bench, _launch


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    device = torch.device("cuda")
    host = _bench.host_overhead(device)
    if not any(key.endswith("_t64_vs_bare") for key in host):
        host |= _t64(device)
    for key, ratio in host.items():
        if key.endswith("_vs_bare") and key != "debug_vs_bare":
            name = key.removesuffix("_vs_bare")
            print(f"{label} {name:>38} {ratio:6.3f} {host.get(f'{name}_us', 0.0):8.2f} us", flush=True)
    print(f"{label} {'bare_launch':>38} {'':6} {host['bare_launch_us']:8.2f} us", flush=True)


def _t64(device: torch.device) -> dict[str, float]:
    """`KVMaterializer`'s calls at T = 64 over a bare launch, as a bench with ``*_t64`` lines times them."""
    x = _bench.make_inputs(_bench.MAIN, 16, device)
    H = _bench.MAIN.num_kv_heads
    grid, params, num_warps = _launch.launch_params(
        x.kv, x.weight, x.eps, x.cos_sin, x.positions, None,
        x.k_out, (x.k_out.stride(0), x.k_out.stride(1), 0, x.k_out.stride(2)),
        x.v_out, (x.v_out.stride(0), x.v_out.stride(1), 0, x.v_out.stride(2)),
        None, num_kv_heads=H, head_dim=x.weight.shape[1], page_size=1, num_rows=16, neox=True,
    )  # fmt: skip
    kernel: Any = _launch.materialize_kv_kernel

    def bare() -> None:
        kernel[grid](*params, num_warps=num_warps)

    calls = _bench.public_calls(device, 64)
    out = {}
    for name in ("materializer_call", "materializer_into_pool_per_layer"):
        us, bare_us = _bench.host_time_us(calls[name]), _bench.host_time_us(bare)
        out[f"{name}_t64_us"] = round(us, 2)
        out[f"{name}_t64_vs_bare"] = round(us / bare_us, 3)
    return out


if __name__ == "__main__":
    main()
