"""The checked implementation of the ops: check a call, then launch the kernel or run the reference.

A call arrives as one typed bundle (`DenseCall`, `PoolCall`: the public
function's arguments, by name), from the public face (`typedkv.kv.api`) when
eager, or from the torch ops (`typedkv.core.torch_ops`) when a compiled graph runs;
the torch ops' fake implementations run the production check alone
(`check_dense`, `check_pool`). Imports point one way -- public face, torch ops,
this module, checking, launch, kernel -- so the public face declares each
function's `Signature` here (`DENSE.declare`) instead of this module importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

from torch import Tensor

from typedkv.core import reference as core_reference
from typedkv.core.checking import Bound
from typedkv.core.device_tables import layer_eps, layer_table
from typedkv.core.errors import InputError
from typedkv.core.implementation import Implementation, Plan, PoolGeometry, check_pools, checked, planner
from typedkv.core.launch_args import ScaleOut
from typedkv.core.value_checks import check_eps, check_scale_numbers
from typedkv.kv import launch as kv_launch
from typedkv.kv import reference as kv_reference
from typedkv.kv.launch import KVGeometry

ROTARY_RULE = (
    "R % 2 == 0 and 2 <= R <= D",
    "cos_sin_cache",
    "the rotary dim R must be even and 2 <= R <= D",
    # Hugging Face keeps cos and sin as two [P, D] tables with duplicated halves: side by side they are 2*D wide.
    (
        "R == 2 * D",
        "Hugging Face cos and sin tables side by side? build the cache with typedkv.cos_sin_cache_from_hf(cos, sin)",
    ),
)
"""``Signature`` rule shared by every function that takes a cos/sin cache."""


class DenseCall(NamedTuple):
    """A `typedkv.materialize_kv` call's arguments, in its signature's order."""

    kv: Tensor
    k_norm_weight: Tensor | None
    eps: float | Sequence[float] | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    num_kv_heads: int
    rope_style: str
    v_norm_weight: Tensor | None
    k_out: Tensor | None
    v_out: Tensor | None


class PoolCall(NamedTuple):
    """A `typedkv.materialize_kv_into_pool` call's arguments, in its signature's order."""

    kv: Tensor
    k_norm_weight: Tensor | None
    eps: float | Sequence[float] | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    cache_loc: Tensor
    k_pool: Tensor | Sequence[Tensor]
    v_pool: Tensor | Sequence[Tensor]
    num_kv_heads: int
    rope_style: str
    v_norm_weight: Tensor | None
    k_scale: float | Tensor | None
    v_scale: float | Tensor | None
    k_scale_out: Tensor | Sequence[Tensor] | None
    v_scale_out: Tensor | Sequence[Tensor] | None
    kv_layout: str | None

    @property
    def scales(self) -> tuple[float | Tensor | None, float | Tensor | None]:
        """K's and V's FP8 scales, in that order (as every kernel and the reference take them)."""
        return self.k_scale, self.v_scale

    @property
    def named_scales(self) -> dict[str, float | Tensor | None]:
        """The FP8 scales by argument name, for the checks' messages."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    @property
    def written_scales(self) -> dict[str, Tensor | Sequence[Tensor] | None]:
        """Where scales written per row go, K's then V's, by argument name (both None: none are written)."""
        return {"k_scale_out": self.k_scale_out, "v_scale_out": self.v_scale_out}


_DENSE_PLANNER = planner()


# --------------------------------------------------------------------- dense


def check_dense(call: DenseCall) -> Bound:
    """The production check of a `typedkv.materialize_kv` call."""
    return DENSE.signature.check(call)


def dense_layout(call: DenseCall) -> Plan:
    """The plan of a dense call's layout: checked by the production check at its first call, then looked up."""
    plan: Plan = DENSE.signature.plan(call, _DENSE_PLANNER)
    return plan


