"""The checking machinery: one source of truth, two modes.

A public function declares its shapes once, as jaxtyping annotations. `Signature`
reads those annotations when the module is imported and turns them into a plan:

- **production** (`Signature.check`): plain Python over ``shape``, ``dtype`` and
  ``device`` -- no device sync, a few microseconds -- that binds the named dims
  (``L``, ``T``, ``H``, ``D`` ...) and rejects every mismatch with an `InputError`
  that names the argument and says how to fix it;
- **debug** (`Signature.debug_check`): the same annotations checked by beartype,
  with jaxtyping's shape memo shared across the arguments.

Both verdicts depend only on each argument's type and, for a tensor, its dtype,
shape, strides and device: `Signature.plan` caches what a layout needs, so a
decode loop pays a dictionary lookup per call, not the check.

Relations that jaxtyping cannot spell (a dim that comes from an ``int`` argument,
"same dtype as kv", "same device as kv", a rule between dims) are declared next to
the function, as arguments of `Signature`, not as if-chains in its body.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from beartype import BeartypeConf
from beartype.door import die_if_unbearable
from beartype.roar import BeartypeDoorHintViolation
from jaxtyping import Shaped, jaxtyped

from ._errors import InputError
from ._types import Derived, PageLayout

# How a dim is spoken of in a fix ("allocate layers first").
_DIM_WORDS = {"L": "layers", "T": "tokens", "H": "heads", "D": "head dims", "S": "slots"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@dataclass(frozen=True)
class _Dim:
    text: str  # as written in the annotation: "L", "2*H*D", "3"
    name: str | None = None  # a named dim
    fixed: int | None = None  # a literal size
    code: Any = None  # compiled expression of a symbolic dim
    needs: tuple[str, ...] = ()  # the names a symbolic dim refers to


@dataclass(frozen=True)
class _ArraySpec:
    dims: tuple[_Dim, ...]
    dtypes: frozenset[torch.dtype]
    dtype_names: tuple[str, ...]
    symbolic: bool
    layout: str | None = None  # the `PageLayout` tag of this shape, if any


@dataclass
class _Param:
    name: str
    index: int
    hint: Any
    optional: bool = False
    arrays: tuple[_ArraySpec, ...] = ()  # the shapes a tensor may have (a union: one per rank and layout)
    sequences: tuple[_ArraySpec, ...] = ()  # likewise for a sequence of tensors, one per `sequence_len`
    scalars: tuple[type, ...] = ()
    literals: tuple[Any, ...] = ()
    sequence_len: str | None = None


@dataclass
class Bound:
    """What a production check learnt: dim sizes, and the tensors' common device."""

    dims: dict[str, int]
    device: torch.device
    bound_by: dict[str, str] = field(default_factory=dict)
    # The shape each tensor argument matched (of a union), by argument name.
    specs: dict[str, _ArraySpec] = field(default_factory=dict)
    # Dims solved from a symbolic dim (D from kv's 2*H*D when nothing else names D).
    solved: set[str] = field(default_factory=set)

    def layout(self, name: str) -> str | None:
        """The `PageLayout` tag of the shape ``name`` matched (``None``: untagged)."""
        return self.specs[name].layout

    def shape_of(self, name: str) -> str:
        """The shape ``name`` matched, as written in its annotation (``"L N B H D"``)."""
        return " ".join(d.text for d in self.specs[name].dims)

    def strides(self, name: str, tensor: torch.Tensor) -> dict[str, int]:
        """``tensor``'s stride of each named dim of the shape ``name`` matched."""
        return {d.name: st for d, st in zip(self.specs[name].dims, tensor.stride(), strict=True) if d.name}


