"""The public functions as torch ops (``torch.ops.typedkv.*``), for torch.compile and CUDA graphs.

Eager calls of the public functions never come here: they check and launch
directly, since an op's dispatch costs host time a decode step cannot spare.
While torch.compile traces, a public function calls its `TorchOps` instead, so
the graph holds one opaque op per call and never a graph break:

- the **fake** implementation runs the production check on the fake tensors,
  so misuse is rejected at trace time with the eager message (debug mode's
  beartype and value checks run in eager calls only);
- the **real** implementation, on CPU and CUDA alike, is the eager checked
  implementation (`typedkv._impl`), called when the compiled graph runs;
- every op returns nothing and declares exactly what it writes in its schema
  (``Tensor(a8!)``), so functionalization and CUDA-graph replay see every write
  and reorder or alias none of them.

Each op's schema is derived from its function's `Signature`, one parameter at a
time (`_Arg`), and printed by ``tests/test_compile.py``:

- a tensor is ``Tensor`` (``Tensor?`` when it may be None); one the function
  writes is ``Tensor(aN!)``, and the traced call allocates it first when the
  caller passed None (``k_out``), unless None means "not written"
  (``Tensor(aN!)?``: the scales a pool call writes per row);
- a tensor or a sequence of tensors (a pool) is ``Tensor`` in one op and
  ``Tensor[]`` in another (the ``stacked`` and ``list`` ops);
- a number or a tensor (eps, the FP8 scales) is two arguments, ``float?
  NAME_value`` and ``Tensor? NAME_tensor``, of which the tensor wins when given
  (a schema has no union); a sequence of per-layer numbers travels as a float32
  tensor on kv's device (a constant of the graph);
- an int is ``SymInt``; a literal is ``str`` (``str?`` when it may be None).

Written tensors that enter the compiled region as separate tensors sharing one
allocation (K and V pools as two halves of one buffer, per-layer pools as views
of one buffer, ``k_out``/``v_out`` views of one slab) are not written in place
by inductor: it copies them out and back around the op on every call
(pytorch/pytorch#139628), and before torch 2.13 that copy can read past the end
of a view with a storage offset and corrupt it (seen on 2.11). The fake
implementations warn when written tensors share an allocation; separate
allocations, and views taken inside the compiled region from one tensor, are
written in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from typedkv.core.checking import check_numbers
from typedkv.core.hints import Param
from typedkv.core.implementation import Implementation

# Before this version inductor's copy of a shared allocation can be wrong, not just slow.
_SHARED_COPY_FIXED = (2, 13)


@dataclass(frozen=True)
class _Arg:
    """How one parameter of a public function travels through its torch ops.

    Plain fields, worked out once: the traced call reads them while Dynamo traces.
    """

    param: Param
    written: bool
    pool: bool  # a tensor or a sequence of tensors: ``Tensor`` in the stacked op, ``Tensor[]`` in the list op
    number_or_tensor: bool  # two schema arguments, NAME_value and NAME_tensor

    optional_output: bool = False  # a written tensor that None leaves unwritten (not allocated by the traced call)

    @staticmethod
    def of(param: Param, written: bool, allocated: bool = False) -> _Arg:
        pool, number_or_tensor = bool(param.arrays and param.sequences), bool(param.arrays and param.scalars)
        return _Arg(param, written, pool, number_or_tensor, written and param.optional and not allocated)

    def schema(self, listed: bool) -> list[str]:
        p = self.param
        if self.number_or_tensor:
            return [f"float? {p.name}_value", f"Tensor? {p.name}_tensor"]
        if p.arrays or p.sequences:
            alias = f"(a{p.index + 1}!)" if self.written else ""
            kind = f"Tensor{alias}" + ("[]" if listed and self.pool else "")
            optional = "?" if p.optional and (not self.written or self.optional_output) else ""
            return [f"{kind}{optional} {p.name}"]
        if p.literals:
            return [f"str{'?' if p.optional else ''} {p.name}"]
        if int in p.scalars:
            return [f"SymInt {p.name}"]
        raise TypeError(f"typedkv: no schema type for parameter {p.name} ({p.hint!r})")

    def flatten(self, value: Any, like: Any) -> list[Any]:
        """The public argument as the schema's values (``like``: the tensor whose device a converted number takes)."""
        if not self.number_or_tensor:
            return [list(value) if self.pool and isinstance(value, (list, tuple)) else value]
        if isinstance(value, Tensor):
            return [None, value]
        if isinstance(value, (list, tuple)):
            # Per-layer numbers: checked with the eager message first (the fake sees only the tensor).
            check_numbers(self.param.name, value)
            return [
                None,
                torch.tensor([float(x) for x in value], dtype=torch.float32, device=getattr(like, "device", None)),
            ]
        return [value, None]

    def take(self, values: Iterator[Any], static: bool) -> Any:
        """The public argument back from the schema's values; ``static``: traced numbers as Python numbers."""
        if self.number_or_tensor:
            value, tensor = next(values), next(values)
            return tensor if tensor is not None else (_concrete(value) if static else value)
        value = next(values)
        return _concrete(value) if static else value


