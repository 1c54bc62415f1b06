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
shape, strides, device and layout (strided only: a sparse, MKL-DNN or nested tensor
is refused by name): `Signature.plan` caches what a layout needs
(`CheckedLayouts`), so a decode loop pays a lookup per call, not the check.

Relations that jaxtyping cannot spell (a dim that comes from an ``int`` argument,
"same dtype as kv", "same device as kv", a rule between dims) are declared next to
the function, as arguments of `Signature`, not as if-chains in its body.

Reading the annotations lives in `typedkv._annotations`, the wording of the errors
in `typedkv._messages`; this module decides what is wrong.
"""

from __future__ import annotations

import inspect
import operator
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from beartype import BeartypeConf
from beartype.door import die_if_unbearable
from beartype.roar import BeartypeDoorHintViolation
from jaxtyping import Shaped, jaxtyped
from torch import Tensor

from ._annotations import NAME, ArraySpec, Dim, Param, is_layout_choice, parse_param, runtime_hint, symbolic
from ._errors import InputError
from ._memory import overlaps_itself
from ._messages import Messages, fmt_dtype, or_list, scalar_fix, type_name
from ._types import is_fp8, strided

_P = TypeVar("_P")


@dataclass
class Bound:
    """What a production check learnt: dim sizes, and the tensors' common device."""

    dims: dict[str, int]
    device: torch.device
    bound_by: dict[str, str] = field(default_factory=dict)
    # The shape each tensor argument matched (of a union), by argument name.
    specs: dict[str, ArraySpec] = field(default_factory=dict)
    # Dims solved from a symbolic dim (D from kv's 2*H*D when nothing else names D).
    solved: set[str] = field(default_factory=set)

    def shape_of(self, name: str) -> str:
        """The shape ``name`` matched, as written in its annotation (``"L N B H D"``)."""
        return " ".join(d.text for d in self.specs[name].dims)

    def strides(self, name: str, tensor: torch.Tensor) -> dict[str, int]:
        """``tensor``'s stride of each named dim of the shape ``name`` matched."""
        return {d.name: st for d, st in zip(self.specs[name].dims, tensor.stride(), strict=True) if d.name}


def _items_facts(items: Sequence[Any]) -> tuple[Any, ...]:
    """What a check's verdict on each of ``items`` depends on (never a tensor's values or address).

    Tensors, None and lists are handled in place, not through `_other_facts`:
    they are most of the items (a per-layer pool call's key holds 16 tensors,
    10 of them in two lists), and a function call for each cost a fifth of that
    key's time (measured on CPU).
    """
    return tuple(
        [
            (x.dtype, x.shape, x.stride(), x.device)
            if isinstance(x, Tensor)
            else None
            if x is None
            else (type(x), _listed_facts(x))
            if isinstance(x, (list, tuple))
            else _other_facts(x)
            for x in items
        ]
    )


def _listed_facts(items: Sequence[Any]) -> tuple[Any, ...]:
    """`_items_facts` of a list's items: tensors in place, the rest (a rejected nesting among them) through `_other_facts`."""
    return tuple(
        [(x.dtype, x.shape, x.stride(), x.device) if isinstance(x, Tensor) else _other_facts(x) for x in items]
    )


def _other_facts(x: Any) -> Any:
    """`_items_facts` of an item that is not a tensor, None, a list or a tuple (or is one, inside a list)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return (type(x), _items_facts(x))
    if isinstance(x, float):
        return float  # any float passes; its value is the kernel's business
    if isinstance(x, (int, str, bool)):
        return (type(x), x)
    return (type(x), id(x))  # rejected by the check anyway


def fingerprint(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a check's verdict on ``args`` depends on: the key under which a layout's plan is kept.

    It holds no tensor's layout: the check accepts strided tensors only (`strided`), and a plan the
    key alone finds is taken only for them (`CheckedLayouts.get`). Raises RuntimeError for a tensor
    whose sizes or strides cannot be read (a strided nested tensor, a sparse CSR one).
    """
    return _items_facts(args)


def _strided(args: Sequence[Any]) -> bool:
    """Whether every tensor among ``args`` (and in their lists) is `strided`."""
    for x in args:
        if isinstance(x, Tensor):
            if not strided(x):
                return False
        elif isinstance(x, (list, tuple)) and not all(strided(e) for e in x if isinstance(e, Tensor)):
            return False
    return True


