"""Developer script for the GPU: would more programs stream the weights faster at small T?

Not part of the package. Usage: ``python benchmarks/tile_rows_probe.py [T ...]`` (default 16 64), on a
CUDA machine; ``--check`` on the CPU under ``TRITON_INTERPRET=1`` runs every variant on a small shape in
float16 against ``torch.mm`` and times nothing.

Up to T = 128 the fused kernel runs 80 programs for the bench's draft (10240 weight rows, one head of
128 rows a program: K's norm runs over the whole head), one an SM, each streaming 1 MB of weights; 52
of the H200's and H100's 132 SMs stay idle. cuBLAS runs 80 CTAs at T = 16 and 92 (tiles of 112 weight
rows) at T = 64, where it is 1-3% faster than the fused kernel. Before any epilogue is designed
around tiles that are not whole heads, this probe asks whether a plain GEMM (``hidden @ W^T``, no
epilogue, the output stored as is) gets faster with more, smaller tiles: rows a program of 128 (80
programs), 64 (160: more than one wave), 80 as tiles of 64 and 16 rows (128 programs, every SM but
four busy), 96 as 64 and 32 (107), and 112 as 64, 32 and 16 (92, cuBLAS's count). Every tile of a
program is loaded by TMA in each step of one pipelined loop over ``hidden``'s columns. Timed as the
bench times (CUDA-graph replays over rotating weight sets, the variants and ``torch.mm`` interleaved
in balanced rounds: `typedkv._bench.paired_gpu_time_us`); each line: the variant, its µs and the
median of its per-round ratios to ``torch.mm``.
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch
import triton
import triton.language as tl

from typedkv import _bench, _bench_e2e
from typedkv._launch import TensorDescriptor

HIDDEN, ROWS_ALL = 4096, 10240  # the bench's draft: 5 layers x 2 x 8 heads x 128
# name: (row pieces a program, block_k, stages)
VARIANTS: dict[str, tuple[tuple[int, ...], int, int]] = {
    "rows128": ((128,), 64, 8),
    "rows64": ((64,), 64, 6),  # 96 KB of shared memory: two programs an SM, all 160 at once
    "rows80": ((64, 16), 64, 8),
    "rows96": ((64, 32), 64, 8),
    "rows112": ((64, 32, 16), 64, 8),
    "rows128_k128": ((128,), 128, 4),
    "rows80_k128": ((64, 16), 128, 6),
}


@triton.jit
def _gemm_rows_kernel(h_desc, w1_desc, w2_desc, w3_desc, out_ptr, out_stride, num_tokens,
                      ROWS1: tl.constexpr, ROWS2: tl.constexpr, ROWS3: tl.constexpr, ACC2: tl.constexpr,
                      ACC3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HIDDEN_: tl.constexpr,
                      N: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """``out[:, rows] = hidden @ W[rows]^T`` for one program's rows: pieces of ROWS1, ROWS2 and ROWS3 (0: none;
    ACC2 / ACC3 the accumulators' widths, 16 for a piece that is none)."""
    pid = tl.program_id(0)
    first = pid * (ROWS1 + ROWS2 + ROWS3)
    acc1 = tl.zeros((BLOCK_M, ROWS1), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, ACC2), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, ACC3), dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN_, BLOCK_K, num_stages=STAGES):
        a = h_desc.load([0, k0])
        acc1 = tl.dot(a, w1_desc.load([first, k0]).T, acc1)
        if ROWS2 > 0:
            acc2 = tl.dot(a, w2_desc.load([first + ROWS1, k0]).T, acc2)
        if ROWS3 > 0:
            acc3 = tl.dot(a, w3_desc.load([first + ROWS1 + ROWS2, k0]).T, acc3)
    tok = tl.arange(0, BLOCK_M)
    tok_ok = tok < num_tokens
    row_base = out_ptr + tok[:, None] * out_stride + first
    cols1 = tl.arange(0, ROWS1)
    tl.store(
        row_base + cols1[None, :],
        acc1.to(out_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & (first + cols1 < N)[None, :],
    )
    if ROWS2 > 0:
        cols2 = ROWS1 + tl.arange(0, ROWS2)
        tl.store(row_base + cols2[None, :], acc2.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (first + cols2 < N)[None, :])  # fmt: skip
    if ROWS3 > 0:
        cols3 = ROWS1 + ROWS2 + tl.arange(0, ROWS3)
        tl.store(row_base + cols3[None, :], acc3.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (first + cols3 < N)[None, :])  # fmt: skip


def gemm_rows(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, variant: str) -> None:
    """``out = hidden @ weight^T`` by the probe kernel in ``variant``'s tiles (``hidden``'s T at most 128)."""
    pieces, block_k, stages = VARIANTS[variant]
    rows = (*pieces, 0, 0)[:3]
    num_tokens, hidden_size = hidden.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(num_tokens))
    h_desc = TensorDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [block_m, block_k])
    w_descs = [TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [max(r, 16), block_k]) for r in rows]
    grid = (triton.cdiv(n, sum(pieces)),)
    _gemm_rows_kernel[grid](
        h_desc, *w_descs, out, out.stride(0), num_tokens, *rows, max(rows[1], 16), max(rows[2], 16),
        block_m, block_k, hidden_size, n, stages, num_warps=4,
    )  # fmt: skip


