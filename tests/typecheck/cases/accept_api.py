"""The documented calls (DESIGN.md): mypy --strict must accept every line, with these exact types."""

from collections.abc import Sequence
from typing import Final, assert_type

import torch
from _inputs import (
    D,
    H,
    L,
    T,
    cache_loc,
    cos_sin_cache,
    eps_per_layer,
    k_norm_weight,
    k_out,
    k_pool,
    k_pool_layers,
    kv,
    positions,
    v_out,
    v_pool,
    v_pool_layers,
)
from torch import Tensor

import typedkv
from typedkv import RopeStyle

# materialize_kv: eps one float or one per layer; returns exactly two tensors.
assert_type(
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H),
    tuple[Tensor, Tensor],
)
k, v = typedkv.materialize_kv(kv, k_norm_weight, eps_per_layer, cos_sin_cache, positions, num_kv_heads=H)
assert_type(k, Tensor)
assert_type(v, Tensor)
k, v = typedkv.materialize_kv(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H, rope_style="gptj", k_out=k_out, v_out=v_out
)
k, v = typedkv.materialize_kv(
    kv,
    k_norm_weight,
    eps=1e-5,
    cos_sin_cache=cos_sin_cache,
    positions=positions.int(),
    num_kv_heads=H,
    rope_style="neox",
    k_out=None,
    v_out=None,
)

# rope_style from a variable: annotated with the public alias, or a Final literal.
style: RopeStyle = "gptj"
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H, rope_style=style)
NEOX: Final = "neox"
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H, rope_style=NEOX)

# materialize_kv_into_pool: stacked pools, per-layer lists, FP8 scales as floats or tensors.
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H
)
typedkv.materialize_kv_into_pool(
    kv,
    k_norm_weight,
    eps_per_layer,
    cos_sin_cache,
    positions,
    cache_loc,
    k_pool_layers,
    v_pool_layers,
    num_kv_heads=H,
    rope_style="gptj",
    k_scale=0.5,
    v_scale=torch.ones(2),
)
layers: Sequence[Tensor] = tuple(k_pool_layers)
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, layers, layers, num_kv_heads=H, k_scale=None
)
# Scales written per row: tensors, or per-layer sequences of them.
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H,
    k_scale_out=torch.empty(L, 16, H), v_scale_out=torch.empty(L, 16, H),
)  # fmt: skip
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, layers, layers, num_kv_heads=H,
    k_scale_out=[torch.empty(16, H) for _ in range(L)], v_scale_out=(torch.empty(16, H),) * L, kv_layout="NHD",
)  # fmt: skip

# KVMaterializer: construction from stacked or per-layer weights; a call is typed as forward.
materializer = typedkv.KVMaterializer(
    torch.empty(L, 2 * H * D, 16), k_norm_weight, eps_per_layer, cos_sin_cache, num_kv_heads=H, rope_style="gptj"
)
per_layer = typedkv.KVMaterializer(
    [torch.empty(2 * H * D, 16) for _ in range(L)], [torch.ones(D) for _ in range(L)], [1e-6] * L, cos_sin_cache,
    num_kv_heads=H, kv_bias=torch.zeros(L, 2 * H * D),
)  # fmt: skip
assert_type(materializer(torch.empty(T, 16), positions), tuple[Tensor, Tensor])
assert_type(materializer.forward(torch.empty(T, 16), positions), tuple[Tensor, Tensor])
assert_type(materializer.into_pool(torch.empty(T, 16), positions, cache_loc, k_pool, v_pool, k_scale=None), None)
scales_out = torch.empty(L, 16, H)
assert_type(
    materializer.into_pool(
        torch.empty(T, 16), positions, cache_loc, k_pool, v_pool, k_scale_out=scales_out, v_scale_out=scales_out
    ),
    None,
)

# The rest of the surface.
typedkv.set_debug(True)
assert_type(typedkv.debug_enabled(), bool)
try:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H)
except typedkv.InputError as err:
    as_value_error: ValueError = err
    as_type_error: TypeError = err
