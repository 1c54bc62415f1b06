"""The warp-specialised fused projection (Hopper, Gluon): where it may run, and its launch.

`typedkv.projection.warp_specialized_kernel` computes a materializer's K and V into dense outputs or
pool rows in one persistent, warp-specialised kernel: from the middle T on, closer to ``torch.mm``
alone than GEMM + kernel (docs/decisions/007-warp-specialised-gluon-kernel.md). "auto" takes it
where the device's tuning table says it was measured faster (`typedkv.projection.tuning`). It is
written in Gluon (Triton 3.6's API, sm_90), so it runs where all of these hold (`launchable`,
`aligned`), and the fused path takes it in the T ranges where it was measured faster (`faster`);
everywhere else the fused path launches `typedkv.projection.kernel` as before:

- a CUDA device of compute capability 9.0, not Triton's interpreter, and a Triton
  release whose Gluon this kernel is written against (`available`: 3.6);
- ``hidden``, the weight and the outputs bfloat16 or float16, all one dtype; no bias;
  no V norm; one RoPE table for all layers;
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
from typedkv.core.launch_args import Inputs, destination_strides
from typedkv.core.tensor_types import strided
from typedkv.kv.launch import KVGeometry
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
# poorly, the tiles of one head fill it better.
_TWO_HEADS = Tiles(128, 3, 8, 8, 1)
_ONE_HEAD = Tiles(128, 5, 8, 8, 1, 128)
_ONE_HEAD_LAST_EPI = _ONE_HEAD._replace(last_in_mma=False)

# (most tokens, tiles), measured on the H200 (docs/decisions/007-warp-specialised-gluon-kernel.md):
# 128 tokens by two heads, 3 slots, bands of 8 token blocks, the two warpgroups one above the other;
# from T = 65536 on, bands of 8 weight tiles over every token block; below 2048, tiles of one head
# at the T where T's 128-token blocks fill the waves better. A program's last tile's epilogue runs
# in the MMA warps, but for tiles of one head from 896 tokens on, where that was slower.
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
    return tuning.triton_release(triton.__version__) in GLUON_RELEASES


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
    v_norm_weight: torch.Tensor | None = None,
) -> bool:
    """Whether this kernel can compute a dense call of this layout (the module's list; addresses aside, `aligned`)."""
    if not isinstance(hidden, torch.Tensor) or not available() or not _hopper(hidden.device):
        return False
    dtype = hidden.dtype
    return (
        dtype in (torch.bfloat16, torch.float16)
        and kv_bias is None
        and v_norm_weight is None
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
    inputs: Inputs,
    target: tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], KVGeometry],
    num_layers: int,
) -> None:
    """K and V of ``hidden`` ``[T, hidden]`` written, the call checked and `launchable` (or `launchable_pool`).

    ``target`` is ``(slots, (k_dst, v_dst, layer table), geometry)``, as `typedkv.projection.fused` has it:
    with ``slots`` None, ``[L, T, H, D]`` outputs stored by TMA (the descriptors hold this call's addresses,
    so they are made per call: the kernel takes the path only at T where a call's GPU time is over 150 us);
    else pool rows at the slots, layer 0's and the offsets of every layer from them where there is a table.
    """
    slots, (k_dst, v_dst, table), geometry = target
    hd = geometry.num_kv_heads * geometry.head_dim
    if slots is not None:
        _launch_kernel(hidden, kv_weight, inputs, _pool_arguments(slots, k_dst, v_dst, table, geometry), hd)
        return
    num_tokens = hidden.shape[0]
    shape = tiles(num_tokens)
    cube = _smem_layout(3)
    k_desc, v_desc = (
        GluonDescriptor(
            out,
            [num_layers, num_tokens, hd],
            [out.stride(0), out.stride(1), 1],
            [1, shape.block_m, shape.block_n],
            cube,
        )
        for out in (k_dst, v_dst)
    )
    _launch_kernel(hidden, kv_weight, inputs, {**_NO_POOLS, "k_desc": k_desc, "v_desc": v_desc}, hd)


