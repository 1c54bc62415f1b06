r"""The fused projection path, checked: a materializer's call checked as the op checks it, then one launch.

`KVMaterializer` can compute ``hidden @ W^T`` and the K/V epilogue in one
kernel (`typedkv.projection.kernel`), with no ``kv`` in memory. Its calls are checked
by the very checks of `typedkv.materialize_kv` / `typedkv.materialize_kv_into_pool`
(`typedkv.kv.impl.dense_plan` / `pool_plan`: their `Signature`, relations,
aliasing and debug checks), run on the call with a stand-in for ``kv``: a
``[T, L, 2*H*D]`` view of ``hidden``'s dtype and device whose token and layer
strides are 0 (nothing reads it). A misuse is therefore rejected with the op's
own message, before anything is written, on either path.

Under ``torch.compile`` the fused path is one torch op per call: ``FUSED`` and
``FUSED_POOL`` are `typedkv._impl`'s ``DENSE`` and ``POOL`` with the projection's
arguments in place of ``kv`` (`fused`); `typedkv.projection.materializer` declares them with
`declaration` (the public function's annotations, read, not restated). The
fake runs the checks above on fake tensors, the real implementation is the
eager path.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from typedkv.core import launcher
from typedkv.core.checking import Bound
from typedkv.core.device_tables import layer_eps
from typedkv.core.implementation import Implementation, Plan
from typedkv.core.launch_args import ScaleOut
from typedkv.core.signature import Signature
from typedkv.kv import launch as kv_launch
from typedkv.kv.impl import (
    DENSE,
    POOL,
    DenseCall,
    Destinations,
    PoolCall,
    dense_plan,
    kv_geometry,
    pool_destinations,
    pool_plan,
    scale_destinations,
)
from typedkv.kv.launch import KVGeometry
from typedkv.projection import launch as fused_launch
from typedkv.projection import warp_specialized

if TYPE_CHECKING:
    # As in `typedkv.kv.api`: jaxtyping's own names, for pyrefly.
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, StorageFloat


def _projection(
    kv_weight: StorageFloat[Tensor, "rows hidden"],
    hidden: StorageFloat[Tensor, "T hidden"],
    positions: Index[Tensor, " T"],
    cache_loc: Index[Tensor, " T"] | None,
) -> None:
    """A materializer call's own arguments against its weights (the op then checks the rest, T bound by hidden)."""


PROJECTION = Signature(_projection, scalar_dims={}, device_of="kv_weight", same_dtype={"hidden": "kv_weight"})
"""`KVMaterializer`'s check of a call's own arguments, on either path."""

_LAUNCHES_MAX = 4096


def stand_in(memory: Tensor, num_tokens: int, num_layers: int, width: int) -> Tensor:
    """``[T, L, width]`` of ``memory``'s dtype and device, strides ``(0, 0, 1)``: kv's place in the op's checks.

    A view of ``memory``'s first ``width`` elements (never read): no allocation.
    """
    return memory.as_strided((num_tokens, num_layers, width), (0, 0, 1))


class Launches(dict[tuple[int, bool], launcher.KernelLaunch]):
    """One layout's fused launches, by the per-layer pools' table multiple (`typedkv.kv.impl.pool_destinations`; 0:
    none) and whether the weight starts on 16 bytes (`typedkv.projection.launch.weight_aligned`: its tiles may then load by
    TMA); and whether the layout's calls take the warp-specialised kernel (`typedkv.projection.warp_specialized`).

    ``warp_specialised`` is decided at the layout's first call (None until then): the measured table,
    the device and every condition of `typedkv.projection.warp_specialized.takes` follow from the layout, so a later
    call only checks its addresses (`typedkv.projection.warp_specialized.aligned`).
    """

    warp_specialised: bool | None = None


# Fused launches by checked layout (the op's plan) and what the plan does not
# fix: hidden's width and strides, the weight's strides, whether there is a bias.
# A plan is kept with its launches, so its id is not reused while the entry lives.
_LAUNCHES: dict[tuple[object, ...], tuple[Plan, Launches]] = {}


