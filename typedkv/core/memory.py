"""Where a call's tensors lie in memory: what it writes apart from what it reads, and from each other.

A kernel program that writes an element another program still reads, or two
programs that write one element, race: the result depends on their order, with
no error. So a call is rejected, before anything is written, when

- a tensor it writes (outputs, pools) shares memory with a tensor it reads
  (``kv``, the norm weights, the cos/sin cache, ``positions``, ``cache_loc``,
  tensor ``eps`` and scales); the memory a tensor spans is compared, from its
  first to its last element;
- two tensors it writes share an element. Spans are not enough there: K and V
  as the two halves of one combined cache (``[N, 2, B, H, D]``, ``k = c[:, 0]``)
  interleave without sharing an element, and are accepted; so are scales kept
  inline in a pool's rows (a float32 view of the bytes after each row's values).

Addresses change from call to call, so this runs on every call. What depends on
the layout alone (each tensor's span around its first element) is worked out
once per layout (`Footprint`, kept with the plan); what a call then pays is a
``data_ptr()`` per tensor and a few comparisons, no device sync.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from typedkv.core.errors import InputError

# Index combinations `shares_element` tries before it answers "shared" (never reached in practice).
_SEARCH_MOST = 4096


def span(tensor: Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` around ``tensor.data_ptr()`` that its elements occupy; ``(0, 0)`` when empty."""
    if tensor.numel() == 0:
        return 0, 0
    lo = hi = 0
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    item = tensor.element_size()
    return lo * item, (hi + 1) * item


