"""The MLA kernel's launch: its configuration and its argument list."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from typedkv.core import launcher
from typedkv.core.launch_args import (
    fp8_format,
    input_extents,
    input_params,
    number_or_tensor,
    pow2_divisor,
    scale_mode,
    scale_params,
    table_mode,
    wide_offsets,
)
from typedkv.core.launcher import INTERPRETED, KernelLaunch
from typedkv.mla.kernel import materialize_mla_kv_kernel


@dataclass(frozen=True)
class MLAConfig:
    """How the MLA kernel is launched: about ``tile`` elements of latent rows per program.

    The default is the best of benchmarks/mla_sweep.py on the H200 (2026-12-01,
    L=5, C=512, R=64, bf16): two tokens' latent rows per program on one warp --
    with the kernel's latent-first loads, dense 93.8% of copy at T = 65536 (2048
    elements on 2 warps: the same; 4 warps: 82.5%), pages of 64 86.7%, FP8 86.0%.
    ``num_warps`` None: 4 for a tile of >= 1024 elements, else 1.
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


def mla_launch(
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    dst: torch.Tensor,
    strides: tuple[int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    kv_lora_rank: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    kv_scale: float | torch.Tensor | None,
    table_multiple: int = 1,
    config: MLAConfig = MLAConfig(),
) -> KernelLaunch:
    """The MLA kernel's launch; called with `mla_varying`'s values.

    ``strides`` are ``(layer, page, slot in page)`` element strides of ``dst``
    (rows are contiguous); the rest as in `launch_params`, with a ``[L]`` table
    of ``layer_offsets``, each a multiple of ``table_multiple`` elements (for
    every call of the launch: the caller checks). ``config``: the launch
    configuration (the default unless a sweep asks for another).
    """
    num_tokens, num_layers, _ = ckv.shape
    rotary_dim = cos_sin_cache.shape[1]
    block_t, block_c, block_half, num_warps = mla_block_config(kv_lora_rank, rotary_dim, config)
    fp8_max, fp8_mant, fp8_min_exp = fp8_format(dst.dtype)
    stride_l, stride_page, stride_slot = strides
    layer_vec = pow2_divisor(stride_l, 16)
    params = (
        ckv, ckv.stride(0), ckv.stride(1),
        *input_params(kv_norm_weight, eps, cos_sin_cache, positions, slots),
        dst, stride_l // layer_vec, stride_page, stride_slot,
        layer_offsets,
        scale_params(kv_scale),
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        kv_lora_rank, rotary_dim, neox, kv_norm_weight is not None, isinstance(eps, torch.Tensor),
        slots is not None, page_size,
        table_mode(layer_offsets, table_multiple), scale_mode(kv_scale, dst), fp8_max, fp8_mant, fp8_min_exp,
        layer_vec,
        block_t, block_c, block_half, INTERPRETED, num_layers, launcher.programmatic_launch(ckv.device),
        wide_offsets(
            (num_layers, ckv.stride(1)),
            *input_extents(num_layers, kv_norm_weight, eps, cos_sin_cache, positions, slots, (kv_scale,)),
        ),
    )  # fmt: skip
    grid = (triton.cdiv(num_tokens, block_t) * num_layers, 1, 1)
    return KernelLaunch(materialize_mla_kv_kernel, grid, params, num_warps)


def mla_varying(
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    kv_scale: float | torch.Tensor | None,
) -> tuple[Any, ...]:
    """The MLA kernel's per-call arguments, in kernel order."""
    return (
        ckv, kv_norm_weight, *number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, dst, layer_offsets,
        scale_params(kv_scale),
    )  # fmt: skip
