"""Dtype families, derived dims and the static shape declaration used in the annotations.

jaxtyping's ``Float`` admits every floating dtype; the op accepts narrower sets
(the kernel stores only 16/32-bit floats or FP8), so each family is spelled out.

Three readers see the same annotations (docs/static-checking.md):

- at run time, `typedkv.core.checking` reads the families below and the shape strings;
- mypy sees ``Annotated[Tensor, ...]`` -- the tensor type, shapes left to others;
- pyrefly's tensor-shape checker reads the shape strings of definitions decorated
  with `static_jaxtyping`, but only under jaxtyping's own names (``Float``,
  ``Int``) imported in the module that uses them: each public module imports the
  families as those names when type checking (see `typedkv.kv.api`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

import torch
from jaxtyping import AbstractDtype

__all__ = [
    "DS_MLA_ROW_BYTES",
    "FP8_DS_MLA",
    "HND",
    "KV_WIDTH",
    "MLA_WIDTH",
    "NHD",
    "PLAIN",
    "SCALE_FLOOR",
    "CacheFormat",
    "Derived",
    "Index",
    "KVLayout",
    "KVPoolDtype",
    "PageLayout",
    "ParamFloat",
    "PoolFloat",
    "RopeStyle",
    "StorageFloat",
    "is_fp8",
    "is_quantized",
    "quant_max",
    "static_jaxtyping",
    "strided",
]

RopeStyle = Literal["neox", "gptj"]
"""``"neox"`` rotates the two halves of the rotary dims; ``"gptj"`` rotates interleaved pairs."""

KVLayout = Literal["NHD", "HND"]
"""Where a paged pool keeps a page's slot dim ``B``: before the heads (``[N, B, H, D]``) or after (``[N, H, B, D]``).

FlashInfer's names. A pool without page dims (``[S, H, D]``) is NHD with pages of one slot.
"""

CacheFormat = Literal["plain", "fp8_ds_mla"]
"""How an MLA pool stores a row: ``"plain"`` in the pool's dtype (ckv's, or FP8 with one scale per layer);
``"fp8_ds_mla"`` as DeepSeek's FP8 row of `DS_MLA_ROW_BYTES` bytes (vLLM's ``kv_cache_dtype="fp8_ds_mla"``):
512 ``float8_e4m3fn`` latent values, 4 float32 scales (one per 128 values), 64 bfloat16 rope values."""

DS_MLA_ROW_BYTES = 656
"""An ``"fp8_ds_mla"`` row: 512 latent bytes, 4 * 4 scale bytes, 64 * 2 rope bytes."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 formats a pool may hold (`PoolFloat`'s one-byte dtypes)."""


def strided(x: torch.Tensor) -> bool:
    """Whether ``x`` is an ordinary tensor: strided layout, not nested. typedkv reads and writes no other kind
    (sparse, MKL-DNN, nested): their memory is not where sizes and strides say, or they have none."""
    return x.layout == torch.strided and not x.is_nested


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an FP8 format: the one test every module uses (scales, quantized stores, messages)."""
    return dtype in FP8_DTYPES


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores scaled values: an FP8 format, or int8 (whose scales are written per row)."""
    return dtype in FP8_DTYPES or dtype == torch.int8


def quant_max(dtype: torch.dtype) -> float:
    """The largest value a quantized pool of ``dtype`` stores: 448 (e4m3fn), 57344 (e5m2), 127 (int8).

    Scales written per row map each row's largest magnitude onto it (`SCALE_FLOOR`).
    """
    return 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)


SCALE_FLOOR = 1e-6
"""The smallest scale a call writes: a row's scale is ``max(amax(|row|) / quant_max, SCALE_FLOOR)`` in float32, so
a row of zeros (or of values below ``quant_max * 1e-6``) gets a finite scale, and its reciprocal too. vLLM's
per-token-head caches (``fp8_per_token_head``, ``int8_per_token_head``) use this floor and this formula."""


_F = TypeVar("_F")

if TYPE_CHECKING:
    # jaxtyping declares its own ``Float``, ``Int`` ... as ``Annotated`` for type
    # checkers; the families are the same to them.
    from jaxtyping import Float as KVPoolDtype
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as PoolFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
    from shape_extensions import static_jaxtyping