def _meta(x: Any) -> Any:
    """What a check's verdict on ``x`` depends on (never the tensor's values or address)."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.shape, x.stride(), x.device)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(map(_meta, x)))
    if isinstance(x, float):
        return float  # any float passes; its value is the kernel's business
    if isinstance(x, (int, str, bool)) or x is None:
        return (type(x), x)
    return (type(x), id(x))  # rejected by the check anyway


_PLANS_MAX = 4096
# As mypy: an int is accepted where a float is annotated.
_BEARTYPE = BeartypeConf(is_pep484_tower=True)


def _parse_array(hint: Any, layout: str | None = None) -> _ArraySpec:
    dims = []
    for token in hint.dim_str.split():
        if token.isdigit():
            dims.append(_Dim(token, fixed=int(token)))
        elif _NAME.fullmatch(token):
            dims.append(_Dim(token, name=token))
        else:
            dims.append(_Dim(token, code=compile(token, token, "eval"), needs=tuple(set(_NAME.findall(token)))))
    dtypes = tuple(hint.dtypes)
    return _ArraySpec(
        tuple(dims),
        frozenset(getattr(torch, n) for n in dtypes),
        dtypes,
        any(d.code is not None for d in dims),
        layout,
    )


def _unwrap(hint: Any) -> tuple[Any, str | None]:
    """``Annotated[hint, PageLayout(...)]`` as ``(hint, layout)``; other hints as ``(hint, None)``."""
    if typing.get_origin(hint) is typing.Annotated:
        inner, *metadata = typing.get_args(hint)
        return inner, next((m.layout for m in metadata if isinstance(m, PageLayout)), None)
    return hint, None


def _is_array_hint(hint: Any) -> bool:
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
    if derived and _is_array_hint(hint):
        names = {d.name: d.expression for d in derived}
        dim_str = " ".join(names.get(token, token) for token in hint.dim_str.split())
        return hint.dtype[hint.array_type, dim_str]
    return hint


def _parse_param(name: str, index: int, hint: Any) -> _Param:
    param = _Param(name, index, hint)
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for tagged in members:
        member, layout = _unwrap(tagged)
        origin = typing.get_origin(member)
        item, item_layout = _unwrap(typing.get_args(member)[0]) if origin is collections.abc.Sequence else (None, None)
        if member is type(None):
            param.optional = True
        elif _is_array_hint(member):
            param.arrays += (_parse_array(member, layout),)
        elif _is_array_hint(item):
            param.sequences += (_parse_array(item, item_layout),)
        elif origin is typing.Literal:
            param.literals = typing.get_args(member)
        elif member in (int, float, bool, str):
            # An int is a float where one is asked for (PEP 484's numeric tower, as mypy has it).
            param.scalars += (member, int) if member is float else (member,)
        else:
            raise TypeError(f"typedkv: cannot check annotation {member!r} of {name}")
    return param


def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _or_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _type_name(value: object) -> str:
    kind = type(value)
    # numpy.int64, not "int64", which would read like a dtype.
    return (
        kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"
    )


class Signature:
    """The checking plan of one public function, read from its annotations.

    Parameters
    ----------
    fn
        The annotated public function.
    scalar_dims
        Dims whose size is an ``int`` argument, e.g. ``{"H": "num_kv_heads"}``.
    device_of
        The argument whose device every tensor argument must share.
    same_dtype
        ``{param: other}``: ``param`` must have ``other``'s dtype.
    outputs
        Arguments the function writes; their fixes show how to allocate them.
    rules
        ``(expression over dims, argument to blame, what the rule says)``.
    sequence_len
        ``{param: dim}``: a sequence argument holds that many tensors.
    inner_contiguous
        Arguments whose last dim must have stride 1 (read or written as vectors).
    layout_of
        The ``Literal`` argument that picks, among an argument's shapes of one
        rank, the one tagged with its value (`PageLayout`).

    Inputs bind the dims first, then the outputs are checked against them: a
    symbolic dim with one unknown (``2*H*D`` with no ``D`` given) is solved
    between the two, so an output never decides a size.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        scalar_dims: Mapping[str, str],
        device_of: str,
        same_dtype: Mapping[str, str] = {},
        outputs: Sequence[str] = (),
        rules: Sequence[tuple[str, str, str]] = (),
        sequence_len: Mapping[str, str] = {},
        inner_contiguous: Sequence[str] = (),
        layout_of: str | None = None,
    ) -> None:
        # Derived dims ("KV = 2*H*D") are read in place of their names, so both
        # modes check the expression itself and messages quote it.
        hints = {n: runtime_hint(h) for n, h in typing.get_type_hints(fn, include_extras=True).items()}
        parameters = list(inspect.signature(fn).parameters)
        self.name = fn.__name__
        self.parameters = parameters
        self.hints = {n: hints[n] for n in parameters}
        self.return_hint = hints.get("return")
        params = [_parse_param(n, i, hints[n]) for i, n in enumerate(parameters)]
        for p in params:
            p.sequence_len = sequence_len.get(p.name)
        by_name = {p.name: p for p in params}
        self._by_name = by_name
        self._scalars = [p for p in params if not p.arrays and not p.sequences]
        tensors = [p for p in params if p.arrays or p.sequences]
        self._inputs = [p for p in tensors if p.name not in outputs]
        self._written = [p for p in tensors if p.name in outputs]
        # jaxtyping evaluates a symbolic dim ("2*H*D" on kv) when it meets it, so
        # the debug check visits those arguments after the ones binding the names.
        self._debug_order = [p for p in tensors if not _symbolic(p)] + [p for p in tensors if _symbolic(p)]
        self._scalar_dims = [(dim, by_name[arg].index, arg) for dim, arg in scalar_dims.items()]
        self._device_index = by_name[device_of].index
        self._device_of = device_of
        self._same_dtype = {by_name[p].name: (by_name[o].index, o) for p, o in same_dtype.items()}
        self._outputs = frozenset(outputs)
        self._rules = [(compile(expr, expr, "eval"), expr, blame, what) for expr, blame, what in rules]
        self._inner_contiguous = frozenset(inner_contiguous)
        self._layout_of = layout_of
        self._layout_index = None if layout_of is None else by_name[layout_of].index
        self._plans: dict[tuple[Any, ...], Any] = {}

    # ----------------------------------------------------------------- plan cache
    def plan(self, args: Sequence[Any], build: Callable[[Bound], Any]) -> Any:
        """The plan for ``args``' layout: checked and built on the first call, then reused.

        A check's verdict depends only on each argument's type and, for tensors,
        dtype, shape, strides and device (the fingerprint), so a layout that
        passed once passes again: decode loops pay a dictionary lookup instead
        of the full check. ``build`` turns the bound dims into the op's plan
        (relational checks, launch configuration); it may raise `InputError`.
        """
        fingerprint = tuple(map(_meta, args))
        plan = self._plans.get(fingerprint)
        if plan is None:
            plan = build(self.check(args))
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            self._plans[fingerprint] = plan
        return plan

    # ------------------------------------------------------------------ production
    def check(self, args: Sequence[Any]) -> Bound:
        """Check ``args`` (in signature order) without touching device memory.

        Returns
        -------
        Bound
            The bound dims and the device all tensors share.

        Raises
        ------
        InputError
            On the first argument that breaks the declared contract.
        """
        for p in self._scalars:
            self._check_scalar(p, args[p.index])
        dims: dict[str, int] = {}
        bound_by: dict[str, str] = {}
        for dim, index, arg in self._scalar_dims:
            dims[dim] = args[index]
            bound_by[dim] = arg
        anchor = args[self._device_index]
        if not isinstance(anchor, torch.Tensor):
            raise InputError(f"{self._device_of}: expected a torch.Tensor, got {_type_name(anchor)}")
        device = anchor.device
        bound = Bound(dims, device, bound_by)
        deferred: list[tuple[str, str, _ArraySpec, torch.Size]] = []
        for group in (self._inputs, self._written):
            for p in group:
                value = args[p.index]
                if value is None and p.optional:
                    continue
                if isinstance(value, torch.Tensor) and p.arrays:
                    spec = self._choose(p, p.name, p.arrays, value, bound, args)
                    bound.specs[p.name] = spec
                    self._check_tensor(p.name, p.name, spec, value, bound, args, deferred)
                elif p.sequences and isinstance(value, (list, tuple)):
                    self._check_sequence(p, value, bound, args, deferred)
                elif p.scalars and isinstance(value, p.scalars) and not isinstance(value, bool):
                    continue
                else:
                    raise InputError(
                        f"{p.name}: expected {self._describe(p)}, got {_type_name(value)}{_scalar_fix(p, value)}"
                    )
            # Symbolic dims whose names were bound by a later argument, or are
            # solved from them here: the inputs' dims are all known before an
            # output is checked against them.
            deferred = self._resolve(deferred, bound)
        for code, expr, blame, what in self._rules:
            if not eval(code, {}, dims):
                shown = ", ".join(f"{n}={dims[n]}" for n in sorted(set(_NAME.findall(expr))) if n in dims)
                raise InputError(f"{blame}: {what}, got {shown}")
        return bound

    def _resolve(
        self, deferred: list[tuple[str, str, _ArraySpec, torch.Size]], bound: Bound
    ) -> list[tuple[str, str, _ArraySpec, torch.Size]]:
        """Check the deferred symbolic dims whose names are bound; solve those with one unknown.

        Returns what is still open (more than one unknown).
        """
        dims = bound.dims
        still: list[tuple[str, str, _ArraySpec, torch.Size]] = []
        for name, label, spec, shape in deferred:
            for d, size in zip(spec.dims, shape, strict=True):
                if d.code is None:
                    continue
                missing = [n for n in d.needs if n not in dims]
                if len(missing) > 1:
                    still.append((name, label, spec, shape))
                    break
                if missing:
                    self._solve(d, missing[0], size, name, label, spec, shape, bound)
                elif eval(d.code, {}, dims) != size:
                    raise InputError(self._shape_message(name, label, spec, tuple(shape), bound))
        return still

    def _solve(
        self, d: _Dim, unknown: str, size: int, name: str, label: str, spec: _ArraySpec, shape: torch.Size, bound: Bound
    ) -> None:
        """Bind ``unknown`` so that the symbolic dim ``d`` (a product such as ``2*H*D``) equals ``size``."""
        per = eval(d.code, {}, {**bound.dims, unknown: 1})
        if eval(d.code, {}, {**bound.dims, unknown: 2}) != 2 * per or per <= 0:
            raise TypeError(f"typedkv: cannot solve {d.text} for {unknown} in the annotation of {name}")
        if size % per:
            msg = self._shape_message(name, label, spec, tuple(shape), bound)
            raise InputError(f"{msg}: the size must be {d.text} = {per}*{unknown}; {size} is not a multiple of {per}")
        bound.dims[unknown] = size // per
        bound.bound_by[unknown] = label
        bound.solved.add(unknown)

    def _choose(
        self,
        p: _Param,
        label: str,
        specs: tuple[_ArraySpec, ...],
        value: torch.Tensor,
        bound: Bound,
        args: Sequence[Any],
    ) -> _ArraySpec:
        """The shape of ``specs`` that ``value`` is checked against: by rank, then by the layout argument."""
        if len(specs) == 1:
            return specs[0]
        layout = None if self._layout_index is None else args[self._layout_index]
        allowed = [s for s in specs if s.layout in (None, layout)]
        fitting = [s for s in allowed if len(s.dims) == value.dim()]
        if len(fitting) == 1:
            return fitting[0]
        shapes = " or ".join(self._expected(s, bound.dims) for s in allowed)
        msg = f"{label}: expected shape {shapes}"
        if self._layout_of is not None:
            msg += f" for {self._layout_of}={layout!r}"
        msg += f", got {tuple(value.shape)}"
        others = sorted({s.layout for s in specs if len(s.dims) == value.dim() and s.layout not in (None, layout)})
        if others:
            msg += f": {self._layout_of}={others[0]!r} takes a tensor of {value.dim()} dims"
        raise InputError(msg)

    def _describe(self, p: _Param) -> str:
        kinds = []
        if p.arrays:
            kinds.append("a torch.Tensor")
        if p.sequences:
            kinds.append(f"a sequence of {p.sequence_len} torch.Tensors")
        words = {int: "an int", float: "a float", str: "a str", bool: "a bool"}
        kinds += [words[s] for s in p.scalars if not (s is int and float in p.scalars)]
        if p.optional:
            kinds.append("None")
        return _or_list(kinds)

    def _check_scalar(self, p: _Param, value: Any) -> None:
        if p.literals:
            if value in p.literals and isinstance(value, str):
                return
            options = _or_list([repr(v) for v in p.literals])
            raise InputError(f"{p.name}: expected {options}, got {value!r}")
        if value is None and p.optional:
            return
        # bool is an int to Python, never a head count or an eps to us.
        if isinstance(value, bool) or not isinstance(value, p.scalars):
            raise InputError(f"{p.name}: expected {self._describe(p)}, got {_type_name(value)}{_scalar_fix(p, value)}")
        if isinstance(value, int) and value < 1 and any(p.name == a for _, _, a in self._scalar_dims):
            raise InputError(f"{p.name}: expected a positive int, got {value}")

    def _check_sequence(
        self,
        p: _Param,
        value: Sequence[Any],
        bound: Bound,
        args: Sequence[Any],
        deferred: list[tuple[str, str, _ArraySpec, torch.Size]],
    ) -> None:
        assert p.sequences and p.sequence_len is not None
        want = bound.dims.get(p.sequence_len)
        if want is not None and len(value) != want:
            raise InputError(f"{p.name}: expected {p.sequence_len}={want} per-layer tensors, got {len(value)}")
        spec: _ArraySpec | None = None
        for i, item in enumerate(value):
            label = f"{p.name}[{i}]"
            if not isinstance(item, torch.Tensor):
                raise InputError(f"{label}: expected a torch.Tensor, got {_type_name(item)}")
            # The first item picks the shape; every other item must have it too.
            if spec is None:
                spec = self._choose(p, label, p.sequences, item, bound, args)
                bound.specs[p.name] = spec
            self._check_tensor(p.name, label, spec, item, bound, args, deferred)

    def _check_tensor(
        self,
        name: str,
        label: str,
        spec: _ArraySpec,
        value: torch.Tensor,
        bound: Bound,
        args: Sequence[Any],
        deferred: list[tuple[str, str, _ArraySpec, torch.Size]],
    ) -> None:
        like = self._same_dtype.get(name)
        if like is not None:
            # An output must be exactly kv's dtype: say so, not the whole family.
            if value.dtype != args[like[0]].dtype:
                raise InputError(self._like_message(name, label, spec, value, args[like[0]].dtype, like[1], bound))
        elif value.dtype not in spec.dtypes:
            raise InputError(
                f"{label}: expected dtype {_or_list(spec.dtype_names)}, got {_fmt_dtype(value.dtype)}"
                + self._dtype_fix(name, label, spec, value.dtype)
            )
        shape = value.shape
        dims = bound.dims
        ok = len(shape) == len(spec.dims)
        # Dims first seen on this tensor are bound only once it passes, so a
        # message about it never quotes a size it brought itself.
        new: dict[str, int] = {}
        if ok:
            for d, size in zip(spec.dims, shape, strict=True):
                if d.name is not None:
                    have = dims.get(d.name, new.get(d.name))
                    if have is None:
                        new[d.name] = size
                    elif have != size:
                        ok = False
                        break
                elif d.fixed is not None:
                    if d.fixed != size:
                        ok = False
                        break
                elif all(n in dims or n in new for n in d.needs):
                    if eval(d.code, {}, {**dims, **new}) != size:
                        ok = False
                        break
                else:
                    deferred.append((name, label, spec, shape))
        if not ok:
            raise InputError(self._shape_message(name, label, spec, tuple(shape), bound))
        for dim, size in new.items():
            dims[dim] = size
            bound.bound_by[dim] = label
        if value.device != bound.device:
            if like is not None:
                raise InputError(self._like_message(name, label, spec, value, args[like[0]].dtype, like[1], bound))
            raise InputError(
                f"{label}: expected device {bound.device} ({self._device_of}'s device), got {value.device}: "
                + (
                    f"allocate it on {self._device_of}.device"
                    if name in self._outputs
                    else f"move it once, outside the hot loop: {label}.to({self._device_of}.device)"
                )
            )
        if name in self._inner_contiguous and value.numel() and value.stride(-1) != 1 and shape[-1] != 1:
            raise InputError(
                f"{label}: the last dim must be contiguous (stride 1), got strides {tuple(value.stride())}"
                + (
                    f": allocate it with a contiguous last dim ({label}.contiguous() would write into a copy)"
                    if name in self._outputs
                    else f": pass {label}.contiguous()"
                )
            )
        if (
            name in self._outputs
            and value.numel() > 1
            and any(st == 0 and n > 1 for st, n in zip(value.stride(), shape, strict=True))
        ):
            raise InputError(
                f"{label}: expected memory of its own for every element, got strides {tuple(value.stride())} "
                "(an expanded view): writes to it would collide"
            )

    def _dtype_fix(self, name: str, label: str, spec: _ArraySpec, got: torch.dtype) -> str:
        if spec.dtype_names[0].startswith("int"):
            return f": pass {label}.long()"
        if got == torch.uint8 and torch.float8_e4m3fn in spec.dtypes:
            # Engines often keep an FP8 cache as raw bytes.
            return f": an FP8 cache kept as bytes can be passed as {label}.view(torch.float8_e4m3fn)"
        if name in self._outputs:
            # Converting an output would write into a copy.
            return f": allocate it with one of these dtypes{'' if label == name else ' (all layers alike)'}"
        return f": convert it with {label}.to(torch.{spec.dtype_names[0]})"

    def _expected(self, spec: _ArraySpec, dims: Mapping[str, int]) -> str:
        parts = []
        for d in spec.dims:
            if d.fixed is not None:
                parts.append(d.text)
            elif d.name is not None:
                parts.append(f"{d.name}={dims[d.name]}" if d.name in dims else d.name)
            else:
                try:
                    parts.append(f"{d.text}={eval(d.code, {}, dict(dims))}")
                except NameError:
                    parts.append(d.text)
        return "(" + ", ".join(parts) + ")"

    def _sizes(self, spec: _ArraySpec, dims: Mapping[str, int]) -> list[int | None] | None:
        """Expected sizes, ``None`` where a dim is not bound yet; ``None`` for a wrong rank."""
        out: list[int | None] = []
        for d in spec.dims:
            if d.fixed is not None:
                out.append(d.fixed)
            elif d.name is not None:
                out.append(dims.get(d.name))
            else:
                try:
                    out.append(eval(d.code, {}, dict(dims)))
                except NameError:
                    out.append(None)
        return out

    def _alloc(self, spec: _ArraySpec, bound: Bound) -> str:
        sizes = self._sizes(spec, bound.dims)
        args = ", ".join(map(str, sizes or []))
        return f"torch.empty({args}, dtype={self._device_of}.dtype, device={self._device_of}.device)"

    def _shape_message(self, name: str, label: str, spec: _ArraySpec, got: tuple[int, ...], bound: Bound) -> str:
        dims = bound.dims
        msg = f"{label}: expected shape {self._expected(spec, dims)}, got {got}"
        want = self._sizes(spec, dims)
        # An output the op can allocate itself (k_out, v_out) gets a torch.empty
        # fix; a pool is the caller's memory and only gets told what is wrong.
        allocatable = name in self._outputs and name in self._same_dtype
        fixes: list[str] = []
        swap = _swapped(want, got) if want is not None and len(want) == len(got) else None
        if swap is not None:
            i, j = swap
            fixes.append(f"dims {i} and {j} look swapped")
            first = spec.dims[i].name
            if name in self._outputs:
                word = _DIM_WORDS.get(first or "", f"dim {first}")
                fixes.append(f"allocate {word} first" + (f": {self._alloc(spec, bound)}" if allocatable else ""))
            elif j != len(got) - 1:
                fixes.append(f"pass {label}.transpose({i}, {j}) (a view: strides are honoured)")
            return msg + ": " + "; ".join(fixes)
        if len(got) == len(spec.dims):
            for d, size in zip(spec.dims, got, strict=True):
                if (
                    d.name is not None
                    and d.name in dims
                    and dims[d.name] != size
                    and bound.bound_by.get(d.name) != label
                ):
                    fixes.append(f"{d.name}={dims[d.name]} comes from {bound.bound_by[d.name]}")
                elif d.code is not None and all(n in dims for n in d.needs) and eval(d.code, {}, dict(dims)) != size:
                    fixes.append(self._symbolic_fix(d, size, dims))
        if allocatable and want is not None and None not in want:
            fixes.append(f"allocate it as {self._alloc(spec, bound)}, or pass {name}=None")
        return msg + (": " + "; ".join(f for f in fixes if f) if fixes else "")

    def _symbolic_fix(self, d: _Dim, size: int, dims: Mapping[str, int]) -> str:
        names = set(_NAME.findall(d.text))
        filled = re.sub(_NAME, lambda m: str(dims.get(m.group(0), m.group(0))), d.text)
        fix = f"the size must be {d.text} = {filled} = {eval(d.code, {}, dict(dims))}"
        for dim, _, arg in self._scalar_dims:
            if dim in names:
                per_unit = eval(d.code, {}, {**dims, dim: 1})
                if per_unit and size % per_unit == 0:
                    fix += f"; {size} would fit {arg}={size // per_unit}"
        return fix

    def _like_message(
        self,
        name: str,
        label: str,
        spec: _ArraySpec,
        value: torch.Tensor,
        want: torch.dtype,
        other: str,
        bound: Bound,
    ) -> str:
        msg = (
            f"{label}: expected dtype {_fmt_dtype(want)} on {bound.device} ({other}'s dtype and device), "
            f"got dtype {_fmt_dtype(value.dtype)} on {value.device}"
        )
        if name in self._outputs:
            msg += f": allocate it as {self._alloc(spec, bound)}, or pass {name}=None"
        return msg

    # ----------------------------------------------------------------------- debug
    def debug_check(self, args: Sequence[Any], bound: Bound) -> None:
        """Check every argument against its annotation with beartype + jaxtyping.

        The arguments are checked in the plan's order inside one jaxtyping memo, so
        a symbolic dim such as ``2*H*D`` sees the ``D`` another argument bound;
        the dims bound by ``int`` arguments are bound first.
        """
        with jaxtyped("context"):
            given = [(dim, args[index]) for dim, index, _ in self._scalar_dims]
            # A dim the production check solved (D from kv's width) has no argument of its own to bind it.
            for dim, size in (*given, *((d, bound.dims[d]) for d in sorted(bound.solved))):
                # A zero-byte meta tensor binds the dim in jaxtyping's memo.
                # To mypy a jaxtyping type is Annotated[...], not a class: it cannot see that isinstance takes it.
                isinstance(torch.empty((size,), device="meta"), Shaped[torch.Tensor, f" {dim}"])  # type: ignore[arg-type]
            for p in self._scalars + self._debug_order:
                try:
                    die_if_unbearable(args[p.index], self.hints[p.name], conf=_BEARTYPE)
                except BeartypeDoorHintViolation as err:
                    raise InputError(f"{p.name}: {err}") from None


