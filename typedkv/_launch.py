"""Launching the fused kernel: block sizes, grid, and one launch for all layers.

No math and no argument checking here: the public ops check, this module picks
the launch configuration and calls the kernel.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import triton

from ._kernel import materialize_kv_kernel

# Triton decides at decoration time whether a kernel runs under its interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tile elements one program aims for: enough bytes in flight per program to
# stream at memory speed, few enough registers to keep occupancy.
_TILE = 4096
# Below this many programs the chip's 132 SMs idle: small T trades tile size
# for parallelism.
_MIN_PROGRAMS = 528


def block_config(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D, num_warps)`` for one launch."""
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    per_token = block_h * block_d
    block_t = max(1, min(16, _TILE // per_token))
    while block_t > 1 and triton.cdiv(num_tokens, block_t) * num_layers < _MIN_PROGRAMS:
        block_t //= 2
    num_warps = 8 if block_t * per_token >= 4096 else 4
    return block_t, block_h, block_d, num_warps


def use_kernel(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (else the reference)."""
    return device.type == "cuda" or INTERPRETED


def launch(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    num_kv_heads: int,
    num_rows: int,
    neox: bool,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    """One launch over ``(token blocks, layers)``.

    ``k_strides``/``v_strides`` are ``(layer, row, head)`` element strides of the
    destinations (the last dim is contiguous). ``slots`` maps tokens to rows
    (``None``: row = token). ``layer_offsets`` is a ``[2, L]`` int64 table of
    element offsets from ``k_dst``/``v_dst`` to each layer's tensor (``None``:
    layer ``l`` starts at ``l * stride``).
    """
    num_tokens, num_layers, _ = kv.shape
    head_dim = k_norm_weight.shape[1]
    block_t, block_h, block_d, num_warps = block_config(num_tokens, num_layers, num_kv_heads, head_dim)
    eps_per_layer = isinstance(eps, torch.Tensor)
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(k_dst.dtype)
    grid = (triton.cdiv(num_tokens, block_t), num_layers)
    kernel: Any = materialize_kv_kernel
    kernel[grid](
        kv,
        kv.stride(0),
        kv.stride(1),
        k_norm_weight,
        k_norm_weight.stride(0),
        k_norm_weight.stride(1),
        eps if eps_per_layer else None,
        0.0 if eps_per_layer else float(eps),  # type: ignore[arg-type]
        cos_sin_cache,
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        positions,
        positions.stride(0),
        slots,
        slots.stride(0) if slots is not None else 0,
        k_dst,
        *k_strides,
        v_dst,
        *v_strides,
        layer_offsets,
        *_scale_args(k_scale),
        *_scale_args(v_scale),
        num_tokens,
        cos_sin_cache.shape[0],
        num_rows,
        H=num_kv_heads,
        D=head_dim,
        R=cos_sin_cache.shape[1],
        NEOX=neox,
        EPS_PER_LAYER=eps_per_layer,
        INDEXED=slots is not None,
        LAYER_TABLE=layer_offsets is not None,
        K_SCALE=_scale_mode(k_scale, k_dst),
        V_SCALE=_scale_mode(v_scale, v_dst),
        FP8_MAX=fp8_max,
        FP8_MANT=fp8_mant,
        FP8_MIN_EXP=fp8_min_exp,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def _fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """``(largest finite, mantissa bits, smallest normal exponent)`` of an FP8 dtype."""
    if dtype.itemsize != 1:
        return 0.0, 0, 0
    info = torch.finfo(dtype)
    return info.max, round(-math.log2(info.eps)), round(math.log2(info.tiny))


def _scale_args(scale: float | torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
    if isinstance(scale, torch.Tensor):
        return scale, 1.0
    return None, 1.0 if scale is None else float(scale)


def _scale_mode(scale: float | torch.Tensor | None, dst: torch.Tensor) -> int:
    if dst.dtype.itemsize != 1:
        return 0
    # An FP8 destination is always saturated; a missing scale means 1.0.
    return 2 if isinstance(scale, torch.Tensor) else 1
