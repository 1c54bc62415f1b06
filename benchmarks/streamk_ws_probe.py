"""Stream-K in the warp-specialised Gluon GEMM (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/streamk_ws_probe.py [T ...]`` on the GPU (Triton 3.6's
Gluon); ``python benchmarks/streamk_ws_probe.py --compile`` compiles every variant for sm_90 on the CPU (no
GPU) and prints its registers, spills and shared memory.

The question. From T = 129 to 1024 the materializer's best path is GEMM + kernel, 1.10-1.13x
``torch.mm`` alone (docs/performance.md), because no fused kernel here multiplies as fast as cuBLAS
there: the warp-specialised kernel (`typedkv._fused_ws_kernel`) is cuBLAS-grade per tile (1.02x at
T = 2048 with K's epilogue) but has 80 tiles of 128 x 256 at T = 256 for 132 SMs, and 640 at 2048
(4.85 waves, so 5). Here the same producer / consumer ring takes the stream-K cut: the tiles'
k-steps laid end to end (``tiles * k_steps``) and cut into one equal run per SM, so that every SM
multiplies the same share. A run covers the end of one tile, whole tiles, and the start of another.

Each program takes its run's pieces from its highest tile down. For a tile cut between programs,
the program holding the tile's last k-step finishes it (its "owner"). The owner reaches that piece
last of all its pieces, and the lower programs that hold the tile's earlier k-steps reached theirs
first: each such program stores its float32 part in its own slot of a workspace and raises its
flag (release); the owner waits on the flags of the programs below it (acquire), adds their parts
in program order (so the sum is the same at every run of one T), lowers the flags for the next
launch and stores the tile. A program only ever waits on lower-numbered programs, which start no
later than it does, so the waits cannot deadlock however few SMs the launch gets.

Variants: ``dp_BMxBN`` (one program a whole tile, as many programs as tiles: today's cut, through
the same code) and ``sk_BMxBN`` (one run an SM), for tiles of 128 tokens (T > 64; 8 consumer warps)
or 64 (T <= 128; 4 warps) by 128 or 256 weight rows, or of 256 tokens by 128 rows (T > 128; 8 warps),
bf16 stores by pointer; ``sk_BMxBN_nofix`` is stream-K with no parts handed over (each piece stores
its own sum, so its results are wrong: it only shows what the hand-over costs); ``sk_BMxBN_epi`` adds
K's epilogue to the tiles an owner stores (gluon_probe.py's ``_k_head_epilogue2``: K tiles normed and
roped, V tiles as they are). Each checked twice on random data against ``a @ w^T`` (with the epilogue:
gluon_probe.py's ``epilogue_ref``), the second call showing that the flags came back down, then
timed against ``torch.mm`` as the other GEMM probes are (`probe_timing.measure`: CUDA-graph replays
over rotating inputs, 3 rounds). T = 64, 128, 256, 512, 1024 and 2048 unless given. At T = 64 every
SM then pulls a 132nd of the weight, where the fused kernel's 80 programs pull an 80th each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
from gluon_probe import (  # the Gluon API of Triton 3.6 (None where there is none), and the K epilogue
    TensorDescriptor,
    _jit,
    _k_head_epilogue2,
    _layout,
    epilogue_ref,
    fence_async_shared,
    gl,
    mbarrier,
    rope_inputs,
)

from typedkv._fused_ws_kernel import _loads, _products, _tile_coords  # the product kernel's ring and tile order

N_OUT, K_IN, BK = 10240, 4096, 64


@_jit
def _run(total):
    """This program's k-steps ``[lo, hi)`` of the ``total`` laid end to end (every program has one at least)."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    return pid * total // programs, (pid + 1) * total // programs


@_jit
def _piece(lo, hi, top, down, k_steps):
    """The run's ``down``-th piece from its highest tile ``top``: ``(tile, k_begin, k_end)``."""
    tile = top - down
    start = tile * k_steps
    return tile, gl.maximum(lo - start, 0), gl.minimum(hi - start, k_steps)


