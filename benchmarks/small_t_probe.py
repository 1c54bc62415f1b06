"""The projection GEMM at small T with the weight's ring apart from ``hidden``'s (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/small_t_probe.py [T ...]`` on the GPU (Triton 3.6's
Gluon); ``python benchmarks/small_t_probe.py --compile`` compiles every variant for sm_90 on the CPU
(no GPU) and prints its registers, shared memory and whether it was warp-specialised.

The question. At T <= 64 the fused projection runs one program per 128-row head (80 programs) and
its time is the weight's 84 MB arriving. Its ring (`typedkv._launch.PROJECTION_BLOCKS_TMA`) holds, per
stage, the head's weight tile and a tile of ``hidden``: at T = 33-64 that is 64 of ``hidden``'s rows
beside 128 weight rows, so a third of the ring holds ``hidden`` (9 stages of 16 KB of weight in
flight, against 6 of 32 KB at T <= 16), and the kernel reads 1.08x ``torch.mm`` at T = 64 against
1.01-1.02x at T = 16 and 48 (benchmarks/NOTES.md). ``hidden`` is small (512 KB at T = 64) and shared
by every program, so it sits in L2 and needs a short ring only. Here the two rings are apart:

* ``joint_s9`` (and ``joint_s8``): one ring, ``hidden``'s and the weight's tile per stage, one load
  warp: the layout of today's kernel;
* ``apart_a{A}_w{W}``: ``hidden``'s ring of ``A`` stages and the weight's of ``W`` stages, each fed
  by its own load warp, so the weight's loads run up to ``W`` k-steps ahead whatever ``hidden``'s do;
* ``_bk128``: 128 columns a step instead of 64.

``hidden``'s ring needs two stages at least: a slot is released once the product after it is issued
(at most one product in flight), so with one slot the next step's tile could never load.

Each program: one warpgroup multiplies by wgmma (at most one in flight, releasing the step before's
slots), then stores its ``[T, 128]`` block of ``c = hidden @ W^T`` from registers. No epilogue: the
question is the loop. Each variant is checked against ``torch.mm`` on random data, then timed with
``torch.mm`` by `typedkv._bench.paired_gpu_time_us` (CUDA graphs, rotating inputs, the variants
interleaved in rounds); printed: each variant's median of its per-round ratios over ``torch.mm``.

The answer (H200, 2026-12-02, 7 rounds): no. Each / ``torch.mm`` at T = 16 / 48 / 64: ``joint_s8``
1.242 / 1.050 / 1.067, ``joint_s9`` 1.238 / 1.076 / 1.093; the best ring apart, ``apart_a4_w12``,
1.225 / 1.310 / 1.361, the others 1.47-2.85. The fused kernels keep one ring.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
from gluon_probe import (  # the Gluon API of Triton 3.6 (None where there is none)
    TensorDescriptor,
    _jit,
    _layout,
    fence_async_shared,
    gl,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

N_OUT, K_IN = 10240, 4096  # the draft's fused K/V projection: 5 layers x 2 x 8 heads x 128 rows, hidden 4096
BM, BN = 64, 128  # wgmma's smallest M; one head a program


@_jit
def _load(a_desc, w_desc, a_bufs, w_bufs, ready, empty, k_steps, BM: gl.constexpr, BN: gl.constexpr,
          BK: gl.constexpr, STAGES: gl.constexpr, LOAD_A: gl.constexpr, LOAD_W: gl.constexpr):  # fmt: skip
    """A load warp: ``hidden``'s tile (``LOAD_A``) and the head's weight tile (``LOAD_W``) of every k-step
    into its ring, under one barrier a slot: both (joint), or one of them (rings apart, a warp each)."""
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    nbytes: gl.constexpr = (LOAD_A * BM + LOAD_W * BN) * BK * 2
    for k in range(k_steps):
        s = k % STAGES
        # The slot's last use released (the first pass waits on parity 1: passes at once).
        mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        if LOAD_A:
            tma.async_copy_global_to_shared(a_desc, [off_m, k * BK], ready.index(s), a_bufs.index(s))
        if LOAD_W:
            tma.async_copy_global_to_shared(w_desc, [off_n, k * BK], ready.index(s), w_bufs.index(s))


@_jit
def _multiply(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, c_ptr, T, N, k_steps, BM: gl.constexpr,
              BN: gl.constexpr, A_STAGES: gl.constexpr, W_STAGES: gl.constexpr, JOINT: gl.constexpr):  # fmt: skip
    """The warpgroup: every k-step by wgmma as both slots fill, then the block of ``c`` stored from registers."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for k in range(k_steps):
        sw = k % W_STAGES
        mbarrier.wait(w_ready.index(sw), (k // W_STAGES) & 1)
        if JOINT:
            a_tile = a_bufs.index(sw)
        else:
            sa = k % A_STAGES
            mbarrier.wait(a_ready.index(sa), (k // A_STAGES) & 1)
            a_tile = a_bufs.index(sa)
        acc = warpgroup_mma(a_tile, w_bufs.index(sw).permute((1, 0)), acc, is_async=True)
        # At most this product in flight: the one before has read its slots, which go back.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(w_empty.index((k + W_STAGES - 1) % W_STAGES), pred=k > 0)
        if not JOINT:
            mbarrier.arrive(a_empty.index((k + A_STAGES - 1) % A_STAGES), pred=k > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.program_id(1) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    ptrs = c_ptr + gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rows < T, 1))


@_jit
def gemm_small_t(a_desc, w_desc, c_ptr, T, N, k_steps, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 A_STAGES: gl.constexpr, W_STAGES: gl.constexpr, JOINT: gl.constexpr):  # fmt: skip
    """``c[T, N] = hidden @ W^T``, program ``(n, m)`` the ``[BM, BN]`` block; ``JOINT``: one ring for both tiles."""
    a_count: gl.constexpr = W_STAGES if JOINT else A_STAGES
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [a_count, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, BN, BK], w_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    for i in gl.static_range(A_STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    fence_async_shared()
    if JOINT:
        gl.warp_specialize(
            [
                (_multiply, (a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, c_ptr, T, N, k_steps, BM, BN,
                             A_STAGES, W_STAGES, JOINT)),
                (_load, (a_desc, w_desc, a_bufs, w_bufs, w_ready, w_empty, k_steps, BM, BN, BK, W_STAGES, True,
                         True)),
            ],
            [1],
            [24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_multiply, (a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, c_ptr, T, N, k_steps, BM, BN,
                             A_STAGES, W_STAGES, JOINT)),
                (_load, (a_desc, w_desc, a_bufs, w_bufs, w_ready, w_empty, k_steps, BM, BN, BK, W_STAGES, False,
                         True)),
                (_load, (a_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, k_steps, BM, BN, BK, A_STAGES, True,
                         False)),
            ],
            [1, 1],
            [24, 24],
        )  # fmt: skip
    for i in gl.static_range(W_STAGES):
        mbarrier.invalidate(w_ready.index(i))
        mbarrier.invalidate(w_empty.index(i))
    for i in gl.static_range(A_STAGES):
        mbarrier.invalidate(a_ready.index(i))
        mbarrier.invalidate(a_empty.index(i))


class Variant(NamedTuple):
    """One ring layout: ``bk`` columns a step; ``hidden``'s ``a_stages`` apart from the weight's ``w_stages``, or joint."""

    bk: int
    a_stages: int
    w_stages: int
    joint: bool

    @property
    def name(self) -> str:
        kind = f"joint_s{self.w_stages}" if self.joint else f"apart_a{self.a_stages}_w{self.w_stages}"
        return kind + ("_bk128" if self.bk == 128 else "")

    def smem_kb(self) -> float:
        a_tiles = self.w_stages if self.joint else self.a_stages
        return (a_tiles * BM + self.w_stages * BN) * self.bk * 2 / 1024

    def constexprs(self) -> dict[str, int]:
        # A joint ring has no A barriers of its own; one pair keeps the allocation's shapes valid.
        a_stages = 1 if self.joint else self.a_stages
        return dict(BM=BM, BN=BN, BK=self.bk, A_STAGES=a_stages, W_STAGES=self.w_stages, JOINT=int(self.joint))


VARIANTS = (
    Variant(64, 0, 9, True),
    Variant(64, 0, 8, True),
    Variant(64, 2, 12, False),
    Variant(64, 3, 12, False),
    Variant(64, 4, 12, False),
    Variant(64, 3, 10, False),
    Variant(128, 2, 6, False),
)


def compile_all(folder: str = "/tmp/small_t") -> int:
    """Compile every variant for sm_90 (CPU, no GPU): registers, shared memory, warp specialisation."""
    from sm90_build import dump
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(gemm_small_t.arg_names)
    bad = 0
    for variant in VARIANTS:
        const = variant.constexprs()
        signature = {
            "a_desc": f"tensordesc<bf16[{BM}, {variant.bk}],{_layout([BM, variant.bk])!r}>",
            "w_desc": f"tensordesc<bf16[{BN}, {variant.bk}],{_layout([BN, variant.bk])!r}>",
            "c_ptr": "*bf16",
            **{name: "i32" for name in ("T", "N", "k_steps")},
            **{name: "constexpr" for name in const},
        }
        src = GluonASTSource(
            fn=gemm_small_t,
            signature={name: signature[name] for name in names},
            constexprs={(names.index(k),): v for k, v in const.items()},
            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ("c_ptr", "N")},
        )
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as e:  # a variant that does not compile
            bad += 1
            print(f"{variant.name:<22} FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        built = dump(kernel, folder, variant.name)
        print(
            f"{variant.name:<22} ok  regs {built.regs}  local {built.local}  stack {built.stack}  "
            f"shared {kernel.metadata.shared / 1024:.1f} KB (rings {variant.smem_kb():.0f} KB)  "
            f"warp_specialize {'ttg.warp_specialize' in built.ttgir}  TMA loads {built.ptx.count('cp.async.bulk.tensor')}  "
            f"wgmma {built.ptx.count('wgmma.mma_async')}",
            flush=True,
        )
    return 1 if bad else 0


def _launch(variant: Variant, w_desc: object, a_desc: object, c: torch.Tensor, num_tokens: int) -> None:
    grid = (N_OUT // BN, triton.cdiv(num_tokens, BM))
    gemm_small_t[grid](a_desc, w_desc, c, num_tokens, N_OUT, K_IN // variant.bk, **variant.constexprs(), num_warps=4)


def main() -> int:
    if "--compile" in sys.argv:
        return compile_all()
    from typedkv import _bench

    device = torch.device("cuda")
    weight = torch.randn(N_OUT, K_IN, device=device, dtype=torch.bfloat16) / 64
    for num_tokens in [int(a) for a in sys.argv[1:]] or [16, 48, 64]:
        hiddens = [torch.randn(num_tokens, K_IN, device=device, dtype=torch.bfloat16) for _ in range(4)]
        outs = [torch.empty(num_tokens, N_OUT, device=device, dtype=torch.bfloat16) for _ in hiddens]
        ref = hiddens[0] @ weight.t()
        calls: dict[str, Sequence[Callable[[], None]]] = {
            "mm": [
                lambda h=h, o=o: _discard(torch.mm(h, weight.t(), out=o)) for h, o in zip(hiddens, outs, strict=True)
            ]
        }
        for variant in VARIANTS:
            w_desc = TensorDescriptor.from_tensor(weight, [BN, variant.bk], _layout([BN, variant.bk]))
            a_descs = [TensorDescriptor.from_tensor(h, [BM, variant.bk], _layout([BM, variant.bk])) for h in hiddens]
            variant_calls = [
                lambda v=variant, w=w_desc, a=a, o=o, t=num_tokens: _launch(v, w, a, o, t)
                for a, o in zip(a_descs, outs, strict=True)
            ]
            try:
                outs[0].fill_(float("nan"))
                variant_calls[0]()
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not compile or fit: left out
                print(f"T={num_tokens} {variant.name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            error = (outs[0].float() - ref.float()).abs().max().item()
            print(f"T={num_tokens} {variant.name}: largest error {error:.3g}{'' if error <= 0.05 else ' WRONG'}")
            calls[variant.name] = variant_calls
        rounds = _bench.paired_gpu_time_us(calls, rounds=7, replays=5)
        mm = rounds["mm"]
        print(f"T={num_tokens} mm {statistics.median(mm):.2f} us; each / mm, median of 7 rounds (lowest-highest):")
        for name, times in sorted(rounds.items(), key=lambda item: statistics.median(item[1])):
            ratios = [t / m for t, m in zip(times, mm, strict=True)]
            print(f"   {name:<22} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
        torch.cuda.empty_cache()
    return 0


def _discard(_: object) -> None:
    return None


if __name__ == "__main__":
    sys.exit(main())
