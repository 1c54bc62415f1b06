"""A warp-specialised Hopper GEMM in Gluon against ``torch.mm`` (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/gluon_probe.py [T ...] [--all]`` on the GPU (Triton 3.6);
``python benchmarks/gluon_probe.py --compile`` compiles every configuration for sm_90 on the CPU and
prints its registers, shared memory and whether it was warp-specialised (no GPU needed).

``c[T, N] = a[T, K] @ w[N, K]^T`` in bf16 with float32 accumulation (N = 10240, K = 4096, the
draft's fused projection), written by hand in Gluon (``triton.experimental.gluon``, the 3.6 API):

* a worker partition of one warp (24 registers, ``setmaxnreg``) issues the TMA loads of the A and
  W tiles into a ring of ``STAGES`` shared-memory slots: it waits on the slot's "empty" barrier,
  sets the "ready" barrier's expected bytes and starts both copies on it;
* the default partition (4 warps, one warpgroup, or 8) waits on "ready", issues the async
  ``warpgroup_mma`` (W's tile transposed by a shared-memory permute), waits until at most one MMA
  is in flight and then releases the previous slot by arriving on its "empty" barrier; at the end
  of a tile it converts the accumulator to bf16 and stores it (masked ``gl.store`` or a TMA store).

Tiles are taken in grouped order (``GROUP_M`` row blocks at a time over every column block).
Non-persistent variants run one program a tile; persistent ones (``_p``) one program an SM, the
producer loading the next tile's stages while the consumer stores the last.

The ``_epi`` variants (of the two best configurations, ``ws_128x256_w8_s3_tma_p`` and
``ws_128x128_w4_s5_tma_p``) add the fused KV kernel's K-head epilogue (``EPILOGUE``) before the TMA
store, on each tile's one or two 128-column heads: the accumulator rounded to bf16, RMSNorm over the
head (``rsqrt(mean(x^2) + 1e-6)``, times a bf16 ``norm[128]``, rounded to bf16), then NeoX RoPE at
the row's ``positions`` entry of a float32 ``cos_sin[4096, 128]`` table (cos in the first 64
columns, sin in the last). It is done in the accumulator's own layout (per-head sums by column
masks; the rotate-half partner by a ``[BM, BN / 128, 2, 64]`` reshape, split and join, the pair in
one thread's registers). Their check is against the same steps in torch on ``torch.mm``'s result.

The ``_epi2`` variants (of the same two) make it cheaper (``EPILOGUE`` 2, ``_k_head_epilogue2``):

* only K tiles take it: the fused weight's rows are per layer ``[K heads: 1024 rows, V heads: 1024]``,
  so a tile is all-K or all-V; a runtime branch per tile on ``off_n % 2048 < 1024`` (``LAYER_COLS``,
  ``K_COLS``), V tiles stored as the plain path (their check: ``epilogue_ref(..., k_only=True)``,
  V columns ``torch.mm``'s);
* cos and sin are loaded once per row and column pair, ``[BM, 64]`` float32 (not ``[BM, BN]`` each,
  4x redundant), and the norm once, ``[64]`` twice: the tile viewed as ``[BM, HEADS, 64, 2]`` and
  split into its halves ``x1, x2`` (``[BM, HEADS, 64]``), the tables loaded in the halves' sliced
  layouts and broadcast by ``expand_dims``; per-head sums over the 64 axis; ``x1 cos - x2 sin``,
  ``x2 cos + x1 sin`` joined back. The same numerics (bf16 rounding of x and of the normed y).

``ws_128x128_w4_s4_tma_p_pp`` (and ``_pp_epi2``) is a ping-pong: two 4-warp consumer partitions
(``PARTS`` 2), each taking alternate tiles of the program with its own c tile, their k-loops
alternating by two ``turn`` mbarriers, so one's epilogue and store overlap the other's MMA.

At T > 64 only the two best configurations, their ``_epi`` and ``_epi2`` variants and the ping-pong ones run, unless
``--all`` (every shape and store, as ``--compile`` always does).

Variants, each / ``torch.mm`` (CUDA-graph replays, rotating inputs, alternated, 3 rounds, medians,
as the other GEMM probes through probe_timing.py); each checked once first on random data (its
largest ``|c - a @ w^T|`` beside ``torch.mm``'s result).

On the H200 (2026-12-02, benchmarks/NOTES.md), each / ``torch.mm``: ``ws_128x256_w8_s3_tma_p``
0.956-0.975 at T = 2048 and 1.005-1.023 at 16384 (bit-equal); its ``_epi2`` 1.021 / 1.047, and
1.047 at 65536; the ping-pong slower (1.041 / 1.076).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from typedkv._fused_ws_kernel import _producer, _tile_coords  # the product kernel's load warp and tile order

try:  # the Gluon API of Triton 3.6 (other versions may differ; only 3.6 is meant)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Gluon: the script cannot run, but importing it (or these names from it) does not fail
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

N_OUT, K_IN, BK = 10240, 4096, 64


def _jit(fn: Callable[..., object]) -> Callable[..., object]:
    """``gluon.jit`` where Gluon is there (the module imports without it)."""
    return gluon.jit(fn) if gluon is not None else fn


@_jit
def _k_head_epilogue(acc, off_m, T, norm_ptr, positions_ptr, cos_sin_ptr,
                     BM: gl.constexpr, BN: gl.constexpr, acc_layout: gl.constexpr):  # fmt: skip
    """As the fused KV kernel's K heads: each 128-column head of the (bf16-rounded) tile RMS-normed, rounded, NeoX-roped.

    All in the accumulator's layout: per-head sums by column masks, the rotate-half partner by a
    ``[BM, BN / 128, 2, 64]`` reshape whose pair dimension is in each thread's registers (split, join).
    """
    D: gl.constexpr = 128
    HALF: gl.constexpr = D // 2
    HEADS: gl.constexpr = BN // D
    x = acc.to(gl.bfloat16).to(gl.float32)
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    sq = x * x
    if HEADS == 1:
        rstd = gl.expand_dims(gl.rsqrt(gl.sum(sq, axis=1) / D + 1e-6), 1)
    else:
        rstd = gl.zeros([BM, BN], gl.float32, acc_layout)
        for h in gl.static_range(HEADS):
            in_head = gl.expand_dims((cols // D) == h, 0)
            head_rstd = gl.rsqrt(gl.sum(gl.where(in_head, sq, 0.0), axis=1) / D + 1e-6)
            rstd = gl.where(in_head, gl.expand_dims(head_rstd, 1), rstd)
    norm = gl.load(norm_ptr + cols % D).to(gl.float32)
    y = (x * rstd * gl.expand_dims(norm, 0)).to(gl.bfloat16).to(gl.float32)
    # rotate_half(y): [-y2, y1] per head, the pair (j, j + 64) one thread's two registers.
    y1, y2 = gl.split(gl.permute(gl.reshape(y, [BM, HEADS, 2, HALF]), (0, 1, 3, 2)))
    rot = gl.reshape(gl.permute(gl.join(-y2, y1), (0, 1, 3, 2)), [BM, BN])
    rot = gl.convert_layout(rot, acc_layout)
    pos = gl.load(positions_ptr + rows, mask=rows < T, other=0)
    table = cos_sin_ptr + gl.expand_dims(pos * D, 1) + gl.expand_dims(cols % HALF, 0)
    cos = gl.load(table)
    sin = gl.load(table + HALF)
    return y * cos + rot * sin


@_jit
def _k_head_epilogue2(acc, off_m, T, norm_ptr, positions_ptr, cos_sin_ptr,
                      BM: gl.constexpr, BN: gl.constexpr, acc_layout: gl.constexpr):  # fmt: skip
    """``_k_head_epilogue``'s numerics, but cos, sin and the norm loaded once per row / once a tile.

    The tile viewed as ``[BM, HEADS, 64, 2]`` (the pair ``(j, j + 64)`` in one thread's registers) and
    split into the halves ``x1, x2`` (``[BM, HEADS, 64]``); the per-head sums over axis 2; ``cos, sin``
    ``[BM, 64]`` float32 and the norm's two halves ``[64]`` loaded in the halves' sliced layouts and
    broadcast (``expand_dims``) over the heads (and rows); the two rotated halves joined back.
    """
    D: gl.constexpr = 128
    HALF: gl.constexpr = D // 2
    HEADS: gl.constexpr = BN // D
    x = acc.to(gl.bfloat16).to(gl.float32)
    x1, x2 = gl.split(gl.permute(gl.reshape(x, [BM, HEADS, 2, HALF]), (0, 1, 3, 2)))
    half_layout: gl.constexpr = x1.type.layout  # [BM, HEADS, HALF]
    row_half: gl.constexpr = gl.SliceLayout(1, half_layout)  # [BM, HALF]
    col_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, half_layout))  # [HALF]
    rstd = gl.rsqrt(gl.sum(x1 * x1 + x2 * x2, axis=2) / D + 1e-6)  # [BM, HEADS]
    rstd = gl.expand_dims(rstd, 2)
    j = gl.arange(0, HALF, layout=col_layout)
    n1 = gl.expand_dims(gl.expand_dims(gl.load(norm_ptr + j).to(gl.float32), 0), 0)
    n2 = gl.expand_dims(gl.expand_dims(gl.load(norm_ptr + HALF + j).to(gl.float32), 0), 0)
    y1 = (x1 * rstd * n1).to(gl.bfloat16).to(gl.float32)
    y2 = (x2 * rstd * n2).to(gl.bfloat16).to(gl.float32)
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, row_half))
    pos = gl.load(positions_ptr + rows, mask=rows < T, other=0)
    jr = gl.arange(0, HALF, layout=gl.SliceLayout(0, row_half))
    table = cos_sin_ptr + gl.expand_dims(pos * D, 1) + gl.expand_dims(jr, 0)  # [BM, HALF]
    cos = gl.expand_dims(gl.load(table), 1)
    sin = gl.expand_dims(gl.load(table + HALF), 1)
    out1 = y1 * cos - y2 * sin
    out2 = y2 * cos + y1 * sin
    out = gl.reshape(gl.permute(gl.join(out1, out2), (0, 1, 3, 2)), [BM, BN])
    return gl.convert_layout(out, acc_layout)


@_jit
def _consumer(a_bufs, w_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, norm_ptr, positions_ptr, cos_sin_ptr,
              T, N, tiles_m, tiles_n, num_tiles, k_steps,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              WARPS_M: gl.constexpr, WARPS_N: gl.constexpr, TMA_STORE: gl.constexpr,
              EPILOGUE: gl.constexpr, PART: gl.constexpr = 0, PARTS: gl.constexpr = 1):  # fmt: skip
    """The MMA warpgroup(s): each tile's k-steps by wgmma as the slots fill, then its store.

    Ping-pong (``PARTS`` 2): consumer ``PART`` takes this program's tiles ``PART, PART + 2, ...``; the
    ring's slots follow the program's tile order, so ``it`` skips the other consumer's k-steps. The
    consumers' k-loops alternate by the ``turn`` barriers (``PART`` waits on ``turn[PART]``, then
    arrives on the other's): no consumer waits on a ``ready`` phase more than one ahead of its slot's.
    """
    K_COLS: gl.constexpr = 1024  # a layer's K heads (H * D) in the fused weight's rows ...
    LAYER_COLS: gl.constexpr = 2048  # ... then its V heads
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BN // WARPS_N, 16]
    )
    it = PART * k_steps
    for tile in range(gl.program_id(0) + PART * gl.num_programs(0), num_tiles, PARTS * gl.num_programs(0)):
        off_m, off_n = _tile_coords(tile, tiles_m, tiles_n, BM, BN, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        if PARTS > 1:  # the first consumer's first turn passes at once (parity 1)
            mbarrier.wait(turn.index(PART), ((it // (PARTS * k_steps)) & 1) ^ (1 - PART))
        for k in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # At most this MMA in flight: the previous one has read its slot, which goes back.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
            it += 1
        if PARTS > 1:  # the other consumer's turn (its MMAs queue behind these)
            mbarrier.arrive(turn.index(1 - PART))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        if EPILOGUE == 1:  # every tile
            out = _k_head_epilogue(acc, off_m, T, norm_ptr, positions_ptr, cos_sin_ptr, BM, BN, acc_layout)
            out = out.to(gl.bfloat16)
        elif EPILOGUE == 2:  # K tiles only (a runtime branch): V tiles as the plain path
            if (off_n % LAYER_COLS) < K_COLS:
                out = _k_head_epilogue2(acc, off_m, T, norm_ptr, positions_ptr, cos_sin_ptr, BM, BN, acc_layout)
                out = out.to(gl.bfloat16)
            else:
                out = acc.to(gl.bfloat16)
        else:
            out = acc.to(gl.bfloat16)
        if TMA_STORE:
            tma.store_wait(0)  # the last tile's store has read c_smem
            c_smem.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)  # rows >= T clipped
        else:
            rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            gl.store(c_ptr + rm[:, None] * N + rn[None, :], out, mask=(rm < T)[:, None])
        it += (PARTS - 1) * k_steps  # the other consumer's tile
    if TMA_STORE:
        tma.store_wait(0)


@_jit
def gemm_ws(a_desc, w_desc, c_desc, c_ptr, norm_ptr, positions_ptr, cos_sin_ptr, T, N, tiles_m, tiles_n, num_tiles,
            k_steps, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
            GROUP_M: gl.constexpr, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr, TMA_STORE: gl.constexpr,
            EPILOGUE: gl.constexpr = 0, PINGPONG: gl.constexpr = 0):  # fmt: skip
    """``c = a @ w^T``: the tiles ``program_id, program_id + num_programs, ...`` (one each when not persistent).

    With ``EPILOGUE`` 1 each tile's 128-column heads are RMS-normed by ``norm_ptr`` and NeoX-roped at
    ``positions_ptr``'s rows of ``cos_sin_ptr`` (``[max_pos, 128]`` float32) before the store; with 2
    the K tiles' only (columns ``c % 2048 < 1024``), cos, sin and the norm loaded once a row / tile.
    """
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_desc.layout)
    else:
        c_smem = a_bufs  # unused
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    if PINGPONG:  # two consumer warpgroups (alternate tiles, own c_smem), one's epilogue beside the other's MMA
        c_smem1 = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_desc.layout)
        gl.warp_specialize(
            [
                (_consumer, (a_bufs, w_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, norm_ptr, positions_ptr,
                             cos_sin_ptr, T, N, tiles_m, tiles_n, num_tiles, k_steps, BM, BN, STAGES, GROUP_M,
                             WARPS_M, WARPS_N, TMA_STORE, EPILOGUE, 0, 2)),
                (_consumer, (a_bufs, w_bufs, ready, empty, turn, c_desc, c_smem1, c_ptr, norm_ptr, positions_ptr,
                             cos_sin_ptr, T, N, tiles_m, tiles_n, num_tiles, k_steps, BM, BN, STAGES, GROUP_M,
                             WARPS_M, WARPS_N, TMA_STORE, EPILOGUE, 1, 2)),
                (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, num_tiles, k_steps,
                             BM, BN, BK, STAGES, GROUP_M)),
            ],
            [4, 1],
            [232, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (a_bufs, w_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, norm_ptr, positions_ptr, cos_sin_ptr,
                             T, N, tiles_m, tiles_n, num_tiles, k_steps, BM, BN, STAGES, GROUP_M, WARPS_M, WARPS_N,
                             TMA_STORE, EPILOGUE)),
                (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, num_tiles, k_steps,
                             BM, BN, BK, STAGES, GROUP_M)),
            ],
            [1],
            [24],
        )  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


@dataclass(frozen=True)
class Config:
    """One variant: tile ``bm x bn``, ``warps`` in the default partition, ``stages`` ring slots."""

    bm: int
    bn: int
    warps: int
    stages: int
    tma_store: bool
    persistent: bool
    group_m: int = 8
    pingpong: bool = False  # two consumer partitions of ``warps`` each, alternate tiles
    epilogue: int = 0  # 0 none, 1 ``_epi`` (every tile), 2 ``_epi2`` (K tiles, loads once)

    @property
    def name(self) -> str:
        store = "tma" if self.tma_store else "st"
        return f"ws_{self.bm}x{self.bn}_w{self.warps}_s{self.stages}_{store}{'_p' if self.persistent else ''}{'_pp' if self.pingpong else ''}{('', '_epi', '_epi2')[self.epilogue]}"

    @property
    def warps_mn(self) -> tuple[int, int]:
        """The accumulator's warps over rows and columns (a warpgroup's 4 warps along M, 16 rows each)."""
        warps_m = min(self.warps, self.bm // 16)
        return warps_m, self.warps // warps_m

    def smem_kb(self) -> float:
        c_tiles = self.tma_store * (1 + self.pingpong)
        return (self.stages * (self.bm + self.bn) * BK * 2 + c_tiles * self.bm * self.bn * 2) / 1024


def _layout(block: list[int]) -> object:
    """The NVMMA shared layout of a bf16 tile ``block`` (rows of >= 64 elements: 128-byte swizzle)."""
    assert block[-1] >= 64
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _grid_args(cfg: Config, num_tokens: int, sms: int) -> tuple[int, tuple[int, int, int, int]]:
    tiles_m, tiles_n = triton.cdiv(num_tokens, cfg.bm), N_OUT // cfg.bn
    num_tiles = tiles_m * tiles_n
    programs = min(num_tiles, sms) if cfg.persistent else num_tiles
    return programs, (tiles_m, tiles_n, num_tiles, K_IN // BK)


def _constexprs(cfg: Config) -> dict[str, int]:
    warps_m, warps_n = cfg.warps_mn
    return dict(BM=cfg.bm, BN=cfg.bn, BK=BK, STAGES=cfg.stages, GROUP_M=cfg.group_m, WARPS_M=warps_m,
                WARPS_N=warps_n, TMA_STORE=int(cfg.tma_store), EPILOGUE=int(cfg.epilogue),
                PINGPONG=int(cfg.pingpong))  # fmt: skip


class Gemm:
    """One configuration's launch over fixed ``weight`` ``[N, K]``: ``__call__(a_desc, c_desc, c)`` writes ``a @ weight^T``.

    ``rope`` is ``(norm, positions, cos_sin)``, the epilogue's inputs (passed always, read by ``_epi`` variants only).
    """

    def __init__(
        self, weight: torch.Tensor, num_tokens: int, cfg: Config, sms: int, rope: tuple[torch.Tensor, ...]
    ) -> None:
        self.cfg, self.num_tokens, self.rope = cfg, num_tokens, rope
        self.programs, self.sizes = _grid_args(cfg, num_tokens, sms)
        self.w_desc = TensorDescriptor.from_tensor(weight, [cfg.bn, BK], _layout([cfg.bn, BK]))

    def descs(self, a: torch.Tensor, c: torch.Tensor) -> tuple[object, object]:
        cfg = self.cfg
        return (
            TensorDescriptor.from_tensor(a, [cfg.bm, BK], _layout([cfg.bm, BK])),
            TensorDescriptor.from_tensor(c, [cfg.bm, cfg.bn], _layout([cfg.bm, cfg.bn])),
        )

    def __call__(self, a_desc: object, c_desc: object, c: torch.Tensor) -> None:
        gemm_ws[(self.programs,)](
            a_desc, self.w_desc, c_desc, c, *self.rope, self.num_tokens, N_OUT, *self.sizes, **_constexprs(self.cfg),
            num_warps=self.cfg.warps,
        )  # fmt: skip


def configs(num_tokens: int, every: bool = False) -> list[Config]:
    """The variants at ``num_tokens``: the ring (at most 8 slots) and any TMA-store tile within 220 KB, one program an SM.

    Above 64 tokens only the two best persistent TMA-store ones and their ``_epi`` and ``_epi2`` variants
    unless ``every`` (then every shape and store, and the epilogue variants of the best two).
    """
    shapes = [(64, 128, 4), (64, 256, 4)] if num_tokens <= 64 else [(128, 128, 4), (128, 256, 8), (64, 256, 4)]
    out = []
    for bm, bn, warps in shapes:
        for tma_store in (False, True):
            stage_kb = (bm + bn) * BK * 2 / 1024
            stages = min(8, int((220 - tma_store * bm * bn * 2 / 1024) // stage_kb))
            for persistent in (False, True) if num_tokens > 64 else (False,):
                out.append(Config(bm, bn, warps, stages, tma_store, persistent))
    best = {"ws_128x256_w8_s3_tma_p", "ws_128x128_w4_s5_tma_p"}  # with the K-head epilogue too
    if num_tokens > 64 and not every:
        out = [cfg for cfg in out if cfg.name in best]
    out += [dataclasses.replace(cfg, epilogue=e) for e in (1, 2) for cfg in out if cfg.name in best]
    if num_tokens > 64:  # ping-pong: two 4-warp consumers of 128x128 tiles, 4 slots and two c tiles (192 KB)
        pp = Config(128, 128, 4, 4, True, True, pingpong=True)
        out += [pp, dataclasses.replace(pp, epilogue=2)]
    return out


MAX_POS, HEAD_DIM = 4096, 128
K_COLS, LAYER_COLS = 1024, 2048  # a layer's K heads' columns, then its V heads' (as the kernel's)


def rope_inputs(num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The epilogue's ``(norm [128] bf16, positions [T] int32, cos_sin [MAX_POS, 128] float32)``: a genuine rotary table."""
    norm = (torch.rand(HEAD_DIM, device=device) + 0.5).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=device, dtype=torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.arange(MAX_POS, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return norm, positions, torch.cat([angles.cos(), angles.sin()], dim=1).contiguous()


def epilogue_ref(
    ref: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_only: bool = False
) -> torch.Tensor:
    """The ``_epi`` variants' result from ``ref`` (the bf16 product): per head RMSNorm, rounded, NeoX RoPE, bf16.

    With ``k_only`` (the ``_epi2`` variants) only the K columns (``c % 2048 < 1024``) so; the V columns ``ref``'s.
    """
    x = ref.float().view(ref.shape[0], -1, HEAD_DIM)
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    y = (x * rstd * norm.float()).bfloat16().float()
    cs = cos_sin[positions.long()][:, None, :]
    half = HEAD_DIM // 2
    cos, sin = cs[..., :half], cs[..., half:]
    y1, y2 = y[..., :half], y[..., half:]
    out = torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1).view(ref.shape).bfloat16()
    if k_only:
        is_k = torch.arange(ref.shape[1], device=ref.device) % LAYER_COLS < K_COLS
        out = torch.where(is_k, out, ref)
    return out


