"""MLA shape misuse, with literal shapes and in annotated functions: pyrefly flags each marked line.

Sizes as in accept_mla.py: L=5, T=16, C=512, R=64 (rows of 576), P=4096, S=256, hidden=1024.
"""

# One statement per line, so that each error lands on its marked line.
# fmt: off

import torch
from jaxtyping import Float, Int
from shape_extensions import static_jaxtyping
from torch import Tensor

import typedkv

ckv = torch.randn(16, 5, 576, dtype=torch.bfloat16)
kv_norm_weight = torch.ones(5, 512)
cos_sin_cache = torch.randn(4096, 64)
positions = torch.arange(16)
cache_loc = torch.arange(16)

# An output allocated tokens first.
typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, rope_style="gptj", out=torch.empty(16, 5, 576))  # E: bad-argument-type

# A norm weight for another number of layers (the target's, say).
typedkv.materialize_mla_kv(ckv, torch.ones(61, 512), 1e-6, cos_sin_cache, positions, rope_style="gptj")  # E: bad-argument-type
typedkv.MLAKVMaterializer(torch.randn(5, 576, 1024), torch.ones(4, 512), 1e-6, cos_sin_cache, rope_style="gptj")  # E: bad-argument-type

# An MLA pool whose rows are not ckv's C+R wide: the latent only.
typedkv.materialize_mla_kv_into_pool(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(5, 256, 512), rope_style="gptj")  # E: bad-argument-type
typedkv.materialize_mla_kv_into_pool(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(5, 4, 64, 512), rope_style="gptj")  # E: bad-argument-type

# DeepSeek's FP8 rows are 656 bytes: not C+R.
typedkv.materialize_mla_kv_into_pool(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, torch.empty(5, 256, 592, dtype=torch.uint8), rope_style="gptj", cache_format="fp8_ds_mla")  # E: bad-argument-type

# A RoPE table per layer for another number of layers.
typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, torch.randn(4, 4096, 64), positions, rope_style="gptj")  # E: bad-argument-type

# One position per token.
typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, cos_sin_cache, torch.arange(15), rope_style="gptj")  # E: bad-argument-type


@static_jaxtyping("T L W C P R S")
def latent_only_pool(
    ckv: Float[Tensor, "T L W"],
    kv_norm_weight: Float[Tensor, "L C"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    cache_loc: Int[Tensor, " T"],
    kv_pool: Float[Tensor, "L S C"],
) -> None:
    typedkv.materialize_mla_kv_into_pool(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, kv_pool, rope_style="gptj")  # E: bad-argument-type


@static_jaxtyping("T L W C P R")
def tokens_first(
    ckv: Float[Tensor, "T L W"],
    kv_norm_weight: Float[Tensor, "L C"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> Float[Tensor, "T L W"]:
    return typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, rope_style="gptj")  # E: bad-return
