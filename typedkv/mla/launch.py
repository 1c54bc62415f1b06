"""The MLA kernel's launch: its configuration and its arguments, by name."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from typedkv.core.launch_args import (
    INPUT_VALUES,
    Inputs,
    destination_strides,
    layer_vec_of,
    scale_mode,
    scale_value,
    shared_arguments,
)
from typedkv.core.launcher import KernelLaunch
from typedkv.mla.kernel import materialize_mla_kv_kernel


@dataclass(frozen=True)
class MLAConfig:
    """How the MLA kernel is launched: about ``tile`` elements of latent rows per program.

    The default, two tokens' latent rows (C = 512) per program on one warp, is the one measured
    fastest (docs/decisions/010-mla-kernel-configuration.md). ``num_warps`` None: 4 for a tile of
    >= 1024 elements, else 1.
    """

    tile: int = 1024
    num_warps: int | None = 1


@functools.lru_cache(maxsize=64)
def mla_block_config(kv_lora_rank: int, rotary_dim: int, config: MLAConfig) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_C, BLOCK_HALF, num_warps)`` of the MLA kernel."""
    block_c = triton.next_power_of_2(max(kv_lora_rank, 1))
    block_half = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_t = max(1, config.tile // block_c)
    warps = config.num_warps
    if warps is None:
        warps = 4 if block_t * block_c >= 1024 else 1
    return block_t, block_c, block_half, warps


VALUES = ("ckv_ptr", *INPUT_VALUES, "dst_ptr", "layer_offsets_ptr", "kv_scale")
"""The names of `call_values`' values: the MLA kernel's per-call arguments."""


def call_values(
    ckv: torch.Tensor,
    inputs: Inputs,
    slots: torch.Tensor | None,
    dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    kv_scale: float | torch.Tensor | None,
) -> tuple[Any, ...]:
    """A call's values, in `VALUES`' order (what `KernelLaunch` fills in at each call of an `mla_launch`): as the
    K/V kernel's (`typedkv.kv.launch.call_values`), with one destination ``dst`` and its ``[L]`` layer table."""
    norm_weight, eps, cos_sin_cache, positions = inputs
    eps_tensor, eps_float = (eps, 0.0) if isinstance(eps, torch.Tensor) else (None, float(eps))
    scale = scale_value(kv_scale)
    return ckv, norm_weight, eps_tensor, eps_float, cos_sin_cache, positions, slots, dst, layer_offsets, scale


def mla_launch(
    values: tuple[Any, ...],
    strides: tuple[int, int, int],
    *,
    kv_lora_rank: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    table_multiple: int = 1,
    ds_mla: bool = False,
    config: MLAConfig = MLAConfig(),
) -> KernelLaunch:
    """The MLA kernel's launch of a layout, from a call's `call_values`; called with each call's.

    ``strides`` are ``(layer, page, slot in page)`` element strides of the destination
    (rows are contiguous); ``page_size``, ``num_rows`` and ``table_multiple`` as in
    `typedkv.kv.launch.KVGeometry`. ``ds_mla``: rows in DeepSeek's FP8 format, the
    destination their ``uint8`` bytes (the kernel stores the latent's as ``float8_e4m3fn``).
    ``config``: the launch configuration (the default unless a sweep asks for another).
    """
    named = dict(zip(VALUES, values, strict=True))
    ckv, dst = named["ckv_ptr"], named["dst_ptr"]
    stored = torch.float8_e4m3fn if ds_mla else dst.dtype  # what the kernel stores the latent as
    num_tokens, num_layers, _ = ckv.shape
    block_t, block_c, block_half, num_warps = mla_block_config(kv_lora_rank, named["cos_sin_ptr"].shape[-1], config)
    layer_vec = layer_vec_of(strides[0])
    arguments = dict(
        **named,
        **shared_arguments(
            named, stored, (named["kv_scale"],), num_layers=num_layers, num_rows=num_rows, page_size=page_size,
            neox=neox, table_multiple=table_multiple, layer_vec=layer_vec, extents=((num_layers, ckv.stride(1)),),
        ),
        **destination_strides("dst", strides, layer_vec),
        ckv_stride_t=ckv.stride(0),
        ckv_stride_l=ckv.stride(1),
        C=kv_lora_rank,
        SCALE=scale_mode(named["kv_scale"], stored),
        DS_MLA=ds_mla,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        BLOCK_HALF=block_half,
    )  # fmt: skip
    grid = (triton.cdiv(num_tokens, block_t) * num_layers, 1, 1)
    return KernelLaunch(materialize_mla_kv_kernel, grid, arguments, VALUES, num_warps)
