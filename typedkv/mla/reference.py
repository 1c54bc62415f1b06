"""The MLA family's PyTorch reference: what CPU tensors run, math only (as the MLA kernel computes it)."""

from __future__ import annotations

import torch

from typedkv.core.launch_args import Inputs
from typedkv.core.reference import rms_normed, roped

DS_MLA_TILE = 128
"""Latent values per scale in an ``"fp8_ds_mla"`` row."""


def mla_rows(ckv: torch.Tensor, inputs: Inputs, neox: bool, latent_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MLA rows ``[L, T, C+R]`` (float32): the latent normed (unless ``inputs.norm_weight`` is None), the rope part rotated.

    The normed latent is rounded to ckv's dtype (``latent_dtype`` if given), as the unfused path stores
    ``kv_a_layernorm``'s output; without a norm it is ckv's values exactly. A
    position outside ``[0, P)`` gives NaN in the rope part only.
    """
    norm_weight, eps, cos_sin_cache, positions = inputs
    rows = ckv.transpose(0, 1).float()
    latent_dim = rows.shape[-1] - cos_sin_cache.shape[-1]
    latent, rope = rows[..., :latent_dim], rows[..., latent_dim:]
    if norm_weight is not None:
        latent = rms_normed(latent, norm_weight, eps, latent_dtype or ckv.dtype)
    return torch.cat((latent, roped(rope, cos_sin_cache, positions, neox)), dim=-1)


def ds_mla_rows(ckv: torch.Tensor, inputs: Inputs, neox: bool) -> torch.Tensor:
    """DeepSeek's FP8 rows ``[L, T, 656]`` (uint8; C = 512, R = 64), as vLLM's ``fp8_ds_mla`` cache holds them.

    The latent (normed as `mla_rows` norms it) rounded to bfloat16; each tile of 128 values divided by its
    scale, ``max(amax(|tile|) / 448, 2**-126)`` in float32 (NaN left out of the amax), saturated to
    ``float8_e4m3fn``; then the 4 scales as float32 bytes, then the rotated rope part rounded to bfloat16.
    """
    rows = mla_rows(ckv, inputs, neox, torch.bfloat16)
    kv_lora_rank = rows.shape[-1] - inputs[2].shape[-1]
    # Without a norm, ckv's latent is rounded here (a normed one was already).
    tiles = rows[..., :kv_lora_rank].to(torch.bfloat16).float().unflatten(-1, (-1, DS_MLA_TILE))
    amax = torch.where(tiles.isnan(), 0.0, tiles.abs()).amax(-1, keepdim=True)
    scales = torch.clamp_min(amax / 448.0, torch.finfo(torch.float32).tiny)
    values = (tiles / scales).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # clamp keeps NaN, as the kernel
    parts = (values.flatten(-2), scales.squeeze(-1).contiguous(), rows[..., kv_lora_rank:].to(torch.bfloat16))
    return torch.cat([part.view(torch.uint8) for part in parts], dim=-1)
