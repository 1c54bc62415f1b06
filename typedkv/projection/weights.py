"""What the materializers' weights must be: the signatures their constructors and kept buffers are checked with.

`typedkv.KVMaterializer` and `typedkv.MLAKVMaterializer` read these as `typedkv.core.signature.Signature`s, the
shapes declared once in the annotations below; a layer count is read from a stacked tensor of the
``*_STACKED_DIMS`` dims, or from a sequence's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

from torch import Tensor

from typedkv.core.signature import Signature
from typedkv.core.tensor_types import KV_WIDTH, MLA_WIDTH, Derived, RopeStyle
from typedkv.kv.impl import ROTARY_RULE
from typedkv.mla.impl import ROTARY_RULE as MLA_ROTARY_RULE

if TYPE_CHECKING:
    # As in `typedkv.kv.api`: jaxtyping's own names, imported here, for pyrefly.
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, ParamFloat, StorageFloat


# --------------------------------------------------------------------- KVMaterializer


def _kv_weights(
    k_norm_weight: ParamFloat[Tensor, "L D"] | Sequence[ParamFloat[Tensor, " D"]] | None,
    v_norm_weight: ParamFloat[Tensor, "L D"] | Sequence[ParamFloat[Tensor, " D"]] | None,
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    kv_weight: Annotated[StorageFloat[Tensor, "L KV hidden"] | Sequence[StorageFloat[Tensor, "KV hidden"]], KV_WIDTH],
    kv_bias: Annotated[StorageFloat[Tensor, "L KV"] | Sequence[StorageFloat[Tensor, " KV"]] | None, KV_WIDTH],
    eps: float | ParamFloat[Tensor, " L"],
    num_kv_heads: int,
    rope_style: RopeStyle,
) -> None:
    """The constructor's arguments, ordered so that ``D`` is bound before ``kv_weight`` needs it.

    Without a norm weight, ``D`` is solved from kv_weight's ``2*H*D`` rows.
    """


_KV_ROWS = Derived("ROWS = L*2*H*D")

KV_WEIGHTS = Signature(
    _kv_weights,
    scalar_dims={"H": "num_kv_heads"},
    device_of="cos_sin_cache",
    sequence_len={"k_norm_weight": "L", "v_norm_weight": "L", "kv_weight": "L", "kv_bias": "L"},
    rules=(ROTARY_RULE,),
)


def _kv_buffers(
    k_norm_weight: ParamFloat[Tensor, "L D"] | None,
    v_norm_weight: ParamFloat[Tensor, "L D"] | None,
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    kv_weight: Annotated[StorageFloat[Tensor, "ROWS hidden"], _KV_ROWS],
    kv_bias: Annotated[StorageFloat[Tensor, " ROWS"] | None, _KV_ROWS],
    eps: float | ParamFloat[Tensor, " L"],
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
) -> None:
    """The buffers a materializer keeps, as its constructor checked them (the weight rows of all layers stacked)."""


KV_BUFFERS = Signature(
    _kv_buffers,
    scalar_dims={"L": "num_layers", "H": "num_kv_heads", "D": "head_dim", "hidden": "hidden_size"},
    device_of="kv_weight",
    same_dtype={"kv_bias": "kv_weight"},
    rules=(ROTARY_RULE,),
)
"""A buffer replaced after construction (``m.kv_bias = ...``) is checked against the others at a call's new layout."""


# An argument's layer count, read where it has one: a stacked tensor of this many dims, or a sequence
# (a cos/sin cache of 2 dims, one table for all layers, has none).
KV_STACKED_DIMS = {
    "kv_weight": 3, "k_norm_weight": 2, "v_norm_weight": 2, "kv_bias": 2, "eps": 1, "cos_sin_cache": 3,
}  # fmt: skip


# ------------------------------------------------------------------ MLAKVMaterializer


def _mla_weights(
    kv_norm_weight: ParamFloat[Tensor, "L C"] | Sequence[ParamFloat[Tensor, " C"]] | None,
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    kv_a_weight: Annotated[StorageFloat[Tensor, "L W hidden"] | Sequence[StorageFloat[Tensor, "W hidden"]], MLA_WIDTH],
    kv_a_bias: Annotated[StorageFloat[Tensor, "L W"] | Sequence[StorageFloat[Tensor, " W"]] | None, MLA_WIDTH],
    eps: float | ParamFloat[Tensor, " L"],
    rope_style: RopeStyle,
) -> None:
    """The constructor's arguments, ordered so that ``C`` and ``R`` are bound before ``kv_a_weight`` needs them.

    Without a norm weight, ``C`` is solved from kv_a_weight's ``C+R`` rows.
    """


MLA_WEIGHTS = Signature(
    _mla_weights,
    scalar_dims={},
    device_of="cos_sin_cache",
    sequence_len={"kv_norm_weight": "L", "kv_a_weight": "L", "kv_a_bias": "L"},
    rules=(MLA_ROTARY_RULE,),
)


_MLA_ROWS = Derived("ROWS = L*(C+R)")


def _mla_buffers(
    kv_norm_weight: ParamFloat[Tensor, "L C"] | None,
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    kv_a_weight: Annotated[StorageFloat[Tensor, "ROWS hidden"], _MLA_ROWS],
    kv_a_bias: Annotated[StorageFloat[Tensor, " ROWS"] | None, _MLA_ROWS],
    eps: float | ParamFloat[Tensor, " L"],
    num_layers: int,
    kv_lora_rank: int,
    rotary_dim: int,
    hidden_size: int,
) -> None:
    """The buffers a materializer keeps, as its constructor checked them (the kv_a rows of all layers stacked)."""


MLA_BUFFERS = Signature(
    _mla_buffers,
    scalar_dims={"L": "num_layers", "C": "kv_lora_rank", "R": "rotary_dim", "hidden": "hidden_size"},
    device_of="kv_a_weight",
    same_dtype={"kv_a_bias": "kv_a_weight"},
    rules=(MLA_ROTARY_RULE,),
)
"""A buffer replaced after construction is checked against the others at a call's new layout (as `KVMaterializer`'s)."""


def _mla_projection(
    kv_a_weight: StorageFloat[Tensor, "rows hidden"],
    hidden: StorageFloat[Tensor, "T hidden"],
    positions: Index[Tensor, " T"],
    cache_loc: Index[Tensor, " T"] | None,
) -> None:
    """A call's own arguments against the weights (the op then checks the rest)."""


MLA_PROJECTION = Signature(
    _mla_projection, scalar_dims={}, device_of="kv_a_weight", same_dtype={"hidden": "kv_a_weight"}
)

# An argument's layer count, read where it has one: a stacked tensor of this many dims, or a sequence.
MLA_STACKED_DIMS = {"kv_a_weight": 3, "kv_norm_weight": 2, "kv_a_bias": 2, "eps": 1, "cos_sin_cache": 3}