@_jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, k_steps, total,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr):  # fmt: skip
    """The load warp: the run's pieces, highest tile first, each piece's k-steps into the ring."""
    nbytes: gl.constexpr = (BM + BN) * BK * 2
    lo, hi = _run(total)
    top = (hi - 1) // k_steps
    it = 0
    for down in range(top - lo // k_steps + 1):
        tile, k_begin, k_end = _piece(lo, hi, top, down, k_steps)
        off_m, off_n = _tile_coords(tile, tiles_m, tiles_n, BM, BN, GROUP_M)
        it = _loads(a_desc, w_desc, a_bufs, w_bufs, ready, empty, it, off_m, off_n, k_begin, k_end, BK, STAGES, nbytes)


@_jit
def _consumer(a_bufs, w_bufs, ready, empty, c_ptr, part_ptr, flag_ptr, rope, T, N, tiles_m, tiles_n, k_steps, total,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              WARPS_M: gl.constexpr, WARPS_N: gl.constexpr, EPILOGUE: gl.constexpr,
              FIXUP: gl.constexpr):  # fmt: skip
    """The MMA warps: each piece's k-steps by wgmma; then its part handed over, or the tile finished and stored
    (with ``EPILOGUE``, a K tile normed and roped first: gluon_probe.py's ``_k_head_epilogue2``)."""
    K_COLS: gl.constexpr = 1024  # a layer's K heads (H * D) in the fused weight's rows ...
    LAYER_COLS: gl.constexpr = 2048  # ... then its V heads
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BN // WARPS_N, 16]
    )
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    in_part = gl.expand_dims(rows, 1) * BN + gl.expand_dims(cols, 0)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    lo, hi = _run(total)
    top = (hi - 1) // k_steps
    it = 0
    for down in range(top - lo // k_steps + 1):
        tile, k_begin, k_end = _piece(lo, hi, top, down, k_steps)
        off_m, off_n = _tile_coords(tile, tiles_m, tiles_n, BM, BN, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc, it = _products(acc, a_bufs, w_bufs, ready, empty, it, k_begin, k_end, STAGES)
        if FIXUP == 0:
            # Diagnosis only: no parts handed over (each piece stores its own sum; results wrong).
            gl.store(c_ptr + gl.expand_dims(off_m + rows, 1) * N + gl.expand_dims(off_n + cols, 0),
                     acc.to(gl.bfloat16), mask=gl.expand_dims(off_m + rows < T, 1))  # fmt: skip
        elif k_end < k_steps:
            # The tile's last k-step is a higher program's: this part goes to its slot, then the flag.
            gl.store(part_ptr + pid * (BM * BN) + in_part, acc)
            gl.thread_barrier()  # every thread's part stored before the one release
            gl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")
        else:
            if k_begin > 0:
                # The tile's first k-steps are in the parts of the programs just below, added
                # highest first: the same order at every run of this T.
                src = pid - 1
                more = True
                while more:
                    while gl.atomic_add(flag_ptr + src, 0, sem="acquire", scope="gpu") == 0:
                        pass
                    gl.thread_barrier()  # the acquire before any thread's loads of the part
                    acc += gl.load(part_ptr + src * (BM * BN) + in_part, cache_modifier=".cg")
                    gl.atomic_xchg(flag_ptr + src, 0, sem="relaxed", scope="gpu")  # down for the next launch
                    more = src * total // programs > tile * k_steps
                    src -= 1
            if EPILOGUE and (off_n % LAYER_COLS) < K_COLS:
                out = _k_head_epilogue2(acc, off_m, T, rope[0], rope[1], rope[2], BM, BN, acc_layout)
            else:
                out = acc
            rm = off_m + rows
            rn = off_n + cols
            mask = gl.expand_dims(rm < T, 1) & gl.expand_dims(rn < N, 0)
            gl.store(c_ptr + gl.expand_dims(rm, 1) * N + gl.expand_dims(rn, 0), out.to(gl.bfloat16), mask=mask)


@_jit
def gemm_streamk_ws(a_desc, w_desc, c_ptr, part_ptr, flag_ptr, norm_ptr, positions_ptr, cos_sin_ptr, T, N, tiles_m,
                    tiles_n, k_steps, total, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_M: gl.constexpr, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
                    EPILOGUE: gl.constexpr, FIXUP: gl.constexpr):  # fmt: skip
    """``c = a @ w^T``, program ``pid`` of ``P`` over the k-steps ``[pid * total // P, (pid + 1) * total // P)``.

    ``part_ptr``: ``P`` float32 ``[BM, BN]`` parts; ``flag_ptr``: ``P`` int32 flags, 0 between launches.
    With ``EPILOGUE`` the K tiles (columns ``c % 2048 < 1024``) normed by ``norm_ptr`` and roped at
    ``positions_ptr``'s rows of ``cos_sin_ptr`` (gluon_probe.py's ``_epi2`` variants).
    """
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, w_bufs, ready, empty, c_ptr, part_ptr, flag_ptr,
                         (norm_ptr, positions_ptr, cos_sin_ptr), T, N, tiles_m, tiles_n, k_steps, total, BM, BN,
                         STAGES, GROUP_M, WARPS_M, WARPS_N, EPILOGUE, FIXUP)),
            (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, k_steps, total, BM, BN,
                         BK, STAGES, GROUP_M)),
        ],
        [1],
        [24],
    )  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@dataclass(frozen=True)