def dense_plan(call: DenseCall, plan: Plan | None = None) -> tuple[Plan, Tensor, Tensor]:
    """A dense call checked (its layout's plan; debug mode's checks too), and the outputs it left None allocated.

    Every dense path runs it first (`materialize_kv`, and the materializer's
    fused projection, `typedkv.projection.fused`), so all reject a misuse alike.
    ``plan``: the call's `dense_layout`, when the caller has it already (a
    materializer keeps its calls' plans).
    """
    if plan is None:
        plan = dense_layout(call)
    kv, k_out, v_out = call.kv, call.k_out, call.v_out
    # Outputs left None are allocated below: apart from everything.
    checked(DENSE, plan, call, norm_weight(call), {}, k_out is not None or v_out is not None)
    if k_out is None or v_out is None:
        dims = plan.bound.dims
        shape = (dims["L"], dims["T"], dims["H"], dims["D"])
        # kv's dtype and device (new_empty: no keyword parsing, host time at decode sizes).
        if k_out is None:
            k_out = kv.new_empty(shape)
        if v_out is None:
            v_out = kv.new_empty(shape)
    return plan, k_out, v_out


def kv_geometry(
    call: DenseCall | PoolCall, plan: Plan, destinations: Destinations, table_multiple: int = 0
) -> KVGeometry:
    """The `KVGeometry` of a checked call's layout, for its launch: dense ``[L, T, H, D]`` outputs are a pool of
    T rows, one token per row, no pages; pools are as `pool_plan`'s geometry says (``table_multiple``:
    `pool_destinations`')."""
    bound, dims = plan.bound, plan.bound.dims
    k_dst, v_dst = destinations[0], destinations[1]
    scale_strides = None
    if isinstance(call, PoolCall):
        pools = cast(PoolGeometry, plan.geometry)
        k_strides, v_strides = pools.strides(bound, "k_pool", k_dst), pools.strides(bound, "v_pool", v_dst)
        rows, page_size = pools.num_slots, pools.page_size
        (k_name, k_scales), (v_name, v_scales) = call.written_scales.items()
        if k_scales is not None and v_scales is not None:
            scale_strides = pools.strides(bound, k_name, _base(k_scales)), pools.strides(bound, v_name, _base(v_scales))
    else:
        k_strides, v_strides = ((out.stride(0), out.stride(1), 0, out.stride(2)) for out in (k_dst, v_dst))
        rows, page_size = dims["T"], 1
    neox = call.rope_style == "neox"
    return KVGeometry(dims["H"], dims["D"], neox, k_strides, v_strides, rows, page_size, table_multiple, scale_strides)


def materialize_kv(call: DenseCall, plan: Plan | None = None, after_gemm: bool = False) -> tuple[Tensor, Tensor]:
    """`typedkv.materialize_kv`, eagerly: checked, then launched (or run by the reference); ``plan`` as in `dense_plan`.

    ``after_gemm``: the call's kv was just written by the caller's own GEMM (`KernelLaunch`).
    """
    plan, k_out, v_out = dense_plan(call, plan)
    if plan.empty:
        return k_out, v_out
    kv = call.kv
    inputs = (call.k_norm_weight, layer_eps(call.eps, kv), call.cos_sin_cache, call.positions)
    if not plan.kernel:
        with core_reference.writing():
            k, v = kv_reference.rmsnorm_rope(
                kv, inputs, plan.bound.dims["H"], call.rope_style == "neox", call.v_norm_weight
            )
            k_out.copy_(k)
            v_out.copy_(v)
        return k_out, v_out
    destinations = (k_out, v_out, None)
    values = kv_launch.call_values(kv, inputs, None, destinations, v_norm_weight=call.v_norm_weight)
    if plan.launch is None:
        plan.launch = kv_launch.Launch(values, kv_geometry(call, plan, destinations))
    plan.launch(values, after_gemm)
    return k_out, v_out


# ---------------------------------------------------------------------- pool


def check_pool(call: PoolCall) -> Bound:
    """The production check of a `typedkv.materialize_kv_into_pool` call."""
    bound = POOL.signature.check(call)
    _pool_layout(call, bound)
    return bound


def pool_layout(call: PoolCall) -> Plan:
    """The plan of a pool call's layout: checked by the production check at its first call, then looked up."""
    plan: Plan = POOL.signature.plan(call, _POOL_PLANNER)
    return plan