def shares_element(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element at one address (one byte in common, for elements of
    different sizes or not aligned alike).

    Exact for two tensors of one shape, strides and element size (what K and V of a pool are): their
    first elements ``delta`` apart share an element unless no index difference reaches ``delta``.
    Other pairs (a pool and the scales kept inline in its rows), byte by byte: whether some byte of
    an element of ``a`` is one of ``b``'s (`_bytes_meet`).
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    a_lo, a_hi = span(a)
    b_lo, b_hi = span(b)
    pa, pb = a.data_ptr(), b.data_ptr()
    if pa + a_hi <= pb + b_lo or pb + b_hi <= pa + a_lo:
        return False
    item = a.element_size()
    delta = pb - pa
    if a.shape != b.shape or a.stride() != b.stride() or b.element_size() != item or delta % item:
        return _bytes_meet(a, b, delta)
    # Dims that add elements, largest stride first: delta in elements must be sum(j * stride)
    # with |j| < size in each, for some element of a and some of b to coincide.
    dims = sorted(((st, n - 1) for n, st in zip(a.shape, a.stride(), strict=True) if n > 1 and st), reverse=True)
    tried = [0]
    return _reaches(abs(delta) // item, dims, tried)


def _bytes_meet(a: Tensor, b: Tensor, delta: int) -> bool:
    """Whether a byte of ``a``'s elements is one of ``b``'s, ``b`` starting ``delta`` bytes after ``a``.

    A byte of ``a`` is ``sum(i * stride * size) + byte`` from ``a``'s start, ``0 <= byte < size``; they meet
    where ``sum(i * a's) - sum(j * b's) = delta``. Each dim is a term ``stride * x``, ``x`` in a range of
    integers (``b``'s negated); terms of one stride merge into one (their ranges add up).
    """
    ranges: dict[int, tuple[int, int]] = {}
    for tensor, sign in ((a, 1), (b, -1)):
        size = tensor.element_size()
        dims = [(st * size, n - 1) for n, st in zip(tensor.shape, tensor.stride(), strict=True)] + [(1, size - 1)]
        for stride, most in dims:
            if stride < 0:
                stride, sign_here = -stride, -sign
            else:
                sign_here = sign
            if stride == 0 or most == 0:
                continue
            lo, hi = (0, most) if sign_here > 0 else (-most, 0)
            have = ranges.get(stride, (0, 0))
            ranges[stride] = (have[0] + lo, have[1] + hi)
    terms = sorted(((stride, lo, hi) for stride, (lo, hi) in ranges.items()), reverse=True)
    return _sums_to(delta, terms, [0])


def _sums_to(delta: int, terms: list[tuple[int, int, int]], tried: list[int]) -> bool:
    """Whether ``delta == sum(x * stride)`` for some ``lo <= x <= hi`` of each ``(stride, lo, hi)`` of ``terms``
    (largest stride first)."""
    tried[0] += 1
    if tried[0] > _SEARCH_MOST:
        return True  # too many ways to try: say shared, the safe answer
    if not terms:
        return delta == 0
    (stride, lo, hi), rest = terms[0], terms[1:]
    least = sum(s * low for s, low, _ in rest)  # how far the smaller terms reach, down and up
    most = sum(s * high for s, _, high in rest)
    first = max(lo, -((most - delta) // stride))  # ceil((delta - most) / stride)
    last = min(hi, (delta - least) // stride)
    return any(_sums_to(delta - x * stride, rest, tried) for x in range(first, last + 1))


def overlaps_itself(tensor: Tensor) -> bool:
    """Whether two of ``tensor``'s elements lie at one address (a stride of 0, or strides that fold one
    dim onto another, as ``as_strided`` can make).

    Two elements coincide when a nonzero index difference ``j`` has ``sum(j * stride) == 0``. Taking
    the dims largest stride first, the first nonzero ``j`` can be taken positive (else negate them all),
    and it must be made up by the dims after it: `_reaches`.
    """
    dims = sorted(((st, n - 1) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n > 1), reverse=True)
    if any(st == 0 for st, _ in dims):
        return True
    tried = [0]
    for k, (stride, most) in enumerate(dims):
        rest = dims[k + 1 :]
        reach = sum(m * s for s, m in rest)  # an ordinary layout's smaller dims never reach its stride
        if any(_reaches(j * stride, rest, tried) for j in range(1, min(most, reach // stride) + 1)):
            return True
    return False


def _reaches(delta: int, dims: list[tuple[int, int]], tried: list[int]) -> bool:
    tried[0] += 1
    if tried[0] > _SEARCH_MOST:
        return True  # too many ways to try: say shared, the safe answer
    if not dims:
        return delta == 0
    (stride, most), rest = dims[0], dims[1:]
    reach = sum(m * s for s, m in rest)  # how far the smaller dims take an index difference
    first = max(-most, -((reach - delta) // stride))  # ceil((delta - reach) / stride)
    last = min(most, (delta + reach) // stride)
    return any(_reaches(delta - j * stride, rest, tried) for j in range(first, last + 1))


class Footprint:
    """A layout's tensors, read and written, with each one's span: what `check` needs besides addresses.

    ``fields``: the call's field names, in order; ``written``: those it writes
    (a tensor, or a sequence of per-layer tensors of one layout); ``call``: a
    call of the layout (its tensors' shapes and strides, never their addresses).
    Tensors that are None, empty or numbers in this layout take no part.
    ``each_other``: whether written tensors are compared with each other too (False
    where the op's own `Footprint` does that).
    """

    __slots__ = ("_apart", "_each_other", "_layered", "_lists", "_no_memory", "_read_tensors", "reads", "writes")

    def __init__(
        self, fields: Sequence[str], written: frozenset[str], call: Sequence[Any], *, each_other: bool = True
    ) -> None:
        self.reads: list[tuple[int, str, int, int]] = []
        self.writes: list[tuple[int, str, int, int, bool]] = []
        self._lists: list[int] = []  # written sequences of per-layer tensors, empty ones too
        # Meta tensors (a dry run of shapes) have no memory: every storage's address is 0, so their
        # addresses would meet whatever the tensors. A layout is on one device, so one tensor tells.
        self._no_memory = False
        for i, (name, value) in enumerate(zip(fields, call, strict=True)):
            layers = isinstance(value, (list, tuple))
            if layers and name in written:
                self._lists.append(i)
            first = value[0] if layers and value else value
            if not isinstance(first, Tensor) or first.numel() == 0:
                continue
            self._no_memory = self._no_memory or first.is_meta
            lo, hi = span(first)
            if name in written:
                self.writes.append((i, name, lo, hi, layers))
            elif not layers:
                self.reads.append((i, name, lo, hi))
        # itemgetter of one index returns the item itself: a repeated index keeps results tuples.
        at = [i for i, _, _, _ in self.reads]
        self._read_tensors = operator.itemgetter(*at, *at[-1:]) if at else None
        self._layered = any(layers for *_, layers in self.writes)
        self._each_other = each_other
        # Sets of addresses (read tensors', then written ones') found apart.
        self._apart: set[tuple[int, ...]] = set()

    def check(self, call: Sequence[Any]) -> list[int] | None:
        """Raise `InputError` when a tensor ``call`` writes shares memory with one it reads (their spans
        meet) or an element with another it writes.

        Returns the per-layer written tensors' addresses, in field order (K's layers, then V's);
        None when every written tensor is a single one.
        """
        # Host time at decode sizes: a call reads each tensor's address, and compares them only when
        # that set of addresses was not found apart before (a decode loop's buffers come back).
        reads = [t.data_ptr() for t in self._read_tensors(call)[:-1]] if self._read_tensors is not None else []
        written: list[int] = []
        for i, _, _, _, layers in self.writes:
            value = call[i]
            if layers:
                written += [t.data_ptr() for t in value]
            else:
                written.append(value.data_ptr())
        key = (*reads, *written)
        if key not in self._apart and not self._no_memory:
            self._compare(call, reads, written)
            if len(self._apart) >= _APART_KEPT:
                self._apart.clear()
            self._apart.add(key)
        if self._layered:
            return written
        # Per-layer tensors with no element take no part, but their addresses are still the caller's to read.
        return [t.data_ptr() for i in self._lists for t in call[i]] if self._lists else None

    def _compare(self, call: Sequence[Any], reads: list[int], written: list[int]) -> None:
        """`check`'s comparisons, for addresses not found apart before: the first read tensor (in field
        order) whose span meets a written one's is named with it."""
        for address, (_, name, lo, hi) in zip(reads, self.reads, strict=True):
            start, end = address + lo, address + hi
            at = 0
            for i, field, w_lo, w_hi, layers in self.writes:
                count = len(call[i]) if layers else 1
                for layer, w in enumerate(written[at : at + count]):
                    if start < w + w_hi and w + w_lo < end:
                        label = f"{field}[{layer}]" if layers else field
                        raise InputError(
                            f"{label}: expected memory apart from {name}, got memory shared with it: the call "
                            f"would overwrite {name} while it still reads it; write into a tensor of its own"
                        )
                at += count
        if self._each_other and len(written) > 1:
            _apart_from_each_other(self._written(call))

    def _written(self, call: Sequence[Any]) -> list[tuple[str, Tensor, int]]:
        """Each written tensor with its label (``k_pool[3]`` for a layer) and address, in field order."""
        written = []
        for i, name, _, _, layers in self.writes:
            value = call[i]
            if layers:
                written += [(f"{name}[{layer}]", t, t.data_ptr()) for layer, t in enumerate(value)]
            else:
                written.append((name, value, value.data_ptr()))
        return written


_APART_KEPT = 16  # sets of addresses kept as found apart, per layout (a decode loop reuses a few)


def _apart_from_each_other(written: list[tuple[str, Tensor, int]]) -> None:
    """No two written tensors share an element. In the order their spans start, each is compared with those
    that start before its span ends."""
    ordered = sorted(written, key=lambda w: w[2] + span(w[1])[0])
    for j, (name, tensor, address) in enumerate(ordered):
        end = address + span(tensor)[1]
        for other_name, other, other_address in ordered[j + 1 :]:
            if other_address + span(other)[0] >= end:
                break
            if shares_element(tensor, other):
                first, second = sorted(((name, address), (other_name, other_address)), key=_field_order(written))
                alike = (tensor.shape, tensor.stride(), tensor.dtype) == (other.shape, other.stride(), other.dtype)
                _raise_shared(first[0], second[0], first[1] == second[1] and alike)


def _field_order(written: list[tuple[str, Tensor, int]]) -> Any:
    order = {name: k for k, (name, _, _) in enumerate(written)}
    return lambda item: order[item[0]]


def _raise_shared(first: str, second: str, same: bool) -> None:
    """``same``: the two are one tensor (a start, shape, strides and dtype in common); else views that overlap."""
    if not same:
        raise InputError(
            f"{second}: expected memory apart from {first}, got views that overlap: writes to one would land in "
            "the other"
        )
    if second == "v_out":
        raise InputError("v_out: expected a tensor apart from k_out, got one sharing its memory")
    if "[" not in second:
        raise InputError(f"{second}: expected memory apart from {first}, got the same tensor")
    raise InputError(f"{second}: expected memory of its own, got the same memory as {first}")
