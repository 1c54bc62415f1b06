"""Shape misuse with literal shapes: pyrefly flags each marked line, with the codes after ``# E:``.

Every line here is type-correct to mypy --strict (it sees ``Tensor``): these
mistakes pass every check but the shape checker before the code runs. Sizes as
in accept_shapes.py: L=5, T=16, H=8, D=128, P=4096, S=256, hidden=1024.
"""

# One statement per line, so that each error lands on its marked line.
# fmt: off

import torch

import typedkv

kv = torch.randn(16, 5, 2048, dtype=torch.bfloat16)
k_norm_weight = torch.ones(5, 128)
cos_sin_cache = torch.randn(4096, 128)
positions = torch.arange(16)
cache_loc = torch.arange(16)
k_pool = torch.empty(5, 256, 8, 128, dtype=torch.bfloat16)
v_pool = torch.empty(5, 256, 8, 128, dtype=torch.bfloat16)

# Outputs allocated tokens first (the seed kernel's classic mistake).
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, k_out=torch.empty(16, 5, 8, 128))  # E: bad-argument-type
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, v_out=torch.empty(16, 5, 8, 128))  # E: bad-argument-type

# Layer count: kv has 5 layers; the norm weight, eps, scales and pools must too.
typedkv.materialize_kv(kv, torch.ones(4, 128), 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv(kv, k_norm_weight, torch.full((4,), 1e-6), cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8, k_scale=torch.ones(4))  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(4, 256, 8, 128), v_pool, num_kv_heads=8)  # E: bad-argument-type

# Token count: positions and cache_loc hold one entry per token of kv.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, torch.arange(15), num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, torch.arange(17), k_pool, v_pool, num_kv_heads=8)  # E: bad-argument-type

# Head dim: D = 128 comes from the norm weight.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, v_out=torch.empty(5, 16, 8, 64))  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, [torch.empty(256, 8, 64)] * 5, [torch.empty(256, 8, 64)] * 5, num_kv_heads=8)  # E: bad-argument-type bad-argument-type

# A missing dim: a 1-D cos/sin cache, a 2-D kv, a 3-D output.
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, torch.randn(4096), positions, num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv(torch.randn(16, 10240), k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, k_out=torch.empty(5, 16, 1024))  # E: bad-argument-type

# K and V pools of different sizes: S = 256 comes from k_pool.
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, torch.empty(5, 128, 8, 128), num_kv_heads=8)  # E: bad-argument-type

# KVMaterializer: the norm weight's layers, the hidden size, positions per token, the pools' layers.
typedkv.KVMaterializer(torch.randn(5, 2048, 1024), torch.ones(4, 128), 1e-6, cos_sin_cache, num_kv_heads=8)  # E: bad-argument-type
materializer = typedkv.KVMaterializer(torch.randn(5, 2048, 1024), k_norm_weight, 1e-6, cos_sin_cache, num_kv_heads=8)
materializer(torch.randn(16, 1000), positions)  # E: bad-argument-type
materializer(torch.randn(16, 1024), torch.arange(8))  # E: bad-argument-type
materializer.into_pool(torch.randn(16, 1024), positions, torch.arange(8), k_pool, v_pool)  # E: bad-argument-type
materializer.into_pool(torch.randn(16, 1024), positions, cache_loc, torch.empty(4, 256, 8, 128), torch.empty(4, 256, 8, 128))  # E: bad-argument-type bad-argument-type

# Paged pools: K and V with different page counts (N = 64 comes from k_pool); pages for 4 layers; a RoPE-only call's k_out of another head dim.
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(5, 64, 16, 8, 128), torch.empty(5, 32, 16, 8, 128), num_kv_heads=8)  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(4, 64, 8, 16, 128), torch.empty(4, 64, 8, 16, 128), num_kv_heads=8, kv_layout="HND")  # E: bad-argument-type bad-argument-type
typedkv.materialize_kv(kv, None, 1e-6, cos_sin_cache, positions, num_kv_heads=8, k_out=torch.empty(5, 16, 8, 128), v_out=torch.empty(5, 16, 8, 64))  # E: bad-argument-type

# Scales written per row: shaped like their pool without D (H = 8 from num_kv_heads; L = 5 from kv).
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8, k_scale_out=torch.empty(5, 256, 4), v_scale_out=torch.empty(5, 256, 8))  # E: bad-argument-type
typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8, k_scale_out=torch.empty(5, 256, 8), v_scale_out=torch.empty(4, 256, 8))  # E: bad-argument-type
