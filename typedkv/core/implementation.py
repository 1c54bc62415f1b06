"""What every family's checked implementation shares: the plan of a checked layout, and the checks run per call.

A family's ``impl`` module checks a call (its `Implementation`), plans it once per layout (`planner`), and
runs the kernel or the reference; the pieces here are the same for the K/V and MLA families.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from typedkv.core import launcher
from typedkv.core.checking import Bound
from typedkv.core.config import debug_enabled
from typedkv.core.errors import InputError
from typedkv.core.launcher import KernelLaunch
from typedkv.core.memory import Footprint
from typedkv.core.messages import fmt_dtype
from typedkv.core.signature import Signature
from typedkv.core.tensor_types import is_fp8, is_quantized
from typedkv.core.value_checks import check_layer_values, check_not_capturing, check_positions, check_slots


@dataclass
class Plan:
    """What one checked layout needs at every call."""

    bound: Bound
    empty: bool  # T == 0 or L == 0: nothing to compute
    kernel: bool  # the Triton kernel (else the PyTorch reference)
    launch: KernelLaunch | None = None  # built at the first launch, when the outputs exist
    typechecked: bool = False  # debug mode's beartype + jaxtyping pass done for this layout
    geometry: PoolGeometry | None = None  # a pool op's page geometry, worked out at its first non-empty call
    footprint: Footprint | None = None  # where its tensors lie around their addresses, worked out at its first call


def planner(check_relations: Callable[[Any, Bound], None] | None = None) -> Callable[[Bound, Any], Plan]:
    """A `Signature.plan` build: ``check_relations(call, bound)`` (what shapes cannot say), then the `Plan`."""

    def build(bound: Bound, call: Any) -> Plan:
        if check_relations is not None:
            check_relations(call, bound)
        dims = bound.dims
        return Plan(bound, dims["T"] == 0 or dims["L"] == 0, launcher.use_kernel(bound.device))

    return build


def checked(
    op: Implementation,
    plan: Plan,
    call: Any,
    norm_weight: Tensor | None,
    scales: Mapping[str, object],
    written: bool = True,
    slots: Tensor | None = None,
) -> list[int] | None:
    """A call's checks once its layout's plan is found, on every call of every op, in this order.

    Its numbers (``op.numbers``); what it writes apart from what it reads and from each other (`check_memory`;
    ``written`` False where the call left every output to be allocated, apart from everything); in debug mode,
    the annotations' pass (once per layout) and the values (`check_values`). A pool call (``slots``, its
    `cache_loc`) that writes anything has its layout's `PoolGeometry` in ``plan.geometry`` (worked out at the
    layout's first such call), its slots checked against it in debug mode. Returns `check_memory`'s addresses.
    """
    op.numbers(call)
    addresses = check_memory(op.signature, plan, call) if written else None
    debug = debug_enabled()
    if debug:
        debug_pass(op.signature, plan, call)
        check_values(call.eps, norm_weight, scales, call.positions, call.cos_sin_cache)
    if slots is not None and not plan.empty:
        geometry = plan.geometry
        if geometry is None:
            geometry = plan.geometry = PoolGeometry.of(plan.bound)
        if debug:
            check_slots(slots, geometry.num_slots)
    return addresses


def check_memory(sig: Signature, plan: Plan, call: tuple[Any, ...]) -> list[int] | None:
    """What the call writes apart from what it reads and from each other (`typedkv.core.memory`), on every call.

    Returns the per-layer written tensors' addresses (K's layers, then V's), or None.
    """
    footprint = plan.footprint
    if footprint is None:
        footprint = plan.footprint = Footprint(cast(Any, call)._fields, sig.outputs, call)
    return footprint.check(call)


def check_values(
    eps: object, norm_weight: Tensor | None, scales: Mapping[str, object], positions: Tensor, cos_sin_cache: Tensor
) -> None:
    """Debug mode's value checks of every op (one device sync each): eps and scale tensors, positions.

    eps as `check_eps` takes it: not checked without a norm weight. A call on the meta device (a dry run of
    shapes; a layout is on one device) has no values to check."""
    if positions.is_meta:
        return
    check_not_capturing(positions)
    if isinstance(eps, Tensor) and norm_weight is not None:
        check_layer_values("eps", eps, zero_ok=True)
    for name, scale in scales.items():
        if isinstance(scale, Tensor):
            check_layer_values(name, scale, zero_ok=False)
    check_positions(positions, cos_sin_cache.shape[-2])  # [P, R], or a table per layer [L, P, R]


def debug_pass(sig: Signature, plan: Plan, args: tuple[Any, ...]) -> None:
    # The annotations' verdict depends on the layout only: one full beartype +
    # jaxtyping pass per layout; the value checks run on every call.
    if not plan.typechecked:
        sig.debug_check(args, plan.bound)
        plan.typechecked = True


@dataclass(frozen=True)
class PoolGeometry:
    """Where slot ``s`` of a pool is: page ``s // page_size``, offset ``s % page_size`` within it."""

    page_size: int  # B; 1 for a pool without page dims (a page per slot)
    num_slots: int  # S, or N * B

    @staticmethod
    def of(bound: Bound) -> PoolGeometry:
        dims = bound.dims
        if "B" in dims:
            return PoolGeometry(dims["B"], dims["N"] * dims["B"])
        return PoolGeometry(1, dims["S"])

    def strides(self, bound: Bound, name: str, tensor: Tensor) -> tuple[int, int, int, int]:
        """``(layer, page, slot within page, head)`` element strides; layer 0 for per-layer tensors (a table)."""
        by_dim = bound.strides(name, tensor)
        page = by_dim["N"] if "N" in by_dim else by_dim["S"]
        return by_dim.get("L", 0), page, by_dim.get("B", 0), by_dim["H"]