def _launches_of(
    plan: Plan, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, kept: Launches | None
) -> Launches:
    """The launches of a call's layout: ``kept``, the caller's own for it (a materializer keeps one per layout
    it checked, keyed by everything below), else the ones kept here."""
    if kept is not None:
        return kept
    key = (id(plan), hidden.shape[1], hidden.stride(), kv_weight.stride(), kv_bias is None)
    entry = _LAUNCHES.get(key)
    if entry is None:
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        entry = _LAUNCHES[key] = (plan, Launches())
    return entry[1]


def project_kv(
    call: DenseCall | PoolCall,
    hidden: Tensor,
    kv_weight: Tensor,
    kv_bias: Tensor | None,
    plan: Plan | None = None,
    launches: Launches | None = None,
) -> tuple[Tensor, Tensor] | None:
    """`KVMaterializer.forward` (``call`` a `DenseCall`, as `typedkv.materialize_kv` takes it) or `into_pool` (a
    `PoolCall`, as `typedkv.materialize_kv_into_pool` takes it) fused, its kv the stand-in.

    ``plan``: the call's `typedkv.kv.impl.dense_layout` or `pool_layout`, and ``launches`` its launches, when the
    materializer kept them. Returns the outputs of a dense call, None for a pool call.
    """
    projection = (hidden, kv_weight, kv_bias)
    if isinstance(call, PoolCall):
        plan, pools, addresses = pool_plan(call, plan)
        if pools is not None:
            destinations = pool_destinations(call, addresses)
            _project(
                call, projection, plan, launches, call.cache_loc, *destinations, scale_destinations(call, addresses)
            )
        return None
    plan, k_out, v_out = dense_plan(call, plan)
    if not plan.empty:
        _project(call, projection, plan, launches, None, (k_out, v_out, None), 0)
    return k_out, v_out


project_kv_into_pool = project_kv
"""The pool op's fused path: `project_kv`, which a `PoolCall` takes into the pools."""


def _project(
    call: DenseCall | PoolCall,
    projection: tuple[Tensor, Tensor, Tensor | None],
    plan: Plan,
    launches: Launches | None,
    slots: Tensor | None,
    destinations: Destinations,
    table_multiple: int,
    scale_out: ScaleOut | None = None,
) -> None:
    """A checked call's fused launch: the warp-specialised kernel's where it takes the layout, else the Triton one's.

    ``slots``: the pool slots (None: dense outputs); ``destinations`` and ``table_multiple`` as
    `typedkv.kv.impl.pool_destinations` gives them (dense outputs and 0 for dense calls), ``scale_out`` as
    `typedkv.kv.impl.scale_destinations` (scales written per row; never with the warp-specialised kernel, whose
    pools hold ``hidden``'s dtype).
    """
    hidden, kv_weight, kv_bias = projection
    inputs = (call.k_norm_weight, layer_eps(call.eps, hidden), call.cos_sin_cache, call.positions)
    scales = call.scales if isinstance(call, PoolCall) else (None, None)
    values = fused_launch.call_values(
        hidden, kv_weight, kv_bias, inputs, slots, destinations, scales,
        v_norm_weight=call.v_norm_weight, scale_out=scale_out,
    )  # fmt: skip
    launches = _launches_of(plan, hidden, kv_weight, kv_bias, launches)
    num_layers = plan.bound.dims["L"]
    if launches.warp_specialised is None:
        geometry = kv_geometry(call, plan, destinations)
        launches.warp_specialised = (
            _warp_specialised_launchable(call, projection, geometry)
            and warp_specialized.faster(hidden.device, hidden.shape[0])
            # Offsets past int32: the pointer kernel's WIDE variant takes the call.
            and not fused_launch.projection_wide(values, geometry, num_layers)
        )
    outputs = destinations[:2] if slots is None else ()  # TMA stores into dense outputs: their addresses too
    if launches.warp_specialised and warp_specialized.aligned(hidden, kv_weight, *outputs):
        target = (slots, destinations, kv_geometry(call, plan, destinations, table_multiple))
        warp_specialized.launch(hidden, kv_weight, inputs, target, num_layers)
        return
    aligned = fused_launch.weight_aligned(kv_weight)
    launch = launches.get((table_multiple, aligned))
    if launch is None:
        geometry = kv_geometry(call, plan, destinations, table_multiple)
        launch = launches[table_multiple, aligned] = fused_launch.projection_launch(
            values, geometry, num_layers=num_layers, weight_aligned=aligned
        )
    launch(values)


