"""The K/V kernel's launch: its configuration by size and shape, and its arguments, by name."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton

from typedkv.core.launch_args import (
    INPUT_VALUES,
    NO_SCALES,
    Inputs,
    Scale,
    ScaleOut,
    destination_strides,
    layer_vec_of,
    scale_mode,
    scale_pair,
    shared_arguments,
)
from typedkv.core.launcher import KernelLaunch
from typedkv.kv.kernel import materialize_kv_kernel

# The configuration by size and shape: docs/decisions/001-kv-kernel-launch-configuration.md.
_SPLIT_BELOW_PROGRAMS = 4096  # K and V in separate programs (grid axis 2) below this many programs
_WIDE_BELOW_PROGRAMS = 1024  # K and V programs (split) below which they take 8 warps, not 4


@dataclass(frozen=True)
class KVConfig:
    """How the K/V kernel is launched: each field ``None`` is chosen by size and shape, as measured.

    The ops always launch with the default; tests and sweeps build launches
    with other configurations (every one computes the same thing).
    """

    block_t: int | None = None  # tokens per program
    split_kv: bool | None = None  # K and V in separate programs (grid axis 2)
    full_row: bool | None = None  # K as one tile (NeoX RoPE over part of the head only)
    # K as one tile: each rotary dim's partner gathered from the normed row in registers
    # (`tl.gather`) instead of loaded again from kv (an L1 hit; the same bits either way;
    # docs/decisions/002-rope-partners-gathered-in-registers.md).
    partner_gather: bool = True
    layer_fast: bool = True  # a token's layers on neighbouring programs
    num_warps: int | None = None  # warps per program (None: by the tile's size, as measured)
    # K and V in one program (no split_kv): V's loads issued before K's part instead of after
    # K's stores, which the compiler does not move loads across.
    v_first: bool = True
    # The cache modifier of kv's loads: "" (the default, cached in L1 and L2) or ".cg" (L2 only).
    load_cache: str = ""


@functools.lru_cache(maxsize=1024)
def block_config(num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D, num_warps)`` for a head shape (cached: it runs on every new layout)."""
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    tile = block_h * block_d
    if tile >= 1024:
        return 1, block_h, block_d, 4
    return min(4, 1024 // tile), block_h, block_d, 1


def split_kv(num_tokens: int, num_layers: int, block_t: int, config: KVConfig) -> bool:
    """Whether K and V go to separate programs: only when there are few programs."""
    if config.split_kv is not None:
        return config.split_kv
    return triton.cdiv(num_tokens, block_t) * num_layers < _SPLIT_BELOW_PROGRAMS


def full_row(head_dim: int, rotary_dim: int, neox: bool, config: KVConfig) -> bool:
    """Whether K is handled as one tile (`_k_row`): NeoX RoPE over part of the head."""
    if config.full_row is not None:
        return config.full_row and neox
    return neox and rotary_dim < head_dim


@functools.lru_cache(maxsize=64)
def _piece_blocks(head_dim: int, rotary_dim: int) -> tuple[int, int]:
    """Block sizes of the rotary half and of the pass-through dims."""
    return triton.next_power_of_2(max(rotary_dim // 2, 1)), triton.next_power_of_2(max(head_dim - rotary_dim, 1))


VALUES = ("kv_ptr", *INPUT_VALUES, "k_ptr", "v_ptr", "layer_offsets_ptr", "scales", "v_norm", "scale_out")
"""The names of `call_values`' values: the K/V kernel's per-call arguments."""


def call_values(
    kv: torch.Tensor,
    inputs: Inputs,
    slots: torch.Tensor | None,
    destinations: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    scales: tuple[Scale, Scale] = (None, None),
    v_norm_weight: torch.Tensor | None = None,
    scale_out: ScaleOut | None = None,
) -> tuple[Any, ...]:
    """A call's values, in `VALUES`' order: what `KernelLaunch` fills in at each call of a `Launch`.

    ``kv`` ``[T, L, 2*H*D]``; ``slots`` maps tokens to destination rows (``None``: row = token);
    ``destinations`` is ``(k_dst, v_dst, layer_offsets)``: K's and V's destination, layer 0's when
    ``layer_offsets`` is a ``[2, L]`` int64 table of element offsets from them to each layer's tensor
    (``None``: layer ``l`` starts at ``l * stride``); ``scales`` K's and V's FP8 scales (float, ``[L]``
    tensor or None), for FP8 destinations only; ``v_norm_weight`` V's ``[L, D]`` norm weight (None: none);
    ``scale_out`` where scales written per row go (FP8 or int8 destinations; None: none are).
    """
    norm_weight, eps, cos_sin_cache, positions = inputs
    k_dst, v_dst, layer_offsets = destinations
    if isinstance(eps, torch.Tensor):
        eps_tensor, eps = eps, 0.0
    else:
        eps_tensor, eps = None, float(eps)
    # No FP8 scales, the usual call: no helper's call (host time at decode sizes).
    scale_values = NO_SCALES if scales[0] is None and scales[1] is None else scale_pair(scales)
    v_norm = v_norm_of(v_norm_weight)
    return (
        kv, norm_weight, eps_tensor, eps, cos_sin_cache, positions, slots, k_dst, v_dst, layer_offsets, scale_values,
        v_norm, scale_out,
    )  # fmt: skip


def v_norm_of(v_norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, int, int] | None:
    """V's norm weight as the kernels' ``v_norm`` argument: ``(weight, layer stride, dim stride)``, or None."""
    if v_norm_weight is None:
        return None
    return v_norm_weight, v_norm_weight.stride(0), v_norm_weight.stride(1)


class KVGeometry(NamedTuple):
    """What a K/V write's layout fixes beside its values: the heads, the RoPE style, where the rows go.

    ``k_strides``/``v_strides`` are ``(layer, page, slot in page, head)`` element strides of
    the destinations (the last dim is contiguous); row ``r`` is page ``r // page_size``, slot
    ``r % page_size`` (``page_size`` 1: one row per page); rows outside ``[0, num_rows)``
    are skipped. ``table_multiple``: every offset of the layer table is a multiple of this
    many elements, for every call of the launch (the caller checks; 16 bytes' worth lets the
    kernel store whole vectors; 0 without a table). ``scale_strides``: with scales written per row, the
    ``(layer, page, slot in page, head)`` strides of K's and V's scale tensors (None: none are written).
    """

    num_kv_heads: int
    head_dim: int
    neox: bool
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    num_rows: int
    page_size: int = 1
    table_multiple: int = 0
    scale_strides: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None = None


def launch_params(
    values: tuple[Any, ...], geometry: KVGeometry, *, config: KVConfig = KVConfig(), k_only: bool = False
) -> tuple[tuple[int, int, int], dict[str, Any], int]:
    """``(grid, every kernel argument by name, num_warps)`` of a layout's launch, from a call's `call_values`.

    ``config``: the launch configuration (the default: chosen by size). ``k_only``: write K
    only, V being written by the caller (a materializer's GEMM into dense outputs,
    `split_gemm_faster`): the split launch's K programs alone; kv's last dim then holds K's
    ``H*D`` only and ``v_dst`` is not touched.
    """
    num_kv_heads, head_dim, neox = geometry[:3]
    named = dict(zip(VALUES, values, strict=True))
    kv = named["kv_ptr"]
    num_tokens, num_layers, _ = kv.shape
    rotary_dim = named["cos_sin_ptr"].shape[-1]
    block_t, block_h, block_d, num_warps = block_config(num_kv_heads, head_dim)
    block_t = config.block_t or block_t
    split = k_only or split_kv(num_tokens, num_layers, block_t, config)
    one_tile_k = full_row(head_dim, rotary_dim, neox, config)
    if one_tile_k and not split:
        num_warps = min(8, max(1, block_h * block_d // 2048))  # one warp per 2048 elements of a token's K
    parts = 1 if k_only else 2 if split else 1  # grid axis 2: K's programs, then V's when split
    if split and num_warps == 4 and triton.cdiv(num_tokens, block_t) * num_layers * parts < _WIDE_BELOW_PROGRAMS:
        num_warps = 8
    elif not split and num_warps == 4 and named["scale_out"] is not None:
        # Scales written per row: each head's amax is a reduction over its row; 2 warps ran faster (decision 015).
        num_warps = 2
    num_warps = config.num_warps or num_warps
    block_half, block_pass = _piece_blocks(head_dim, rotary_dim)
    arguments = dict(
        **named, **kv_arguments(named, geometry, num_layers, ((num_layers, kv.stride(1)),)),
        kv_stride_t=kv.stride(0), kv_stride_l=kv.stride(1),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        SPLIT=split, LAYER_FAST=config.layer_fast, V_FIRST=config.v_first and not split,
        FULL_ROW=(2 if config.partner_gather else 1) if one_tile_k else 0, LOAD_CACHE=config.load_cache,
    )  # fmt: skip
    return (triton.cdiv(num_tokens, block_t) * num_layers, 1, parts), arguments, num_warps


def kv_arguments(
    named: dict[str, Any], geometry: KVGeometry, num_layers: int, extents: tuple[tuple[int, int], ...]
) -> dict[str, Any]:
    """The arguments, by name, that the K/V kernel and the fused projection's take alike from a call's values (by
    name) and its `KVGeometry`: `shared_arguments`, K's and V's destinations, the heads. ``extents``: the kernel's
    own ``(count, stride)`` products beside these (`typedkv.core.launch_args.wide_offsets`)."""
    k_dst, v_dst, scales = named["k_ptr"], named["v_ptr"], named["scales"]
    v_norm, scale_out = named["v_norm"], named["scale_out"]
    layer_vec = layer_vec_of(geometry.k_strides[0], geometry.v_strides[0])
    # V's norm weight: its layer and dim strides' products, as the K norm weight's (`input_extents`).
    v_norm_extents = () if v_norm is None else ((num_layers, v_norm[1]), (geometry.head_dim, v_norm[2]))
    return dict(
        **shared_arguments(
            named, k_dst.dtype, scales, num_layers=num_layers, num_rows=geometry.num_rows,
            page_size=geometry.page_size, neox=geometry.neox, table_multiple=geometry.table_multiple,
            layer_vec=layer_vec, extents=(*extents, *head_extents(geometry), *v_norm_extents),
        ),
        **destination_strides("k", geometry.k_strides, layer_vec),
        **destination_strides("v", geometry.v_strides, layer_vec),
        H=geometry.num_kv_heads, D=geometry.head_dim, V_NORM=v_norm is not None, scale_strides=geometry.scale_strides,
        K_SCALE=scale_mode(scales[0], k_dst.dtype, scale_out), V_SCALE=scale_mode(scales[1], v_dst.dtype, scale_out),
    )  # fmt: skip


def head_extents(geometry: KVGeometry) -> tuple[tuple[int, int], ...]:
    """The ``(count, stride)`` products over the destinations' heads (`typedkv.core.launch_args.wide_offsets`)."""
    return (geometry.num_kv_heads, geometry.k_strides[3]), (geometry.num_kv_heads, geometry.v_strides[3])


class Launch(KernelLaunch):
    """The K/V kernel's launch of a layout, built from `launch_params`' arguments; called with each call's
    `call_values`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grid, arguments, num_warps = launch_params(*args, **kwargs)
        super().__init__(materialize_kv_kernel, grid, arguments, VALUES, num_warps)