class TorchOps:
    """The torch ops of one public function, their schemas derived from its `Signature`.

    Parameters
    ----------
    implementation
        The function's checked implementation, with its declared `Signature`.
    names
        The op names: one, or ``(stacked, list)`` for a function that takes pools.
    allocate
        Traced calls only: fills in the outputs the caller left None (the ops write, never allocate).
    returns
        The written arguments the public function returns (none: it returns None).
    check_kinds
        Traced calls only: raises the eager message for pools of different kinds
        (a stacked tensor beside a list), which no op takes.
    """

    def __init__(
        self,
        implementation: Implementation,
        names: Sequence[str],
        allocate: Callable[[list[Any], Mapping[str, int]], None] | None = None,
        returns: Sequence[str] = (),
        check_kinds: Callable[..., None] | None = None,
    ) -> None:
        signature = implementation.signature
        self._implementation = implementation
        self._args = [_Arg.of(p, p.name in signature.outputs, p.name in returns) for p in signature.params]
        self._allocate = allocate
        self._index = {name: i for i, name in enumerate(signature.parameters)}
        self._returns = tuple(self._index[name] for name in returns)
        self._check_kinds = check_kinds
        self._pools = [a.param.index for a in self._args if a.pool]
        mutated = [a.param.name for a in self._args if a.written]
        self.ops = []
        for listed, name in zip((False, True), names, strict=False):
            schema = "(" + ", ".join(s for a in self._args for s in a.schema(listed)) + ") -> ()"
            op = torch.library.custom_op(f"typedkv::{name}", self._real, mutates_args=mutated, schema=schema)
            op.register_fake(self._fake)
            self.ops.append(op)

    def __call__(self, call: Sequence[Any]) -> Any:
        """The public function while torch.compile traces ``call`` (its bundle): outputs allocated, one op call."""
        arguments = list(call)
        if self._allocate is not None:
            self._allocate(arguments, self._index)
        listed = [isinstance(arguments[i], (list, tuple)) for i in self._pools if arguments[i] is not None]
        if any(listed) and not all(listed) and self._check_kinds is not None:
            # No op takes a stacked pool beside a list: the eager message, raised here (plain Python, traceable).
            self._check_kinds(*(arguments[i] for i in self._pools))
        # The numbers' ranges with the eager messages, while they are numbers (a per-layer eps list is a tensor below).
        self._implementation.numbers(self._implementation.call(*arguments))
        values = [v for i, a in enumerate(self._args) for v in a.flatten(arguments[i], arguments[0])]
        self.ops[int(any(listed))](*values)
        if not self._returns:
            return None
        return tuple(arguments[i] for i in self._returns)

    def _arguments(self, values: Sequence[Any], static: bool) -> list[Any]:
        """The public arguments, in the signature's order, back from the schema's values."""
        flat = iter(values)
        return [a.take(flat, static) for a in self._args]

    def _real(self, *values: Any) -> None:
        self._implementation.run(self._implementation.call(*self._arguments(values, static=False)))

    def _fake(self, *values: Any) -> None:
        arguments = self._arguments(values, static=True)
        self._implementation.check(self._implementation.call(*arguments))
        written: list[tuple[str, Tensor]] = []
        for a, value in zip(self._args, arguments, strict=True):
            if a.written and value is not None:
                name = a.param.name
                written += (
                    [(name, value)] if isinstance(value, Tensor) else [(f"{name}[{i}]", t) for i, t in enumerate(value)]
                )
        _warn_shared_allocation(written)


def _concrete(value: Any) -> Any:
    """A traced scalar as the Python number the checks expect (a guard on its value).

    torch.compile passes an ``int`` or ``float`` argument that changed between
    calls as a symbol; the layout checks are on concrete numbers.
    """
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return value


def _warn_shared_allocation(written: Sequence[tuple[str, Tensor]]) -> None:
    """Trace time: warn when tensors an op writes share an allocation (see the module notes)."""
    seen: dict[int, str] = {}
    for name, tensor in written:
        other = seen.setdefault(tensor.untyped_storage()._cdata, name)
        if other == name:
            continue
        harm = "copies them around the op on every call instead of writing in place"
        if _torch_version() < _SHARED_COPY_FIXED:
            harm += f", and with torch {torch.__version__} the copy can corrupt them"
        warnings.warn(
            f"typedkv: {name} shares one allocation with {other}: when such tensors enter a torch.compile'd region "
            f"as separate tensors, inductor {harm} (pytorch/pytorch#139628); give each its own allocation, "
            "or take the views inside the compiled region from one tensor",
            stacklevel=2,
        )
        return


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def allocate_dense_outputs(arguments: list[Any], index: Mapping[str, int]) -> None:
    """`typedkv.materialize_kv` traced: ``[L, T, H, D]`` outputs for those left None, as the eager op allocates.

    ``arguments`` is the call in the signature's order, ``index`` each
    parameter's position. Arguments that cannot size the outputs get a
    placeholder: the op's fake implementation rejects them (they come before
    the outputs) with the eager message.
    """
    kv, k_norm_weight, num_kv_heads = (arguments[index[n]] for n in ("kv", "k_norm_weight", "num_kv_heads"))
    for name in ("k_out", "v_out"):
        if arguments[index[name]] is not None:
            continue
        heads_ok = (
            isinstance(num_kv_heads, (int, torch.SymInt)) and not isinstance(num_kv_heads, bool) and num_kv_heads > 0
        )
        if (
            isinstance(kv, Tensor)
            and kv.dim() == 3
            and heads_ok
            and (k_norm_weight is None or k_norm_weight.dim() == 2)
        ):
            # D from the norm weight, else from kv's width (2*H*D).
            head_dim = kv.shape[2] // (2 * num_kv_heads) if k_norm_weight is None else k_norm_weight.shape[1]
            shape = (kv.shape[1], kv.shape[0], num_kv_heads, head_dim)
            arguments[index[name]] = torch.empty(shape, dtype=kv.dtype, device=kv.device)
        else:
            arguments[index[name]] = torch.empty(0)