def _warp_specialised_launchable(
    call: DenseCall | PoolCall, projection: tuple[Tensor, Tensor, Tensor | None], geometry: KVGeometry
) -> bool:
    """Whether the warp-specialised kernel can compute ``call``'s layout (`typedkv.projection.warp_specialized`)."""
    hidden, kv_weight, kv_bias = projection
    heads, head_dim, neox = geometry.num_kv_heads, geometry.head_dim, geometry.neox
    if isinstance(call, PoolCall):
        return warp_specialized.launchable_pool(
            hidden, kv_weight, kv_bias, call.cos_sin_cache, call.k_pool, call.scales, num_kv_heads=heads,
            head_dim=head_dim, neox=neox, v_norm_weight=call.v_norm_weight,
        )  # fmt: skip
    return warp_specialized.launchable(
        hidden, kv_weight, kv_bias, call.cos_sin_cache, call.k_out, call.v_out, num_kv_heads=heads, head_dim=head_dim,
        neox=neox, v_norm_weight=call.v_norm_weight,
    )  # fmt: skip


def project_kv_split(
    call: DenseCall, project: Callable[[Tensor], Tensor], plan: Plan, launches: Launches
) -> tuple[Tensor, Tensor]:
    """`KVMaterializer.forward` with V written by the GEMM: ``call`` as `typedkv.materialize_kv` takes it, kv the stand-in.

    Once the call is checked and its outputs exist, ``project(v_rows)`` (the
    materializer's two batched GEMMs, `typedkv.projection.layers.split_gemm`) writes V's rows
    straight into ``v_out`` (contiguous: the materializer takes this path only then),
    seen as ``v_rows`` ``[L, T, H*D]``, and returns K's rows ``[L, T, H*D]``; then the
    K/V kernel handles K alone (`typedkv.kv.launch.launch_params`' ``k_only``). K and V
    are what GEMM + kernel computes, the GEMM's accumulation order aside.
    ``plan``: the call's `typedkv.kv.impl.dense_layout`, ``launches`` its launches, both
    kept by the materializer.
    """
    plan, k_out, v_out = dense_plan(call, plan)
    if plan.empty:
        return k_out, v_out
    dims = plan.bound.dims
    # The kernel reads K's rows as kv [T, L, H*D].
    k_input = project(v_out.view(dims["L"], dims["T"], dims["H"] * dims["D"])).permute(1, 0, 2)
    inputs = (call.k_norm_weight, layer_eps(call.eps, k_input), call.cos_sin_cache, call.positions)
    values = kv_launch.call_values(k_input, inputs, None, (k_out, v_out, None))
    launch = launches.get((0, True))
    if launch is None:
        geometry = kv_geometry(call, plan, (k_out, v_out, None))
        launch = launches[0, True] = kv_launch.Launch(values, geometry, k_only=True)
    launch(values, True)  # right after the GEMMs: a plain launch (`typedkv.core.launcher.KernelLaunch`)
    return k_out, v_out


# ------------------------------------------------------------- torch ops


