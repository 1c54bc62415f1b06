"""Misuse mypy --strict must reject: each marked line, with exactly the codes after ``# E:``."""

# One statement per line, so that each error lands on its marked line.
# fmt: off

import torch
from _inputs import D, H, L, T, cache_loc, cos_sin_cache, k_norm_weight, k_out, k_pool, kv, positions, v_pool
from torch import Tensor

import typedkv

# num_kv_heads is required and keyword-only.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions)  # E: call-arg
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, H)  # E: call-arg
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=2.0)  # E: arg-type

# rope_style is "neox" or "gptj", nothing else; a plain str variable is not narrowed to them.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H, rope_style="llama")  # E: arg-type
style = "gptj"
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H, rope_style=style)  # E: arg-type
bad_style: typedkv.RopeStyle = "llama"  # E: assignment

# kv_layout is "NHD" or "HND" (FlashInfer's names), nothing else.
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H, kv_layout="NDH")  # E: arg-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H, kv_layout="hnd")  # E: arg-type
bad_layout: typedkv.KVLayout = "paged"  # E: assignment

# An MLA pool's cache_format is "plain" or "fp8_ds_mla", keyword-only.
typedkv.materialize_mla_kv_into_pool(kv, None, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, rope_style="gptj", cache_format="fp8")  # E: arg-type
bad_format: typedkv.CacheFormat = "fp8_e4m3"  # E: assignment

# positions (and cache_loc) are tensors, not lists.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, [0, 1, 2, 3], num_kv_heads=H)  # E: arg-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, [0, 1, 2, 3], k_pool, v_pool, num_kv_heads=H)  # E: arg-type

# eps is a float or a tensor.
typedkv.materialize_kv(kv, k_norm_weight, "1e-6", cos_sin_cache, positions, num_kv_heads=H)  # E: arg-type

# Two outputs, not three.
k, v, extra = typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=H)  # E: misc

# k_out / v_out are keyword-only (mypy binds the extra positional to num_kv_heads).
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, k_out, num_kv_heads=H)  # E: misc arg-type

# materialize_kv_into_pool writes in place and returns None. A bare `written = ...` passes:
# mypy's func-returns-value is not emitted for a decorated function, whatever the decorator
# (python/mypy#14179), and the public ops carry the static_jaxtyping declaration pyrefly
# needs. Once a mypy release emits it, the first line below gains func-returns-value.
pooled: Tensor = typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H)  # E: assignment
shape = typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H).shape  # E: attr-defined

# A KVMaterializer call is forward's signature: hidden and positions (then the optional k_out and
# v_out, tensors), nothing more, two tensors back.
materializer = typedkv.KVMaterializer(torch.empty(L, 2 * H * D, 16), k_norm_weight, 1e-6, cos_sin_cache, num_kv_heads=H)
materializer(torch.empty(T, 16))  # E: call-arg
materializer(torch.empty(T, 16), positions, cache_loc, k_pool, v_pool)  # E: call-arg
materializer(torch.empty(T, 16), positions, k_out=[k_pool])  # E: arg-type
materializer(hidden=torch.empty(T, 16), position=positions)  # E: call-arg
k3, v3, extra3 = materializer(torch.empty(T, 16), positions)  # E: misc
materializer.into_pool(torch.empty(T, 16), positions, cache_loc, k_pool)  # E: call-arg

# Pool options are keyword-only; scales are floats or tensors.
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, H)  # E: call-arg
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H, k_scale="0.5")  # E: arg-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, [[k_pool]], v_pool, num_kv_heads=H)  # E: list-item
# Scales written per row are tensors (or sequences of them), keyword-only: never numbers.
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H, k_scale_out=0.5)  # E: arg-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=H, v_scale_out=[0.5, 0.5])  # E: list-item list-item
materializer.into_pool(torch.empty(T, 16), positions, cache_loc, k_pool, v_pool, None, None, k_pool, v_pool)  # E: call-arg

# The debug switch takes a bool.
typedkv.set_debug("yes")  # E: arg-type
