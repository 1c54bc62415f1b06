"""Shape-correct uses of every public entry point: pyrefly and mypy --strict report nothing here.

Literal shapes (what a quick script writes) and annotated user functions (what
typed model code writes, dims symbolic) for ``materialize_kv``,
``materialize_kv_into_pool`` and ``KVMaterializer`` (construction, call,
``into_pool``). L=5 layers, T=16 tokens, H=8 kv heads, D=128, P=4096 positions,
S=256 pool slots, hidden=1024.
"""

import torch
from jaxtyping import Float, Int
from shape_extensions import static_jaxtyping
from torch import Tensor

import typedkv

kv = torch.randn(16, 5, 2048, dtype=torch.bfloat16)
k_norm_weight = torch.ones(5, 128)
eps = torch.full((5,), 1e-6)
cos_sin_cache = torch.randn(4096, 128)
positions = torch.arange(16)
cache_loc = torch.arange(16)

k, v = typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)
k, v = typedkv.materialize_kv(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    num_kv_heads=8,
    rope_style="gptj",
    k_out=torch.empty(5, 16, 8, 128, dtype=torch.bfloat16),
    v_out=torch.empty(5, 16, 8, 128, dtype=torch.bfloat16),
)
# Partial rotary: R = 64 <= D.
k, v = typedkv.materialize_kv(kv, k_norm_weight, 1e-6, torch.randn(4096, 64), positions, num_kv_heads=8)

# FP8 pools check the same; the bf16 pools here keep clear of a gap in pyrefly-torch-stubs
# 1.4.0, which lacks torch.float8_e4m3fn (docs/static-checking.md, "Limits").
k_pool = torch.empty(5, 256, 8, 128, dtype=torch.bfloat16)
v_pool = torch.empty(5, 256, 8, 128, dtype=torch.bfloat16)
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
    num_kv_heads=8, k_scale=torch.ones(5), v_scale=0.5,
)  # fmt: skip
k_layers = [torch.empty(256, 8, 128, dtype=torch.bfloat16) for _ in range(5)]
v_layers = [torch.empty(256, 8, 128, dtype=torch.bfloat16) for _ in range(5)]
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_layers, v_layers, num_kv_heads=8
)

materializer = typedkv.KVMaterializer(
    torch.randn(5, 2048, 1024, dtype=torch.bfloat16), k_norm_weight, 1e-6, cos_sin_cache, num_kv_heads=8
)
hidden = torch.randn(16, 1024, dtype=torch.bfloat16)
k, v = materializer(hidden, positions)
materializer.into_pool(hidden, positions, cache_loc, k_pool, v_pool, k_scale=1.0, v_scale=1.0)
per_layer = typedkv.KVMaterializer(
    [torch.randn(2048, 1024) for _ in range(5)], [torch.ones(128) for _ in range(5)], [1e-6] * 5, cos_sin_cache,
    num_kv_heads=8, kv_bias=torch.zeros(5, 2048),
)  # fmt: skip


@static_jaxtyping("T L KV D P R")
def draft_kv(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> tuple[Float[Tensor, "L T 8 D"], Float[Tensor, "L T 8 D"]]:
    return typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)


@static_jaxtyping("T L KV D P R S")
def write_cache(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    cache_loc: Int[Tensor, " T"],
    k_pool: Float[Tensor, "L S 8 D"],
    v_pool: Float[Tensor, "L S 8 D"],
) -> None:
    typedkv.materialize_kv_into_pool(
        kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8
    )


@static_jaxtyping("T L H D")
def tokens_first(k: Float[Tensor, "L T H D"]) -> Float[Tensor, "T L H D"]:
    return k.transpose(0, 1)


@static_jaxtyping("T hidden L H D")
def draft_step(
    m: typedkv.KVMaterializer, hidden: Float[Tensor, "T hidden"], positions: Int[Tensor, " T"]
) -> Float[Tensor, "T L H D"]:
    k, _ = m(hidden, positions)
    return k.transpose(0, 1)


# Paged pools: NHD [L, N, B, H, D] and HND [L, N, H, B, D], stacked or per layer, as views of one
# combined cache; a RoPE-only draft (no norm weight).
nhd_cache = torch.empty(5, 64, 2, 16, 8, 128, dtype=torch.bfloat16)
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, nhd_cache[:, :, 0], nhd_cache[:, :, 1], num_kv_heads=8
)
hnd_pages = torch.empty(5, 64, 8, 16, 128, dtype=torch.bfloat16)
typedkv.materialize_kv_into_pool(
    kv, None, 1e-6, cos_sin_cache, positions, cache_loc, hnd_pages, hnd_pages.clone(), num_kv_heads=8, kv_layout="HND"
)
per_layer_pages = [torch.empty(64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(5)]
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, per_layer_pages, per_layer_pages, num_kv_heads=8
)
rope_only_k, rope_only_v = typedkv.materialize_kv(kv, None, 1e-6, cos_sin_cache, positions, num_kv_heads=8)

# V normed as K, and a RoPE table per layer [L, P, R].
layer_tables = torch.randn(5, 4096, 128)
k, v = typedkv.materialize_kv(
    kv, k_norm_weight, 1e-6, layer_tables, positions, num_kv_heads=8, v_norm_weight=torch.ones(5, 128)
)
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, layer_tables, positions, cache_loc, k_pool, v_pool, num_kv_heads=8,
    v_norm_weight=torch.ones(5, 128),
)  # fmt: skip
# Scales written per row ([L, S, H] for [L, S, H, D] pools; per layer [N, B, H] for [N, B, H, D] pages).
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8,
    k_scale_out=torch.empty(5, 256, 8), v_scale_out=torch.empty(5, 256, 8),
)  # fmt: skip
typedkv.materialize_kv_into_pool(
    kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, per_layer_pages, per_layer_pages, num_kv_heads=8,
    k_scale_out=[torch.empty(64, 16, 8)] * 5, v_scale_out=[torch.empty(64, 16, 8)] * 5,
)  # fmt: skip
normed_v = typedkv.KVMaterializer(
    torch.randn(5, 2048, 1024, dtype=torch.bfloat16), k_norm_weight, 1e-6, layer_tables, num_kv_heads=8,
    v_norm_weight=torch.ones(5, 128),
)  # fmt: skip


@static_jaxtyping("T L KV D P R")
def draft_with_v_norm(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    v_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "L P R"],
    positions: Int[Tensor, " T"],
) -> tuple[Float[Tensor, "L T 8 D"], Float[Tensor, "L T 8 D"]]:
    return typedkv.materialize_kv(
        kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, v_norm_weight=v_norm_weight
    )
