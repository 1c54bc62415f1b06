"""The MLA ops as registered torch ops (``torch.ops.typedkv.*``), for torch.compile and CUDA graphs.

As `typedkv._library` is for the K/V ops (its notes hold here too): eager calls
never come here; while torch.compile traces, the public functions call these
ops, whose fake implementations run the production checks and whose real ones
run the eager checked implementation (`_mla_impl`). Each op returns nothing and
declares what it writes (``out``, or the pool) in ``mutates_args``; eps and the
FP8 scale travel as a ``(value, tensor)`` pair.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _mla_impl
from ._library import _eps, _join, _labelled, _split, _static, _warn_shared_allocation
from ._types import RopeStyle

# ------------------------------------------------------------------ dense op


@torch.library.custom_op("typedkv::materialize_mla_kv_out", mutates_args=("out",))
def materialize_mla_kv_out(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    rope_style: str,
    out: Tensor,
) -> None:
    """`typedkv.materialize_mla_kv` into ``out``."""
    _mla_impl.materialize_mla_kv(
        ckv, kv_norm_weight, _eps(eps_value, eps_tensor), cos_sin_cache, positions, rope_style, out
    )


@materialize_mla_kv_out.register_fake
def _materialize_mla_kv_out_fake(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    rope_style: str,
    out: Tensor,
) -> None:
    eps = _join(_static(eps_value), eps_tensor)
    _mla_impl.check_dense((ckv, kv_norm_weight, eps, cos_sin_cache, positions, rope_style, out))


# ------------------------------------------------------------------- pool ops


@torch.library.custom_op("typedkv::materialize_mla_kv_into_pool_stacked", mutates_args=("kv_pool",))
def materialize_mla_kv_into_pool_stacked(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    kv_pool: Tensor,
    rope_style: str,
    kv_scale_value: float | None,
    kv_scale_tensor: Tensor | None,
) -> None:
    """`typedkv.materialize_mla_kv_into_pool` with a stacked pool (``[L, S, C+R]``, or paged)."""
    _mla_impl.materialize_mla_kv_into_pool(
        ckv, kv_norm_weight, _eps(eps_value, eps_tensor), cos_sin_cache, positions, cache_loc, kv_pool,
        rope_style, _join(kv_scale_value, kv_scale_tensor),
    )  # fmt: skip


@torch.library.custom_op("typedkv::materialize_mla_kv_into_pool_list", mutates_args=("kv_pool",))
def materialize_mla_kv_into_pool_list(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    kv_pool: Sequence[Tensor],
    rope_style: str,
    kv_scale_value: float | None,
    kv_scale_tensor: Tensor | None,
) -> None:
    """`typedkv.materialize_mla_kv_into_pool` with one pool tensor per layer."""
    _mla_impl.materialize_mla_kv_into_pool(
        ckv, kv_norm_weight, _eps(eps_value, eps_tensor), cos_sin_cache, positions, cache_loc, kv_pool,
        rope_style, _join(kv_scale_value, kv_scale_tensor),
    )  # fmt: skip


@materialize_mla_kv_into_pool_stacked.register_fake
@materialize_mla_kv_into_pool_list.register_fake
def _pool_fake(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    kv_pool: Tensor | Sequence[Tensor],
    rope_style: str,
    kv_scale_value: float | None,
    kv_scale_tensor: Tensor | None,
) -> None:
    eps = _join(_static(eps_value), eps_tensor)
    kv_scale = _join(_static(kv_scale_value), kv_scale_tensor)
    _mla_impl.check_pool((ckv, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, kv_pool, rope_style, kv_scale))
    _warn_shared_allocation(_labelled("kv_pool", kv_pool))


# ------------------------------------------------- what the public ops trace


def materialize_mla_kv(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps: float | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    *,
    rope_style: RopeStyle,
    out: Tensor | None,
) -> Tensor:
    """`typedkv.materialize_mla_kv` while torch.compile traces: the output, then one op call."""
    if out is None:
        out = _empty_out(ckv)
    eps_value, eps_tensor = _split(eps)
    materialize_mla_kv_out(ckv, kv_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, rope_style, out)
    return out


def materialize_mla_kv_into_pool(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps: float | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    kv_pool: Tensor | Sequence[Tensor],
    *,
    rope_style: RopeStyle,
    kv_scale: float | Tensor | None,
) -> None:
    """`typedkv.materialize_mla_kv_into_pool` while torch.compile traces: one op call."""
    eps_value, eps_tensor = _split(eps)
    scale_value, scale_tensor = _split(kv_scale)
    if isinstance(kv_pool, Tensor):
        materialize_mla_kv_into_pool_stacked(
            ckv, kv_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, kv_pool,
            rope_style, scale_value, scale_tensor,
        )  # fmt: skip
    else:
        materialize_mla_kv_into_pool_list(
            ckv, kv_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, list(kv_pool),
            rope_style, scale_value, scale_tensor,
        )  # fmt: skip


def _empty_out(ckv: Tensor) -> Tensor:
    """An ``[L, T, C+R]`` output like the eager op allocates (a placeholder for arguments that cannot size it).

    The op's fake implementation then rejects those arguments with the eager message.
    """
    if ckv.dim() == 3:
        return torch.empty((ckv.shape[1], ckv.shape[0], ckv.shape[2]), dtype=ckv.dtype, device=ckv.device)
    return torch.empty(0)