class Config:
    """One variant: tiles of ``bm x bn``, ``stages`` ring slots, one run an SM (``streamk``) or one tile a
    program, ``bm // 16`` consumer warps along the tokens, K's epilogue (``epilogue``) or not."""

    bm: int
    bn: int
    stages: int
    streamk: bool
    epilogue: bool = False
    group_m: int = 8
    fixup: bool = True

    @property
    def warps(self) -> int:
        return min(self.bm // 16, 8)

    @property
    def name(self) -> str:
        return f"{'sk' if self.streamk else 'dp'}_{self.bm}x{self.bn}_s{self.stages}{'_epi' if self.epilogue else ''}{'' if self.fixup else '_nofix'}"

    def constexprs(self) -> dict[str, int]:
        return dict(BM=self.bm, BN=self.bn, BK=BK, STAGES=self.stages, GROUP_M=self.group_m, WARPS_M=self.warps,
                    WARPS_N=1, EPILOGUE=int(self.epilogue), FIXUP=int(self.fixup))  # fmt: skip


# Tiles and ring slots within 200 KB of shared memory: 128 tokens at T > 64, 64 up to 128.
SHAPES = {128: ((128, 256, 4), (128, 128, 6)), 64: ((64, 256, 5), (64, 128, 8)), 256: ((256, 128, 4),)}


def configs(num_tokens: int) -> list[Config]:
    """The variants at ``num_tokens``: each shape one tile a program and stream-K, stream-K with K's epilogue."""
    sizes = [
        bm
        for bm in SHAPES
        if (bm == 64 and num_tokens <= 128) or (bm == 128 and num_tokens > 64) or (bm == 256 and num_tokens > 128)
    ]
    return [
        Config(bm, bn, stages, streamk, epilogue, fixup=fixup)
        for size in sizes
        for bm, bn, stages in SHAPES[size]
        for streamk, epilogue, fixup in (
            (False, False, True),
            (True, False, True),
            (True, True, True),
            (True, False, False),
        )
    ]


class Gemm:
    """One variant's launch over a fixed ``weight`` ``[N, K]``: ``__call__(a_desc, c)`` writes ``a @ weight^T`` to ``c``."""

    def __init__(
        self, weight: torch.Tensor, num_tokens: int, cfg: Config, sms: int, rope: tuple[torch.Tensor, ...]
    ) -> None:
        self.cfg, self.num_tokens, self.rope = cfg, num_tokens, rope
        self.tiles_m, self.tiles_n = triton.cdiv(num_tokens, cfg.bm), N_OUT // cfg.bn
        self.k_steps = K_IN // BK
        self.total = self.tiles_m * self.tiles_n * self.k_steps
        num_tiles = self.tiles_m * self.tiles_n
        self.programs = min(sms, self.total) if cfg.streamk else num_tiles
        assert self.programs * self.total < 2**31, "the runs' bounds are int32 products"
        # One part a program (one tiles' parts are never read: every program there owns its tile).
        parts = self.programs if cfg.streamk else 1
        self.parts = torch.empty(parts, cfg.bm * cfg.bn, device=weight.device, dtype=torch.float32)
        self.flags = torch.zeros(self.programs, device=weight.device, dtype=torch.int32)
        self.w_desc = TensorDescriptor.from_tensor(weight, [cfg.bn, BK], _layout([cfg.bn, BK]))

    def a_desc(self, a: torch.Tensor) -> object:
        return TensorDescriptor.from_tensor(a, [self.cfg.bm, BK], _layout([self.cfg.bm, BK]))

    def __call__(self, a_desc: object, c: torch.Tensor) -> None:
        gemm_streamk_ws[(self.programs,)](
            a_desc, self.w_desc, c, self.parts, self.flags, *self.rope, self.num_tokens, N_OUT, self.tiles_m,
            self.tiles_n, self.k_steps, self.total, **self.cfg.constexprs(), num_warps=self.cfg.warps,
        )  # fmt: skip


def compile_all(folder: str = "/tmp/streamk_ws") -> int:
    """Compile every variant for sm_90 (CPU, no GPU): registers, spills, shared memory; TTGIR/PTX under ``folder``."""
    from sm90_build import dump
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(gemm_streamk_ws.arg_names)
    bad = 0
    every = {c.name.removeprefix("dp_").removeprefix("sk_"): c for t in (64, 256) for c in configs(t)}
    for cfg in every.values():  # one tile a program and stream-K are one kernel
        const = cfg.constexprs()
        signature: dict[str, str] = {}
        for name in names:
            if name in const:
                signature[name] = "constexpr"
            elif name.endswith("_desc"):
                block = [cfg.bm, BK] if name == "a_desc" else [cfg.bn, BK]
                signature[name] = f"tensordesc<bf16{block},{_layout(block)!r}>"
            else:
                pointers = {"c_ptr": "*bf16", "part_ptr": "*fp32", "flag_ptr": "*i32", "norm_ptr": "*bf16",
                            "positions_ptr": "*i32", "cos_sin_ptr": "*fp32"}  # fmt: skip
                signature[name] = pointers.get(name, "i32")
        constexprs = {(names.index(k),): v for k, v in const.items()}
        attrs = {
            (names.index(k),): [["tt.divisibility", 16]]
            for k in ("c_ptr", "part_ptr", "flag_ptr", "norm_ptr", "positions_ptr", "cos_sin_ptr", "N")
        }
        src = GluonASTSource(fn=gemm_streamk_ws, signature=signature, constexprs=constexprs, attrs=attrs)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.warps})
        except Exception as e:  # a variant that does not compile
            bad += 1
            print(f"{cfg.name:<16} FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            continue
        built = dump(kernel, folder, cfg.name)
        ptx = built.ptx
        barriers = sorted({line.strip() for line in ptx.splitlines() if line.strip().startswith("bar.sync")})
        print(f"{cfg.name:<16} ok  regs {built.regs}  local {built.local}  stack {built.stack}  shared {kernel.metadata.shared / 1024:.1f} KB  "
              f"warp_specialize {'ttg.warp_specialize' in built.ttgir}  wgmma {ptx.count('wgmma.mma_async')}  "
              f"barriers {barriers}  "
              f"atomics {ptx.count('atom.')}, acquire loads {ptx.count('.acquire.')}", flush=True)  # fmt: skip
    return 1 if bad else 0


def main() -> int:
    if "--compile" in sys.argv:
        return compile_all()
    from probe_timing import gemm_inputs, largest_error, measure, report

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    weight = torch.randn(N_OUT, K_IN, device=device, dtype=torch.bfloat16) / 64
    for num_tokens in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 128, 256, 512, 1024, 2048]:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, num_tokens, 4)
        rope = rope_inputs(num_tokens, device)
        # Each checked twice into the first output: the second call shows the flags came back down.
        checks = {
            False: largest_error(outs[0], ref, calls=2),
            True: largest_error(outs[0], epilogue_ref(ref, *rope, k_only=True), calls=2),
        }
        variants: dict[str, Sequence[Callable[[], object]]] = {"mm": mm_calls}
        for cfg in configs(num_tokens):
            gemm = Gemm(weight, num_tokens, cfg, sms, rope)
            descs = [gemm.a_desc(h) for h in hiddens]
            variants[cfg.name] = [lambda g=gemm, d=d, o=o: g(d, o) for d, o in zip(descs, outs, strict=True)]

        def check(name: str, calls: Sequence[Callable[[], object]], checks: dict = checks) -> str:
            return checks[name.endswith("_epi")](name, calls)

        report(f"T={num_tokens}", *measure(f"T={num_tokens}", variants, check))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