_NO_POOLS = {
    **dict.fromkeys(("k_ptr", "v_ptr", "offsets_ptr", "slots_ptr")),
    **dict.fromkeys(("offsets_stride_part", "offsets_stride_layer", "slots_stride", "num_rows"), 0),
    **{f"{dst}_stride_{part}": 0 for dst in "kv" for part in ("l", "page", "slot", "h")},
    "POOL": False,
    "PAGE": 1,
    "TABLE": 0,
}
"""The kernel's pool arguments for dense outputs: unused, None (constexprs to Triton) and zeros."""


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
    v_norm_weight: torch.Tensor | None = None,
) -> bool:
    """Whether this kernel can compute a pool call of this layout: `launchable`'s list with pools of ``hidden``'s
    dtype (not FP8, no scales) in place of the outputs (any page size, NHD or HND, stacked or per layer)."""
    if not launchable(
        hidden, kv_weight, kv_bias, cos_sin_cache, None, None, num_kv_heads=num_kv_heads, head_dim=head_dim,
        neox=neox, v_norm_weight=v_norm_weight,
    ):  # fmt: skip
        return False
    first: Any
    if isinstance(k_pool, torch.Tensor):
        first = k_pool
    else:
        first = k_pool[0] if isinstance(k_pool, (list, tuple)) and k_pool else None
    return isinstance(first, torch.Tensor) and first.dtype == hidden.dtype and scales[0] is None and scales[1] is None


def _pool_arguments(
    slots: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, table: torch.Tensor | None, geometry: KVGeometry
) -> dict[str, Any]:
    """The kernel's arguments for pools (its descriptors None): as `typedkv.kv.impl.pool_destinations` and `kv_geometry` give them."""
    return dict(
        k_desc=None,
        v_desc=None,
        k_ptr=k_dst,
        v_ptr=v_dst,
        offsets_ptr=table,
        offsets_stride_part=table.stride(0) if table is not None else 0,
        offsets_stride_layer=table.stride(1) if table is not None else 0,
        **destination_strides("k", geometry.k_strides, 1),
        **destination_strides("v", geometry.v_strides, 1),
        slots_ptr=slots,
        slots_stride=slots.stride(0),
        num_rows=geometry.num_rows,
        POOL=True,
        PAGE=geometry.page_size,
        TABLE=geometry.table_multiple,
    )


def _launch_kernel(
    hidden: torch.Tensor, kv_weight: torch.Tensor, inputs: Inputs, destinations: dict[str, Any], hd: int
) -> None:
    """One launch: ``destinations`` the kernel's arguments for its outputs or pools, by name."""
    num_tokens = hidden.shape[0]
    shape = tiles(num_tokens)
    flat = _smem_layout(2)
    a_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [shape.block_m, BLOCK_K], flat)
    w_desc = GluonDescriptor(kv_weight, list(kv_weight.shape), list(kv_weight.stride()), [shape.block_n, BLOCK_K], flat)
    tiles_m = triton.cdiv(num_tokens, shape.block_m)
    tiles_n = kv_weight.shape[0] // shape.block_n
    norm_weight, eps, cos_sin_cache, positions = inputs
    # Unused pointers (no per-layer eps, no norm) take tensors the call has anyway.
    if isinstance(eps, torch.Tensor):
        eps_arguments: dict[str, Any] = dict(eps=0.0, eps_ptr=eps, eps_stride=eps.stride(0), EPS_PER_LAYER=True)
    else:
        eps_arguments = dict(eps=float(eps), eps_ptr=cos_sin_cache, eps_stride=0, EPS_PER_LAYER=False)
    norm = norm_weight if norm_weight is not None else kv_weight
    arguments = dict(
        **destinations,
        **eps_arguments,
        a_desc=a_desc,
        w_desc=w_desc,
        weight_ptr=norm,
        weight_stride_l=norm.stride(0),
        weight_stride_d=norm.stride(1),
        positions_ptr=positions,
        positions_stride=positions.stride(0),
        num_positions=cos_sin_cache.shape[0],
        cos_sin_ptr=cos_sin_cache,
        stride_p=cos_sin_cache.stride(0),
        stride_r=cos_sin_cache.stride(1),
        num_tokens=num_tokens,
        tiles_m=tiles_m,
        tiles_n=tiles_n,
        num_tiles=tiles_m * tiles_n,
        k_steps=triton.cdiv(hidden.shape[1], BLOCK_K),
        HD=hd,
        D=HEAD_DIM,
        BM=shape.block_m,
        BN=shape.block_n,
        BK=BLOCK_K,
        STAGES=shape.stages,
        GROUP_M=shape.group_m,
        GROUP_N=shape.group_n,
        LAST_MMA=shape.last_in_mma,
        WARPS_M=shape.warps_m,
        WARPS_N=shape.warps_n,
        NORM=norm_weight is not None,
    )
    kernel: Any = project_kv_ws_kernel
    kernel[(min(tiles_m * tiles_n, _sm_count(hidden.device)),)](
        *launcher.in_order(kernel, arguments), num_warps=shape.num_warps
    )
