"""Which kernels cuBLAS runs for the end-to-end bench's ``torch.mm``, with their grids, at each T.

Not part of the package. Usage: ``python benchmarks/mm_kernels.py [T ...]`` (default 16 64 128 256
512 1024 2048 16384). For each T: the draft's ``hidden [T, 4096] @ W^T [4096, L*2*H*D]`` under
torch.profiler, each CUDA kernel's name, grid, block, shared memory and registers (from the trace's
event arguments) and its mean time. The tile shape and whether cuBLAS splits the hidden dimension
(split-K, stream-K: "segment_k", a reduction kernel) say what a fused GEMM must match at that T.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from typedkv._bench_e2e import Draft


def main() -> None:
    counts = [int(a) for a in sys.argv[1:]] or [16, 64, 128, 256, 512, 1024, 2048, 16384]
    device = torch.device("cuda")
    draft = Draft()
    rows = draft.num_layers * 2 * draft.num_kv_heads * draft.head_dim
    weight = torch.randn(rows, draft.hidden, device=device, dtype=draft.dtype) / draft.hidden**0.5
    for num_tokens in counts:
        hidden = torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype)
        for _ in range(5):
            torch.mm(hidden, weight.t())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                torch.mm(hidden, weight.t())
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        seen: dict[tuple[str, str, str, str, str], list[float]] = defaultdict(list)
        for event in events:
            if event.get("cat") != "kernel":
                continue
            args = event.get("args", {})
            key = (
                event["name"],
                str(args.get("grid")),
                str(args.get("block")),
                str(args.get("shared memory")),
                str(args.get("registers per thread")),
            )
            seen[key].append(float(event.get("dur", 0.0)))
        for (name, grid, block, smem, regs), durations in seen.items():
            mean = sum(durations) / len(durations)
            print(
                f"T={num_tokens:<6} {mean:9.2f} us x{len(durations):<3} grid {grid} block {block} smem {smem} regs {regs}"
            )
            print(f"         {name}")


if __name__ == "__main__":
    main()
