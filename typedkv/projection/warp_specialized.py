"""The warp-specialised fused projection (Hopper, Gluon): where it may run, and its launch.

`typedkv.projection.warp_specialized_kernel` computes a materializer's K and V into dense outputs or
pool rows in one persistent, warp-specialised kernel. End to end on the H200
(2026-12-04, third run; "fused", which "auto" was then at T = 1024 too, and is from
T = 1537 on: `PROJECTION_WS_FASTER`): 1.10x ``torch.mm`` alone at T = 1024,
1.06-1.07x at 2048, 1.03-1.05x at 16384, 1.02x at 65536 (into per-layer pools 1.10x,
1.03-1.04x, 1.02-1.03x, 1.01x), where GEMM + kernel reads 1.10x, 1.08x, 1.07x and 1.04x
(1.07x into pools; docs/performance.md, "The last tile in the MMA warps; tiles of one
head"). "auto" takes it where `PROJECTION_WS_FASTER` says, per device: on the H200 at
T = 736-768 and from 1537 on, on the H100 80GB HBM3 at 736-768 and from 1024 on, both but
in bands of T where it was measured slower (on the H100 2026-12-06: 1.03x at
16384 and 1.04x at 65536 end to end, where GEMM + kernel reads 1.10-1.12x and 1.09-1.10x;
docs/performance.md, "The warp-specialised kernel on the H100"). It is written in Gluon
(Triton 3.6's API, sm_90), so it runs where all of these hold (`launchable`, `aligned`),
and the fused path takes it in the T ranges where it was measured faster (`faster`);
everywhere else the fused path launches `typedkv.projection.kernel` as before:

- a CUDA device of compute capability 9.0, not Triton's interpreter, and a Triton
  release whose Gluon this kernel is written against (`available`: 3.6);
- ``hidden``, the weight and the outputs bfloat16 or float16, all one dtype; no bias;
- NeoX RoPE over the whole head, of ``D`` = 128 dims; ``H*D`` a multiple of 256
  (a tile is one head or two by T, `WS_TILES`, never across K and V);
- TMA's layout rules: ``hidden``'s and the weight's rows contiguous and on 16
  bytes; each output ``[L, T, H, D]`` with its heads contiguous (strides
  ``(., ., D, 1)``) and its other strides on 16 bytes; every base address on 16
  bytes (checked per call).

The call's checks are the fused path's (`typedkv.projection.fused`): this module only
says where the kernel may run and launches it.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

import torch
import triton

from typedkv.core import launcher
from typedkv.core.tensor_types import strided
from typedkv.projection import tuning
from typedkv.projection.warp_specialized_kernel import project_kv_ws_kernel

try:  # Gluon and its host-side TMA descriptors (Triton 3.6; imported by name: they ship no types)
    gl: Any = importlib.import_module("triton.experimental.gluon.language")
    GluonDescriptor: Any = importlib.import_module("triton.experimental.gluon.nvidia.hopper").TensorDescriptor
except (ImportError, AttributeError):
    gl = GluonDescriptor = None

HEAD_DIM = 128
# A tile is two heads' weight rows (never across K and V; `Tiles.block_n`), 64 hidden columns a step.
BLOCK_N, BLOCK_K = 256, 64


class Tiles(NamedTuple):
    """A launch's tiles: ``block_m`` tokens, ``stages`` ring slots, bands of ``group_m`` token blocks, and
    the consumer warps as ``warps_m`` along the tokens by ``warps_n`` along the columns (a warpgroup's
    wgmma takes 64 rows); ``block_n`` weight rows (two heads, or one); ``group_n`` > 0 takes the tiles
    in bands of ``group_n`` weight tiles over every token block instead of ``group_m``'s bands;
    ``last_in_mma``: each program's last tile's epilogue runs in the MMA warps (idle by then, and four
    times the epilogue warps) instead of the epilogue warps."""

    block_m: int
    stages: int
    group_m: int
    warps_m: int
    warps_n: int
    block_n: int = BLOCK_N
    group_n: int = 0
    last_in_mma: bool = True

    @property
    def num_warps(self) -> int:
        """The MMA warps (the load warp and the epilogue warps are the kernel's own)."""
        return self.warps_m * self.warps_n


# Two heads a tile (128 x 256) and one (128 x 128): a persistent kernel's time goes by its busiest
# program's tiles, so where T's token blocks make 128 x 256 tiles fill the last wave of programs
# poorly, the tiles of one head fill it better (H200, 132 SMs, 80 heads: at T = 1280, 800 one-head
# tiles are 7 waves of 6.06, 400 two-head ones 4 of 3.03, which is 8 one-head waves of work).
_TWO_HEADS = Tiles(128, 3, 8, 8, 1)
_ONE_HEAD = Tiles(128, 5, 8, 8, 1, 128)
_ONE_HEAD_LAST_EPI = _ONE_HEAD._replace(last_in_mma=False)

# (most tokens, tiles), measured on the H200 (L=5, H=8, D=128, hidden 4096, bf16; benchmarks/NOTES.md).
# 128 tokens by two heads, 3 slots, bands of 8 token blocks, the two warpgroups one above the other
# (benchmarks/gluon_probe.py: the fastest of 128 x 128 / 128 x 256 / 64 x 256 tiles at T = 2048-65536,
# with the epilogue in the MMA warps). From T = 65536 on, bands of 8 weight tiles over every token
# block (`ws_sweep.py --weight-bands`, 2026-12-03, three rounds, each / torch.mm: 1.023-1.036 dense
# and 1.057-1.061 into per-layer pools against 1.038-1.039 and 1.065-1.068; at 16384 and 32768 not
# faster in every round, at 2048 slower). Below 2048, tiles of one head where T's 128-token blocks
# fill the waves better (`ws_sweep.py --last-tile`, 2026-12-04, one to three runs, each / torch.mm,
# dense / per-layer pools): at 704-768 0.99-1.04 / 1.02-1.06 (two heads 1.07-1.10 / 1.06-1.10), 896
# 1.06 / 1.09 (1.31 / 1.26), 1024 0.96-1.01 / 0.98-1.03 (1.18-1.26 / 1.11-1.18), 1280-1408 0.97 /
# 1.02-1.03 (1.15-1.16 / 1.09-1.15), 1792 0.95 / 1.03 (1.08 / 1.03); two heads at 1152 1.04 / 1.03
# (one 1.05 / 1.06) and 1536 1.03-1.08 / 1.02-1.07 (1.02-1.09 / 1.07-1.13). GEMM + kernel at
# 704-1792: 1.05-1.11. The last tile's epilogue in the MMA warps: faster with two heads at every T
# up to 4096 (0.98-1.00 against 1.03-1.05 at 2048, 1.18-1.26 against 1.30-1.35 at 1024), alike at
# 16384 and 65536 (three rounds); with one head faster up to 768 (0.99-1.04 against 1.04-1.06 at
# 768), slower from 896 on (1.04 against 0.97 at 1408).
WS_TILES: tuple[tuple[float, Tiles], ...] = (
    (768, _ONE_HEAD),
    (1024, _ONE_HEAD_LAST_EPI),
    (1152, _TWO_HEADS),
    (1408, _ONE_HEAD_LAST_EPI),
    (1664, _TWO_HEADS),
    (1792, _ONE_HEAD_LAST_EPI),
    (65535, _TWO_HEADS),
    (math.inf, _TWO_HEADS._replace(group_n=8)),
)


def tiles(num_tokens: int) -> Tiles:
    """The tiles `WS_TILES` gives ``num_tokens``."""
    return next(t for most, t in WS_TILES if num_tokens <= most)


# The Triton releases whose Gluon the kernel is written against and was run on (major, minor).
# Gluon is experimental and its API changes between releases: under Triton 3.9 the kernel does
# not compile (its TMA copies are `async_load` / `async_store` there), although
# `warp_specialize`'s signature is 3.6's. Elsewhere the fused path keeps its other kernel.
GLUON_RELEASES = ((3, 6),)


@functools.cache
def available() -> bool:
    """Whether this Triton is a release the kernel is written for (`GLUON_RELEASES`), with Gluon importable."""
    if gl is None or GluonDescriptor is None:
        return False
    release = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    return release in GLUON_RELEASES


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and not launcher.INTERPRETED and torch.cuda.get_device_capability(device) == (9, 0)


def faster(device: torch.device, num_tokens: int) -> bool:
    """Whether this kernel was measured faster at ``num_tokens`` on ``device`` (`typedkv.projection.tuning.TUNING`)."""
    return device.type == "cuda" and tuning.warp_specialized_faster(device, num_tokens)


def _rows_ok(t: Any, dtype: torch.dtype) -> bool:
    """A ``[rows, width]`` tensor of ``dtype`` whose rows TMA can load: contiguous rows, strides and width on 16 bytes."""
    if not isinstance(t, torch.Tensor) or not strided(t) or t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1:
        return False
    size = t.element_size()
    return (t.stride(0) * size) % 16 == 0 and (t.shape[1] * size) % 16 == 0


def _output_ok(t: Any, dtype: torch.dtype, head_dim: int) -> bool:
    """None (the call allocates it, contiguous), or an ``[L, T, H, D]`` output TMA can store as ``[L, T, H*D]``."""
    if t is None:
        return True
    if not isinstance(t, torch.Tensor) or not strided(t) or t.dtype != dtype or t.dim() != 4:
        return False
    size = t.element_size()
    return t.stride(3) == 1 and t.stride(2) == head_dim and all((s * size) % 16 == 0 for s in t.stride()[:2])


def launchable(
    hidden: Any,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    cos_sin_cache: Any,
    k_out: Any,
    v_out: Any,
    *,
    num_kv_heads: int,
    head_dim: int,
    neox: bool,
) -> bool:
    """Whether this kernel can compute a dense call of this layout (the module's list; addresses aside, `aligned`)."""
    if not isinstance(hidden, torch.Tensor) or not available() or not _hopper(hidden.device):
        return False
    dtype = hidden.dtype
    return (
        dtype in (torch.bfloat16, torch.float16)
        and kv_bias is None
        and neox
        and head_dim == HEAD_DIM
        and isinstance(cos_sin_cache, torch.Tensor)
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] == head_dim
        and (num_kv_heads * head_dim) % BLOCK_N == 0
        and _rows_ok(hidden, dtype)
        and _rows_ok(kv_weight, dtype)
        and _output_ok(k_out, dtype, head_dim)
        and _output_ok(v_out, dtype, head_dim)
    )


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every one of ``tensors`` starts on 16 bytes, as TMA requires."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