def _tensor_guards() -> Callable[..., Any] | None:
    """torch's C++ layout check of a tuple of tensors (from ``torch.compile``'s guards), or None.

    ``TensorGuards(*tensors, ...)`` records each tensor's Python type, dispatch keys (the device's
    type among them), dtype, device index, ``requires_grad``, sizes and strides, and the
    thread's dispatch state; ``.check(*tensors)`` says in one call whether another tuple has all of
    them. It is not public API, so it is taken only when it behaves here as written below, and
    always given its keyword arguments (without them some releases crash).
    """
    try:
        from torch._C._dynamo import guards as dynamo_guards

        # Its stub omits the tensors it takes positionally.
        tensor_guards: Any = dynamo_guards.TensorGuards
        probe = torch.zeros(2, 3)
        guards = tensor_guards(probe, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        if guards.check(probe) is True and guards.check(probe.t()) is False and guards.check(probe.half()) is False:
            return tensor_guards  # type: ignore[no-any-return]
    except Exception:  # any failure: the fingerprint alone, as before
        pass
    return None


_TENSOR_GUARDS = _tensor_guards()
_IS_NESTED = operator.attrgetter("is_nested")
# Values compared as the fingerprint compares them (floats by type alone); others make no `LayoutGuard`.
_PLAIN = (type(None), bool, int, str, float)


class LayoutGuard:
    """A checked call's layout, recognised again without its fingerprint: its tensors' facts checked in C++.

    The fingerprint reads four facts of every tensor from Python: on a CUDA host about
    0.7 us a tensor, 11 us of a per-layer pool call's 16 tensors. A guard holds the
    call's structure (where tensors and lists of tensors are, the other arguments' types
    and values, floats by type alone) and torch's ``TensorGuards`` over its tensors,
    which compares everything the fingerprint holds and more (the tensor's Python
    type, ``requires_grad``, the thread's dispatch state, and with the dispatch keys the
    tensor's layout): ``matches(args)`` implies ``fingerprint(args)`` equals the kept call's,
    and its tensors are strided. It keeps no tensor alive.
    """

    __slots__ = (
        "_count", "_exact", "_exact_values", "_guards", "_lists", "_other_types", "_others", "_tensor_at", "_tensors"
    )  # fmt: skip

    def __init__(self, args: Sequence[Any], guards: Callable[..., Any]) -> None:
        self._count = len(args)
        tensor_at = [i for i, x in enumerate(args) if isinstance(x, Tensor)]
        list_at = [i for i, x in enumerate(args) if isinstance(x, (list, tuple))]
        other_at = [i for i, x in enumerate(args) if not isinstance(x, (Tensor, list, tuple))]
        # itemgetter of one index returns the item itself, of several a tuple: fewer than two, indexed instead.
        self._tensor_at = tensor_at
        self._tensors = operator.itemgetter(*tensor_at) if len(tensor_at) > 1 else None
        self._lists = [(i, type(args[i]), len(args[i])) for i in list_at]
        # A repeated index keeps results tuples.
        self._others = operator.itemgetter(*other_at, *other_at[-1:]) if other_at else None
        values = self._others(args) if self._others is not None else ()
        self._other_types = tuple(map(type, values))
        # Compared by value (floats by type alone): one C-level gather and tuple comparison a call.
        exact_at = [i for i in other_at if type(args[i]) is not float]
        self._exact = operator.itemgetter(*exact_at, *exact_at[-1:]) if exact_at else None
        self._exact_values = self._exact(args) if self._exact is not None else ()
        flat = self._flat_tensors(args)
        for i in list_at:
            flat += args[i]
        self._guards = guards(*flat, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    @classmethod
    def of(cls, args: Sequence[Any]) -> LayoutGuard | None:
        """A guard for ``args``, or None where there is none to take (no `_tensor_guards`, or arguments
        other than strided tensors, lists of them and plain values)."""
        if _TENSOR_GUARDS is None:
            return None
        for x in args:
            if isinstance(x, (list, tuple)):
                if not all(isinstance(e, Tensor) for e in x):
                    return None
            elif not isinstance(x, Tensor) and type(x) not in _PLAIN:
                return None
        # Only checked layouts are kept, all strided; and TensorGuards would abort on recording a nested
        # or sparse CSR tensor (see `matches`).
        if not _strided(args):
            return None
        try:
            return cls(args, _TENSOR_GUARDS)
        except Exception:  # any tensor it cannot record: the fingerprint alone
            return None

    def _flat_tensors(self, args: Sequence[Any]) -> list[Any]:
        """The items of ``args`` where the kept call had tensors, as a new list."""
        if self._tensors is not None:
            return list(self._tensors(args))
        return [args[i] for i in self._tensor_at]

    def matches(self, args: Sequence[Any], nested_possible: bool = True) -> bool:
        """Whether ``args`` has the kept call's layout (so the same fingerprint).

        ``nested_possible``: False where the caller read ``fingerprint(args)``, which raises for a
        strided nested tensor, the one kind ``TensorGuards`` cannot be handed.
        """
        if len(args) != self._count:
            return False
        if self._others is not None and tuple(map(type, self._others(args))) != self._other_types:
            return False
        if self._exact is not None and self._exact(args) != self._exact_values:
            return False
        flat = self._flat_tensors(args)
        for i, kind, length in self._lists:
            x = args[i]
            if type(x) is not kind or len(x) != length:
                return False
            flat += x
        # TensorGuards reads a tensor's sizes and strides before it compares its dispatch keys, and a
        # nested tensor's (torch.nested, strided layout) raise a C++ error there that nothing catches: the
        # process aborts. So no nested tensor reaches it (the one per-tensor read in Python here); an item
        # that is no tensor (no is_nested) is no match either.
        try:
            if nested_possible and any(map(_IS_NESTED, flat)):
                return False
        except Exception:
            return False
        # A tensor of another Python type, or the same tensor twice, fails the guard's own checks.
        return self._guards.check(*flat) is True


class CheckedLayouts(Generic[_P]):
    """Plans by the layout of the arguments they were checked with (`fingerprint`), the last one found
    again by its `LayoutGuard`.

    A decode loop calls with one layout again and again: its call pays the guard's check
    (about a microsecond) instead of the fingerprint. A call of another layout pays the
    fingerprint and a dictionary lookup, and its guard becomes the one tried first (remade
    for this call where it compares more than the fingerprint and that differs). A plan the
    fingerprint finds without its guard's word is taken only for strided tensors: a sparse or
    MKL-DNN tensor can have a kept strided tensor's fingerprint.
    """

    def __init__(self, most: int) -> None:
        self._most = most  # more layouts than this: all dropped, and checked again as they come
        self._plans: dict[tuple[Any, ...], _P] = {}
        self._guards: dict[tuple[Any, ...], LayoutGuard | None] = {}
        self._last: tuple[LayoutGuard, _P] | None = None

    def __len__(self) -> int:
        return len(self._plans)

    def __reduce__(self) -> tuple[type[CheckedLayouts[Any]], tuple[int]]:
        # A copy (copy.deepcopy, pickling) starts empty and checks each layout again: a plan's guards
        # and launches cannot be copied, and a copy's tensors lie at addresses of their own.
        return CheckedLayouts, (self._most,)

    def values(self) -> list[_P]:
        """The plans kept."""
        return list(self._plans.values())

    def clear(self) -> None:
        """Drop every plan: each layout is checked again."""
        self._plans.clear()
        self._guards.clear()
        self._last = None

    def get(self, args: Sequence[Any]) -> _P | None:
        """The plan kept for ``args``' layout, or None."""
        last = self._last
        if last is not None and last[0].matches(args):
            return last[1]
        try:
            key = fingerprint(args)
        except RuntimeError:
            # A tensor without sizes or strides to read (nested, sparse CSR...): no plan; the check names it.
            return None
        plan = self._plans.get(key)
        if plan is None:
            return None
        guard = self._guards.get(key)
        if guard is not None and guard.matches(args, False):
            self._last = (guard, plan)
            return plan
        # The fingerprint holds no tensor's layout: a sparse or MKL-DNN tensor can have a kept strided
        # tensor's facts (a sparse COO tensor's strides are all 0). Where the guard, which compares
        # dispatch keys, does not vouch for the call, its tensors are strided or it is checked in full.
        if not _strided(args):
            return None
        if guard is not None:
            # Same layout, but a fact only the guard compares differs (the thread's dispatch state,
            # e.g. a first call outside inference_mode and the rest inside it): a guard for this call.
            guard = self._guards[key] = LayoutGuard.of(args)
            if guard is not None:
                self._last = (guard, plan)
        return plan

    def keep(self, args: Sequence[Any], plan: _P) -> _P:
        """Keep ``plan`` (for ``args``, just checked in full) under their layout; returns it."""
        if len(self._plans) >= self._most:
            self.clear()
        key = fingerprint(args)
        guard = LayoutGuard.of(args)
        self._plans[key] = plan
        self._guards[key] = guard
        self._last = None if guard is None else (guard, plan)
        return plan


def check_numbers(name: str, value: Sequence[Any], kinds: tuple[type, ...] = (float, int)) -> None:
    """Every item of ``value`` a number of ``kinds`` (never a bool, which Python counts as an int), and
    where a float goes, one a float can hold (`check_float`)."""
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, kinds):
            words = or_list([f"{'an' if k is int else 'a'} {k.__name__}" for k in kinds])
            raise InputError(f"{name}[{i}]: expected {words}, got {type_name(item)}")
        if float in kinds:
            check_float(f"{name}[{i}]", item)


def check_float(name: str, value: object) -> None:
    """An int given where a float goes is one a float can hold: every path converts it (``float()``), and past
    float64's range that raises OverflowError. Other values pass (their kind is the signature's to check)."""
    if type(value) is int and not -sys.float_info.max <= value <= sys.float_info.max:
        raise InputError(
            f"{name}: expected a float, got an int of {len(str(abs(value)))} digits: past float64's range, "
            "no float holds it"
        )


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
        of its annotation's FP8 dtypes.
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
        # The argument annotated `KVLayout` picks, among an argument's shapes of
        # one rank, the one tagged with its value (`PageLayout`).
        layout_of = next((p.name for p in params if is_layout_choice(hints[p.name])), None)
        self._layout_of = layout_of
        self._layout_index = None if layout_of is None else by_name[layout_of].index
        self._default_layout = default_layout
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
                    spec = self._choose(p, p.name, p.arrays, value, bound, args)
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
            fitting = [s for s in same_rank if self._fits(s, value.shape, bound.dims)]
            if len(fitting) > 1:
                raise InputError(self._messages.ambiguous_layout(self._layout_of, label, fitting, value, bound.dims))
        layout = self._default_layout if given is None else given
        chosen = [s for s in same_rank if s.layout in (None, layout)]
        if len(chosen) == 1:
            spec = chosen[0]
            if not self._fits(spec, value.shape, bound.dims):
                # A pool of the other layout passed without saying so: name the argument that fixes it.
                for other in same_rank:
                    if other.layout not in (None, layout) and self._fits(other, value.shape, bound.dims):
                        raise InputError(
                            self._messages.other_layout(self._layout_of, label, spec, other, layout, value, bound.dims)
                        )
            return spec
        allowed = [s for s in specs if s.layout in (None, layout)]
        shapes = " or ".join(self._messages.expected(s, bound.dims) for s in allowed)
        msg = f"{label}: expected shape {shapes}"
        if self._layout_of is not None:
            msg += f" for {self._layout_of}={layout!r}"
        msg += f", got {tuple(value.shape)}"
        others = sorted({s.layout for s in same_rank if s.layout not in (None, layout)})
        if others:
            msg += f": {self._layout_of}={others[0]!r} takes a tensor of {value.dim()} dims"
        else:
            msg += self._messages.combined_fix(p.name, label, self._combined_half(specs, value, bound.dims))
        raise InputError(msg)

    @staticmethod
    def _fits(spec: ArraySpec, shape: Sequence[int], dims: Mapping[str, int]) -> bool:
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

    def _combined_half(self, specs: Sequence[ArraySpec], value: torch.Tensor, dims: Mapping[str, int]) -> int | None:
        """The dim of size 2 whose removal makes ``value`` fit a shape: a combined K/V cache passed whole."""
        shape = tuple(value.shape)
        for i, size in enumerate(shape):
            if size == 2 and any(self._fits(s, shape[:i] + shape[i + 1 :], dims) for s in specs):
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
            raise InputError(f"{p.name}: expected {p.sequence_len}={want} per-layer numbers, got {len(value)}")

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
            raise InputError(f"{p.name}: expected {p.sequence_len}={want} per-layer tensors, got {len(value)}")
        spec: ArraySpec | None = None
        for i, item in enumerate(value):
            label = f"{p.name}[{i}]"
            if not isinstance(item, torch.Tensor):
                raise InputError(f"{label}: expected a torch.Tensor, got {type_name(item)}")
            self._check_kind(p.name, label, item)
            # The first item picks the shape; every other item must have it too.
            if spec is None:
                spec = self._choose(p, label, p.sequences, item, bound, args)
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
        elif storage is not None:
            # A pool holds kv's dtype or an FP8 one: say which, not the whole family.
            want = args[storage[0]].dtype
            fp8 = [d for d in spec.dtype_names if is_fp8(getattr(torch, d))]
            if value.dtype != want and fmt_dtype(value.dtype) not in fp8:
                raise InputError(self._messages.storage_message(label, value.dtype, want, storage[1], fp8))
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
            raise InputError(self._messages.shape_message(name, label, spec, tuple(shape), bound))
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