def compile_all(folder: str = "/tmp/gluon") -> int:
    """Compile every configuration for sm_90 (CPU, no GPU): registers, shared memory, warp specialisation.

    Each one's TTGIR, PTX and cubin are written under ``folder``; registers as ``cuobjdump -res-usage`` reads them.
    """
    import re

    from sm90_build import dump
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(gemm_ws.arg_names)
    bad = 0
    for cfg in {c.name: c for t in (64, 2048) for c in configs(t, every=True)}.values():
        const = _constexprs(cfg)
        signature: dict[str, str] = {}
        for name in names:
            if name in const:
                signature[name] = "constexpr"
            elif name.endswith("_desc"):
                block = {"a_desc": [cfg.bm, BK], "w_desc": [cfg.bn, BK], "c_desc": [cfg.bm, cfg.bn]}[name]
                signature[name] = f"tensordesc<bf16{block},{_layout(block)!r}>"
            elif name in ("c_ptr", "norm_ptr"):
                signature[name] = "*bf16"
            elif name == "positions_ptr":
                signature[name] = "*i32"
            elif name == "cos_sin_ptr":
                signature[name] = "*fp32"
            else:
                signature[name] = "i32"
        constexprs = {(names.index(k),): v for k, v in const.items()}
        attrs = {
            (names.index(k),): [["tt.divisibility", 16]]
            for k in ("c_ptr", "N", "norm_ptr", "positions_ptr", "cos_sin_ptr")
        }
        src = GluonASTSource(fn=gemm_ws, signature=signature, constexprs=constexprs, attrs=attrs)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.warps})
        except Exception as e:  # a configuration that does not compile
            bad += 1
            print(f"{cfg.name:<28} FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        md = kernel.metadata
        built = dump(kernel, folder, cfg.name)
        ttgir, ptx = built.ttgir, built.ptx
        regs = sorted(set(re.findall(r"setmaxnreg\.((?:inc|dec)\.sync\.aligned\.u32\s+\d+)", ptx)))
        regs = [" ".join((r.split(".")[0], r.split()[-1])) for r in regs]
        ws = "ttg.warp_specialize" in ttgir
        maxnreg = re.findall(r"\.maxnreg\s+(\d+)", ptx) or "-"
        print(f"{cfg.name:<28} ok  regs {built.regs}  local {built.local}  stack {built.stack}  shared {md.shared / 1024:.1f} KB (ring+c {cfg.smem_kb():.0f} KB)  "
              f"num_warps {md.num_warps}  warp_specialize {ws}  setmaxnreg {regs or 'none'}  "
              f"wgmma {ptx.count('wgmma.mma_async')}  "
              f"maxnreg {maxnreg}", flush=True)  # fmt: skip
    return 1 if bad else 0


def main() -> int:
    if "--compile" in sys.argv:
        return compile_all()
    from probe_timing import gemm_inputs, measure, report

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    weight = torch.randn(N_OUT, K_IN, device=device, dtype=torch.bfloat16) / 64
    for num_tokens in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 2048, 16384]:
        hiddens, outs, ref, mm_calls = gemm_inputs(weight, num_tokens, 4)
        rope = rope_inputs(num_tokens, device)
        epi_ref = epilogue_ref(ref, *rope)
        epi2_ref = epilogue_ref(ref, *rope, k_only=True)
        variants: dict[str, Sequence[Callable[[], object]]] = {"mm": mm_calls}
        for cfg in configs(num_tokens, every="--all" in sys.argv):
            gemm = Gemm(weight, num_tokens, cfg, sms, rope)
            descs = [gemm.descs(h, o) for h, o in zip(hiddens, outs, strict=True)]
            variants[cfg.name] = [lambda g=gemm, d=d, o=o: g(d[0], d[1], o) for d, o in zip(descs, outs, strict=True)]

        def verdict(
            name: str,
            calls: Sequence[Callable[[], object]],
            out: torch.Tensor = outs[0],
            ref: torch.Tensor = ref,
            epi_ref: torch.Tensor = epi_ref,
            epi2_ref: torch.Tensor = epi2_ref,
        ) -> str:
            out.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize()
            expected = epi_ref if name.endswith("_epi") else epi2_ref if name.endswith("_epi2") else ref
            error = (out.float() - expected.float()).abs().max().item()
            return f"{error:.3g}{'' if error <= 0.05 else ' WRONG'}"

        report(f"T={num_tokens}", *measure(f"T={num_tokens}", variants, verdict))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
