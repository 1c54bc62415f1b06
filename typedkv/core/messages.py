"""The words of an `InputError`: what was expected, what came, and the fix.

`Messages` holds what a function's messages need to know about it (which
arguments are outputs, whose dtype they copy, which dims come from ``int``
arguments); `typedkv.core.signature.Signature` decides *that* an argument is wrong
and asks here how to say it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from typedkv.core.hints import NAME, ArraySpec, Dim, Param

if TYPE_CHECKING:
    from typedkv.core.checking import Bound

# How a dim is spoken of in a fix ("allocate layers first").
DIM_WORDS = {"L": "layers", "T": "tokens", "H": "heads", "D": "head dims", "S": "slots"}


class Messages:
    """How one function's checks word their errors.

    Parameters
    ----------
    device_of
        The argument whose device every tensor shares (named in allocation fixes).
    outputs
        Arguments the function writes: their fixes say how to allocate them.
    same_dtype
        Arguments that must have another's dtype.
    scalar_dims
        ``(dim, index, argument)`` of each dim an ``int`` argument gives.
    """

    def __init__(
        self,
        device_of: str,
        outputs: frozenset[str],
        same_dtype: Mapping[str, Any],
        scalar_dims: Sequence[tuple[str, int, str]],
    ) -> None:
        self._device_of = device_of
        self._outputs = outputs
        self._same_dtype = same_dtype
        self._scalar_dims = scalar_dims

    def describe(self, p: Param) -> str:
        kinds = []
        if p.arrays:
            kinds.append("a torch.Tensor")
        if p.sequences:
            kinds.append(f"a sequence of {p.sequence_len} torch.Tensors")
        if p.scalar_items:
            kinds.append(f"a sequence of {p.sequence_len} numbers")
        words = {int: "an int", float: "a float", str: "a str", bool: "a bool"}
        kinds += [words[s] for s in p.scalars if not (s is int and float in p.scalars)]
        if p.optional:
            kinds.append("None")
        return or_list(kinds)

    def dtype_fix(self, name: str, label: str, spec: ArraySpec, got: torch.dtype) -> str:
        if spec.dtype_names[0].startswith("int"):
            return f": pass {label}.long()"
        if name in self._outputs:
            # Converting an output would write into a copy.
            return f": allocate it with one of these dtypes{'' if label == name else ' (all layers alike)'}"
        return f": convert it with {label}.to(torch.{spec.convert_to})"

    def storage_message(
        self, label: str, got: torch.dtype, want: torch.dtype, other: str, quantized: Sequence[str]
    ) -> str:
        """A pool of neither ``other``'s dtype nor a ``quantized`` one (FP8; int8 for K/V pools)."""
        kinds = or_list([f"{fmt_dtype(want)} ({other}'s)", *quantized])
        msg = f"{label}: expected dtype {kinds}, got {fmt_dtype(got)}"
        if got == torch.uint8:
            # Engines often keep an FP8 cache as raw bytes.
            return msg + f": an FP8 cache kept as bytes can be passed as {label}.view(torch.float8_e4m3fn)"
        if "int8" in quantized:
            return msg + f": allocate the pool with dtype={other}.dtype, an FP8 dtype, or int8 with its scales written"
        return msg + f": allocate the pool with dtype={other}.dtype or an FP8 dtype"

    def expected(self, spec: ArraySpec, dims: Mapping[str, int]) -> str:
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

    def sizes(self, spec: ArraySpec, dims: Mapping[str, int]) -> list[int | None] | None:
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

    def alloc(self, spec: ArraySpec, bound: Bound) -> str:
        sizes = self.sizes(spec, bound.dims)
        args = ", ".join(map(str, sizes or []))
        return f"torch.empty({args}, dtype={self._device_of}.dtype, device={self._device_of}.device)"

    def shape_message(self, name: str, label: str, spec: ArraySpec, got: tuple[int, ...], bound: Bound) -> str:
        dims = bound.dims
        msg = f"{label}: expected shape {self.expected(spec, dims)}, got {got}"
        want = self.sizes(spec, dims)
        # An output the op can allocate itself (k_out, v_out) gets a torch.empty
        # fix; a pool is the caller's memory and only gets told what is wrong.
        allocatable = name in self._outputs and name in self._same_dtype
        fixes: list[str] = []
        swap = swapped(want, got) if want is not None and len(want) == len(got) else None
        if swap is not None:
            i, j = swap
            fixes.append(f"dims {i} and {j} look swapped")
            first = spec.dims[i].name
            if name in self._outputs:
                word = DIM_WORDS.get(first or "", f"dim {first}")
                fixes.append(f"allocate {word} first" + (f": {self.alloc(spec, bound)}" if allocatable else ""))
            elif j != len(got) - 1:
                fixes.append(f"pass {label}.transpose({i}, {j}) (a view: strides are honoured)")
            return msg + ": " + "; ".join(fixes)
        if len(got) == len(spec.dims):
            hinted = False
            for d, size in zip(spec.dims, got, strict=True):
                if (
                    d.name is not None
                    and d.name in dims
                    and dims[d.name] != size
                    and bound.bound_by.get(d.name) != label
                ):
                    hint = "" if hinted else self.swapped_source(d.name, lambda ds: self._fits(spec, got, ds), bound)
                    hinted = hinted or bool(hint)
                    fixes.append(f"{d.name}={dims[d.name]} comes from {bound.bound_by[d.name]}{hint}")
                elif d.code is not None and all(n in dims for n in d.needs) and eval(d.code, {}, dict(dims)) != size:
                    fixes.append(self.symbolic_fix(d, size, dims))
        if allocatable and want is not None and None not in want:
            fixes.append(f"allocate it as {self.alloc(spec, bound)}, or pass {name}=None")
        return msg + (": " + "; ".join(f for f in fixes if f) if fixes else "")

    def _fits(self, spec: ArraySpec, got: Sequence[int], dims: Mapping[str, int]) -> bool:
        """Whether ``got`` has ``spec``'s sizes under ``dims`` (a dim not bound there fits any size)."""
        want = self.sizes(spec, dims)
        return want is not None and all(w is None or w == g for w, g in zip(want, got, strict=True))

    def swapped_source(self, dim: str, explained: Callable[[Mapping[str, int]], bool], bound: Bound) -> str:
        """A hint that the input which bound ``dim`` has two of its dims swapped, or "".

        A later argument disagrees with ``dim``; if exchanging the sizes of
        ``dim`` and another dim the same input bound makes ``explained`` hold
        (the later argument fits), the input is the likelier culprit: kv passed
        layers first makes the norm weight look wrong. Read from the input's
        matched shape, so no layout is restated here. Outputs and items of a
        sequence are left alone: their own messages say how to allocate them.
        """
        source = bound.bound_by.get(dim, "")
        spec = bound.specs.get(source)
        if spec is None or source in self._outputs:
            return ""
        names = [d.name for d in spec.dims]
        if dim not in names:
            return ""  # solved from a symbolic dim (D from kv's width): no dim of its own to swap
        i = names.index(dim)
        for j, other in enumerate(names):
            if other is None or other == dim or bound.bound_by.get(other) != source:
                continue
            if bound.dims[other] == bound.dims[dim]:
                continue
            if explained({**bound.dims, dim: bound.dims[other], other: bound.dims[dim]}):
                a, b = sorted((i, j))
                hint = f", whose dims {a} and {b} look swapped: {source} is {self.brackets(spec)}"
                first, second = DIM_WORDS.get(names[a] or ""), DIM_WORDS.get(names[b] or "")
                if first and second:
                    hint += f", {first} before {second}"
                if b != len(names) - 1:  # a view moving the last dim would leave it strided, which is refused
                    hint += f"; pass {source}.transpose({a}, {b}) (a view: strides are honoured)"
                return hint
        return ""

    def count_message(self, name: str, dim: str, got: int, items: str, bound: Bound) -> str:
        """A sequence of ``got`` per-layer ``items`` where ``dim`` asks for another count."""
        want = bound.dims[dim]
        hint = self.swapped_source(dim, lambda exchanged: exchanged[dim] == got, bound)
        source = f": {dim}={want} comes from {bound.bound_by[dim]}{hint}" if hint else ""
        return f"{name}: expected {dim}={want} per-layer {items}, got {got}{source}"

    def symbolic_fix(self, d: Dim, size: int, dims: Mapping[str, int]) -> str:
        names = set(NAME.findall(d.text))
        filled = re.sub(NAME, lambda m: str(dims.get(m.group(0), m.group(0))), d.text)
        fix = f"the size must be {d.text} = {filled} = {eval(d.code, {}, dict(dims))}"
        for dim, _, arg in self._scalar_dims:
            if dim in names:
                per_unit = eval(d.code, {}, {**dims, dim: 1})
                if per_unit and size % per_unit == 0:
                    fix += f"; {size} would fit {arg}={size // per_unit}"
        return fix

    def ambiguous_layout(
        self,
        layout_of: str | None,
        label: str,
        fitting: Sequence[ArraySpec],
        value: torch.Tensor,
        dims: Mapping[str, int],
    ) -> str:
        """A paged pool that reads as several layouts (its head count equals its page size)."""
        readings = " or ".join(f"{layout_of}={s.layout!r} {self.brackets(s)}" for s in fitting)
        return (
            f"{layout_of}: expected {or_list([repr(s.layout) for s in fitting])} for {label} of shape "
            f"{tuple(value.shape)}, got None: with H={dims['H']} heads and pages of {dims['H']} slots it reads as "
            f"{readings}; pass the layout the cache was allocated with"
        )

    def other_layout(
        self,
        layout_of: str | None,
        label: str,
        spec: ArraySpec,
        other: ArraySpec,
        layout: str | None,
        value: torch.Tensor,
        dims: Mapping[str, int],
    ) -> str:
        """A pool that fits another layout than the one asked for."""
        # "an NHD", "an HND", "an fp8_ds_mla" pool (letters read by name), but "a plain" one.
        article = "a" if other.layout == "plain" else "an"
        return (
            f"{label}: expected shape {self.expected(spec, dims)} for {layout_of}={layout!r}, got "
            f"{tuple(value.shape)}: that is {article} {other.layout} pool {self.brackets(other)}: pass "
            f"{layout_of}={other.layout!r}"
        )

    def combined_fix(self, name: str, label: str, half_dim: int | None) -> str:
        """For a combined K/V cache passed whole: pass its halves, as views (K/V pools only: an MLA pool has none)."""
        if half_dim is None or name[:2] not in ("k_", "v_"):
            return ""
        k_name, v_name = ("k" + name[1:], "v" + name[1:]) if name[0] in "kv" else (name, name)
        index = "".join(":, " for _ in range(half_dim))
        if label == name:
            halves = f"{k_name}=cache[{index}0] and {v_name}=cache[{index}1]"
        else:
            halves = f"{k_name}=[c[{index}0] for c in caches] and {v_name}=[c[{index}1] for c in caches]"
        return f": a combined K/V cache (K and V along dim {half_dim})? pass its halves, {halves} (views: written in place)"

    def kind_message(self, name: str, label: str, value: torch.Tensor) -> str:
        """A tensor that is not strided (sparse, MKL-DNN, nested): what it is, and the strided tensor to pass."""
        nested = value.is_nested
        kind = "a nested tensor" if nested else _KINDS.get(value.layout, f"a tensor of layout {value.layout}")
        # A nested tensor's pieces, joined along their first dim; any other kind, its dense copy.
        conversion = f"torch.cat({label}.unbind())" if nested else f"{label}.to_dense()"
        if name in self._outputs:
            # Converting a written tensor would write into a copy the caller never sees.
            fix = f"allocate it as a strided tensor ({conversion} would write into a copy)"
        elif nested:
            fix = f"join its pieces into one tensor, {conversion}"
        else:
            fix = f"pass {conversion}"
        return f"{label}: expected a strided tensor, got {kind}: {fix}"

    @staticmethod
    def brackets(spec: ArraySpec) -> str:
        return "[" + ", ".join(d.text for d in spec.dims) + "]"

    def like_message(
        self,
        name: str,
        label: str,
        spec: ArraySpec,
        value: torch.Tensor,
        want: torch.dtype,
        other: str,
        bound: Bound,
    ) -> str:
        msg = (
            f"{label}: expected dtype {fmt_dtype(want)} on {bound.device} ({other}'s dtype and device), "
            f"got dtype {fmt_dtype(value.dtype)} on {value.device}"
        )
        if name in self._outputs:
            msg += f": allocate it as {self.alloc(spec, bound)}, or pass {name}=None"
        else:
            # An input is converted once, where it is made: a copy per call would cost a kernel.
            target = ", ".join(
                ([f"{other}.device"] if value.device != bound.device else [])
                + ([f"{other}.dtype"] if value.dtype != want else [])
            )
            msg += f": convert it where it is made, {label}.to({target})"
        return msg


