from typing import TYPE_CHECKING

from jaxtyping import Float, Int
from torch import Tensor

import typedkv

if TYPE_CHECKING:
    from shape_extensions import static_jaxtyping
else:

    def static_jaxtyping(dims):  # run time: leave the function as it is
        return lambda fn: fn


@static_jaxtyping("T L KV D P R")
def draft_kv(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> tuple[Float[Tensor, "L T 8 D"], Float[Tensor, "L T 8 D"]]:
    return typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)


# The docs page's example above, as a user's project holds it (tests/typecheck/test_user_project.py
# checks that it is the page's), then the misuse the page says pyrefly flags there: each marked line,
# and nothing else.


@static_jaxtyping("T N L KV D P R")
def positions_of_another_length(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " N"],
) -> None:
    typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)  # E: bad-argument-type


@static_jaxtyping("T L KV D P R")
def returned_tokens_first(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
) -> Float[Tensor, "T L 8 D"]:
    k, _ = typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=8)
    return k  # E: bad-return


@static_jaxtyping("T L KV D P R")
def output_tokens_first(
    kv: Float[Tensor, "T L KV"],
    k_norm_weight: Float[Tensor, "L D"],
    cos_sin_cache: Float[Tensor, "P R"],
    positions: Int[Tensor, " T"],
    k_out: Float[Tensor, "T L 8 D"],
) -> None:
    typedkv.materialize_kv(
        kv,
        k_norm_weight,
        1e-6,
        cos_sin_cache,
        positions,
        num_kv_heads=8,
        k_out=k_out,  # E: bad-argument-type
    )
