"""Does TMA feed a skinny GEMM faster than pointer loads (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/tma_probe.py [T ...]``. The fused projection
at T = 48-256 streams the 84 MB weight from 80 programs (one per head) with ``tl.load`` pointer
tiles and reaches 0.85-0.9 of ``torch.mm``'s rate. This times the GEMM alone (no epilogue: each
program stores its ``[BLOCK_M, 128]`` tile of ``kv``) with the weight tiles loaded through pointers
or through a host-side TMA descriptor, over a few pipelines, beside ``torch.mm`` in one process
(CUDA-graph replays, rotating inputs, each variant alternated in a round, 3 rounds, medians).
Prints each variant's time over ``torch.mm``'s and its largest difference from it.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from probe_timing import gemm_inputs, largest_error, measure

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton
    TensorDescriptor = None


@triton.jit
def gemm(a, w, c_ptr, T, HIDDEN: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, STAGES: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr):  # fmt: skip
    """``c = a @ w^T`` tile by tile: ``w`` (and with ``A_TMA`` ``a`` too) a TMA descriptor, else a pointer."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, HIDDEN, BK, num_stages=STAGES):
        if A_TMA:
            a_tile = a.load([pid_m * BM, k])
        else:
            a_tile = tl.load(a + rm[:, None] * HIDDEN + (k + rk)[None, :], mask=(rm < T)[:, None], other=0.0)
        if W_TMA:
            acc = tl.dot(a_tile, w.load([pid_n * BN, k]).T, acc)
        else:
            acc = tl.dot(a_tile, tl.load(w + rn[None, :] * HIDDEN + (k + rk)[:, None]), acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=(rm < T)[:, None])


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [16, 64, 128, 256, 2048]
    device = torch.device("cuda")
    N, K = 10240, 4096
    weight = torch.randn(N, K, device=device, dtype=torch.bfloat16) / 64
    for T in tokens:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, T, 4 if T <= 256 else 1)
        variants = {"mm": mm_calls}
        for bm in (16,) if T <= 16 else (32,) if T <= 32 else (64,) if T <= 64 else (64, 128):
            for bk, stages, warps in ((64, 4, 4), (64, 6, 4), (128, 3, 4), (128, 4, 8)):
                grid = (triton.cdiv(T, bm), N // 128)
                meta = dict(HIDDEN=K, N=N, BM=bm, BN=128, BK=bk, STAGES=stages, num_warps=warps)
                tag = f"bm{bm}_bk{bk}_s{stages}_w{warps}"
                variants[f"ptr_{tag}"] = [
                    lambda h=h, o=o, g=grid, m=meta, t=T: gemm[g](h, weight, o, t, **m, W_TMA=False, A_TMA=False)
                    for h, o in zip(hiddens, outs, strict=True)
                ]
                if TensorDescriptor is not None:
                    w_desc = TensorDescriptor.from_tensor(weight, [128, bk])
                    variants[f"tma_{tag}"] = [
                        lambda h=h, o=o, d=w_desc, g=grid, m=meta, t=T: gemm[g](
                            h, d, o, t, **m, W_TMA=True, A_TMA=False
                        )
                        for h, o in zip(hiddens, outs, strict=True)
                    ]
                    if T % bm == 0:
                        a_descs = [TensorDescriptor.from_tensor(h, [bm, bk]) for h in hiddens]
                        variants[f"tma2_{tag}"] = [
                            lambda a=a, o=o, d=w_desc, g=grid, m=meta, t=T: gemm[g](
                                a, d, o, t, **m, W_TMA=True, A_TMA=True
                            )
                            for a, o in zip(a_descs, outs, strict=True)
                        ]

        med, errors = measure(f"T={T}", variants, largest_error(outs[0], ref))
        mm = med["mm"]
        best = sorted(med.items(), key=lambda kv: kv[1])
        print(f"T={T} mm {mm:.2f} us; best: " + ", ".join(f"{k} {v / mm:.3f} (err {errors[k]})" for k, v in best[:8]))
        for prefix in ("ptr_", "tma_", "tma2_"):
            mine = [(k, v) for k, v in best if k.startswith(prefix)]
            if mine:
                print(f"   best {prefix}: {mine[0][0]} {mine[0][1] / mm:.3f}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