# The layouts other than torch.strided, as a message names them (nested tensors are told by is_nested).
_KINDS = {
    torch.sparse_coo: "a sparse COO tensor",
    torch.sparse_csr: "a sparse CSR tensor",
    torch.sparse_csc: "a sparse CSC tensor",
    torch.sparse_bsr: "a sparse BSR tensor",
    torch.sparse_bsc: "a sparse BSC tensor",
    torch._mkldnn: "an MKL-DNN tensor",  # type: ignore[attr-defined]
}


def fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def or_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def type_name(value: object) -> str:
    kind = type(value)
    # numpy.int64, not "int64", which would read like a dtype.
    return (
        kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"
    )


# Fixes for a None where an argument has no None: why a user might hold one, and what to pass.
NONE_FIXES = {
    "eps": "torch.nn.RMSNorm built without eps keeps None and uses torch.finfo(x.dtype).eps: pass that number "
    "(torch.finfo(kv.dtype).eps), or the model's configured epsilon (Hugging Face RMSNorm modules keep it "
    "as .variance_epsilon)",
}


def scalar_fix(p: Param, value: object) -> str:
    """How to pass a number: for a numpy (or other array-library) scalar, a float count, or a None."""
    if value is None and p.name in NONE_FIXES:
        return f": {NONE_FIXES[p.name]}"
    if isinstance(value, float) and int in p.scalars and float not in p.scalars:
        return ": a count is an int (// divides to an int, / to a float)"
    if isinstance(value, torch.Tensor) or not hasattr(value, "item") or not p.scalars:
        return ""
    kind = "float" if float in p.scalars else "int"
    return f": pass {kind}({p.name})"


def swapped(want: Sequence[int | None], got: Sequence[int]) -> tuple[int, int] | None:
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
