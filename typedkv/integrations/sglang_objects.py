"""Reading sglang's objects by their attributes, for `typedkv.integrations.sglang`: what typedkv cannot
serve is a `typedkv.InputError` naming the attribute."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

import typedkv

F32 = torch.finfo(torch.float32)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def attribute(obj: Any, attr: str, where: str) -> Any:
    if not hasattr(obj, attr):
        raise typedkv.InputError(f"{where}.{attr}: expected sglang's attribute, got {type(obj).__name__} without it")
    return getattr(obj, attr)


def read_layer_id(i: int, layer: Any) -> int:
    radix = attribute(layer.self_attn, "attn", f"layers[{i}].self_attn")
    return integer(attribute(radix, "layer_id", f"layers[{i}].self_attn.attn"), f"layers[{i}].self_attn.attn.layer_id")


def integer(value: Any, where: str) -> int:
    """``int(value)``, as sglang's helper reads its integers; what ``int`` cannot convert is an InputError."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise typedkv.InputError(f"{where}: expected an integer, got {short(value)}") from None


def number(value: Any, where: str) -> float:
    """``float(value)``, as sglang's helper reads eps; what ``float`` cannot convert is an InputError."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise typedkv.InputError(f"{where}: expected a number, got {short(value)}") from None


def short(value: Any) -> str:
    """A value for a message: a tensor by its shape and dtype (its repr can be long), anything else by repr."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
    return repr(value)


def one_per_token(name: str, values: Tensor, num_tokens: int, what: str) -> Tensor:
    """``values`` flattened to ``[T]``: sglang may pass ``[T, 1]``; a count other than ``num_tokens`` is an error."""
    if values.ndim != 1:
        values = values.reshape(-1)
    if values.numel() != num_tokens:
        raise typedkv.InputError(
            f"{name}: expected T={num_tokens} {what} (one per token of ctx_hidden), got {values.numel()}"
        )
    return values


def is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def layer_scales(layers: Sequence[Any], device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """Each layer's FP8 ``attn.k_scale`` / ``attn.v_scale`` as ``[L]`` float32 on the device; None when none has one.

    A layer without a scale stores unscaled (1.0), as sglang's ``set_kv_buffer`` does. Every scale
    is checked here, once: production calls never read the values, and a zero, negative, NaN or
    infinite scale would silently saturate, flip or NaN the pool. Reading tensor scales costs one
    device sync, at construction only.
    """
    read: dict[str, list[float | Tensor] | None] = {}
    for attr in ("k_scale", "v_scale"):
        scales = [getattr(getattr(layer.self_attn, "attn", None), attr, None) for layer in layers]
        if all(s is None for s in scales):
            read[attr] = None
            continue
        values: list[float | Tensor] = []
        for i, s in enumerate(scales):
            where = f"layers[{i}].self_attn.attn.{attr}"
            if s is None:
                values.append(1.0)
            elif isinstance(s, Tensor):
                if s.numel() != 1:
                    raise typedkv.InputError(f"{where}: expected one per-tensor scale, got shape {tuple(s.shape)}")
                # float64 holds every float scale exactly, so the check below sees the value as given.
                values.append(s.detach().reshape(()).to(device=device, dtype=torch.float64))
            elif isinstance(s, numbers.Real):
                values.append(float(s))
            else:
                raise typedkv.InputError(
                    f"{where}: expected None, a number or a one-element tensor, got {type(s).__name__}"
                )
        read[attr] = values
    tensors = [v for values in read.values() if values is not None for v in values if isinstance(v, Tensor)]
    fetched = iter(torch.stack(tensors).tolist() if tensors else [])  # the one sync
    out: list[Tensor | None] = []
    for attr, given in read.items():
        if given is None:
            out.append(None)
            continue
        floats = [next(fetched) if isinstance(v, Tensor) else v for v in given]
        for i, value in enumerate(floats):
            # The kernel stores x / scale in float32: the scale and its reciprocal must be finite there
            # (NaN fails both comparisons).
            if not F32.tiny <= value <= F32.max:
                raise typedkv.InputError(
                    f"layers[{i}].self_attn.attn.{attr}: expected a finite number > 0 in float32's normal range "
                    f"[{F32.tiny:.3g}, {F32.max:.3g}], got {value!r}: the FP8 pool stores {attr[0].upper()} / {attr}"
                )
        out.append(torch.tensor(floats, dtype=torch.float32, device=device))
    return out[0], out[1]


def projection_rows(attn: Any, name: str, heads_size: int) -> tuple[Tensor, slice, Tensor | None]:
    """A layer's float ``qkv_proj``: its weight, the rows of its K and V projection (after ``q_size``), its bias.

    ``heads_size``: ``num_kv_heads * head_dim``, what ``kv_size`` must be. A quantized projection, or one of
    fewer rows than ``q_size + 2*kv_size``, is an InputError naming the attribute.
    """
    qkv = attribute(attn, "qkv_proj", name)
    quant = getattr(qkv, "quant_method", None)
    if quant is not None and type(quant).__name__ != "UnquantizedLinearMethod":
        raise typedkv.InputError(
            f"{name}.qkv_proj.quant_method: expected None or UnquantizedLinearMethod, got "
            f"{type(quant).__name__}: typedkv reads float projection weights; a quantized "
            "projection takes the per-layer path"
        )
    weight = attribute(qkv, "weight", f"{name}.qkv_proj")
    if not isinstance(weight, Tensor) or weight.dtype not in FLOATS or weight.ndim != 2:
        got = f"dtype {weight.dtype}, shape {tuple(weight.shape)}" if isinstance(weight, Tensor) else repr(weight)
        raise typedkv.InputError(
            f"{name}.qkv_proj.weight: expected a 2-dim float16, bfloat16 or float32 tensor, got {got}: "
            "a quantized projection takes the per-layer path"
        )
    q_size = integer(attribute(attn, "q_size", name), f"{name}.q_size")
    kv_size = integer(attribute(attn, "kv_size", name), f"{name}.kv_size")
    if kv_size != heads_size:
        raise typedkv.InputError(f"{name}.kv_size: expected num_kv_heads * head_dim = {heads_size}, got {kv_size}")
    rows = slice(q_size, q_size + 2 * kv_size)
    if weight.shape[0] < rows.stop:
        raise typedkv.InputError(
            f"{name}.qkv_proj.weight: expected at least q_size + 2*kv_size = {rows.stop} rows, "
            f"got shape {tuple(weight.shape)}"
        )
    bias = getattr(qkv, "bias", None)
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype:
            got = f"shape {tuple(bias.shape)}, dtype {bias.dtype}" if isinstance(bias, Tensor) else repr(bias)
            raise typedkv.InputError(
                f"{name}.qkv_proj.bias: expected shape ({weight.shape[0]},) and dtype {weight.dtype} "
                f"(one per weight row), got {got}"
            )
    return weight, rows, bias
