"""The kernel arguments every family builds alike, by the kernels' parameter names.

Every kernel reads its rows, then the same inputs (`Inputs`: the norm's weight and eps, the RoPE table and
positions; and the pool slots), and stores through the same epilogue (`typedkv.core.epilogue`) into
destinations addressed alike: their parameters share names, and the pieces here build them for all. A
call's per-call values come as a tuple whose names its family lists once (its ``VALUES``, `INPUT_VALUES`
among them); everything else is fixed by the layout and built once per layout (`shared_arguments`,
`destination_strides`), as `typedkv.core.launcher.KernelLaunch` takes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from typedkv.core import launcher
from typedkv.core.tensor_types import is_fp8, quant_max

Scale = float | torch.Tensor | None
"""An FP8 destination's scale: one float, an ``[L]`` tensor read in the kernel, or None (1.0)."""

ScaleValue = tuple[torch.Tensor | None, int, float]
"""An FP8 scale as the kernels take it (one tuple argument, `typedkv.core.epilogue._layer_scale`):
``(tensor, its stride, float)``, the tensor read per layer when given, else the float (1.0 for None)."""


ScaleOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Where a K/V kernel writes each row's scale (scales written per row): ``(K's, V's, table)``, the K and V
scale tensors (layer 0's for per-layer ones) and, for per-layer ones, a ``[2, L]`` int64 table of element offsets
from them to each layer's (else None); `typedkv.core.epilogue._scale_destinations` takes it."""


Inputs = tuple[torch.Tensor | None, float | torch.Tensor, torch.Tensor, torch.Tensor]
"""What every kernel and reference reads beside its rows: ``(norm_weight, eps, cos_sin_cache, positions)``.

``norm_weight`` ``[L, D]`` (None: no norm); ``eps`` a float, or ``[L]`` (`typedkv.core.device_tables.layer_eps`);
``cos_sin_cache`` ``[P, R]``, or ``[L, P, R]`` (layer ``l`` reads table ``l``); ``positions`` ``[T]``. A plain
tuple: a call builds one (host time at decode sizes).
"""


INPUT_VALUES = ("weight_ptr", "eps_ptr", "eps", "cos_sin_ptr", "positions_ptr", "slots_ptr")
"""The per-call input arguments of every kernel, in this order among a family's ``VALUES``: a call's `Inputs`,
eps as a ``(tensor, float)`` pair (the tensor when eps is one, read per layer; else the float), and its pool
slots (None: row = token)."""


def scale_value(scale: Scale) -> ScaleValue:
    """An FP8 scale as the kernels take it (`ScaleValue`)."""
    if isinstance(scale, torch.Tensor):
        return scale, scale.stride(0), 1.0
    return None, 0, 1.0 if scale is None else float(scale)


NO_SCALES = (scale_value(None), scale_value(None))


def scale_pair(scales: tuple[Scale, Scale]) -> tuple[ScaleValue, ScaleValue]:
    """K's and V's scales as the K/V kernels' ``scales`` argument (where neither is given, the usual call: `NO_SCALES`)."""
    return scale_value(scales[0]), scale_value(scales[1])


def scale_mode(scale: ScaleValue, dtype: torch.dtype, scale_out: ScaleOut | None = None) -> int:
    """A kernel's ``SCALE`` constexpr for a destination of ``dtype``: 0 stores as is; an FP8 destination is always
    saturated, 1 dividing by the scale's float (1.0 when none was given), 2 by its tensor's entry for the layer;
    with scales written per row (``scale_out``, FP8 or int8), 3 by each row's own, 4 the same into per-layer scale
    tensors (through ``scale_out``'s table)."""
    if scale_out is not None:
        return 3 if scale_out[2] is None else 4
    if not is_fp8(dtype):
        return 0
    return 2 if scale[0] is not None else 1


def shared_arguments(
    values: Mapping[str, Any],
    store: torch.dtype,
    scales: tuple[ScaleValue, ...],
    *,
    num_layers: int,
    num_rows: int,
    page_size: int,
    neox: bool,
    table_multiple: int,
    layer_vec: int,
    extents: tuple[tuple[int, int], ...],
) -> dict[str, Any]:
    """The arguments every kernel takes alike, by name, from a call's values (by name) and its layout.

    The inputs' strides (0 for a tensor that is absent) and the constexprs they decide; the counts; how
    destination rows are addressed (``page_size``, ``table_multiple``: every offset of the layer table is a
    multiple of that many elements, for every call of the launch; ``layer_vec``: what the layer strides
    arrive divided by, `destination_strides`); the FP8 format of ``store``, the destinations' dtype; the
    switches every kernel has. ``scales``: the call's FP8 scale values; ``extents``: the family's own
    ``(count, stride)`` products, weighed with the inputs' for ``WIDE`` (`wide_offsets`).
    """
    norm_weight, eps_t, cos_sin_cache = values["weight_ptr"], values["eps_ptr"], values["cos_sin_ptr"]
    positions, slots = values["positions_ptr"], values["slots_ptr"]
    # A table per layer: its layer stride, else None (a constant to Triton: the launch of one table is unchanged).
    per_layer = cos_sin_cache.dim() == 3
    weight_strides = norm_weight.stride() if norm_weight is not None else (0, 0)
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(store)
    return dict(
        weight_stride_l=weight_strides[0],
        weight_stride_d=weight_strides[1],
        eps_stride=eps_t.stride(0) if eps_t is not None else 0,
        cos_sin_stride_l=cos_sin_cache.stride(0) if per_layer else None,
        cos_sin_stride_p=cos_sin_cache.stride(-2),
        cos_sin_stride_r=cos_sin_cache.stride(-1),
        positions_stride=positions.stride(0),
        slots_stride=slots.stride(0) if slots is not None else 0,
        num_tokens=positions.shape[0],
        num_positions=cos_sin_cache.shape[-2],
        num_rows=num_rows,
        R=cos_sin_cache.shape[-1],
        NEOX=neox,
        NORM=norm_weight is not None,
        EPS_PER_LAYER=eps_t is not None,
        INDEXED=slots is not None,
        PAGE=page_size,
        LAYER_TABLE=0 if values["layer_offsets_ptr"] is None else table_multiple,
        FP8_MAX=fp8_max,
        FP8_MANT=fp8_mant,
        FP8_MIN_EXP=fp8_min_exp,
        LAYER_VEC=layer_vec,
        SOFT_ROUND=launcher.INTERPRETED,
        NUM_LAYERS=num_layers,
        WAIT_PRIOR=launcher.programmatic_launch(positions.device),
        WIDE=wide_offsets(*extents, *input_extents(values, scales, num_layers)),
    )


def input_extents(
    values: Mapping[str, Any], scales: tuple[ScaleValue, ...], num_layers: int
) -> tuple[tuple[int, int], ...]:
    """The ``(count, stride)`` products every kernel forms over a call's input tensors and FP8 scale tensors (its
    values by name, as in `shared_arguments`), for `wide_offsets`."""
    norm_weight, cos_sin_cache, positions, slots = (
        values["weight_ptr"], values["cos_sin_ptr"], values["positions_ptr"], values["slots_ptr"]
    )  # fmt: skip
    extents = [(cos_sin_cache.shape[-1], cos_sin_cache.stride(-1)), (positions.shape[0], positions.stride(0))]
    if cos_sin_cache.dim() == 3:
        extents.append((num_layers, cos_sin_cache.stride(0)))
    if norm_weight is not None:
        extents += [(num_layers, norm_weight.stride(0)), (norm_weight.shape[1], norm_weight.stride(1))]
    if slots is not None:
        extents.append((slots.shape[0], slots.stride(0)))
    tensors = (values["eps_ptr"], *(scale[0] for scale in scales))
    return (*extents, *((num_layers, t.stride(0)) for t in tensors if t is not None))


def destination_strides(name: str, strides: tuple[int, ...], layer_vec: int) -> dict[str, int]:
    """A destination's element strides as the kernels name them: ``{name}_stride_l`` (divided by ``layer_vec``, so
    the compiler still sees 16-byte aligned rows), ``_page``, ``_slot`` (in the page) and, for K and V, ``_h``."""
    parts = ("l", "page", "slot", "h")[: len(strides)]
    return {
        f"{name}_stride_{part}": stride
        for part, stride in zip(parts, (strides[0] // layer_vec, *strides[1:]), strict=True)
    }


def layer_vec_of(*layer_strides: int) -> int:
    """``LAYER_VEC``: the largest power of two, at most 16, that divides every one of the destinations' layer strides."""
    value = 0
    for stride in layer_strides:
        value |= stride
    if value == 0:
        return 16
    return min(value & -value, 16)


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


def _fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """``(largest finite, mantissa bits, smallest normal exponent)`` of an FP8 dtype; int8's largest (127) and zeros;
    zeros for another."""
    if dtype == torch.int8:
        return quant_max(dtype), 0, 0
    if not is_fp8(dtype):
        return 0.0, 0, 0
    info = torch.finfo(dtype)
    return info.max, round(-math.log2(info.eps)), round(math.log2(info.tiny))
