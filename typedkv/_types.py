"""Dtype families and public type aliases used in the annotations.

jaxtyping's ``Float`` admits every floating dtype; the op accepts narrower sets
(the kernel stores only 16/32-bit floats or FP8), so each family is spelled out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from jaxtyping import AbstractDtype

__all__ = ["Index", "ParamFloat", "PoolFloat", "RopeStyle", "StorageFloat"]

RopeStyle = Literal["neox", "gptj"]
"""``"neox"`` rotates the two halves of the rotary dims; ``"gptj"`` rotates interleaved pairs."""

if TYPE_CHECKING:
    # To a static type checker ``StorageFloat[Tensor, "L T H D"]`` is
    # ``Annotated[Tensor, "L T H D"]``: the tensor type, shapes left to run time.
    # jaxtyping declares its own ``Float``, ``Int`` ... the same way.
    from typing import Annotated as Index
    from typing import Annotated as ParamFloat
    from typing import Annotated as PoolFloat
    from typing import Annotated as StorageFloat
else:

    class StorageFloat(AbstractDtype):
        """The dtypes K/V are stored in: kv, k_out, v_out."""

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32"]

    class ParamFloat(AbstractDtype):
        """Dtypes accepted for small parameters (norm weights, cos/sin cache, eps, scales)."""

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32", "float64"]

    class PoolFloat(AbstractDtype):
        """Dtypes a paged KV pool may have: a storage float or an FP8 format."""

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]

    class Index(AbstractDtype):
        """Integer dtypes for ``positions`` and ``cache_loc``."""

        dtypes: ClassVar[list[str]] = ["int32", "int64"]