def _mm(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(hidden, weight.T, out=out)


def check() -> None:
    """Every variant against torch.mm on a small float16 shape (the interpreter's dot is wrong in bf16)."""
    g = torch.Generator().manual_seed(0)
    for num_tokens in (1, 16, 64):
        hidden = torch.randn(num_tokens, 256, generator=g).half()
        weight = (torch.randn(2 * 3 * 7 * 16 * 5 - 70, 256, generator=g) / 16).half()  # 560 rows: tails for each
        want = (hidden.float() @ weight.float().T).half()
        for variant in VARIANTS:
            out = torch.full((num_tokens, weight.shape[0]), float("nan"), dtype=torch.half)
            gemm_rows(hidden, weight, out, variant)
            err = (out.float() - want.float()).abs().max().item()
            print(f"check T={num_tokens:<3} {variant:>13}: max |err| {err:.3g}", flush=True)
            assert err < 0.05, (variant, num_tokens, err)


def main() -> None:
    if "--check" in sys.argv:
        check()
        return
    tokens = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [16, 64]
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    sets = 3  # 3 x 84 MB of weights: no set is in L2 when its turn comes
    weights = [(torch.randn(ROWS_ALL, HIDDEN, device=device, generator=g) / 64).bfloat16() for _ in range(sets)]
    for num_tokens in tokens:
        hiddens = [torch.randn(num_tokens, HIDDEN, device=device, generator=g).bfloat16() for _ in range(sets)]
        outs = [torch.empty(num_tokens, ROWS_ALL, device=device, dtype=torch.bfloat16) for _ in range(sets)]
        for variant in VARIANTS:
            gemm_rows(hiddens[0], weights[0], outs[0], variant)
            want = hiddens[0].float() @ weights[0].float().T
            err = (outs[0].float() - want).abs().max().item()
            print(f"T={num_tokens} {variant}: max |err| {err:.3g} against float32", flush=True)
        triples = list(zip(hiddens, weights, outs, strict=True))
        calls = {"mm": [functools.partial(_mm, *t) for t in triples]}
        for variant in VARIANTS:
            calls[variant] = [functools.partial(gemm_rows, *t, variant) for t in triples]
        for _ in range(2):
            times = _bench.paired_gpu_time_us(calls)
            for variant in VARIANTS:
                ratio = _bench_e2e.paired_ratio(times[variant], times["mm"])
                print(
                    f"T={num_tokens:<4} {variant:>13} {statistics.median(times[variant]):8.2f} us  "
                    f"mm {statistics.median(times['mm']):8.2f} us  ratio {ratio.median:.3f} "
                    f"({ratio.low:.3f}-{ratio.high:.3f})",
                    flush=True,
                )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
