"""The reference pieces every family shares: RMSNorm and RoPE as the kernels compute them, FP8 quantization,
scales written per row, pool row writes.

Math in float32, as the kernels; a position outside ``[0, P)`` gives NaN where RoPE applies, and tokens
with a slot outside ``[0, S)`` are skipped, so the reference never indexes out of bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from typedkv.core.tensor_types import SCALE_FLOOR, is_fp8, quant_max


def writing() -> AbstractContextManager[None]:
    """Where a family's reference computes and writes its outputs: inference only, as on the GPU.

    No autograd history on what is written, and tensors made under ``inference_mode`` are written
    outside it as the kernel writes them (torch refuses in-place updates of those otherwise).
    """
    return torch.inference_mode()


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32, layers first: ``[L, ..., F]``) RMS-normed over its last dim by ``weight`` ``[L, F]``, with
    ``eps`` (a float, or ``[L]``), rounded to ``dtype`` as the unfused model stores the norm's output (float32)."""
    layers_first = (x.shape[0], *(1,) * (x.dim() - 1))
    eps_l = eps.float().view(layers_first) if isinstance(eps, torch.Tensor) else torch.tensor(eps, dtype=torch.float32)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps_l)
    return (x * rstd * weight.float().view(*layers_first[:-1], weight.shape[-1])).to(dtype).float()


def roped(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    """``x`` (float32, ``[L, T, ..., F]``) with its first R dims rotated by RoPE at ``positions`` (NeoX halves, else
    GPT-J pairs) and the others passed; all NaN for a token whose position is outside ``[0, P)``.

    ``cos_sin_cache`` is ``[P, R]``, or ``[L, P, R]``: layer ``l`` rotates with table ``l``."""
    tables = cos_sin_cache if cos_sin_cache.dim() == 3 else cos_sin_cache[None]  # [L or 1, P, R]
    num_positions, rotary_dim = tables.shape[1:]
    half = rotary_dim // 2
    valid = (positions >= 0) & (positions < num_positions)
    if num_positions == 0:  # no position is valid: nothing may be read
        tables = tables.new_zeros(tables.shape[0], 1, rotary_dim)
    cos_sin = tables[:, torch.where(valid, positions, 0).long()].float()  # [L or 1, T, R]
    tokens = (slice(None), slice(None), *(None,) * (x.dim() - 3))  # [L or 1, T, ...] as x's dims
    cos, sin = cos_sin[(*tokens, slice(None, half))], cos_sin[(*tokens, slice(half, None))]
    return torch.where(valid[(None, *tokens[1:], None)], rotated(x, cos, sin, neox), torch.nan)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """``x`` (float32, ``[..., F]``) with its first ``R = 2 * cos.shape[-1]`` dims rotated (NeoX halves, else
    GPT-J pairs) and the others passed; ``cos`` and ``sin`` broadcast against ``x[..., :R/2]``."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((turned, rest), dim=-1)


def quantize(x: torch.Tensor, scale: float | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (``[L, T, H, D]``) as ``dtype``; FP8 targets get ``saturate(x / scale)``.

    The division is ``x * (1 / scale)`` in float32, one reciprocal per layer, as
    the kernel computes it.
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    xf = x.float()
    if isinstance(scale, torch.Tensor):
        xf = xf * scale.float().reciprocal().view(-1, 1, 1, 1)
    elif scale is not None:
        xf = xf * torch.tensor(scale, dtype=torch.float32).reciprocal()
    limit = torch.finfo(dtype).max
    # clamp keeps NaN, as the kernel does.
    return xf.clamp(-limit, limit).to(dtype)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[..., F]``) as ``dtype`` (FP8 or int8) with a scale per row: ``(stored, scales)``, scales ``[...]``.

    A row's scale is ``max(amax(|row|) / quant_max(dtype), SCALE_FLOOR)`` and it stores ``row * (1 / scale)``,
    saturated to ``[-quant_max, quant_max]`` (int8: ``[-128, 127]``, rounded to the nearest integer, ties to even),
    all in float32 as the kernels compute it; a row with a NaN gets a NaN scale (and NaN values, 0 in int8).
    """
    xf = x.float()
    qmax = quant_max(dtype)
    scales = torch.clamp(xf.abs().amax(-1) / qmax, min=SCALE_FLOOR)  # clamp keeps NaN, as the kernel's max
    scaled = xf * scales.reciprocal().unsqueeze(-1)
    if dtype == torch.int8:
        rounded = scaled.clamp(-128.0, 127.0).round()
        return torch.where(rounded.isnan(), 0.0, rounded).to(dtype), scales
    return scaled.clamp(-qmax, qmax).to(dtype), scales


def write_pool(
    values: torch.Tensor,
    cache_loc: torch.Tensor,
    pools: Sequence[torch.Tensor],
    page_size: int = 1,
    hnd: bool = False,
) -> None:
    """Write ``values[l, t]`` (``[H, D]``; ``[H]`` for scales) to slot ``cache_loc[t]`` of ``pools[l]`` for every slot
    in range.

    A pool is ``[S, H, D]`` (``page_size`` 1), or ``[N, B, H, D]`` / ``[N, H, B, D]``
    (``hnd``): slot ``s`` is page ``s // B``, offset ``s % B``; scale tensors the same without ``D``.
    """
    if cache_loc.is_meta:
        return  # a dry run on the meta device: its pools hold no values (selecting the slots would need them)
    paged = pools[0].dim() == values.dim()  # values have a layer dim, a paged pool a page dim more than slots
    num_slots = pools[0].shape[0] * (page_size if paged else 1)
    keep = (cache_loc >= 0) & (cache_loc < num_slots)
    slots = cache_loc[keep].long()
    for layer, pool in enumerate(pools):
        if not paged:
            pool[slots] = values[layer][keep]
        elif hnd:
            # Advanced indices split by a slice: their dim comes first, [K, H, D].
            pool[slots // page_size, :, slots % page_size] = values[layer][keep]
        else:
            pool[slots // page_size, slots % page_size] = values[layer][keep]
