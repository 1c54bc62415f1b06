"""Where the warp-specialised projection kernel beats GEMM + kernel: the T table's data (a developer script, Hopper).

Not part of the package. Usage: ``python benchmarks/ws_sweep.py [--tiles[=NAME,...] | --grouping [--pools] | --weight-bands
[--pools] | --small | --last-tile | --last-tile-large [--pools] | --rotation | --harness] [T ...]``.
The end-to-end bench's draft, weights and timer (`typedkv.tools.bench_e2e.run_e2e`, CUDA graphs,
the implementations interleaved in rounds, medians of the per-round ratios), with this device's `typedkv.projection.tuning.Tuning.warp_specialized_faster` widened to every T,
so the materializer pinned to "fused" launches the warp-specialised kernel wherever it can. Two
rounds; per T and round, each / ``torch.mm`` alone: that kernel (dense, per-layer pools) and
GEMM + kernel (dense, per-layer pools). T from 256 to 65536 unless given.

``--tiles``: each round three times, the kernel with `typedkv.projection.warp_specialized.WS_TILES`' tiles (one head or two
by T), with its tiles of two heads at every T and with tiles of one head at every T below the weight
bands; ``--tiles=NAME,...`` times those of `TILES` named (``table``, ``2heads``, ``1head``). T from 256 to
4096 unless given.

``--grouping``: the kernel's dense call alone against ``torch.mm``, with `WS_TILES`' 128 x 256 tiles
in bands of 1 to 32 token blocks (`Tiles.group_m`) and 2 or 3 ring slots, the variants alternated
within each of three rounds; T 2048, 16384 and 65536 unless given. With ``--pools``: into the bench's
per-layer pools instead.

``--weight-bands``: as ``--grouping``, with the tiles in bands of 4 to 20 weight tiles over every
token block (`Tiles.group_n`: a band's weight stays in L2 while every token block passes, so the
weight is read from memory once) against bands of 8 token blocks (the tiles below T = 65536), run
first and last.

``--small``: the small and middle T, where the fused path is `typedkv.projection.kernel` (one program per
head and token block) or GEMM + kernel. Against both and ``torch.mm``, the warp-specialised kernel
with the tiles of `SMALL_TILES`: 64 tokens by one head or two, 128 by one or two (the table's tiles), in
bands of 8 token blocks. Dense and per-layer pools, every variant of one T interleaved in rounds
(`typedkv.tools.bench.paired_gpu_time_us`); each variant's K and V first compared with the Triton
kernel's. T 16, 32, 48 and 64 unless given.

``--last-tile``: as ``--small``, with `LAST_TILES`: each program's last tile's epilogue in the epilogue
warps or in the MMA warps, tiles of 128 tokens by two heads or one. T 1024, 1536,
2048, 4096 and 16384 unless given. ``--last-tile-large [--pools]``: the two with `WS_TILES`' tiles, as
``--grouping`` (2048, 16384 and 65536 unless given).

``--rotation``: the end-to-end bench's timing (the kernel with `WS_TILES`' tiles, GEMM + kernel) with one
input set, as the bench runs above T = 256 (`typedkv.tools.bench_e2e.ROTATE_UP_TO`), and with four in turn, as
``--last-tile`` runs: whether the input sets explain the two timings' disagreement. T 1024, 1280, 1536
and 1792 unless given.

``--harness``: the kernel with `WS_TILES`' tiles timed both ways in one process (the end-to-end bench's
`run_e2e`, and `small` with and without the Triton kernel's implementations), two rounds; T 1024 unless given.

What the last runs found, and the tables they chose: docs/decisions/007-warp-specialised-gluon-kernel.md,
008-toward-the-gemm-alone.md and 013-end-to-end-timing.md.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from typedkv import KVMaterializer
from typedkv.projection import tuning, warp_specialized
from typedkv.tools import bench_e2e, timing

TILES = {
    "table": warp_specialized.WS_TILES,
    "2heads": tuple((most, t) for most, t in warp_specialized.WS_TILES if t.block_n == warp_specialized.BLOCK_N),
    # One head a tile (the last tile's epilogue in the epilogue warps, as the table's one-head rows from
    # 897 on) at every T below the weight bands.
    "1head": ((65535, warp_specialized._ONE_HEAD_LAST_EPI), warp_specialized.WS_TILES[-1]),
}


GROUPINGS = {
    f"g{group_m}s{stages}": ((math.inf, warp_specialized.Tiles(128, stages, group_m, 8, 1)),)
    for group_m, stages in ((8, 3), (1, 3), (4, 3), (16, 3), (32, 3), (8, 2))
}
GROUPINGS["g8s3 again"] = GROUPINGS["g8s3"]  # the default last too: a control for drift within a row
WEIGHT_BANDS = {"g8": GROUPINGS["g8s3"]} | {
    f"n{group_n}": ((math.inf, warp_specialized.Tiles(128, 3, 8, 8, 1, group_n=group_n)),)
    for group_n in (4, 8, 10, 16, 20)
}
WEIGHT_BANDS["g8 again"] = WEIGHT_BANDS["g8"]


def grouping(
    tokens: list[int], variants: dict[str, tuple[tuple[float, warp_specialized.Tiles], ...]], pools: bool
) -> None:
    """``--grouping`` / ``--weight-bands``: each of ``variants`` / torch.mm, dense outputs (``pools``: into the
    bench's per-layer pools), alternated within each of three rounds."""
    device = torch.device("cuda")
    tuning.TUNING.update(
        [tuning.measured(torch.cuda.get_device_name(device), warp_specialized_faster=((0, math.inf),))]
    )
    bench = bench_e2e.bench_draft(device)
    draft = bench.draft
    m = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
    m.projection_path = "fused"
    print(f"{'round':>5} {'T':>6} {'mm us':>9} " + " ".join(f"{name:>7}" for name in variants))
    for round_ in (1, 2, 3):
        for num_tokens in tokens:
            x = bench_e2e._inputs(draft, num_tokens, device)
            gemm_out = torch.empty(num_tokens, bench.flat.shape[0], device=device, dtype=draft.dtype)
            k = torch.empty(draft.num_layers, num_tokens, draft.num_kv_heads, draft.head_dim, device=device,
                            dtype=draft.dtype)  # fmt: skip
            v = torch.empty_like(k)
            weight_t = bench.flat.t()
            mm = timing.gpu_time_us([functools.partial(_discard, torch.mm, x.hidden, weight_t, out=gemm_out)])
            cells = []
            if pools:
                call = functools.partial(m.into_pool, x.hidden, x.positions, x.cache_loc, x.k_pool, x.v_pool)
            else:
                call = functools.partial(_discard, m, x.hidden, x.positions, k, v)
            for table in variants.values():
                warp_specialized.WS_TILES = table
                cells.append(timing.gpu_time_us([call]) / mm)
            print(f"{round_:>5} {num_tokens:>6} {mm:>9.2f} " + " ".join(f"{c:>7.3f}" for c in cells), flush=True)
            torch.cuda.empty_cache()


SMALL_TILES = {
    "64x256 s4": warp_specialized.Tiles(64, 4, 8, 4, 2),
    "64x128 s8": warp_specialized.Tiles(64, 8, 8, 4, 1, 128),
    "128x128 s5": warp_specialized.Tiles(128, 5, 8, 8, 1, 128),
    "128x256 s3": warp_specialized.Tiles(128, 3, 8, 8, 1),
}

# ``--last-tile``: a program's last tile's epilogue in the epilogue warps (as every other tile's) or in
# the MMA warps, idle by then (`Tiles.last_in_mma`), with the two-head tiles and 128 x 128.
LAST_TILES = {
    f"{tiles.block_n} {where}": tiles._replace(last_in_mma=where == "mma")
    for tiles in (warp_specialized._TWO_HEADS, warp_specialized._ONE_HEAD)
    for where in ("epi", "mma")
}
# ``--last-tile-large``: the same for `WS_TILES` (bands of weight tiles from 65536 on), as ``--grouping``.
LAST_LARGE = {
    "epi": tuple((most, t._replace(last_in_mma=False)) for most, t in warp_specialized.WS_TILES),
    "mma": tuple((most, t._replace(last_in_mma=True)) for most, t in warp_specialized.WS_TILES),
}
LAST_LARGE["epi again"] = LAST_LARGE["epi"]


def small(
    tokens: list[int], variants: dict[str, warp_specialized.Tiles] = SMALL_TILES, triton_kernel: bool = True
) -> None:
    """``--small``: ``variants`` (`SMALL_TILES`) against the Triton fused kernel (unless not ``triton_kernel``),
    GEMM + kernel and torch.mm, dense and into pools."""
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    measured, default_tiles = tuning.tuning_of(name).warp_specialized_faster, warp_specialized.WS_TILES
    bench = bench_e2e.bench_draft(device)
    draft = bench.draft

    def materializer(path: str = "fused") -> KVMaterializer:
        m = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
        m.projection_path = path
        return m

    def tiled(fn: Callable[[], object], table: tuple[tuple[float, warp_specialized.Tiles], ...]) -> Callable[[], None]:
        # The table is read at each launch: set before the call a graph captures.
        def call() -> None:
            warp_specialized.WS_TILES = table
            fn()

        return call

    triton_m, gemm_m = materializer(), materializer("gemm")
    for num_tokens in tokens:
        inputs = [bench_e2e._inputs(draft, num_tokens, device) for _ in range(4)]
        gemm_out = torch.empty(num_tokens, bench.flat.shape[0], device=device, dtype=draft.dtype)
        weight_t = bench.flat.t()
        calls: dict[str, list[Callable[[], None]]] = {
            "mm": [functools.partial(_discard, torch.mm, x.hidden, weight_t, out=gemm_out) for x in inputs]
        }
        # A layout's kernel is decided at its first call: the Triton kernel's before the table is widened.
        tuning.TUNING.update([tuning.measured(name, warp_specialized_faster=measured)])
        calls["triton"] = [functools.partial(_discard, triton_m, x.hidden, x.positions) for x in inputs]
        calls["triton pool"] = [
            functools.partial(triton_m.into_pool, x.hidden, x.positions, x.cache_loc, x.k_pool, x.v_pool)
            for x in inputs
        ]
        calls["gemm"] = [functools.partial(_discard, gemm_m, x.hidden, x.positions) for x in inputs]
        calls["gemm pool"] = [
            functools.partial(gemm_m.into_pool, x.hidden, x.positions, x.cache_loc, x.k_pool, x.v_pool) for x in inputs
        ]
        for fn in (calls["triton"][0], calls["triton pool"][0]):
            fn()
        ref_k, ref_v = triton_m(inputs[0].hidden, inputs[0].positions)
        if not triton_kernel:
            del calls["triton"], calls["triton pool"]
        tuning.TUNING.update([tuning.measured(name, warp_specialized_faster=((0, math.inf),))])
        for label, tiles in variants.items():
            table = ((math.inf, tiles),)
            m = materializer()
            calls[label] = [tiled(functools.partial(_discard, m, x.hidden, x.positions), table) for x in inputs]
            calls[f"{label} pool"] = [
                tiled(functools.partial(m.into_pool, x.hidden, x.positions, x.cache_loc, x.k_pool, x.v_pool), table)
                for x in inputs
            ]
            warp_specialized.WS_TILES = table
            k, v = m(inputs[0].hidden, inputs[0].positions)
            calls[f"{label} pool"][0]()
            torch.cuda.synchronize()
            dk = (k.float() - ref_k.float()).abs().max().item()
            dv = (v.float() - ref_v.float()).abs().max().item()
            print(f"T={num_tokens} {label}: max|dk| {dk:.3g} max|dv| {dv:.3g} (against the Triton kernel)", flush=True)
        rounds = timing.paired_gpu_time_us(calls)  # each tiled call sets its table
        warp_specialized.WS_TILES = default_tiles
        tuning.TUNING.update([tuning.measured(name, warp_specialized_faster=measured)])
        mm = rounds.pop("mm")
        print(f"T={num_tokens} mm {statistics.median(mm):.2f} us; each / mm, median of the rounds (lowest-highest):")
        for label, times in rounds.items():
            ratio = bench_e2e.paired_ratio(times, mm)
            print(f"   {label:<20} {ratio.median:.3f} ({ratio.low:.3f}-{ratio.high:.3f})", flush=True)
        torch.cuda.empty_cache()


def rotation(tokens: list[int]) -> None:
    """``--rotation``: the end-to-end bench's timing with one input set above T = 256 (as it runs) and with
    four in turn (as ``--last-tile`` runs), alternated over two rounds; the kernel with `WS_TILES`' tiles
    and GEMM + kernel, each / torch.mm timed the same way."""
    device = torch.device("cuda")
    tuning.TUNING.update(
        [tuning.measured(torch.cuda.get_device_name(device), warp_specialized_faster=((0, math.inf),))]
    )
    _print_header("inputs")
    for round_ in (1, 2):
        for sets, rotate_up_to in ((1, 256), (4, math.inf)) if round_ % 2 else ((4, math.inf), (1, 256)):
            bench_e2e.ROTATE_UP_TO = rotate_up_to
            for row in bench_e2e.run_e2e(timing.paired_gpu_time_us, device, tokens)["rows"]:
                _print_row(round_, str(sets), row)
            torch.cuda.empty_cache()


def _print_header(label: str) -> None:
    """The column heads of `_print_row`'s lines, ``label`` the second column's."""
    print(f"{'round':>5} {label:>8} {'T':>6} {'mm us':>9} {'ws':>6} {'ws pool':>8} {'gemm':>6} {'gemm pool':>9}")


def _print_row(round_: int, label: str, row: dict[str, Any]) -> None:
    """One row of `bench_e2e.run_e2e`: torch.mm's time, then the kernel and GEMM + kernel / torch.mm, dense and pools."""
    r = row["ratio"]
    print(
        f"{round_:>5} {label:>8} {row['tokens']:>6} {row['us']['mm']:>9.2f} {r['typedkv_fused / mm']:>6.3f} "
        f"{r['typedkv_pool_fused / mm']:>8.3f} {r['typedkv_gemm / mm']:>6.3f} {r['typedkv_pool_gemm / mm']:>9.3f}",
        flush=True,
    )


def harness(tokens: list[int]) -> None:
    """``--harness``: the kernel with `WS_TILES`' tiles timed by the end-to-end bench (`bench_e2e.run_e2e`) and by
    ``--small`` / ``--last-tile`` (`small`, with and without the Triton kernel's two implementations), the three
    in turn, two rounds, one process: whether the two timings still disagree side by side."""
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    measured = tuning.tuning_of(name).warp_specialized_faster
    for round_ in (1, 2):
        for num_tokens in tokens:
            tuning.TUNING.update([tuning.measured(name, warp_specialized_faster=((0, math.inf),))])
            row = bench_e2e.run_e2e(timing.paired_gpu_time_us, device, [num_tokens])["rows"][0]
            tuning.TUNING.update([tuning.measured(name, warp_specialized_faster=measured)])
            _print_header("timing")
            _print_row(round_, "e2e", row)
            torch.cuda.empty_cache()
            for triton_kernel in (True, False):
                print(f"round {round_} T={num_tokens} small, Triton kernel {triton_kernel}:", flush=True)
                small([num_tokens], {"table": warp_specialized.tiles(num_tokens)}, triton_kernel)


def _discard(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    fn(*args, **kwargs)


def main() -> None:
    if "--small" in sys.argv:
        small([int(a) for a in sys.argv[1:] if not a.startswith("--")] or [16, 32, 48, 64])
        return
    if "--last-tile" in sys.argv:
        small([int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1024, 1536, 2048, 4096, 16384], LAST_TILES)
        return
    for flag, variants in (
        ("--grouping", GROUPINGS),
        ("--weight-bands", WEIGHT_BANDS),
        ("--last-tile-large", LAST_LARGE),
    ):
        if flag in sys.argv:
            tokens = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [2048, 16384, 65536]
            grouping(tokens, variants, "--pools" in sys.argv)
            return
    if "--harness" in sys.argv:
        harness([int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1024])
        return
    if "--rotation" in sys.argv:
        rotation([int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1024, 1280, 1536, 1792])
        return
    named = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--tiles=")]
    compare = "--tiles" in sys.argv or bool(named)
    variants = {name: TILES[name] for name in named[0]} if named else TILES
    given = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    default = [256, 512, 1024, 2048, 4096] if compare else [256, 512, 768, 1024, 1536, 2048, 4096, 16384, 65536]
    tokens = given or default
    device = torch.device("cuda")
    tuning.TUNING.update(
        [tuning.measured(torch.cuda.get_device_name(device), warp_specialized_faster=((0, math.inf),))]
    )
    _print_header("tiles")
    for round_ in (1, 2):
        for name, table in variants.items() if compare else [("128x256", warp_specialized.WS_TILES)]:
            warp_specialized.WS_TILES = table
            for row in bench_e2e.run_e2e(timing.paired_gpu_time_us, device, tokens)["rows"]:
                _print_row(round_, name, row)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