def _projection_op(
    hidden: StorageFloat[Tensor, "T hidden"],
    kv_weight: StorageFloat[Tensor, "rows hidden"],
    kv_bias: StorageFloat[Tensor, " rows"] | None,
    num_layers: int,
) -> None:
    """A fused op's first parameters: the materializer's projection, in kv's place (`declaration`)."""


class Projection(NamedTuple):
    """A fused op call's projection: `_projection_op`'s parameters, in order."""

    hidden: Tensor
    kv_weight: Tensor  # [L*2*H*D, hidden]: every layer's rows, layer-major
    kv_bias: Tensor | None
    num_layers: int


class FusedCall(NamedTuple):
    """A fused op call: its projection, and the call as the op without projection takes it, kv the stand-in."""

    projection: Projection
    op: DenseCall | PoolCall


def declaration(op: Callable[..., Any]) -> Callable[..., None]:
    """The fused op's declaration, derived from ``op`` (a public function): `_projection_op`'s parameters, then ``op``'s after its ``kv``.

    Nothing calls it: `typedkv.core.torch_ops` reads its parameters and
    annotations, as from any declaration, into the op's schema (printed by
    ``tests/test_fused_compile.py``), so the fused ops restate no annotation of
    the public function they fuse a projection into.
    """
    head = list(inspect.signature(_projection_op).parameters.values())
    tail = list(inspect.signature(op).parameters.values())[1:]
    hints = {
        **typing.get_type_hints(_projection_op, include_extras=True),
        **typing.get_type_hints(op, include_extras=True),
    }

    def declared(*args: Any) -> None:
        raise TypeError("a declaration, not a function")

    declared.__name__ = declared.__qualname__ = f"project_{op.__name__}"
    declared.__signature__ = inspect.Signature(head + tail)  # type: ignore[attr-defined]
    declared.__annotations__ = {p.name: hints[p.name] for p in head + tail}
    return declared


def _stand_in_of(projection: Projection) -> Tensor:
    hidden, kv_weight, _, num_layers = projection
    return stand_in(kv_weight, hidden.shape[0], num_layers, kv_weight.shape[0] // num_layers)


def _accepted(bound: Bound, args: object) -> bool:
    return True


def _projection_args(call: FusedCall) -> tuple[Any, ...]:
    """`PROJECTION`'s arguments for a fused call (cache_loc None for the dense op)."""
    op = call.op
    cache_loc = op.cache_loc if isinstance(op, PoolCall) else None
    return (call.projection.kv_weight, call.projection.hidden, op.positions, cache_loc)


def fused(op: Implementation, project: Callable[..., Any]) -> Implementation:
    """``op`` (`DENSE` or `POOL`) with the projection fused in, as one op: checked as ``op``, launched by ``project``.

    The op's arguments are `_projection_op`'s, then ``op``'s after its kv (`declaration`).
    CPU tensors take the GEMM, then ``op`` itself (there is no fused kernel to run).
    """

    def bundle(hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, num_layers: int, *args: Any) -> FusedCall:
        projection = Projection(hidden, kv_weight, kv_bias, num_layers)
        return FusedCall(projection, op.call(_stand_in_of(projection), *args))

    def check(call: FusedCall) -> Bound:
        """The production check of a fused call: the materializer's, then the op's."""
        PROJECTION.check(_projection_args(call))
        return op.check(call.op)

    def run(call: FusedCall) -> None:
        """A fused call, checked and launched (CPU tensors: GEMM, then the op)."""
        PROJECTION.plan(_projection_args(call), _accepted)
        hidden, kv_weight, kv_bias, num_layers = call.projection
        if not launcher.use_kernel(hidden.device):
            with torch.no_grad():
                kv = F.linear(hidden, kv_weight, kv_bias).view(hidden.shape[0], num_layers, -1)
            op.run(op.call(kv, *call.op[1:]))
            return
        project(call.op, hidden, kv_weight, kv_bias)

    return Implementation(bundle, check, run)


FUSED = fused(DENSE, project_kv)
FUSED_POOL = fused(POOL, project_kv_into_pool)
