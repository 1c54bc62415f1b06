"""Shape misuse inside annotated user functions: dims are symbols, not numbers.

What typed model code looks like: the caller's own parameters carry jaxtyping
annotations and the definition declares its dims with ``@static_jaxtyping``, so
pyrefly checks the flow of ``T``, ``L``, ``D`` ... through typedkv's signatures
without knowing any size. Each marked line is flagged with the codes after ``# E:``.
"""

# fmt: off

import torch
from jaxtyping import Float, Int
from shape_extensions import static_jaxtyping
from torch import Tensor

import typedkv


@static_jaxtyping("T L KV D P R")
def tokens_first_output(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> None:
    k_out = torch.empty(kv.shape[0], kv.shape[1], 8, k_norm_weight.shape[1])
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, k_out=k_out)  # E: bad-argument-type


@static_jaxtyping("T L M KV D P R")
def other_layers(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "M D"],
    eps: Float[Tensor, " M"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type
    typedkv.materialize_kv(kv, k_norm_weight[:1].expand(kv.shape[1], -1), eps, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T N L KV D P R S")
def wrong_token_count(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " N"],
    cache_loc: Int[Tensor, " N"],
    k_pool: Float[Tensor, "L S 8 D"],
    v_pool: Float[Tensor, "L S 8 D"],
) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type
    typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions[:1].expand(kv.shape[0]), cache_loc, k_pool, v_pool, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T L KV D E P R S")
def head_dims_disagree(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    cache_loc: Int[Tensor, " T"],
    k_pool: Float[Tensor, "L S 8 E"],
    v_pool: Float[Tensor, "L S 8 E"],
) -> None:
    typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8)  # E: bad-argument-type bad-argument-type


@static_jaxtyping("T L KV D P R S U")
def pools_of_different_sizes(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    cache_loc: Int[Tensor, " T"],
    k_pool: Float[Tensor, "L S 8 D"],
    v_pool: Float[Tensor, "L U 8 D"],
) -> None:
    typedkv.materialize_kv_into_pool(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T L KV D")
def missing_dim(kv: Float[Tensor, "T L KV"], k_norm_weight: Float[Tensor, " D"], positions: Int[Tensor, " T"]) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, torch.randn(4096, 128), positions, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T L H D")
def attend(k: Float[Tensor, "T L H D"], positions: Int[Tensor, " T"]) -> None: ...


@static_jaxtyping("T L KV D P R")
def result_into_tokens_first(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> Float[Tensor, "T L 8 D"]:
    k, v = typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)
    attend(v, positions)  # E: bad-argument-type
    return k  # E: bad-return


@static_jaxtyping("T N hidden")
def materializer_call(
    m: typedkv.KVMaterializer, hidden: Float[Tensor, "T hidden"], positions: Int[Tensor, " N"]
) -> None:
    m(hidden, positions)  # E: bad-argument-type
    m.into_pool(hidden, positions[:1].expand(hidden.shape[0]), positions, torch.empty(5, 256, 8, 128), torch.empty(5, 256, 8, 128))  # E: bad-argument-type


@static_jaxtyping("T L M KV D P R")
def tables_for_other_layers(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "M P R"],
    positions: Int[Tensor, " T"],
) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T L KV D E P R")
def v_norm_weight_of_another_head_dim(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    v_norm_weight: Float[Tensor, "L E"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, v_norm_weight=v_norm_weight)  # E: bad-argument-type
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8, v_norm_weight=v_norm_weight.transpose(0, 1))  # E: bad-argument-type