else:

    class StorageFloat(AbstractDtype):
        """The dtypes K/V are stored in: kv, k_out, v_out.

        Examples
        --------
        >>> from torch import Tensor
        >>> isinstance(torch.zeros(4, 2, 64, dtype=torch.bfloat16), typedkv.StorageFloat[Tensor, "T L KV"])
        True
        >>> isinstance(torch.zeros(4, 2, 64, dtype=torch.float64), typedkv.StorageFloat[Tensor, "T L KV"])
        False
        """

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32"]

    class ParamFloat(AbstractDtype):
        """Dtypes accepted for small parameters (norm weights, cos/sin cache, eps, scales).

        Examples
        --------
        >>> from torch import Tensor
        >>> isinstance(torch.ones(2, 16, dtype=torch.float64), typedkv.ParamFloat[Tensor, "L D"])
        True
        >>> isinstance(torch.ones(2, 16, dtype=torch.int64), typedkv.ParamFloat[Tensor, "L D"])
        False
        """

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32", "float64"]
        # What a dtype error's fix converts to: the kernels compute with these in float32, and none is big enough for
        # its precision to cost (a storage family's fix takes its first dtype).
        convert_to: ClassVar[str] = "float32"

    class PoolFloat(AbstractDtype):
        """Dtypes a paged KV pool may have: a storage float or an FP8 format.

        Examples
        --------
        >>> from torch import Tensor
        >>> isinstance(torch.zeros(2, 8, 2, 16, dtype=torch.float8_e4m3fn), typedkv.PoolFloat[Tensor, "L S H D"])
        True
        >>> isinstance(torch.zeros(2, 8, 2, 16, dtype=torch.uint8), typedkv.PoolFloat[Tensor, "L S H D"])
        False
        """

        dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]

    class KVPoolDtype(AbstractDtype):
        """Dtypes a K/V pool may have: `PoolFloat`'s, or int8 (the call then writes each row's scale).

        Examples
        --------
        >>> pools = {dtype: torch.zeros(8, 2, 16, dtype=dtype) for dtype in (torch.int8, torch.uint8)}
        >>> {str(dtype): isinstance(pool, typedkv.KVPoolDtype[torch.Tensor, "S H D"]) for dtype, pool in pools.items()}
        {'torch.int8': True, 'torch.uint8': False}
        """

        dtypes: ClassVar[list[str]] = [*PoolFloat.dtypes, "int8"]

    class Index(AbstractDtype):
        """Integer dtypes for ``positions`` and ``cache_loc``.

        Examples
        --------
        >>> from torch import Tensor
        >>> isinstance(torch.arange(4, dtype=torch.int32), typedkv.Index[Tensor, " T"])
        True
        >>> isinstance(torch.arange(4.0), typedkv.Index[Tensor, " T"])
        False
        """

        dtypes: ClassVar[list[str]] = ["int32", "int64"]

    def static_jaxtyping(declaration: str) -> Callable[[_F], _F]:
        """The dims a definition's shape strings use, for pyrefly; nothing at run time.

        pyrefly-shape-extensions' decorator of the same name does the same at run
        time, but importing it patches torch's classes: typedkv does not.
        """
        return _unchanged


def _unchanged(value: _F) -> _F:
    return value


@dataclass(frozen=True)
class Derived:
    """A dim that is an expression over other dims, as ``Annotated`` metadata.

    pyrefly's jaxtyping reader takes a dim name, ``name+1`` or ``name-1``, so a
    width such as ``2*H*D`` is written as a name in the shape string and defined
    here: ``Annotated[StorageFloat[Tensor, "T L KV"], Derived("KV = 2*H*D")]``.
    The static checker binds ``KV`` like any dim; the run-time checks read the
    expression in its place (messages say ``2*H*D=2048``).
    """

    definition: str

    @property
    def name(self) -> str:
        return self.definition.split("=")[0].strip()

    @property
    def expression(self) -> str:
        return self.definition.split("=", 1)[1].strip()


KV_WIDTH = Derived("KV = 2*H*D")
"""kv's last dim: per layer, ``H`` heads of ``D`` for K, then the same for V."""

MLA_WIDTH = Derived("W = C+R")
"""An MLA row: the latent (``C``, kv_lora_rank) then the rope part (``R``, the rotary dim)."""


@dataclass(frozen=True)
class PageLayout:
    """The `KVLayout` (or an MLA pool's `CacheFormat`) a pool shape belongs to, as ``Annotated`` metadata.

    A pool argument is a union of shapes; two of them have the same rank (NHD's
    ``[L, N, B, H, D]`` and HND's ``[L, N, H, B, D]``; a plain MLA pool's
    ``[L, S, C+R]`` and an ``"fp8_ds_mla"`` one's ``[L, S, 656]``), so the
    run-time check picks the one tagged with the call's layout argument (its
    ``kv_layout``, or an MLA pool's ``cache_format``). Static checkers ignore
    the tag and accept any member.
    """

    layout: str


NHD = PageLayout("NHD")
HND = PageLayout("HND")
PLAIN = PageLayout("plain")
FP8_DS_MLA = PageLayout("fp8_ds_mla")