def pool_plan(call: PoolCall, plan: Plan | None = None) -> tuple[Plan, PoolGeometry | None, list[int] | None]:
    """A pool call checked (its layout's plan; debug mode's checks too), its pools' geometry (None: nothing to do).

    Last, per-layer pools' addresses (K's, then V's; None for stacked pools), for `pool_destinations`.

    Every pool path runs it first (`materialize_kv_into_pool`, and the
    materializer's fused projection, `typedkv.projection.fused`), so all reject a misuse alike.
    ``plan``: the call's `pool_layout`, when the caller has it already.
    """
    if plan is None:
        plan = pool_layout(call)
    addresses = checked(POOL, plan, call, norm_weight(call), call.named_scales, slots=call.cache_loc)
    return plan, plan.geometry, addresses  # no geometry where nothing is written


Destinations = tuple[Tensor, Tensor, Tensor | None]
"""Where a call writes: ``(k_dst, v_dst, layer table)``, as `typedkv.kv.launch.call_values` takes them."""


def pool_destinations(call: PoolCall, addresses: list[int] | None) -> tuple[Destinations, int]:
    """A checked pool call's `Destinations` and table multiple: stacked pools as they are, or layer 0's tensors
    and the offsets of every layer from them.

    ``addresses``: `pool_plan`'s, read once per call. The table multiple (`KVGeometry.table_multiple`): 0
    without a table; else every offset is a multiple of that many elements -- 16 bytes' worth when every
    layer starts on 16 bytes (whole vectors stored), else 1.
    """
    k_pool, v_pool = call.k_pool, call.v_pool
    if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor):
        return (k_pool, v_pool, None), 0
    # Per-layer tensors (a mixed stacked/list pair was rejected by the plan):
    # layer 0's address plus an offset table for the others.
    k_list, v_list = cast(Sequence[Tensor], k_pool), cast(Sequence[Tensor], v_pool)
    table, table_multiple = layer_table(k_list, v_list, cast(list[int], addresses)[: 2 * len(k_list)])
    return (k_list[0], v_list[0], table), table_multiple


def scale_destinations(call: PoolCall, addresses: list[int] | None) -> ScaleOut | None:
    """Where a checked pool call writes each row's scale (`typedkv.core.launch_args.ScaleOut`), None where it writes
    none: stacked scale tensors as they are, or layer 0's and a table of every layer's offsets from them.

    ``addresses``: `pool_plan`'s (the pools' layers, then the scale tensors', K's before V's).
    """
    k_out, v_out = call.written_scales.values()
    if k_out is None or v_out is None:
        return None
    if isinstance(k_out, Tensor) and isinstance(v_out, Tensor):
        return k_out, v_out, None
    k_list, v_list = cast(Sequence[Tensor], k_out), cast(Sequence[Tensor], v_out)
    table, _ = layer_table(k_list, v_list, cast(list[int], addresses)[2 * len(k_list) :])
    return k_list[0], v_list[0], table


