"""Does a persistent GEMM hide a norm + RoPE epilogue at large T (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/persistent_probe.py [T ...]``. The fused
projection runs one program per (token block, head) tile, one program per SM (131 KB of shared
memory), so a program's epilogue (round, RMSNorm over the head row, RoPE between the halves,
stores) does not overlap any loads: 1.20x ``torch.mm`` at T = 2048 where the GEMM alone by TMA
runs at 1.02x. This times one GEMM kernel, ``c = a @ w^T`` in ``[BM, 128]`` tiles by TMA,
with the epilogue or without, launched one program per tile or persistent (one program per
SM looping over the tiles in bands). Each beside ``torch.mm`` in one process (CUDA-graph
replays, rotating inputs, alternated, 3 rounds, medians).

Not here: the persistent loop flattened with its inner loop (``tl.range(flatten=True)``, the
next tile's loads issued during this tile's epilogue) or warp-specialised. On the H200 with
Triton 3.6 the first version of this script, which had them, printed nothing in 330 s (each
variant compiles in about a second for sm_90 on a CPU, so it ran and did not return), and
tritonbench allows ``flatten`` on Hopper with neither warp-specialisation path
(meta-pytorch/tritonbench#1025).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from probe_timing import gemm_inputs, measure, report

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton
    TensorDescriptor = None


@triton.jit
def gemm_tiles(a_desc, w_desc, norm_ptr, positions_ptr, cos_sin_ptr, c_ptr, T, PROGRAMS, HIDDEN: tl.constexpr,
               N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               EPILOGUE: tl.constexpr):  # fmt: skip
    """``c = a @ w^T`` tile by tile, program ``p`` taking tiles ``p, p + PROGRAMS, ...`` in bands of ``GROUP_M``."""
    num_m = tl.cdiv(T, BM)
    num_n: tl.constexpr = N // BN
    num_tiles = num_m * num_n
    HALF: tl.constexpr = BN // 2
    for tile in tl.range(tl.program_id(0), num_tiles, PROGRAMS):
        per_band = GROUP_M * num_n
        first = (tile // per_band) * GROUP_M
        size = tl.minimum(num_m - first, GROUP_M)
        pid_m = first + (tile % per_band) % size
        pid_n = (tile % per_band) // size
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, HIDDEN, BK):
            acc = tl.dot(a_desc.load([pid_m * BM, k]), w_desc.load([pid_n * BN, k]).T, acc)
        rm = pid_m * BM + tl.arange(0, BM)
        m_ok = rm < T
        x = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        if EPILOGUE:
            # As the fused kernel's K head: RMSNorm over the row, rounded, then NeoX RoPE of its halves.
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / BN + 1e-6)[:, None]
            y = (x * rstd * tl.load(norm_ptr + tl.arange(0, BN))[None, :].to(tl.float32)).to(c_ptr.dtype.element_ty)
            y1, y2 = tl.split(tl.permute(tl.reshape(y.to(tl.float32), (BM, 2, HALF)), (0, 2, 1)))
            pos = tl.load(positions_ptr + rm, mask=m_ok, other=0)
            pair = tl.arange(0, HALF)
            cos = tl.load(cos_sin_ptr + pos[:, None] * BN + pair[None, :])
            sin = tl.load(cos_sin_ptr + pos[:, None] * BN + HALF + pair[None, :])
            x = tl.reshape(tl.permute(tl.join(y1 * cos - y2 * sin, y2 * cos + y1 * sin), (0, 2, 1)), (BM, BN))
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], x.to(c_ptr.dtype.element_ty), mask=m_ok[:, None])


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [2048, 16384]
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    N, K, BN = 10240, 4096, 128
    weight = torch.randn(N, K, device=device, dtype=torch.bfloat16) / 64
    norm = torch.rand(BN, device=device, dtype=torch.bfloat16) + 0.5
    cos_sin = torch.randn(32768, BN, device=device, dtype=torch.float32)
    for T in tokens:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, T, 2)
        positions = torch.randint(0, 32768, (T,), device=device, dtype=torch.int32)
        variants = {"mm": mm_calls}
        for bm, bk, stages, warps in ((128, 64, 4, 8), (128, 64, 3, 8), (128, 64, 4, 4), (128, 128, 3, 8)):
            w_desc = TensorDescriptor.from_tensor(weight, [BN, bk])
            a_descs = [TensorDescriptor.from_tensor(h, [bm, bk]) for h in hiddens]
            tiles = triton.cdiv(T, bm) * (N // BN)
            for epilogue in (False, True):
                for how, programs in (("tiles", tiles), ("persistent", sms)):
                    meta = dict(HIDDEN=K, N=N, BM=bm, BN=BN, BK=bk, GROUP_M=8, EPILOGUE=epilogue,
                                num_warps=warps, num_stages=stages)  # fmt: skip
                    name = f"{'epi' if epilogue else 'gemm'}_{how}_bm{bm}_bk{bk}_s{stages}_w{warps}"
                    variants[name] = [
                        lambda a=a, o=o, p=programs, m=meta, d=w_desc, pos=positions, t=T: gemm_tiles[(p,)](
                            a, d, norm, pos, cos_sin, o, t, p, **m
                        )
                        for a, o in zip(a_descs, outs, strict=True)
                    ]

        def check(
            name: str, calls: Sequence[Callable[[], object]], out: torch.Tensor = outs[0], ref: torch.Tensor = ref
        ) -> str:
            out.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize()
            if name.startswith("epi"):
                return "nan" if out.isnan().any().item() else "-"
            return f"{(out.float() - ref.float()).abs().max().item():.3g}"

        report(f"T={T}", *measure(f"T={T}", variants, check, replays=5, min_calls=10))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
