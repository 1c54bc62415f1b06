"""The K/V family's PyTorch reference: what CPU tensors run, math only.

It computes exactly what the Triton kernel computes (float32 math, K rounded to
the storage dtype after the norm, V copied bit for bit, NaN K for positions
outside ``[0, P)``) with plain tensor operations, so it never indexes out of
bounds either.
"""

from __future__ import annotations

import torch


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
