"""The MLA family's PyTorch reference: what CPU tensors run, math only (as the MLA kernel computes it)."""

from __future__ import annotations

import torch

from typedkv.core.launch_args import Inputs
from typedkv.core.reference import rms_normed, roped


def mla_rows(ckv: torch.Tensor, inputs: Inputs, neox: bool) -> torch.Tensor:
    """MLA rows ``[L, T, C+R]`` (float32): the latent normed (unless ``inputs.norm_weight`` is None), the rope part rotated.

    The normed latent is rounded to ckv's dtype, as the unfused path stores
    ``kv_a_layernorm``'s output; without a norm it is ckv's values exactly. A
    position outside ``[0, P)`` gives NaN in the rope part only.
    """
    norm_weight, eps, cos_sin_cache, positions = inputs
    rows = ckv.transpose(0, 1).float()
    latent, rope = (
        rows[..., : rows.shape[-1] - cos_sin_cache.shape[1]],
        rows[..., rows.shape[-1] - cos_sin_cache.shape[1] :],
    )
    if norm_weight is not None:
        latent = rms_normed(latent, norm_weight, eps, ckv.dtype)
    return torch.cat((latent, roped(rope, cos_sin_cache, positions, neox)), dim=-1)
