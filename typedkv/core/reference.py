"""The reference writes every family shares: FP8 quantization as the kernels do it, and pool row writes.

Tokens with a slot outside ``[0, S)`` are skipped, so the reference never indexes out of bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from typedkv.core.tensor_types import is_fp8


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
