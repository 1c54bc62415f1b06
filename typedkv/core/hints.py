"""Reading the annotations: a function's jaxtyping hints as shapes the checks can walk.

`runtime_hint` puts each `Derived` dim's expression in place of its name (what
both run-time readers check); `parse_param` turns a parameter's hint -- a tensor,
a union of shapes tagged with a `PageLayout`, a sequence of tensors, a scalar or
a ``Literal`` -- into a `Param`.
"""

from __future__ import annotations

import collections.abc
import functools
import operator
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from typedkv.core.tensor_types import CacheFormat, Derived, KVLayout, PageLayout

NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@dataclass(frozen=True)
class Dim:
    text: str  # as written in the annotation: "L", "2*H*D", "3"
    name: str | None = None  # a named dim
    fixed: int | None = None  # a literal size
    code: Any = None  # compiled expression of a symbolic dim
    needs: tuple[str, ...] = ()  # the names a symbolic dim refers to


@dataclass(frozen=True)
class ArraySpec:
    dims: tuple[Dim, ...]
    dtypes: frozenset[torch.dtype]
    dtype_names: tuple[str, ...]
    symbolic: bool
    layout: str | None = None  # the `PageLayout` tag of this shape, if any
    convert_to: str = ""  # the dtype a wrong dtype's fix converts to: the family's ``convert_to``, else its first


@dataclass
class Param:
    name: str
    index: int
    hint: Any
    optional: bool = False
    arrays: tuple[ArraySpec, ...] = ()  # the shapes a tensor may have (a union: one per rank and layout)
    sequences: tuple[ArraySpec, ...] = ()  # likewise for a sequence of tensors, one per `sequence_len`
    scalars: tuple[type, ...] = ()
    # A sequence of numbers, one per `sequence_len` (eps: one per layer): the types of its items.
    scalar_items: tuple[type, ...] = ()
    literals: tuple[Any, ...] = ()
    sequence_len: str | None = None


def parse_array(hint: Any, layout: str | None = None) -> ArraySpec:
    dims = []
    for token in hint.dim_str.split():
        if token.isdigit():
            dims.append(Dim(token, fixed=int(token)))
        elif NAME.fullmatch(token):
            dims.append(Dim(token, name=token))
        else:
            dims.append(Dim(token, code=compile(token, token, "eval"), needs=tuple(set(NAME.findall(token)))))
    dtypes = tuple(hint.dtypes)
    return ArraySpec(
        tuple(dims),
        frozenset(getattr(torch, n) for n in dtypes),
        dtypes,
        any(d.code is not None for d in dims),
        layout,
        getattr(hint.dtype, "convert_to", dtypes[0]),
    )


def unwrap(hint: Any) -> tuple[Any, str | None]:
    """``Annotated[hint, PageLayout(...)]`` as ``(hint, layout)``; other hints as ``(hint, None)``."""
    if typing.get_origin(hint) is typing.Annotated:
        inner, *metadata = typing.get_args(hint)
        return inner, next((m.layout for m in metadata if isinstance(m, PageLayout)), None)
    return hint, None


def is_layout_choice(hint: Any) -> bool:
    """Whether ``hint`` is `KVLayout` (or ``KVLayout | None``) or `CacheFormat`: the argument that picks a pool's
    shape among those of one rank (`PageLayout`)."""
    return hint in (KVLayout, CacheFormat) or KVLayout in typing.get_args(hint)


def is_array_hint(hint: Any) -> bool:
    return hasattr(hint, "dim_str") and hasattr(hint, "dtypes")


def runtime_hint(hint: Any, derived: Sequence[Derived] = ()) -> Any:
    """``hint`` as the run-time checks read it: every `Derived` dim replaced by its expression.

    ``Annotated[StorageFloat[Tensor, "T L KV"], Derived("KV = 2*H*D")]`` becomes
    ``StorageFloat[Tensor, "T L 2*H*D"]``, which jaxtyping evaluates itself. The
    replacement reaches into unions and sequences below the ``Annotated``.
    """
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(hint)
        mine = tuple(m for m in metadata if isinstance(m, Derived))
        others = tuple(m for m in metadata if not isinstance(m, Derived))
        inner = runtime_hint(inner, (*derived, *mine))
        return typing.Annotated[(inner, *others)] if others else inner
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, (runtime_hint(m, derived) for m in typing.get_args(hint)))
    if origin is collections.abc.Sequence:
        (item,) = typing.get_args(hint)
        return collections.abc.Sequence[runtime_hint(item, derived)]  # type: ignore[misc]
    if derived and is_array_hint(hint):
        names = {d.name: d.expression for d in derived}
        dim_str = " ".join(names.get(token, token) for token in hint.dim_str.split())
        return hint.dtype[hint.array_type, dim_str]
    return hint


def parse_param(name: str, index: int, hint: Any) -> Param:
    param = Param(name, index, hint)
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for tagged in members:
        member, layout = unwrap(tagged)
        origin = typing.get_origin(member)
        item, item_layout = unwrap(typing.get_args(member)[0]) if origin is collections.abc.Sequence else (None, None)
        if member is type(None):
            param.optional = True
        elif is_array_hint(member):
            param.arrays += (parse_array(member, layout),)
        elif is_array_hint(item):
            param.sequences += (parse_array(item, item_layout),)
        elif item in (int, float):
            param.scalar_items = _numbers(item)
        elif origin is typing.Literal:
            param.literals = typing.get_args(member)
        elif member in (int, float, bool, str):
            param.scalars += _numbers(member)
        else:
            raise TypeError(f"typedkv: cannot check annotation {member!r} of {name}")
    return param


def _numbers(kind: type) -> tuple[type, ...]:
    # An int is a float where one is asked for (PEP 484's numeric tower, as mypy has it).
    return (float, int) if kind is float else (kind,)


def symbolic(p: Param) -> bool:
    return any(spec.symbolic for spec in (*p.arrays, *p.sequences))


def fits(spec: ArraySpec, shape: Sequence[int], dims: Mapping[str, int]) -> bool:
    """Whether ``shape`` agrees with ``spec`` on its rank, fixed sizes and the dims bound so far."""
    if len(shape) != len(spec.dims):
        return False
    seen: dict[str, int] = {}
    for d, size in zip(spec.dims, shape, strict=True):
        if d.fixed is not None and d.fixed != size:
            return False
        if d.name is not None and dims.get(d.name, seen.setdefault(d.name, size)) != size:
            return False
    return True