@functools.cache
def _smem_layout(rank: int) -> Any:
    """The shared-memory layout of a 16-bit tile whose rows are 64 elements or more: 128-byte swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def launch(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    num_layers: int,
) -> None:
    """K and V of ``hidden`` ``[T, hidden]`` into ``k_out``/``v_out`` ``[L, T, H, D]``, the call checked and `launchable`.

    ``eps``: a float, or an ``[L]`` tensor (`typedkv.core.device_tables.layer_eps`). The
    descriptors hold this call's addresses, so they are made per call: the kernel takes the
    path from T = 1537 on, where a call's GPU time is over 150 us.
    """
    num_tokens = hidden.shape[0]
    hd = k_out.shape[2] * k_out.shape[3]
    cube = _smem_layout(3)
    shape = tiles(num_tokens)
    outs = [
        GluonDescriptor(
            out,
            [num_layers, num_tokens, hd],
            [out.stride(0), out.stride(1), 1],
            [1, shape.block_m, shape.block_n],
            cube,
        )
        for out in (k_out, v_out)
    ]
    # The pools' arguments unused: None (constexprs to Triton) and zeros.
    pools: tuple[Any, ...] = (None, None, None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None, 0, 0)
    _launch_kernel(hidden, kv_weight, k_norm_weight, eps, cos_sin_cache, positions, (*outs, *pools), hd, {})


def launchable_pool(
    hidden: Any,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    cos_sin_cache: Any,
    k_pool: Any,
    scales: tuple[Any, Any],
    *,
    num_kv_heads: int,
    head_dim: int,
    neox: bool,
) -> bool:
    """Whether this kernel can compute a pool call of this layout: `launchable`'s list with pools of ``hidden``'s
    dtype (not FP8, no scales) in place of the outputs (any page size, NHD or HND, stacked or per layer)."""
    if not launchable(
        hidden, kv_weight, kv_bias, cos_sin_cache, None, None, num_kv_heads=num_kv_heads, head_dim=head_dim,
        neox=neox,
    ):  # fmt: skip
        return False
    first: Any
    if isinstance(k_pool, torch.Tensor):
        first = k_pool
    else:
        first = k_pool[0] if isinstance(k_pool, (list, tuple)) and k_pool else None
    return isinstance(first, torch.Tensor) and first.dtype == hidden.dtype and scales[0] is None and scales[1] is None


def launch_pool(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    destinations: tuple[torch.Tensor, tuple[int, int, int, int], torch.Tensor, tuple[int, int, int, int]],
    table: torch.Tensor | None,
    table_multiple: int,
    page_size: int,
    num_rows: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """K and V of ``hidden`` into pool rows at ``cache_loc``'s slots, the call checked and `launchable_pool`.

    ``destinations``: ``(k_dst, k_strides, v_dst, v_strides)`` as `typedkv.kv.impl.pool_destinations` and
    the pool geometry give them (strides ``(layer, page, slot in page, head)`` in elements);
    ``table``: the ``[2, L]`` layer offsets of per-layer pools, or None (stacked); ``table_multiple``
    what every offset is a multiple of (`typedkv.core.device_tables.layer_table`; 0 without a table).
    """
    k_dst, k_strides, v_dst, v_strides = destinations
    pools = (
        None, None, k_dst, v_dst, table, table.stride(0) if table is not None else 0,
        table.stride(1) if table is not None else 0, *k_strides, *v_strides, cache_loc, cache_loc.stride(0), num_rows,
    )  # fmt: skip
    options = {"POOL": True, "PAGE": page_size, "TABLE": table_multiple}
    _launch_kernel(
        hidden, kv_weight, k_norm_weight, eps, cos_sin_cache, positions, pools, num_kv_heads * head_dim, options
    )


def _launch_kernel(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    destinations: tuple[Any, ...],
    hd: int,
    options: dict[str, Any],
) -> None:
    """One launch: ``destinations`` the kernel's arguments from ``k_desc`` to ``num_rows``, ``options`` its
    constexprs for pools."""
    num_tokens = hidden.shape[0]
    shape = tiles(num_tokens)
    flat = _smem_layout(2)
    a_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [shape.block_m, BLOCK_K], flat)
    w_desc = GluonDescriptor(kv_weight, list(kv_weight.shape), list(kv_weight.stride()), [shape.block_n, BLOCK_K], flat)
    tiles_m = triton.cdiv(num_tokens, shape.block_m)
    tiles_n = kv_weight.shape[0] // shape.block_n
    num_tiles = tiles_m * tiles_n
    per_layer = isinstance(eps, torch.Tensor)
    # Unused pointers (no per-layer eps, no norm) take tensors the call has anyway.
    eps_ptr = eps if isinstance(eps, torch.Tensor) else cos_sin_cache
    eps_stride = eps.stride(0) if isinstance(eps, torch.Tensor) else 0
    norm = k_norm_weight if k_norm_weight is not None else kv_weight
    project_kv_ws_kernel[(min(num_tiles, _sm_count(hidden.device)),)](
        a_desc, w_desc, *destinations, 0.0 if per_layer else float(eps), eps_ptr, eps_stride,
        norm, norm.stride(0), norm.stride(1),
        positions, positions.stride(0), cos_sin_cache.shape[0], cos_sin_cache, cos_sin_cache.stride(0),
        cos_sin_cache.stride(1), num_tokens, tiles_m, tiles_n, num_tiles, triton.cdiv(hidden.shape[1], BLOCK_K),
        HD=hd, D=HEAD_DIM, BM=shape.block_m, BN=shape.block_n, BK=BLOCK_K, STAGES=shape.stages, GROUP_M=shape.group_m,
        GROUP_N=shape.group_n, LAST_MMA=shape.last_in_mma, WARPS_M=shape.warps_m, WARPS_N=shape.warps_n, NORM=k_norm_weight is not None, EPS_PER_LAYER=per_layer,
        num_warps=shape.num_warps, **options,
    )  # fmt: skip
