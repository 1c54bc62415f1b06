"""The K/V family's PyTorch reference: what CPU tensors run, math only.

It computes exactly what the Triton kernel computes (float32 math, K rounded to
the storage dtype after the norm, V copied bit for bit or normed and rounded as
K, NaN K for positions outside ``[0, P)``) with plain tensor operations, so it
never indexes out of bounds either.
"""

from __future__ import annotations

import torch

from typedkv.core.launch_args import Inputs
from typedkv.core.reference import rms_normed, roped


def rmsnorm_rope(
    kv: torch.Tensor, inputs: Inputs, num_kv_heads: int, neox: bool, v_norm_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K normed (unless ``inputs.norm_weight`` is None) and rotated (float32), and V (kv's dtype), both ``[L, T, H, D]``.

    ``kv`` ``[T, L, 2*H*D]``, K's block first. Without a norm K's values enter RoPE exactly as they are.
    ``v_norm_weight`` ``[L, D]``: V RMS-normed as K is (with eps), rounded to kv's dtype; None: V as it is.
    """
    heads = kv.shape[2] // 2
    k = kv[..., :heads].unflatten(-1, (num_kv_heads, -1)).transpose(0, 1).float()
    v = kv[..., heads:].unflatten(-1, (num_kv_heads, -1)).transpose(0, 1)
    norm_weight, eps, cos_sin_cache, positions = inputs
    if norm_weight is not None:
        k = rms_normed(k, norm_weight, eps, kv.dtype)
    if v_norm_weight is not None:
        v = rms_normed(v.float(), v_norm_weight, eps, kv.dtype).to(kv.dtype)
    return roped(k, cos_sin_cache, positions, neox), v