def materialize_kv_into_pool(call: PoolCall, plan: Plan | None = None, after_gemm: bool = False) -> None:
    """`typedkv.materialize_kv_into_pool`, eagerly: checked, then launched (or run by the reference); ``plan`` as in `pool_plan`.

    ``after_gemm``: the call's kv was just written by the caller's own GEMM (`KernelLaunch`).
    """
    plan, geometry, addresses = pool_plan(call, plan)
    if geometry is None:
        return
    kv = call.kv
    inputs = (call.k_norm_weight, layer_eps(call.eps, kv), call.cos_sin_cache, call.positions)
    if not plan.kernel:
        page, hnd = geometry.page_size, plan.bound.specs["k_pool"].layout == "HND"
        with core_reference.writing():
            rows = kv_reference.rmsnorm_rope(
                kv, inputs, plan.bound.dims["H"], call.rope_style == "neox", call.v_norm_weight
            )
            written = call.written_scales.values()
            pools = (call.k_pool, call.v_pool)
            for computed, scale, pool, scale_tensors in zip(rows, call.scales, pools, written, strict=True):
                layers = _layers(pool)
                if scale_tensors is None:
                    stored = core_reference.quantize(computed, scale, layers[0].dtype)
                else:
                    # Scales written per row quantize K as stored in kv's dtype (V is).
                    stored, row_scales = core_reference.quantize_rows(computed.to(kv.dtype), layers[0].dtype)
                    core_reference.write_pool(row_scales, call.cache_loc, _layers(scale_tensors), page, hnd)
                core_reference.write_pool(stored, call.cache_loc, layers, page, hnd)
        return
    destinations, table_multiple = pool_destinations(call, addresses)
    scale_out = scale_destinations(call, addresses)
    values = kv_launch.call_values(
        kv, inputs, call.cache_loc, destinations, call.scales, v_norm_weight=call.v_norm_weight, scale_out=scale_out
    )
    # The plan keeps the launch of layers on 16 bytes (or of stacked pools); a call whose per-layer
    # pools are not gets a launch of its own, uncached, which stores element by element.
    launch = plan.launch if table_multiple != 1 else None
    if launch is None:
        launch = kv_launch.Launch(values, kv_geometry(call, plan, destinations, table_multiple))
        if table_multiple != 1:
            plan.launch = launch
    launch(values, after_gemm)


def _pool_layout(call: PoolCall, bound: Bound) -> None:
    """The relations between pools, kv and scales that shapes cannot say."""
    k_pool, v_pool = call.k_pool, call.v_pool
    check_pool_kinds(k_pool, v_pool, *call.written_scales.values())
    if not isinstance(k_pool, Tensor) and not k_pool:
        return  # L == 0: nothing to write
    k_shape, v_shape = bound.shape_of("k_pool"), bound.shape_of("v_pool")
    if k_shape != v_shape:
        raise InputError(
            f"v_pool: expected k_pool's layout [{', '.join(k_shape.split())}], got [{', '.join(v_shape.split())}]: "
            "K and V pools are paged alike"
        )
    check_pools({"k_pool": k_pool, "v_pool": v_pool}, "K and V pool tensor", call.named_scales, call.written_scales)


_POOL_PLANNER = planner(_pool_layout)


def check_pool_kinds(k_pool: object, v_pool: object, *written_scales: object) -> None:
    """K and V pools both stacked tensors or both sequences, and so the scale tensors written per row (K's, then
    V's, when given): plain Python, torch.compile traces it."""
    stacked = isinstance(k_pool, Tensor)
    kind = "a stacked tensor" if stacked else "a sequence of per-layer tensors"
    if stacked != isinstance(v_pool, Tensor):
        raise InputError(f"v_pool: expected the same layout as k_pool ({kind}), got {type(v_pool).__qualname__}")
    for name, value in zip(("k_scale_out", "v_scale_out"), written_scales, strict=False):
        if value is not None and stacked != isinstance(value, Tensor):
            raise InputError(f"{name}: expected the same layout as k_pool ({kind}), got {type(value).__qualname__}")


def _layers(pool: Tensor | Sequence[Tensor]) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def norm_weight(call: DenseCall | PoolCall) -> Tensor | None:
    """A norm weight of the call, K's or else V's: eps is read (and checked) where there is one."""
    return call.k_norm_weight if call.k_norm_weight is not None else call.v_norm_weight


def _base(pool: Tensor | Sequence[Tensor]) -> Tensor:
    """The tensor a launch addresses ``pool`` from: a stacked one itself, layer 0 of per-layer ones."""
    return pool if isinstance(pool, Tensor) else pool[0]


def check_numbers(call: DenseCall | PoolCall) -> None:
    """Every call: eps (with a norm weight) and, into pools, the FP8 scales given as numbers in range."""
    check_eps(call.eps, norm_weight(call))
    if isinstance(call, PoolCall):
        check_scale_numbers(call.named_scales)


DENSE = Implementation(DenseCall, check_dense, materialize_kv, check_numbers)
POOL = Implementation(PoolCall, check_pool, materialize_kv_into_pool, check_numbers)
