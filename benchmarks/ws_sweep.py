"""Where the warp-specialised projection kernel beats GEMM + kernel: the T table's data (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/ws_sweep.py [T ...]`` (default 256 to 65536).
The end-to-end bench's draft, weights and timer (`typedkv._bench_e2e.run_e2e`, CUDA graphs,
medians), with this device's entry of `typedkv._fused_ws.PROJECTION_WS_FASTER` widened to every T,
so the materializer pinned to "fused" launches the warp-specialised kernel wherever it can. Two
rounds; per T and round, each / ``torch.mm`` alone: that kernel (dense, per-layer pools) and
GEMM + kernel (dense, per-layer pools).
"""

from __future__ import annotations

import math
import sys

import torch

from typedkv import _bench, _bench_e2e, _fused_ws


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [256, 512, 768, 1024, 1536, 2048, 4096, 16384, 65536]
    device = torch.device("cuda")
    _fused_ws.PROJECTION_WS_FASTER[torch.cuda.get_device_name(device)] = ((0, math.inf),)
    print(f"{'round':>5} {'T':>6} {'mm us':>9} {'ws':>6} {'ws pool':>8} {'gemm':>6} {'gemm pool':>9}", flush=True)
    for round_ in (1, 2):
        for row in _bench_e2e.run_e2e(_bench.gpu_time_us, device, tokens)["rows"]:
            r = row["ratio"]
            print(
                f"{round_:>5} {row['tokens']:>6} {row['us']['mm']:>9.2f} {r['typedkv_fused / mm']:>6.3f} "
                f"{r['typedkv_pool_fused / mm']:>8.3f} {r['typedkv_gemm / mm']:>6.3f} {r['typedkv_pool_gemm / mm']:>9.3f}",
                flush=True,
            )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
