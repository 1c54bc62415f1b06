"""The PyTorch reference implementation: what CPU tensors run, math only.

It computes exactly what the Triton kernel computes (float32 math, K rounded to
the storage dtype after the norm, V copied bit for bit, NaN K for positions
outside ``[0, P)``, tokens with a slot outside ``[0, S)`` skipped) with plain
tensor operations, so it never indexes out of bounds either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._types import is_fp8


def rmsnorm_rope(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K normed (unless ``k_norm_weight`` is None) and rotated (float32), and V (kv's dtype), both ``[L, T, H, D]``."""
    _, num_layers, width = kv.shape
    head_dim = width // (2 * num_kv_heads)
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    heads = num_kv_heads * head_dim
    k = kv[..., :heads].unflatten(-1, (num_kv_heads, head_dim)).transpose(0, 1).float()
    v = kv[..., heads:].unflatten(-1, (num_kv_heads, head_dim)).transpose(0, 1)

    if k_norm_weight is None:
        y = k  # kv's values, exactly: RoPE takes them as they are
    else:
        if isinstance(eps, torch.Tensor):
            eps_l = eps.float().view(num_layers, 1, 1, 1)
        else:
            eps_l = torch.tensor(eps, dtype=torch.float32)
        rstd = torch.rsqrt(k.square().mean(-1, keepdim=True) + eps_l)
        weight = k_norm_weight.float()[:, None, None, :]
        # Rounded to the storage dtype between norm and RoPE, as the unfused model does.
        y = (k * rstd * weight).to(kv.dtype).float()

    valid = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    if cos_sin_cache.shape[0] == 0:  # no position is valid: nothing may be read
        cos_sin_cache = cos_sin_cache.new_zeros(1, rotary_dim)
    cos_sin = cos_sin_cache[torch.where(valid, positions, 0).long()].float()
    cos = cos_sin[None, :, None, :half]
    sin = cos_sin[None, :, None, half:]
    rot, rest = y[..., :rotary_dim], y[..., rotary_dim:]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = torch.cat((rotated, rest), dim=-1)
    out = torch.where(valid[None, :, None, None], out, torch.nan)
    return out, v


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


def write_pool(
    values: torch.Tensor,
    cache_loc: torch.Tensor,
    pools: Sequence[torch.Tensor],
    page_size: int = 1,
    hnd: bool = False,
) -> None:
    """Write ``values[l, t]`` (``[H, D]``) to slot ``cache_loc[t]`` of ``pools[l]`` for every slot in range.

    A pool is ``[S, H, D]`` (``page_size`` 1), or ``[N, B, H, D]`` / ``[N, H, B, D]``
    (``hnd``): slot ``s`` is page ``s // B``, offset ``s % B``.
    """
    if cache_loc.is_meta:
        return  # a dry run on the meta device: its pools hold no values (selecting the slots would need them)
    num_slots = pools[0].shape[0] * (page_size if pools[0].dim() == 4 else 1)
    keep = (cache_loc >= 0) & (cache_loc < num_slots)
    slots = cache_loc[keep].long()
    for layer, pool in enumerate(pools):
        if pool.dim() == 3:
            pool[slots] = values[layer][keep]
        elif hnd:
            # Advanced indices split by a slice: their dim comes first, [K, H, D].
            pool[slots // page_size, :, slots % page_size] = values[layer][keep]
        else:
            pool[slots // page_size, slots % page_size] = values[layer][keep]


def mla_rows(
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    neox: bool,
) -> torch.Tensor:
    """MLA rows ``[L, T, C+R]`` (float32): the latent normed (unless ``kv_norm_weight`` is None), the rope part rotated.

    The normed latent is rounded to ckv's dtype, as the unfused path stores
    ``kv_a_layernorm``'s output; without a norm it is ckv's values exactly. A
    position outside ``[0, P)`` gives NaN in the rope part only.
    """
    num_layers = ckv.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    rows = ckv.transpose(0, 1).float()
    latent, rope = rows[..., : rows.shape[-1] - rotary_dim], rows[..., rows.shape[-1] - rotary_dim :]
    if kv_norm_weight is not None:
        eps_l = eps.float().view(num_layers, 1, 1) if isinstance(eps, torch.Tensor) else torch.tensor(eps)
        rstd = torch.rsqrt(latent.square().mean(-1, keepdim=True) + eps_l)
        latent = (latent * rstd * kv_norm_weight.float()[:, None, :]).to(ckv.dtype).float()
    valid = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    if cos_sin_cache.shape[0] == 0:  # no position is valid: nothing may be read
        cos_sin_cache = cos_sin_cache.new_zeros(1, rotary_dim)
    cos_sin = cos_sin_cache[torch.where(valid, positions, 0).long()].float()
    cos, sin = cos_sin[None, :, :half], cos_sin[None, :, half:]
    if neox:
        x1, x2 = rope[..., :half], rope[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    rotated = torch.where(valid[None, :, None], rotated, torch.nan)
    return torch.cat((latent, rotated), dim=-1)
