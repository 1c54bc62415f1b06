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

Reading the annotations lives in `typedkv.core.hints`, the wording of the errors
in `typedkv.core.messages`; this module decides what is wrong.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from typedkv.core.errors import InputError
from typedkv.core.hints import ArraySpec
from typedkv.core.messages import or_list, type_name
from typedkv.core.tensor_types import strided

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
