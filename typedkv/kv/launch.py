"""The K/V kernel's launch: its configuration by size and shape, and its argument list."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from typedkv.core import launcher
from typedkv.core.launch_args import (
    NO_SCALES,
    Scale,
    fp8_format,
    input_extents,
    input_params,
    kv_destination_params,
    number_or_tensor,
    scale_mode,
    scale_pair,
    table_mode,
    wide_offsets,
)
from typedkv.core.launcher import INTERPRETED, KernelLaunch
from typedkv.kv.kernel import materialize_kv_kernel

# Measured on the H200 (benchmarks/NOTES.md, launch-configuration sweep of
# 2026-11-29 evening): about 1024 K elements per program; 4 warps for a token's
# K of >= 1024 elements, 1 warp for several tokens of a narrow K; K and V in
# one program, except for small batches, where separate K and V programs (grid
# axis 2) give the SMs twice as many programs; a token's layers on neighbouring
# programs, so kv is read front to back.
_SPLIT_BELOW_PROGRAMS = 4096
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
    # (`tl.gather`) instead of loaded again from kv (an L1 hit; the same bits either way).
    # benchmarks/partner_probe.py and peer_design.py --configs time the two.
    partner_gather: bool = True
    layer_fast: bool = True  # a token's layers on neighbouring programs
    num_warps: int | None = None  # warps per program (None: by the tile's size, as measured)
    # K and V in one program (no split_kv): V's loads issued before K's part instead of after
    # K's stores, which the compiler does not move loads across. H200 (benchmarks/ab_time.py,
    # alternated, 2026-12-01): main case 93.6 -> 95.1% of copy at T = 16384, flat pool 89.0 ->
    # 92.1%, FP8 pool 82.8 -> 92.4%, pages of 64 90.2 -> 92.1%.
    v_first: bool = True


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


def launch_params(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    scales: tuple[Scale, Scale] = (None, None),
    config: KVConfig = KVConfig(),
    table_multiple: int = 1,
    k_only: bool = False,
) -> tuple[tuple[int, int, int], tuple[Any, ...], int]:
    """``(grid, kernel arguments in order, num_warps)`` of one launch.

    ``k_strides``/``v_strides`` are ``(layer, page, slot in page, head)`` element
    strides of the destinations (the last dim is contiguous); row ``r`` is page
    ``r // page_size``, slot ``r % page_size`` (``page_size`` 1: one row per
    page). ``slots`` maps tokens to rows (``None``: row = token); rows outside
    ``[0, num_rows)`` are skipped. ``layer_offsets`` is a ``[2, L]`` int64 table
    of element offsets from ``k_dst``/``v_dst`` to each layer's tensor
    (``None``: layer ``l`` starts at ``l * stride``). ``k_norm_weight`` None:
    no K norm. ``scales``: K's and V's FP8 scales (float, ``[L]`` tensor or
    None), for FP8 destinations only. ``config``: the launch configuration (the
    default: chosen by size). ``table_multiple``: every offset in ``layer_offsets``
    is a multiple of this many elements, for every call of the launch (the caller
    checks; 16 bytes' worth lets the kernel store whole vectors). ``k_only``: write
    K only, V being written by the caller (a materializer's GEMM into dense outputs,
    `split_gemm_faster`): the split launch's K programs alone; kv's last dim then
    holds K's ``H*D`` only and ``v_dst`` is not touched.
    """
    num_tokens, num_layers, _ = kv.shape
    rotary_dim = cos_sin_cache.shape[1]
    block_t, block_h, block_d, num_warps = block_config(num_kv_heads, head_dim)
    block_t = config.block_t or block_t
    split = k_only or split_kv(num_tokens, num_layers, block_t, config)
    one_tile_k = full_row(head_dim, rotary_dim, neox, config)
    if one_tile_k and not split:
        # Measured: the one-tile K (`_k_row`) runs best with one warp per 2048
        # elements of a token's K (L=2, H=8, D=256, R=64: 92% of copy vs 81% with 4).
        num_warps = min(8, max(1, block_h * block_d // 2048))
    parts = 1 if k_only else 2 if split else 1  # grid axis 2: K's programs, then V's when split
    if split and num_warps == 4 and triton.cdiv(num_tokens, block_t) * num_layers * parts < _WIDE_BELOW_PROGRAMS:
        # Measured (benchmarks/peer_cases.py --sweep, H200): with this few programs, 8 warps
        # each; T = 16 2.42 -> 2.14 us, T = 64 3.0 -> 2.77 us (L = 5, H = 8, D = 128), one layer
        # at T = 256 3.0 -> 2.76 us; at 2048 programs and more (L = 8 at T = 128) 4 warps are faster.
        num_warps = 8
    num_warps = config.num_warps or num_warps
    fp8_max, fp8_mant, fp8_min_exp = fp8_format(k_dst.dtype)
    destinations, layer_vec = kv_destination_params(k_dst, k_strides, v_dst, v_strides, layer_offsets, scales)
    wide = wide_offsets(
        (num_layers, kv.stride(1)), (num_kv_heads, k_strides[3]), (num_kv_heads, v_strides[3]),
        *input_extents(num_layers, k_norm_weight, eps, cos_sin_cache, positions, slots, scales),
    )  # fmt: skip
    params = (
        kv, kv.stride(0), kv.stride(1),
        *input_params(k_norm_weight, eps, cos_sin_cache, positions, slots),
        *destinations,
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        num_kv_heads, head_dim, rotary_dim, neox, k_norm_weight is not None, isinstance(eps, torch.Tensor),
        slots is not None, page_size, table_mode(layer_offsets, table_multiple), scale_mode(scales[0], k_dst),
        scale_mode(scales[1], v_dst),
        fp8_max, fp8_mant, fp8_min_exp, layer_vec, block_t, block_h, block_d,
        *_piece_blocks(head_dim, rotary_dim), split, INTERPRETED, num_layers, config.layer_fast,
        (2 if config.partner_gather else 1) if one_tile_k else 0,  # FULL_ROW
        config.v_first and not split, launcher.programmatic_launch(kv.device), wide,
    )  # fmt: skip
    return (triton.cdiv(num_tokens, block_t) * num_layers, 1, parts), params, num_warps


def varying(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    scales: tuple[Scale, Scale] = (None, None),
) -> tuple[Any, ...]:
    """The per-call kernel arguments, in kernel order (the slots `KernelLaunch` fills on each call).

    ``scales``: K's and V's, as in `launch_params`.
    """
    if scales[0] is None and scales[1] is None and not isinstance(eps, torch.Tensor):
        # The usual call (no FP8 scales, one eps) without the helpers' calls: host time at decode sizes.
        return (
            kv, k_norm_weight, None, float(eps), cos_sin_cache, positions, slots, k_dst, v_dst, layer_offsets,
            NO_SCALES,
        )  # fmt: skip
    return (
        kv, k_norm_weight, *number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, k_dst, v_dst,
        layer_offsets, scale_pair(scales),
    )  # fmt: skip


class Launch(KernelLaunch):
    """The K/V kernel's launch, from `launch_params`' arguments; called with `varying`'s values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grid, params, num_warps = launch_params(*args, **kwargs)
        super().__init__(materialize_kv_kernel, grid, params, num_warps)
