"""The kernel arguments every family's launch builds alike: inputs, destinations, scales, offsets' width."""

from __future__ import annotations

import math
from typing import Any

import torch

from typedkv.core.tensor_types import is_fp8

Scale = float | torch.Tensor | None
"""An FP8 destination's scale: one float, an ``[L]`` tensor read in the kernel, or None (1.0)."""


def number_or_tensor(value: float | torch.Tensor | None, default: float) -> tuple[torch.Tensor | None, float]:
    """A kernel's ``(tensor, float)`` argument pair: the tensor when given (read per layer), else the float."""
    if isinstance(value, torch.Tensor):
        return value, default
    return None, default if value is None else float(value)


def input_params(
    norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
) -> tuple[Any, ...]:
    """The arguments every kernel takes after its input: norm weight, eps, cos/sin cache, positions, slots.

    Each tensor with its strides (0 for one that is absent); eps as its ``(tensor, float)`` pair.
    """
    eps_t, eps_f = number_or_tensor(eps, 0.0)
    return (
        norm_weight, *(norm_weight.stride() if norm_weight is not None else (0, 0)),
        eps_t, eps_t.stride(0) if eps_t is not None else 0, eps_f,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        positions, positions.stride(0),
        slots, slots.stride(0) if slots is not None else 0,
    )  # fmt: skip


# The kernels multiply a layer's, a token's, a head's and a dim's index by a stride in int32 (the
# fastest code) unless their WIDE constexpr is set; the rows of kv, hidden, pools and outputs and
# their layers' starts are int64 always. The room leaves space for the in-row offsets added to a
# product before it meets a 64-bit pointer.
_INT32_ROOM = 2**31 - 2**20


def wide_offsets(*extents: tuple[int, int]) -> bool:
    """Whether a launch needs its kernel's WIDE: some ``(count, stride)``'s last index times its stride passes
    int32 (a layer-major kv's layer stride, a head-major pool's head stride, a column of a large tensor as
    ``positions``, ...)."""
    return any((count - 1) * abs(stride) >= _INT32_ROOM for count, stride in extents)


def input_extents(
    num_layers: int,
    norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    scales: tuple[Scale, ...],
) -> tuple[tuple[int, int], ...]:
    """The ``(count, stride)`` products a kernel forms over `input_params`' tensors and the FP8 scales."""
    extents = [(cos_sin_cache.shape[1], cos_sin_cache.stride(1)), (positions.shape[0], positions.stride(0))]
    if norm_weight is not None:
        extents += [(num_layers, norm_weight.stride(0)), (norm_weight.shape[1], norm_weight.stride(1))]
    if slots is not None:
        extents.append((slots.shape[0], slots.stride(0)))
    extents += [(num_layers, t.stride(0)) for t in (eps, *scales) if isinstance(t, torch.Tensor)]
    return tuple(extents)


def kv_destination_params(
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int, int],
    layer_offsets: torch.Tensor | None,
    scales: tuple[Scale, Scale],
) -> tuple[tuple[Any, ...], int]:
    """The K/V kernels' destination arguments (K's and V's base and strides, the layer table, the scales).

    Also ``LAYER_VEC``: the layer strides arrive divided by it, so the compiler still sees 16-byte aligned rows.
    """
    k_stride_l, k_stride_page, k_stride_slot, k_stride_h = k_strides
    v_stride_l, v_stride_page, v_stride_slot, v_stride_h = v_strides
    layer_vec = pow2_divisor(k_stride_l | v_stride_l, 16)
    params = (
        k_dst, k_stride_l // layer_vec, k_stride_page, k_stride_slot, k_stride_h,
        v_dst, v_stride_l // layer_vec, v_stride_page, v_stride_slot, v_stride_h,
        layer_offsets, scale_pair(scales),
    )  # fmt: skip
    return params, layer_vec


def scale_params(scale: Scale) -> tuple[torch.Tensor | None, int, float]:
    """An FP8 scale as the kernels take it (one tuple argument, `typedkv.core.epilogue._layer_scale`).

    ``(tensor, its stride, float)``: the tensor read per layer when given, else the float (1.0 for None).
    """
    scale_t, scale_f = number_or_tensor(scale, 1.0)
    return scale_t, scale_t.stride(0) if scale_t is not None else 0, scale_f


def scale_pair(scales: tuple[Scale, Scale]) -> tuple[tuple[torch.Tensor | None, int, float], ...]:
    """K's and V's scales as the K/V kernels' ``scales`` argument."""
    return scale_params(scales[0]), scale_params(scales[1])


NO_SCALES = scale_pair((None, None))


def table_mode(layer_offsets: torch.Tensor | None, table_multiple: int) -> int:
    """A kernel's ``LAYER_TABLE``: 0 without a layer table, else the multiple its offsets are of."""
    return 0 if layer_offsets is None else table_multiple


def pow2_divisor(value: int, cap: int) -> int:
    """The largest power of two, at most ``cap``, that divides ``value``."""
    if value == 0:
        return cap
    return min(value & -value, cap)


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """``(largest finite, mantissa bits, smallest normal exponent)`` of an FP8 dtype."""
    if not is_fp8(dtype):
        return 0.0, 0, 0
    info = torch.finfo(dtype)
    return info.max, round(-math.log2(info.eps)), round(math.log2(info.tiny))


def scale_mode(scale: float | torch.Tensor | None, dst: torch.Tensor) -> int:
    if not is_fp8(dst.dtype):
        return 0
    # An FP8 destination is always saturated; a missing scale means 1.0.
    return 2 if isinstance(scale, torch.Tensor) else 1
