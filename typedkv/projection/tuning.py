"""The fused projection's tuning: its launch configuration by batch size, and where it beats GEMM + kernel.

What was measured is one `Tuning` per (device name, Triton release) in `TUNING`; a device or a Triton
release not measured gets `DEFAULT`: GEMM + kernel at every T, and the shared rows of the launch tables.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import triton

from typedkv.core.launcher import device_name


class Blocks(NamedTuple):
    """A fused projection launch's configuration, as `ProjectionConfig.blocks` settles it."""

    block_m: int
    block_k: int
    num_stages: int
    early_rope: bool
    early_loads: bool
    tma: bool
    group_m: int
    num_warps: int
    # The V heads' pipeline depth; None in the tables: as K's (``num_stages``).
    v_stages: int | None = None
    # Under a programmatic dependent launch (`programmatic_launch`): the first weight columns
    # of each head asked of L2 before the program waits for the prior kernel (0: none), and
    # the next kernel let launch once a program's weight loop is done.
    l2_before_wait: int = 0
    signal_next: bool = False


@dataclass(frozen=True)
class ProjectionConfig:
    """How the fused projection kernel (`project_kv_kernel`) is launched.

    A field left ``None`` comes from the device's launch rows by the batch's size
    (`Tuning.blocks`, or `Tuning.blocks_tma` where the weight's tiles can load by TMA), with the
    pipeline's depth, then ``block_k``, reduced until it fits the device's shared
    memory. Tests and sweeps pass others; every configuration computes the same thing.
    """

    block_m: int | None = None  # tokens per program
    block_k: int | None = None  # hidden columns per step of the K loop
    num_warps: int | None = None
    num_stages: int | None = None  # software pipelining of the K loop (tl.range)
    # K's RoPE rows loaded before the GEMM loop, their latency hidden behind it (registers:
    # 2 * block_m * R/2 floats more through the loop).
    early_rope: bool | None = None
    # The epilogue's other loads (per-layer pools' table entry, a tensor scale, eps, the K
    # norm weights) before the loop too.
    early_loads: bool | None = None
    # Weight tiles loaded by TMA (Hopper's tensor memory accelerator, from host-side
    # descriptors) instead of by pointer. Taken only where it can be (`weight_blocks`):
    # NeoX RoPE, each piece of a head a power of two >= 16 rows, the weight's rows
    # 16-byte aligned; elsewhere the weights load by pointer whatever this says.
    tma: bool | None = None
    # Token blocks per band of programs (1: none): programs running together share a
    # band of ``hidden``'s rows, which stays in L2 while every head passes over it.
    group_m: int | None = None
    # The V heads' pipeline depth (None: the table's where ``num_stages`` is the table's too,
    # else as K's). Where all programs run at once (small T) each program's loads are bound
    # by their latency: K's programs, with more of them in flight than V's, end their loop
    # first, and their longer epilogue overlaps V's last loads.
    v_stages: int | None = None
    # Where launches are programmatic dependent ones (`programmatic_launch`): the first weight
    # columns of each head asked of L2 before a program waits for the prior kernel, so that
    # they stream in while that kernel ends (a power of two, 0: none), and the next kernel let
    # launch when a program's weight loop is done, so that its launch overlaps this epilogue.
    l2_before_wait: int | None = None
    signal_next: bool | None = None

    def blocks(
        self,
        num_tokens: int,
        head_rows: int,
        itemsize: int,
        shared_memory: int,
        tma_possible: bool = False,
        device_name: str = "",
    ) -> Blocks:
        """The launch configuration for ``num_tokens``; ``head_rows`` weight rows per program.

        ``tma_possible``: the weight's tiles can load by TMA (`weight_blocks`), so the
        defaults come from the TMA rows unless ``tma`` is False: ``device_name``'s entry of `TUNING`
        (`Tuning.blocks_tma`, `Tuning.blocks`), `DEFAULT`'s where it has none.
        """
        entry = tuning_of(device_name)
        table = entry.blocks_tma if tma_possible and self.tma is not False else entry.blocks
        measured = next(blocks for most, blocks in table if num_tokens <= most)
        block_m = self.block_m or measured.block_m
        block_k = self.block_k or measured.block_k
        stages = self.num_stages or measured.num_stages
        early_rope = measured.early_rope if self.early_rope is None else self.early_rope
        early_loads = measured.early_loads if self.early_loads is None else self.early_loads
        tma = measured.tma if self.tma is None else self.tma
        group_m = self.group_m or measured.group_m
        num_warps = self.num_warps or measured.num_warps
        l2_before_wait = measured.l2_before_wait if self.l2_before_wait is None else self.l2_before_wait
        signal_next = measured.signal_next if self.signal_next is None else self.signal_next

        # A stage holds a hidden tile and the head's weight tile.
        def fits() -> bool:
            return stages * (block_m + head_rows) * block_k * itemsize <= shared_memory

        while self.num_stages is None and stages > 2 and not fits():
            stages -= 1
        while self.block_k is None and block_k > 16 and not fits():
            block_k //= 2
        if self.v_stages is not None:
            v_stages = self.v_stages
        elif self.num_stages is None and measured.v_stages is not None:
            # The table's V depth in proportion to K's, where shared memory made K's shallower.
            v_stages = max(2, -(-stages * measured.v_stages // measured.num_stages))
        else:
            v_stages = stages
        return Blocks(
            block_m, block_k, stages, early_rope, early_loads, tma, group_m, num_warps, v_stages, l2_before_wait,
            signal_next,
        )  # fmt: skip


Rows = tuple[tuple[float, Blocks], ...]
"""A launch table: ``(most tokens, blocks)`` rows, the first whose bound holds ``T`` taken."""

Ranges = tuple[tuple[float, float], ...]
"""Token counts ``[low, high)`` where a path was measured faster than GEMM + kernel."""

# The launch rows every device starts from, measured on the H200 with benchmarks/fused_sweep.py
# (docs/decisions/005-fused-kernel-launch-tables.md): weights by pointer ...
PROJECTION_BLOCKS: Rows = (
    (16, Blocks(16, 128, 5, True, True, False, 1, 4)),
    (32, Blocks(32, 128, 5, False, True, False, 1, 4)),
    (64, Blocks(64, 64, 6, False, False, False, 1, 4)),
    (math.inf, Blocks(128, 64, 3, False, False, False, 1, 4)),
)

# ... and where the weight's tiles can load by TMA (`typedkv.projection.launch.weight_blocks`).
PROJECTION_BLOCKS_TMA: Rows = (
    (16, Blocks(16, 128, 6, True, True, True, 1, 4, 5, 0, True)),
    (32, Blocks(32, 128, 5, False, True, True, 1, 4, None, 128, True)),
    (64, Blocks(64, 64, 8, False, False, True, 1, 4, 7, 128, True)),
    (128, Blocks(128, 64, 7, False, False, True, 1, 8, 6, 128, True)),
    (256, Blocks(64, 64, 3, False, False, True, 8, 4, None, 0, True)),
    (math.inf, Blocks(128, 64, 4, False, False, True, 8, 8)),
)


@dataclass(frozen=True)
class Tuning:
    """What was measured on one device under one Triton release: the fused projection's launch rows, and the
    token counts where each other path beats GEMM + kernel (`typedkv.projection.dispatch` reads them).

    A device or Triton release without an entry in `TUNING` gets `DEFAULT`: the shared launch rows, and
    GEMM + kernel at every T (a ``projection_path="fused"`` call still runs the fused kernel).
    """

    source: str  # where the figures behind the entry are recorded
    blocks: Rows = PROJECTION_BLOCKS
    blocks_tma: Rows = PROJECTION_BLOCKS_TMA
    fused_faster: Ranges = ()  # the fused kernel, its weights by pointer
    fused_faster_tma: Ranges = ()  # the fused kernel, its weight tiles by TMA
    split_gemm_faster: Ranges = ()  # V written by the GEMM into dense outputs (`layers.split_gemm`)
    warp_specialized_faster: Ranges = ()  # the warp-specialised Gluon kernel (`typedkv.projection.warp_specialized`)
    # Where `fused_faster` and `fused_faster_tma` hold: at least this many programs per block of tokens (layers x
    # 2 x KV heads; each streams its head's weight rows, so few heads and layers leave most SMs idle, where one
    # GEMM reads the same weights with all of them), and heads of at most this many values.
    fused_min_programs: int = 0
    fused_max_head_dim: float = math.inf


TuningKey = tuple[str, tuple[int, int]]
"""``(torch.cuda.get_device_name(), (Triton major, minor))``."""


def triton_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string (``"3.6.0"``, ``"3.7.0+git1a2b"``); ``(0, 0)`` if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


TRITON_RELEASE = triton_release(triton.__version__)
"""The Triton release this process runs, as `TUNING` keys it."""

DEFAULT = Tuning(source="not measured: GEMM + kernel at every T, the shared launch rows")

_H200 = "NVIDIA H200"
_H100 = "NVIDIA H100 80GB HBM3"

TUNING: dict[TuningKey, Tuning] = {
    (_H200, (3, 6)): Tuning(
        source="docs/decisions/004-projection-path-by-token-count.md (torch 2.11, Triton 3.6)",
        fused_faster=((1, 33),),
        fused_faster_tma=((1, 129),),
        split_gemm_faster=((65536, math.inf),),
        warp_specialized_faster=((736, 769), (1537, 2177), (2305, 2433), (2561, 2945), (3073, math.inf)),
        # Only the ranges' own draft (5 layers, 8 heads of 128) was measured here.
        fused_min_programs=80,
        fused_max_head_dim=128,
    ),
    (_H100, (3, 6)): Tuning(
        source="docs/decisions/004-projection-path-by-token-count.md (torch 2.11, Triton 3.6)",
        # The H200's rows with V's pipeline one stage shallower up to T = 64, and K's too at 33-64.
        blocks_tma=(
            (16, PROJECTION_BLOCKS_TMA[0][1]._replace(v_stages=4)),
            (32, PROJECTION_BLOCKS_TMA[1][1]._replace(v_stages=4)),
            (64, PROJECTION_BLOCKS_TMA[2][1]._replace(num_stages=8, v_stages=6)),
            *PROJECTION_BLOCKS_TMA[3:],
        ),
        fused_faster=((1, 65),),
        fused_faster_tma=((1, 129),),
        warp_specialized_faster=((736, 769), (1024, 2049), (2177, 2433), (2561, math.inf)),
        # Drafts of 2-128 programs, heads of 128 and 512 (decision 004).
        fused_min_programs=48,
        fused_max_head_dim=128,
    ),
}
"""Every measured (device, Triton release): the only places "auto" leaves GEMM + kernel."""


def tuning_of(name: str, release: tuple[int, int] | None = None) -> Tuning:
    """The entry of the device named ``name`` under ``release`` (None: this process's Triton, `TRITON_RELEASE`):
    `TUNING`'s, else `DEFAULT`."""
    return TUNING.get((name, release or TRITON_RELEASE), DEFAULT)


def measured(name: str, release: tuple[int, int] | None = None, **fields: Any) -> tuple[TuningKey, Tuning]:
    """``(key, entry)``: the entry of ``name`` under ``release`` with ``fields`` replaced (for sweeps and tests:
    ``monkeypatch.setitem(TUNING, *measured("cpu", split_gemm_faster=((1, math.inf),)))``)."""
    return (name, release or TRITON_RELEASE), replace(tuning_of(name, release), **fields)


def _faster(ranges: Ranges, num_tokens: int) -> bool:
    return any(low <= num_tokens < high for low, high in ranges)


def projection_fused_faster(
    device: torch.device, num_tokens: int, tma: bool = False, programs: int = 0, head_dim: int = 0
) -> bool:
    """Whether the fused projection was measured faster at ``num_tokens`` on ``device``.

    ``tma``: its weight tiles would load by TMA (`Tuning.fused_faster_tma`), else by pointer.
    ``programs``: the fused kernel's programs per block of tokens, one per layer, K or V, and KV head;
    ``head_dim``: its heads' size (`Tuning.fused_min_programs`, `Tuning.fused_max_head_dim`).
    """
    entry = tuning_of(device_name(device))
    if programs < entry.fused_min_programs or head_dim > entry.fused_max_head_dim:
        return False
    return _faster(entry.fused_faster_tma if tma else entry.fused_faster, num_tokens)


def split_gemm_faster(device: torch.device, num_tokens: int) -> bool:
    """Whether V written by the GEMM (`Tuning.split_gemm_faster`) was measured faster at ``num_tokens``."""
    return _faster(tuning_of(device_name(device)).split_gemm_faster, num_tokens)


def warp_specialized_faster(device: torch.device, num_tokens: int) -> bool:
    """Whether the warp-specialised kernel (`Tuning.warp_specialized_faster`) was measured faster at ``num_tokens``."""
    return _faster(tuning_of(device_name(device)).warp_specialized_faster, num_tokens)
