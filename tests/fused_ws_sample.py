"""The warp-specialised fused kernel's calls as a plain script, for ``compute-sanitizer``.

`typedkv.projection.warp_specialized` (Gluon, Hopper) runs the fused path from the T its measured table
gives; here the table is widened to every T, and each tile set the kernel is launched
with (`typedkv.projection.warp_specialized.WS_TILES`' sets, and two heads with the last tile in the
epilogue warps) takes every call in turn. Each set writes dense outputs (T = 1, 300
with positions outside the cos/sin cache, and a T where every program takes three
tiles or more, so that the ring and the staging tile carry from tile to tile) and
pools at slots negative, past the pool and in it: the first set every layout the kernel
takes (flat, NHD and HND pages, per-layer lists, layers off 16 bytes, the halves of one
allocation), the others HND pages and layers off 16 bytes (each layout compiles apart).
Every destination sits inside a larger allocation whose bytes around it are guards
(`fused_sample.Guarded`): after each call the guards are unchanged, dense K/V hold the
float64 oracle (one ulp), and pools what the GEMM + kernel path writes (V bit for bit,
K within one storage step: `fused_sample._same_pools`).
A counter around the kernel's launch checks that each call ran this kernel.

Run from the repository root on an H200 (sm_90, Triton 3.6)::

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/fused_ws_sample.py

It prints ``ws sample done`` at the end (``ws sample skipped`` where the kernel cannot
run). ``tests/test_gpu_fused_ws.py`` runs it under memcheck and under synccheck, this one
on this kernel alone (``--kernel-name``; racecheck: see that test).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from fused_sample import FILL, Guarded, _positions_out_of_range, _same_pools, check_dense
from test_fused_projection import Draft, H, L, _layers
from ws_launches import counted_launches, runs_here, taken_everywhere

import typedkv
from typedkv.projection import warp_specialized

D = warp_specialized.HEAD_DIM
SLOTS = 512  # pool slots: 32 pages of 16
PAGE = 16


def tile_sets() -> dict[str, warp_specialized.Tiles]:
    """Every tile set `WS_TILES` launches with, by a name, and two heads with the last tile in the epilogue warps."""
    sets = {}
    for _, shape in warp_specialized.WS_TILES:
        heads = "two heads" if shape.block_n == 2 * D else "one head"
        last = "MMA" if shape.last_in_mma else "epilogue"
        bands = f", bands of {shape.group_n} weight tiles" if shape.group_n else ""
        sets[f"{heads}, last tile in the {last} warps{bands}"] = shape
    two_heads = warp_specialized.WS_TILES[-2][1]
    sets.setdefault("two heads, last tile in the epilogue warps", two_heads._replace(last_in_mma=False))
    return sets


def several_tiles_a_program(shape: warp_specialized.Tiles) -> int:
    """A T at which every program takes three tiles or more (one tile a token block and ``block_n`` weight rows)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_n = L * 2 * H * D // shape.block_n
    return shape.block_m * (3 * sms // tiles_n + 1)


def dense_cases(shape: warp_specialized.Tiles) -> Iterator[tuple[str, dict[str, Any], int]]:
    yield "T=1 rope only", {"norm": False, "hidden": 256}, 1
    # hidden 1000: the last k-step runs past the hidden and weight columns (TMA fills zeros).
    yield "T=300 hidden=1000", {"hidden": 1000}, 300
    num_tokens = several_tiles_a_program(shape)
    yield f"T={num_tokens} (three tiles a program or more)", {"hidden": 256}, num_tokens


def run_dense(shape: warp_specialized.Tiles, launches: list[int]) -> None:
    for name, kw, num_tokens in dense_cases(shape):
        draft = Draft(torch.bfloat16, head_dim=D, rotary_dim=D, **kw)
        draft.m.to("cuda")
        draft.m.projection_path = "fused"
        before = len(launches)
        check_dense(name, draft, num_tokens, torch.device("cuda"))
        assert launches[before:] == [num_tokens] * 2, f"dense {name}: not the warp-specialised kernel"


def _pools(layout: str) -> tuple[Guarded, Any, Any, typedkv.KVLayout | None]:
    """K and V pools of ``layout`` (``D``-wide heads, ``SLOTS`` slots) carved from one guarded allocation."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    stacked: dict[str, tuple[tuple[int, ...], typedkv.KVLayout | None]] = {
        "flat": ((L, SLOTS, H, D), None),
        "NHD": ((L, SLOTS // PAGE, PAGE, H, D), "NHD"),
        "HND": ((L, SLOTS // PAGE, H, PAGE, D), "HND"),
    }
    if layout in stacked:
        shape, kv_layout = stacked[layout]
        memory = Guarded([shape, shape], bf16, cuda)
        return memory, memory.tensors[0], memory.tensors[1], kv_layout
    if layout == "combined":  # K and V the two halves of one allocation, as engines keep them
        memory = Guarded([(2, L, SLOTS, H, D)], bf16, cuda)
        return memory, memory.tensors[0][0], memory.tensors[0][1], None
    if layout == "list":
        memory = Guarded([(SLOTS, H, D)] * (2 * L), bf16, cuda)
        return memory, memory.tensors[:L], memory.tensors[L:], None
    # "list_unaligned": each layer one element into its own row, so no layer starts on 16 bytes.
    memory = Guarded([(SLOTS * H * D + 1,)] * (2 * L), bf16, cuda)
    layers = [row[1:].view(SLOTS, H, D) for row in memory.tensors]
    return memory, layers[:L], layers[L:], None


POOL_LAYOUTS = ("flat", "NHD", "HND", "list", "list_unaligned", "combined")
# The tile sets after the first: the pool stores whose addressing differs most (pages across the heads,
# per-layer tables stored element by element), not every layout again (each a compile of its own).
POOL_LAYOUTS_AFTER = ("HND", "list_unaligned")


class Written(NamedTuple):
    """A pool call's K tensors, then V's (what `fused_sample._same_pools` reads of a `Guarded`)."""

    tensors: list[torch.Tensor]


def run_pools(layouts: tuple[str, ...], launches: list[int]) -> None:
    # Slots: negative (skipped), one == SLOTS and one far past it (skipped in production), the rest distinct.
    g = torch.Generator().manual_seed(5)
    cache_loc = torch.randperm(SLOTS, generator=g)[:300]
    cache_loc[[0, 7, 150, 299]] = torch.tensor([-1, SLOTS, -7, 10**6])
    draft = Draft(torch.bfloat16, head_dim=D, rotary_dim=D, hidden=256)
    draft.m.to("cuda")
    x, positions = draft.call(cache_loc.shape[0])
    positions = _positions_out_of_range(positions)
    for layout in layouts:
        written = []
        before = len(launches)
        for path in ("fused", "gemm"):
            memory, k_pool, v_pool, kv_layout = _pools(layout)
            draft.m.projection_path = path
            draft.m.into_pool(x.cuda(), positions.cuda(), cache_loc.cuda(), k_pool, v_pool, kv_layout=kv_layout)
            assert memory.guards_intact(), f"pool {layout}, {path} path: a guard byte changed"
            if layout == "list_unaligned":  # the element before each layer is the allocation's, not the pool's
                assert all(bool((row[:1].view(torch.uint8) == FILL).all()) for row in memory.tensors)
            # `_same_pools` reads K's tensors, then V's.
            written.append(Written([*_layers(k_pool), *_layers(v_pool)]))
        _same_pools(layout, *written)  # type: ignore[arg-type]  # it reads .tensors alone
        assert launches[before:] == [cache_loc.shape[0]], f"pool {layout}: not the warp-specialised kernel"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None).parse_args(argv)
    if not runs_here():
        print("ws sample skipped: the warp-specialised kernel needs an sm_90 GPU and Triton 3.6's Gluon", flush=True)
        return 0
    typedkv.set_debug(False)  # production: slots past the pool are skipped, not rejected
    start = time.perf_counter()
    with taken_everywhere(torch.cuda.get_device_name()), counted_launches() as launches:
        for index, (label, shape) in enumerate(tile_sets().items()):
            warp_specialized.WS_TILES = ((math.inf, shape),)
            layouts = POOL_LAYOUTS if index == 0 else POOL_LAYOUTS_AFTER
            run_dense(shape, launches)
            run_pools(layouts, launches)
            print(f"{label}: dense outputs and pools ({', '.join(layouts)}) passed", flush=True)
    print(f"ws sample done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
