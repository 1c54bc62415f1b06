"""Does a skinny GEMM gain from more programs than heads (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/splitk_probe.py [T ...]``. At T <= 64 the
fused projection runs one token block, one program per 128 columns: 80 programs for the bench's
draft on 132 SMs, so 52 SMs pull no weight bytes. This times the GEMM alone (``c = a @ w^T``, weight tiles by TMA)
with the columns cut finer (64 per program: 160 programs) and with the hidden dimension split
over ``SPLIT`` programs per tile: each stores its float32 partial tile to a workspace, bumps the
tile's arrival counter, and the last to arrive sums the partials in split order (deterministic)
and stores the tile, then resets the counter (so CUDA-graph replays need no memset). That last
program is where the fused kernel's epilogue would run. Each variant beside ``torch.mm`` in one
process (CUDA-graph replays, rotating inputs, alternated, 3 rounds, medians); prints each
variant's time over ``torch.mm``'s and its largest difference from it. On the H200 (2026-12-01,
benchmarks/NOTES.md) neither finer columns nor a split hidden dimension was faster at any T.
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
def gemm_split(a, w, part_ptr, count_ptr, c_ptr, T, M_PAD, HIDDEN: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """``c = a @ w^T`` by ``[BM, BN]`` tiles, the hidden dimension split over ``SPLIT`` programs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    span: tl.constexpr = HIDDEN // SPLIT
    for k in tl.range(pid_s * span, pid_s * span + span, BK, num_stages=STAGES):
        a_tile = tl.load(a + rm[:, None] * HIDDEN + (k + rk)[None, :], mask=(rm < T)[:, None], other=0.0)
        acc = tl.dot(a_tile, w.load([pid_n * BN, k]).T, acc)
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        parts = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(parts + pid_s * M_PAD * N, acc, cache_modifier=".cg")
        # Every thread's partial is stored before the one atomic that publishes them.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(parts + s * M_PAD * N, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], total.to(c_ptr.dtype.element_ty), mask=(rm < T)[:, None])
    else:
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=(rm < T)[:, None])


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [16, 32, 64, 128, 256]
    device = torch.device("cuda")
    N, K = 10240, 4096
    weight = torch.randn(N, K, device=device, dtype=torch.bfloat16) / 64
    for T in tokens:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, T, 4)
        variants = {"mm": mm_calls}
        bms = (16,) if T <= 16 else (32,) if T <= 32 else (64,) if T <= 64 else (64, 128)
        for bm in bms:
            m_pad = triton.cdiv(T, bm) * bm
            for bn in (128, 64):
                for split in (1, 2, 4):
                    for bk, stages, warps in ((128, 4, 4), (64, 6, 4), (128, 3, 4)):
                        if bm == 128 and bk == 128 and stages == 4:
                            continue  # over the shared memory
                        grid = (triton.cdiv(T, bm), N // bn, split)
                        parts = torch.empty(split, m_pad, N, device=device, dtype=torch.float32)
                        counts = torch.zeros(grid[0] * grid[1], device=device, dtype=torch.int32)
                        w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
                        meta = dict(HIDDEN=K, N=N, BM=bm, BN=bn, BK=bk, STAGES=stages, SPLIT=split, num_warps=warps)
                        variants[f"bm{bm}_bn{bn}_split{split}_bk{bk}_s{stages}_w{warps}"] = [
                            lambda h=h, o=o, g=grid, m=meta, p=parts, c=counts, d=w_desc, mp=m_pad, t=T: gemm_split[g](
                                h, d, p, c, o, t, mp, **m
                            )
                            for h, o in zip(hiddens, outs, strict=True)
                        ]

        # Three calls: the counters must come back to zero, which a second call checks.
        med, errors = measure(f"T={T}", variants, largest_error(outs[0], ref, calls=3))
        mm = med["mm"]
        best = sorted(med.items(), key=lambda kv: kv[1])
        print(f"T={T} mm {mm:.2f} us; best: " + ", ".join(f"{k} {v / mm:.3f} (err {errors[k]})" for k, v in best[:10]))
        for tag in ("bn128_split1", "bn64_split1", "bn128_split2", "bn128_split4", "bn64_split2", "bn64_split4"):
            mine = [(k, v) for k, v in best if tag in k]
            if mine:
                print(f"   best {tag}: {mine[0][0]} {mine[0][1] / mm:.3f} (err {errors[mine[0][0]]})", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