def check_pools(
    pools: Mapping[str, Tensor | Sequence[Tensor]],
    sharing: str,
    scales: Mapping[str, float | Tensor | None],
    written: Mapping[str, Tensor | Sequence[Tensor] | None] = {},
) -> None:
    """The pools' tensors (each a stacked tensor, or a sequence of per-layer tensors; at least one) of one dtype,
    the first's, a sequence's tensors of one layout, its first's, and FP8 ``scales`` only for an FP8 dtype, scale
    tensors ``written`` per row only for an FP8 or int8 one (`check_scales`; a sequence of them of one layout too).
    ``sharing``: who shares the dtype, as the message says it."""
    dtype, first = None, ""
    for name, pool in pools.items():
        stacked = isinstance(pool, Tensor)
        layers = [pool] if isinstance(pool, Tensor) else pool
        for i, layer in enumerate(layers):
            label = name if stacked else f"{name}[{i}]"
            if dtype is None:
                dtype, first = layer.dtype, label
            elif layer.dtype != dtype:
                raise InputError(
                    f"{label}: expected dtype {fmt_dtype(dtype)} ({first}'s), got {fmt_dtype(layer.dtype)}: "
                    f"every {sharing} shares one dtype"
                )
            if not stacked:
                _first_layout(name, layers, i)
    assert dtype is not None, "no pool tensor"
    check_scales(dtype, scales, written)
    for name, tensors in written.items():
        if isinstance(tensors, (list, tuple)):
            for i in range(len(tensors)):
                _first_layout(name, tensors, i)


def _first_layout(name: str, layers: Sequence[Tensor], i: int) -> None:
    """Layer ``i`` of a sequence of per-layer tensors with the strides of its first."""
    if layers[i].stride() != layers[0].stride():
        raise InputError(
            f"{name}[{i}]: expected strides {tuple(layers[0].stride())} ({name}[0]'s), got "
            f"{tuple(layers[i].stride())}: per-layer pools must share one layout"
        )


def check_scales(
    dtype: torch.dtype,
    scales: Mapping[str, float | Tensor | None],
    written: Mapping[str, Tensor | Sequence[Tensor] | None] = {},
) -> None:
    """Given scales only for an FP8 pool (``dtype``): a scale beside a 16/32-bit pool would be silently unused.
    Scales ``written`` per row (K's and V's together) only for an FP8 or int8 pool, in place of given ones; an int8
    pool only with them (its values mean nothing without a scale)."""
    given = [name for name, tensors in written.items() if tensors is not None]
    if given:
        _check_written(dtype, scales, written, given[0])
        return
    if dtype == torch.int8:
        k_name, v_name = written
        raise InputError(
            f"{k_name}: expected a tensor to write K's scales into for an int8 pool, got None: an int8 pool holds "
            f"row / scale, with a scale per (token, layer, head) that the call computes: pass {k_name} and "
            f"{v_name}, float32, shaped like the pools without their last dim"
        )
    if is_fp8(dtype):
        return
    for name, scale in scales.items():
        if scale is not None:
            raise InputError(
                f"{name}: expected None for a {fmt_dtype(dtype)} pool (scales are for FP8 pools), got {_describe(scale)}"
            )


def _check_written(
    dtype: torch.dtype,
    scales: Mapping[str, float | Tensor | None],
    written: Mapping[str, Tensor | Sequence[Tensor] | None],
    first: str,
) -> None:
    """Scales written per row (``first`` the first of ``written`` given): for a pool that stores scaled values, K's
    and V's together, and no scale given beside them."""
    if not is_quantized(dtype):
        raise InputError(
            f"{first}: expected None for a {fmt_dtype(dtype)} pool (scales are written for FP8 and int8 pools), got "
            f"{_describe(written[first])}"
        )
    for name, tensors in written.items():
        if tensors is None:
            raise InputError(
                f"{name}: expected a tensor beside {first}, got None: K's and V's scales are written together "
                "(pass both, or neither)"
            )
    for name, scale in scales.items():
        if scale is not None:
            raise InputError(
                f"{name}: expected None beside {first}, got {_describe(scale)}: the call computes each row's scale "
                f"and writes it into {first}; pass scales to apply or tensors to write them into, not both"
            )


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return f"a sequence of {len(value)} tensors"
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


@dataclass
class Implementation:
    """One public function's checked implementation: its call type, its production check, the whole op.

    Its `Signature` is read from the public function's annotations and declared
    here by the public face (`declare`), which imports this module, not the reverse.
    """

    # Builds a call from the op's arguments, in order: the call's NamedTuple type, or `typedkv.projection.fused.fused`'s.
    call: Callable[..., Any]
    check: Callable[[Any], Bound]
    run: Callable[[Any], Any]
    # Every call's check of the numbers it was given (eps, FP8 scales): run by the op on the call, and on the
    # call a torch.compile trace makes, before a per-layer eps list becomes a tensor whose values only debug
    # mode reads.
    numbers: Callable[[Any], None] = lambda call: None

    def declare(self, fn: Callable[..., Any], **relations: Any) -> Signature:
        """Read ``fn``'s annotations into the `Signature` its calls are checked with (``relations`` as there)."""
        self.signature = Signature(fn, **relations)
        return self.signature