def _scalar_fix(p: _Param, value: object) -> str:
    """For a numpy (or other array-library) scalar where a Python number is expected: how to convert."""
    if isinstance(value, float) and int in p.scalars and float not in p.scalars:
        return ": a count is an int (// divides to an int, / to a float)"
    if isinstance(value, torch.Tensor) or not hasattr(value, "item") or not p.scalars:
        return ""
    kind = "float" if float in p.scalars else "int"
    return f": pass {kind}({p.name})"


def _swapped(want: Sequence[int | None], got: Sequence[int]) -> tuple[int, int] | None:
    """The two dims whose exchange would fix ``got``, if there is exactly one such pair."""
    wrong = [i for i, w in enumerate(want) if w is not None and w != got[i]]
    if len(wrong) == 2:
        i, j = wrong
        return (i, j) if (got[i], got[j]) == (want[j], want[i]) else None
    if len(wrong) == 1:
        (i,) = wrong
        # The other dim of the pair is one not bound yet (S of a pool, say).
        free = [j for j, w in enumerate(want) if w is None and got[j] == want[i]]
        if len(free) == 1:
            return min(i, free[0]), max(i, free[0])
    return None


def _symbolic(p: _Param) -> bool:
    return any(spec.symbolic for spec in (*p.arrays, *p.sequences))
