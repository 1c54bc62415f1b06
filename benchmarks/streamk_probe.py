"""Is a skinny GEMM faster spread evenly over every SM (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/streamk_probe.py [--check] [T ...]``.

At T <= 256 the fused projection runs one program per (token block, head): 80 programs for the
bench's draft (5 layers, 8 KV heads, D = 128, hidden 4096) on 132 SMs. splitk_probe.py split
the hidden dimension of each tile over 2 or 4 programs and was slower, but those programs ran in
two waves (160 programs of 144 KB of shared memory, one an SM) or shared SMs unevenly. Here the
work is cut the stream-K way: the tiles' k-steps laid end to end (``tiles * k_steps`` of them)
and cut into ``P`` equal runs, one a program, ``P`` the SM count: every SM pulls the same bytes.
A program whose run covers a whole tile stores it; a tile cut between programs is summed by the
last of them to arrive (each stores its float32 partial, bumps the tile's counter; the last
loads the partials in run order, so the sum does not depend on who came last, stores the tile
and resets the counter for the next call). That last program is where the fused kernel's K/V
epilogue would run.

Variants, each / ``torch.mm`` (CUDA-graph replays, rotating inputs, alternated, 3 rounds,
medians): ``tiles`` (one program a tile, as the fused kernel now) and ``streamk`` (``P`` = the
SM count, and twice that where two programs fit an SM), each over a few k-step widths and
pipeline depths, A and W tiles by TMA.

``--check``: no timing; on CPU unless CUDA is there (the interpreter: float32), small sizes and
every cut (a tile's run over one, two or three programs), each against ``a @ w^T``, twice (the
counters must come back to zero).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton
    TensorDescriptor = None


@triton.jit
def gemm_streamk(a_desc, w_desc, part_ptr, count_ptr, c_ptr, T, N, TILES_N, K_STEPS, TOTAL, P,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 MAX_CUTS: tl.constexpr):  # fmt: skip
    """``c = a @ w^T``: program ``pid`` runs the k-steps ``[pid * TOTAL // P, (pid + 1) * TOTAL // P)``."""
    pid = tl.program_id(0)
    start = pid * TOTAL // P
    end = (pid + 1) * TOTAL // P
    rm_ = tl.arange(0, BM)
    rn_ = tl.arange(0, BN)
    while start < end:
        tile = start // K_STEPS
        k0 = start - tile * K_STEPS
        k1 = tl.minimum(K_STEPS, k0 + end - start)
        pid_m = tile // TILES_N
        pid_n = tile - pid_m * TILES_N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(k0, k1, num_stages=STAGES):
            a = a_desc.load([pid_m * BM, k * BK])
            w = w_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, w.T, acc)
        rm = pid_m * BM + rm_
        rn = pid_n * BN + rn_
        out = c_ptr + rm[:, None] * N + rn[None, :]
        if k1 - k0 == K_STEPS:
            tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rm < T)[:, None])
        else:
            # The programs whose runs cut this tile: the first and the last k-step's.
            first = ((tile * K_STEPS + 1) * P - 1) // TOTAL
            last = ((tile * K_STEPS + K_STEPS) * P - 1) // TOTAL
            tile_parts = part_ptr + tile * (MAX_CUTS * BM * BN) + rm_[:, None] * BN + rn_[None, :]
            tl.store(tile_parts + (pid - first) * (BM * BN), acc, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's partial stored before the one atomic that publishes them
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for cut in range(0, last - first + 1):
                    total += tl.load(tile_parts + cut * (BM * BN), cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
                tl.store(out, total.to(c_ptr.dtype.element_ty), mask=(rm < T)[:, None])
        start += k1 - k0


class Gemm:
    """One configuration's launch over fixed ``weight`` ``[N, K]``: ``__call__(a, c)`` writes ``a @ weight^T`` to ``c``."""

    def __init__(
        self, weight: torch.Tensor, num_tokens: int, bm: int, bk: int, stages: int, programs: int | None
    ) -> None:
        n, k = weight.shape
        self.bm, self.bk, self.stages = bm, bk, stages
        self.n, self.tiles_n, self.k_steps = n, n // 128, k // bk
        self.tiles = triton.cdiv(num_tokens, bm) * self.tiles_n
        self.total = self.tiles * self.k_steps
        self.programs = self.tiles if programs is None else programs
        per = self.total // self.programs
        self.max_cuts = triton.next_power_of_2(max(2, triton.cdiv(self.k_steps, max(per, 1)) + 1))
        dev = weight.device
        self.parts = torch.empty(self.tiles * self.max_cuts * bm * 128, device=dev, dtype=torch.float32)
        self.counts = torch.zeros(self.tiles, device=dev, dtype=torch.int32)
        self.w_desc = TensorDescriptor.from_tensor(weight, [128, bk])
        self.num_tokens = num_tokens

    def a_desc(self, a: torch.Tensor) -> object:
        return TensorDescriptor.from_tensor(a, [self.bm, self.bk])

    def __call__(self, a_desc: object, c: torch.Tensor) -> None:
        gemm_streamk[(self.programs,)](
            a_desc, self.w_desc, self.parts, self.counts, c, self.num_tokens, self.n, self.tiles_n, self.k_steps,
            self.total, self.programs, BM=self.bm, BN=128, BK=self.bk, STAGES=self.stages, MAX_CUTS=self.max_cuts,
            num_warps=8 if self.bm == 128 else 4,
        )  # fmt: skip


def check() -> int:
    """Every cut against ``a @ w^T`` on small sizes, each configuration twice (the counters reset)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's tl.dot: not bf16
    bad = 0
    weight = torch.randn(512, 256, device=device).to(dtype) / 16
    for num_tokens, bm in ((5, 16), (40, 32), (70, 64)):
        a = torch.randn(num_tokens, 256, device=device).to(dtype)
        want = (a.double() @ weight.double().t()).float()
        for programs in (None, 3, 5, 7, 11):
            gemm = Gemm(weight, num_tokens, bm, 64, 2, programs)
            if gemm.programs > gemm.total:
                continue
            for _ in range(2):
                c = torch.full((num_tokens, 512), float("nan"), device=device, dtype=dtype)
                gemm(gemm.a_desc(a), c)
                error = (c.float() - want).abs().max().item()
                ok = error <= 2e-2 if dtype == torch.bfloat16 else error <= 1e-4
                ok = ok and int(gemm.counts.sum().item()) == 0
                bad += not ok
            print(f"check T={num_tokens} bm={bm} programs={gemm.programs} (cuts <= {gemm.max_cuts}) "
                  f"max error {error:.3g} {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    return 1 if bad else 0


def main() -> int:
    if "--check" in sys.argv:
        return check()
    from probe_timing import gemm_inputs, largest_error, measure, report

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n, k = 10240, 4096
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / 64
    for num_tokens in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [16, 64, 128, 256]:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, num_tokens, 4)
        variants: dict[str, Sequence[Callable[[], object]]] = {"mm": mm_calls}
        bm = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64 if num_tokens <= 64 else 128
        # (BK, stages): about 200 KB of stages one program an SM, about 100 KB two.
        for bk in (64, 128):
            stage_kb = (bm + 128) * bk * 2 / 1024
            one = int(200 // stage_kb)
            two = int(100 // stage_kb)
            for tag, programs, stages in (("tiles", None, one), ("streamk", sms, one), ("streamk2", 2 * sms, two)):
                if stages < 2:
                    continue
                gemm = Gemm(weight, num_tokens, bm, bk, stages, programs)
                descs = [gemm.a_desc(h) for h in hiddens]
                variants[f"{tag}_bm{bm}_bk{bk}_s{stages}"] = [
                    lambda g=gemm, d=d, o=o: g(d, o) for d, o in zip(descs, outs, strict=True)
                ]

        # Three calls: the counters must come back to zero, which later calls check.
        report(f"T={num_tokens}", *measure(f"T={num_tokens}", variants, largest_error(outs[0], ref, calls=3)))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
