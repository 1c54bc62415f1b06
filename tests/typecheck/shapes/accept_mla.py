"""Shape-correct uses of the MLA entry points: pyrefly and mypy --strict report nothing here.

DeepSeek's geometry: L=5 layers, T=16 tokens, latent C=512, rope part R=64 (rows of C+R=576),
P=4096 positions, S=256 pool slots, hidden=1024.
"""

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

rows = typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, rope_style="gptj")
rows = typedkv.materialize_mla_kv(
    ckv, None, torch.full((5,), 1e-6), cos_sin_cache, positions, rope_style="neox",
    out=torch.empty(5, 16, 576, dtype=torch.bfloat16),
)  # fmt: skip

# Stacked, paged and per-layer pools: vLLM's [num_blocks, block_size, C+R], sglang's [S, 1, C+R].
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc,
    torch.empty(5, 256, 576, dtype=torch.bfloat16), rope_style="gptj",
)  # fmt: skip
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc,
    torch.empty(5, 4, 64, 576, dtype=torch.bfloat16), rope_style="gptj", kv_scale=torch.ones(5),
)  # fmt: skip
vllm_caches = [torch.empty(4, 64, 576, dtype=torch.bfloat16) for _ in range(5)]
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, vllm_caches, rope_style="gptj"
)
sglang_buffers = [torch.empty(256, 1, 576, dtype=torch.bfloat16) for _ in range(5)]
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, sglang_buffers, rope_style="gptj"
)

# DeepSeek's FP8 rows: uint8 pools of 656-byte rows, stacked or per layer.
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc,
    torch.empty(5, 256, 656, dtype=torch.uint8), rope_style="gptj", cache_format="fp8_ds_mla",
)  # fmt: skip
ds_caches = [torch.empty(4, 64, 656, dtype=torch.uint8) for _ in range(5)]
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, ds_caches, rope_style="gptj",
    cache_format="fp8_ds_mla",
)  # fmt: skip

materializer = typedkv.MLAKVMaterializer(
    torch.randn(5, 576, 1024, dtype=torch.bfloat16), kv_norm_weight, 1e-6, cos_sin_cache, rope_style="gptj"
)
hidden = torch.randn(16, 1024, dtype=torch.bfloat16)
rows = materializer(hidden, positions)
materializer.into_pool(hidden, positions, cache_loc, vllm_caches)
materializer.into_pool(hidden, positions, cache_loc, ds_caches, cache_format="fp8_ds_mla")

# A RoPE table per layer [L, P, R].
layer_tables = torch.randn(5, 4096, 64)
rows = typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, layer_tables, positions, rope_style="gptj")
typedkv.materialize_mla_kv_into_pool(
    ckv, kv_norm_weight, 1e-6, layer_tables, positions, cache_loc, sglang_buffers, rope_style="gptj"
)
per_layer_rope = typedkv.MLAKVMaterializer(
    torch.randn(5, 576, 1024, dtype=torch.bfloat16), kv_norm_weight, 1e-6, layer_tables, rope_style="gptj"
)


@static_jaxtyping("T L W C P R S")
def write_mla_cache(
    ckv: Float[Tensor, "T L W"],
    kv_norm_weight: Float[Tensor, "L C"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    cache_loc: Int[Tensor, " T"],
    kv_pool: Float[Tensor, "L S W"],
) -> Float[Tensor, "L T W"]:
    typedkv.materialize_mla_kv_into_pool(
        ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, kv_pool, rope_style="gptj"
    )
    return typedkv.materialize_mla_kv(ckv, kv_norm_weight, 1e-6, cos_sin_cache, positions, rope_style="gptj")
