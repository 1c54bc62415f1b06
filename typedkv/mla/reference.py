"""The MLA family's PyTorch reference: what CPU tensors run, math only (as the MLA kernel computes it)."""

from __future__ import annotations

import torch


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
