"""`Signature`: a public function's checking plan, read once from its jaxtyping annotations.

Production mode (`Signature.check`) is plain Python over shapes, dtypes and devices; debug mode
(`Signature.debug_check`) runs beartype and jaxtyping over the same annotations. The plan of each
layout is cached (`typedkv.core.checking.CheckedLayouts`), so a decode loop pays a lookup per call.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from beartype import BeartypeConf
from beartype.door import die_if_unbearable
from beartype.roar import BeartypeDoorHintViolation
from jaxtyping import Shaped, jaxtyped

from typedkv.core import hints
from typedkv.core.checking import Bound, CheckedLayouts, check_numbers
from typedkv.core.errors import InputError
from typedkv.core.hints import NAME, ArraySpec, Dim, Param, is_layout_choice, parse_param, runtime_hint, symbolic
from typedkv.core.memory import overlaps_itself
from typedkv.core.messages import Messages, fmt_dtype, or_list, scalar_fix, type_name
from typedkv.core.tensor_types import is_quantized, strided

_P = TypeVar("_P")

_PLANS_MAX = 4096
# As mypy: an int is accepted where a float is annotated.
_BEARTYPE = BeartypeConf(is_pep484_tower=True)


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
    storage_of
        ``{param: other}``: ``param`` (a pool) has ``other``'s dtype or one
        of its annotation's FP8 dtypes (in a shape whose dtypes hold
        ``other``'s; another shape, an MLA pool's bytes, has its own dtypes).
    outputs
        Arguments the function writes; their fixes show how to allocate them.
    rules
        ``(expression over dims, argument to blame, what the rule says)``,
        optionally followed by ``(condition over dims, fix)`` pairs: the fix of
        the first condition that holds ends the message.
    sequence_len
        ``{param: dim}``: a sequence argument holds that many tensors.
    inner_contiguous
        Arguments whose last dim must have stride 1 (read or written as vectors).
    default_layout
        The layout a ``None`` layout argument stands for, when the tensor fits
        only one of its rank's shapes.
    per_row_of
        ``{param: other}``: ``param`` holds one element per row of ``other``
        (its shape is ``other``'s without the last dim): it is checked against
        that shape of its union, never read as another layout.

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
        storage_of: Mapping[str, str] = {},
        outputs: Sequence[str] = (),
        rules: Sequence[tuple[Any, ...]] = (),
        sequence_len: Mapping[str, str] = {},
        inner_contiguous: Sequence[str] = (),
        default_layout: str | None = None,
        per_row_of: Mapping[str, str] = {},
    ) -> None:
        # Derived dims ("KV = 2*H*D") are read in place of their names, so both
        # modes check the expression itself and messages quote it.
        hints = {n: runtime_hint(h) for n, h in typing.get_type_hints(fn, include_extras=True).items()}
        parameters = list(inspect.signature(fn).parameters)
        self.name = fn.__name__
        self.parameters = parameters
        self.hints = {n: hints[n] for n in parameters}
        self.return_hint = hints.get("return")
        params = [parse_param(n, i, hints[n]) for i, n in enumerate(parameters)]
        for p in params:
            p.sequence_len = sequence_len.get(p.name)
        by_name = {p.name: p for p in params}
        self.params = params  # every parameter, read from its annotation (the torch ops' schemas come from these)
        self._scalars = [p for p in params if not p.arrays and not p.sequences]
        tensors = [p for p in params if p.arrays or p.sequences]
        self._inputs = [p for p in tensors if p.name not in outputs]
        self._written = [p for p in tensors if p.name in outputs]
        # jaxtyping evaluates a symbolic dim ("2*H*D" on kv) when it meets it, so
        # the debug check visits those arguments after the ones binding the names.
        self._debug_order = [p for p in tensors if not symbolic(p)] + [p for p in tensors if symbolic(p)]
        self._scalar_dims = [(dim, by_name[arg].index, arg) for dim, arg in scalar_dims.items()]
        self._device_index = by_name[device_of].index
        self._device_of = device_of
        self._same_dtype = {by_name[p].name: (by_name[o].index, o) for p, o in same_dtype.items()}
        self._storage_of = {by_name[p].name: (by_name[o].index, o) for p, o in storage_of.items()}
        self.outputs = self._outputs = frozenset(outputs)
        self._rules = [(compile(expr, expr, "eval"), expr, blame, what, fixes) for expr, blame, what, *fixes in rules]
        self._inner_contiguous = frozenset(inner_contiguous)
        # The argument annotated `KVLayout` (or `CacheFormat`) picks, among an
        # argument's shapes of one rank, the one tagged with its value (`PageLayout`).
        layout_of = next((p.name for p in params if is_layout_choice(hints[p.name])), None)
        self._layout_of = layout_of
        self._layout_index = None if layout_of is None else by_name[layout_of].index
        self._default_layout = default_layout
        self._per_row_of = dict(per_row_of)
        self._messages = Messages(device_of, self._outputs, self._same_dtype, self._scalar_dims)
        self._plans: CheckedLayouts[Any] = CheckedLayouts(_PLANS_MAX)

    # ----------------------------------------------------------------- plan cache
    def plan(self, args: Sequence[Any], build: Callable[[Bound, Any], Any]) -> Any:
        """The plan for ``args``' layout: checked and built on the first call, then reused.

        A check's verdict depends only on each argument's type and, for tensors,
        dtype, shape, strides and device (the fingerprint), so a layout that
        passed once passes again: decode loops pay a lookup (`CheckedLayouts`) instead
        of the full check. ``build(bound, args)`` turns the bound dims into the
        op's plan (relational checks, launch configuration); it may raise
        `InputError`. It is given ``args`` rather than closing over them, so a
        call that finds its plan creates no function.
        """
        plan = self._plans.get(args)
        if plan is None:
            plan = self._plans.keep(args, build(self.check(args), args))
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
            raise InputError(f"{self._device_of}: expected a torch.Tensor, got {type_name(anchor)}")
        device = anchor.device
        bound = Bound(dims, device, bound_by)
        deferred: list[tuple[str, str, ArraySpec, torch.Size]] = []
        for group in (self._inputs, self._written):
            for p in group:
                value = args[p.index]
                if value is None and p.optional:
                    continue
                if isinstance(value, torch.Tensor) and p.arrays:
                    self._check_kind(p.name, p.name, value)
                    spec = self._row_spec(p.name, p.arrays, bound) or self._choose(
                        p, p.name, p.arrays, value, bound, args
                    )
                    bound.specs[p.name] = spec
                    self._check_tensor(p.name, p.name, spec, value, bound, args, deferred)
                elif p.sequences and isinstance(value, (list, tuple)):
                    self._check_sequence(p, value, bound, args, deferred)
                elif p.scalar_items and isinstance(value, (list, tuple)):
                    self._check_numbers(p, value, bound)
                elif p.scalars and isinstance(value, p.scalars) and not isinstance(value, bool):
                    continue
                else:
                    raise InputError(
                        f"{p.name}: expected {self._messages.describe(p)}, got {type_name(value)}{scalar_fix(p, value)}"
                    )
            # Symbolic dims whose names were bound by a later argument, or are
            # solved from them here: the inputs' dims are all known before an
            # output is checked against them.
            deferred = self._resolve(deferred, bound)
        for code, expr, blame, what, fixes in self._rules:
            if not eval(code, {}, dims):
                shown = ", ".join(f"{n}={dims[n]}" for n in sorted(set(NAME.findall(expr))) if n in dims)
                fix = next((f": {text}" for condition, text in fixes if eval(condition, {}, dims)), "")
                raise InputError(f"{blame}: {what}, got {shown}{fix}")
        return bound

    def _resolve(
        self, deferred: list[tuple[str, str, ArraySpec, torch.Size]], bound: Bound
    ) -> list[tuple[str, str, ArraySpec, torch.Size]]:
        """Check the deferred symbolic dims whose names are bound; solve those with one unknown.

        Returns what is still open (more than one unknown).
        """
        dims = bound.dims
        still: list[tuple[str, str, ArraySpec, torch.Size]] = []
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
                    raise InputError(self._messages.shape_message(name, label, spec, tuple(shape), bound))
        return still

    def _solve(
        self, d: Dim, unknown: str, size: int, name: str, label: str, spec: ArraySpec, shape: torch.Size, bound: Bound
    ) -> None:
        """Bind ``unknown`` so that the symbolic dim ``d`` equals ``size``.

        ``d`` is ``per*unknown + offset`` over the bound dims: a product such as
        ``2*H*D`` (offset 0), or a sum such as ``C+R`` (per 1).
        """
        offset = eval(d.code, {}, {**bound.dims, unknown: 0})
        per = eval(d.code, {}, {**bound.dims, unknown: 1}) - offset
        if eval(d.code, {}, {**bound.dims, unknown: 2}) != 2 * per + offset or per <= 0:
            raise TypeError(f"typedkv: cannot solve {d.text} for {unknown} in the annotation of {name}")
        if offset and size < offset:
            msg = self._messages.shape_message(name, label, spec, tuple(shape), bound)
            known = "; ".join(
                f"{n}={bound.dims[n]} comes from {bound.bound_by[n]}" for n in sorted(set(d.needs) - {unknown})
            )
            raise InputError(f"{msg}: the size must be {d.text} with {unknown} >= 0, at least {offset}; {known}")
        if (size - offset) % per:
            msg = self._messages.shape_message(name, label, spec, tuple(shape), bound)
            raise InputError(f"{msg}: the size must be {d.text} = {per}*{unknown}; {size} is not a multiple of {per}")
        bound.dims[unknown] = (size - offset) // per
        bound.bound_by[unknown] = label
        bound.solved.add(unknown)

    def _choose(
        self,
        p: Param,
        label: str,
        specs: tuple[ArraySpec, ...],
        value: torch.Tensor,
        bound: Bound,
        args: Sequence[Any],
    ) -> ArraySpec:
        """The shape of ``specs`` that ``value`` is checked against: by rank, then by the layout argument.

        With the layout argument None, a rank that several layouts share takes
        the default layout, unless the tensor fits more than one of them with
        the dims bound so far (an HND pool whose head count equals its page
        size): then only the caller can say which it is.
        """
        if len(specs) == 1:
            return specs[0]
        given = None if self._layout_index is None else args[self._layout_index]
        same_rank = [s for s in specs if len(s.dims) == value.dim()]
        if given is None and len({s.layout for s in same_rank}) > 1:
            fitting = [s for s in same_rank if hints.fits(s, value.shape, bound.dims)]
            if len(fitting) > 1:
                raise InputError(self._messages.ambiguous_layout(self._layout_of, label, fitting, value, bound.dims))
        layout = self._default_layout if given is None else given
        chosen = [s for s in same_rank if s.layout in (None, layout)]
        if len(chosen) == 1:
            spec = chosen[0]
            if not hints.fits(spec, value.shape, bound.dims):
                # A pool of the other layout passed without saying so: name the argument that fixes it (one
                # whose dtypes, where the layouts' differ, take the tensor's: an MLA pool of bytes is no plain one).
                for other in same_rank:
                    takes = value.dtype in other.dtypes or other.dtypes == spec.dtypes
                    if other.layout not in (None, layout) and takes and hints.fits(other, value.shape, bound.dims):
                        raise InputError(
                            self._messages.other_layout(self._layout_of, label, spec, other, layout, value, bound.dims)
                        )
            return spec
        allowed = [s for s in specs if s.layout in (None, layout)]
        shapes = " or ".join(self._messages.expected(s, bound.dims) for s in allowed)
        msg = f"{label}: expected shape {shapes}"
        if self._layout_of is not None and any(s.layout for s in specs):  # shapes of the layout argument's choice
            msg += f" for {self._layout_of}={layout!r}"
        msg += f", got {tuple(value.shape)}"
        others = sorted({s.layout for s in same_rank if s.layout not in (None, layout)})
        if others:
            msg += f": {self._layout_of}={others[0]!r} takes a tensor of {value.dim()} dims"
        else:
            msg += self._messages.combined_fix(p.name, label, self._combined_half(specs, value, bound.dims))
        raise InputError(msg)

    def _row_spec(self, name: str, specs: tuple[ArraySpec, ...], bound: Bound) -> ArraySpec | None:
        """The shape of ``specs`` that is ``per_row_of``'s other argument's without its last dim (None: no such
        relation, or no such shape, as for a sequence beside a stacked tensor: the caller's relations say so)."""
        other = self._per_row_of.get(name)
        matched = bound.specs.get(other) if other is not None else None
        if matched is None:
            return None
        want = [d.text for d in matched.dims[:-1]]
        return next((s for s in specs if [d.text for d in s.dims] == want), None)

    def _combined_half(self, specs: Sequence[ArraySpec], value: torch.Tensor, dims: Mapping[str, int]) -> int | None:
        """The dim of size 2 whose removal makes ``value`` fit a shape: a combined K/V cache passed whole."""
        shape = tuple(value.shape)
        for i, size in enumerate(shape):
            if size == 2 and any(hints.fits(s, shape[:i] + shape[i + 1 :], dims) for s in specs):
                return i
        return None

    def _check_scalar(self, p: Param, value: Any) -> None:
        if value is None and p.optional:
            return
        if p.literals:
            if value in p.literals and isinstance(value, str):
                return
            options = or_list([repr(v) for v in p.literals])
            raise InputError(f"{p.name}: expected {options}, got {value!r}")
        # bool is an int to Python, never a head count or an eps to us.
        if isinstance(value, bool) or not isinstance(value, p.scalars):
            raise InputError(
                f"{p.name}: expected {self._messages.describe(p)}, got {type_name(value)}{scalar_fix(p, value)}"
            )
        if isinstance(value, int) and value < 1 and any(p.name == a for _, _, a in self._scalar_dims):
            raise InputError(f"{p.name}: expected a positive int, got {value}")

    def _check_numbers(self, p: Param, value: Sequence[Any], bound: Bound) -> None:
        """A sequence of numbers, one per `sequence_len` (eps of each layer)."""
        assert p.sequence_len is not None
        check_numbers(p.name, value, p.scalar_items)
        want = bound.dims.get(p.sequence_len)
        if want is not None and len(value) != want:
            raise InputError(self._messages.count_message(p.name, p.sequence_len, len(value), "numbers", bound))

    def _check_sequence(
        self,
        p: Param,
        value: Sequence[Any],
        bound: Bound,
        args: Sequence[Any],
        deferred: list[tuple[str, str, ArraySpec, torch.Size]],
    ) -> None:
        assert p.sequences and p.sequence_len is not None
        want = bound.dims.get(p.sequence_len)
        if want is not None and len(value) != want:
            raise InputError(self._messages.count_message(p.name, p.sequence_len, len(value), "tensors", bound))
        spec: ArraySpec | None = None
        for i, item in enumerate(value):
            label = f"{p.name}[{i}]"
            if not isinstance(item, torch.Tensor):
                raise InputError(f"{label}: expected a torch.Tensor, got {type_name(item)}")
            self._check_kind(p.name, label, item)
            # The first item picks the shape; every other item must have it too.
            if spec is None:
                spec = self._row_spec(p.name, p.sequences, bound) or self._choose(
                    p, label, p.sequences, item, bound, args
                )
                bound.specs[p.name] = spec
            self._check_tensor(p.name, label, spec, item, bound, args, deferred)

    def _check_kind(self, name: str, label: str, value: torch.Tensor) -> None:
        """A strided tensor: no other kind has the memory layout the kernels and the reference address
        (and a nested tensor has no sizes or strides to check), so it is refused before its shape is read."""
        if not strided(value):
            raise InputError(self._messages.kind_message(name, label, value))

    def _check_tensor(
        self,
        name: str,
        label: str,
        spec: ArraySpec,
        value: torch.Tensor,
        bound: Bound,
        args: Sequence[Any],
        deferred: list[tuple[str, str, ArraySpec, torch.Size]],
    ) -> None:
        like = self._same_dtype.get(name)
        storage = self._storage_of.get(name)
        if like is not None:
            # An output must be exactly kv's dtype: say so, not the whole family.
            if value.dtype != args[like[0]].dtype:
                raise InputError(
                    self._messages.like_message(name, label, spec, value, args[like[0]].dtype, like[1], bound)
                )
        elif storage is not None and args[storage[0]].dtype in spec.dtypes:
            # A pool holds kv's dtype or a quantized one (FP8; int8 for K/V pools): say which, not the whole family.
            want = args[storage[0]].dtype
            quantized = [d for d in spec.dtype_names if is_quantized(getattr(torch, d))]
            if value.dtype != want and fmt_dtype(value.dtype) not in quantized:
                raise InputError(self._messages.storage_message(label, value.dtype, want, storage[1], quantized))
        elif value.dtype not in spec.dtypes:
            raise InputError(
                f"{label}: expected dtype {or_list(spec.dtype_names)}, got {fmt_dtype(value.dtype)}"
                + self._messages.dtype_fix(name, label, spec, value.dtype)
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
            msg = self._messages.shape_message(name, label, spec, tuple(shape), bound)
            other = self._per_row_of.get(name)
            if other is not None:
                fixed = msg.count(": ") > 1  # the message ends in fixes already
                msg += f"{';' if fixed else ':'} one element per row of {other}, its shape without the last dim"
            raise InputError(msg)
        for dim, size in new.items():
            dims[dim] = size
            bound.bound_by[dim] = label
        if value.device != bound.device:
            if like is not None:
                raise InputError(
                    self._messages.like_message(name, label, spec, value, args[like[0]].dtype, like[1], bound)
                )
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
        if name in self._outputs and value.numel() > 1 and overlaps_itself(value):
            expanded = any(st == 0 and n > 1 for st, n in zip(value.stride(), shape, strict=True))
            how = "an expanded view" if expanded else "two elements at one address"
            raise InputError(
                f"{label}: expected memory of its own for every element, got strides {tuple(value.stride())} "
                f"({how}): writes to it would collide"
            )

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
