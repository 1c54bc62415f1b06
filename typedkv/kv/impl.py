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

import torch
from torch import Tensor

from typedkv.core import reference as core_reference
from typedkv.core.checking import Bound
from typedkv.core.config import debug_enabled
from typedkv.core.device_tables import layer_eps, layer_table
from typedkv.core.errors import InputError
from typedkv.core.implementation import (
    Implementation,
    Plan,
    PoolGeometry,
    check_memory,
    check_scales,
    check_values,
    debug_pass,
    planner,
)
from typedkv.core.messages import fmt_dtype
from typedkv.core.value_checks import check_eps, check_scale_numbers, check_slots
from typedkv.kv import launch as kv_launch
from typedkv.kv import reference as kv_reference

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
    k_scale: float | Tensor | None
    v_scale: float | Tensor | None
    kv_layout: str | None

    @property
    def scales(self) -> tuple[float | Tensor | None, float | Tensor | None]:
        """K's and V's FP8 scales, in that order (as every kernel and the reference take them)."""
        return self.k_scale, self.v_scale

    @property
    def named_scales(self) -> dict[str, float | Tensor | None]:
        """The FP8 scales by argument name, for the checks' messages."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


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
    sig = DENSE.signature
    if plan is None:
        plan = dense_layout(call)
    kv, k_out, v_out = call.kv, call.k_out, call.v_out
    check_numbers(call)
    if k_out is not None or v_out is not None:
        check_memory(sig, plan, call)  # outputs left None are allocated below: apart from everything
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_values(call.eps, call.k_norm_weight, {}, call.positions, call.cos_sin_cache)
    if k_out is None or v_out is None:
        dims = plan.bound.dims
        shape = (dims["L"], dims["T"], dims["H"], dims["D"])
        # kv's dtype and device (new_empty: no keyword parsing, host time at decode sizes).
        if k_out is None:
            k_out = kv.new_empty(shape)
        if v_out is None:
            v_out = kv.new_empty(shape)
    return plan, k_out, v_out


def dense_strides(out: Tensor) -> tuple[int, int, int, int]:
    """A dense ``[L, T, H, D]`` output's ``(layer, page, slot in page, head)`` element strides, as the launches
    take a destination's: a pool of T rows, one token per row, no pages."""
    return out.stride(0), out.stride(1), 0, out.stride(2)


def materialize_kv(call: DenseCall, plan: Plan | None = None, after_gemm: bool = False) -> tuple[Tensor, Tensor]:
    """`typedkv.materialize_kv`, eagerly: checked, then launched (or run by the reference); ``plan`` as in `dense_plan`.

    ``after_gemm``: the call's kv was just written by the caller's own GEMM (`KernelLaunch`).
    """
    plan, k_out, v_out = dense_plan(call, plan)
    if plan.empty:
        return k_out, v_out
    kv, dims = call.kv, plan.bound.dims
    eps = layer_eps(call.eps, kv)
    neox = call.rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written, and tensors made under
        # inference_mode written outside it as the kernel writes them (torch refuses in-place updates of those).
        with torch.inference_mode():
            k, v = kv_reference.rmsnorm_rope(
                kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, dims["H"], neox
            )
            k_out.copy_(k)
            v_out.copy_(v)
        return k_out, v_out
    if plan.launch is None:
        plan.launch = kv_launch.Launch(
            kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, None,
            k_out, dense_strides(k_out), v_out, dense_strides(v_out), None, num_kv_heads=dims["H"], head_dim=dims["D"], page_size=1, num_rows=dims["T"], neox=neox,
        )  # fmt: skip
    plan.launch(
        kv_launch.varying(kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, None, k_out, v_out, None),
        after_gemm,
    )
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
    sig = POOL.signature
    if plan is None:
        plan = pool_layout(call)
    check_numbers(call)
    scales = call.named_scales
    addresses = check_memory(sig, plan, call)
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_values(call.eps, call.k_norm_weight, scales, call.positions, call.cos_sin_cache)
    if plan.empty:
        return plan, None, addresses
    geometry = plan.geometry
    if geometry is None:
        geometry = plan.geometry = PoolGeometry.of(plan.bound)
    if debug_enabled():
        check_slots(call.cache_loc, geometry.num_slots)
    return plan, geometry, addresses


def pool_destinations(
    k_pool: Tensor | Sequence[Tensor], v_pool: Tensor | Sequence[Tensor], addresses: list[int] | None
) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """``(k_dst, v_dst, layer table, table multiple)`` of checked pools: stacked tensors as they are, or
    layer 0's plus offsets.

    ``addresses``: `pool_plan`'s, read once per call. The table multiple (the launches' ``table_multiple``):
    0 without a table; else every offset is a multiple of that many elements -- 16 bytes' worth when
    every layer starts on 16 bytes (whole vectors stored), else 1.
    """
    if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor):
        return k_pool, v_pool, None, 0
    # Per-layer tensors (a mixed stacked/list pair was rejected by the plan):
    # layer 0's address plus an offset table for the others.
    k_list, v_list = cast(Sequence[Tensor], k_pool), cast(Sequence[Tensor], v_pool)
    table, table_multiple = layer_table(k_list, v_list, cast(list[int], addresses))
    return k_list[0], v_list[0], table, table_multiple


def materialize_kv_into_pool(call: PoolCall, plan: Plan | None = None, after_gemm: bool = False) -> None:
    """`typedkv.materialize_kv_into_pool`, eagerly: checked, then launched (or run by the reference); ``plan`` as in `pool_plan`.

    ``after_gemm``: the call's kv was just written by the caller's own GEMM (`KernelLaunch`).
    """
    plan, geometry, addresses = pool_plan(call, plan)
    if geometry is None:
        return
    dims = plan.bound.dims
    kv, k_pool, v_pool = call.kv, call.k_pool, call.v_pool
    eps = layer_eps(call.eps, kv)
    neox = call.rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written, and tensors made under
        # inference_mode written outside it as the kernel writes them (torch refuses in-place updates of those).
        with torch.inference_mode():
            k, v = kv_reference.rmsnorm_rope(
                kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, dims["H"], neox
            )
            k_layers, v_layers = _layers(k_pool), _layers(v_pool)
            page, hnd = geometry.page_size, plan.bound.specs["k_pool"].layout == "HND"
            for values, scale, layers in zip((k, v), call.scales, (k_layers, v_layers), strict=True):
                core_reference.write_pool(
                    core_reference.quantize(values, scale, layers[0].dtype), call.cache_loc, layers, page, hnd
                )
        return
    k_dst, v_dst, table, table_multiple = pool_destinations(k_pool, v_pool, addresses)
    scales = call.scales
    # The plan keeps the launch of layers on 16 bytes (or of stacked pools); a call whose per-layer
    # pools are not gets a launch of its own, uncached, which stores element by element.
    launch = plan.launch if table_multiple != 1 else None
    if launch is None:
        launch = kv_launch.Launch(
            kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc,
            k_dst, geometry.strides(plan.bound, "k_pool", k_dst),
            v_dst, geometry.strides(plan.bound, "v_pool", v_dst),
            table, num_kv_heads=dims["H"], head_dim=dims["D"], page_size=geometry.page_size,
            num_rows=geometry.num_slots, neox=neox, scales=scales, table_multiple=table_multiple,
        )  # fmt: skip
        if table_multiple != 1:
            plan.launch = launch
    launch(
        kv_launch.varying(
            kv, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc, k_dst, v_dst, table, scales
        ),
        after_gemm,
    )


def _pool_layout(call: PoolCall, bound: Bound) -> None:
    """The relations between pools, kv and scales that shapes cannot say."""
    k_pool, v_pool = call.k_pool, call.v_pool
    check_pool_kinds(k_pool, v_pool)
    stacked = isinstance(k_pool, Tensor)
    # A stacked pool is one tensor; a list is checked layer by layer.
    k_layers = [k_pool] if isinstance(k_pool, Tensor) else k_pool
    v_layers = [v_pool] if isinstance(v_pool, Tensor) else v_pool
    if not k_layers:
        return  # L == 0: nothing to write
    k_shape, v_shape = bound.shape_of("k_pool"), bound.shape_of("v_pool")
    if k_shape != v_shape:
        raise InputError(
            f"v_pool: expected k_pool's layout [{', '.join(k_shape.split())}], got [{', '.join(v_shape.split())}]: "
            "K and V pools are paged alike"
        )
    dtype = k_layers[0].dtype
    for name, layers in (("k_pool", k_layers), ("v_pool", v_layers)):
        for i, layer in enumerate(layers):
            label = name if stacked else f"{name}[{i}]"
            if layer.dtype != dtype:
                first = "k_pool" if stacked else "k_pool[0]"
                raise InputError(
                    f"{label}: expected dtype {fmt_dtype(dtype)} ({first}'s), got {fmt_dtype(layer.dtype)}: "
                    "every K and V pool tensor shares one dtype"
                )
            if not stacked and layer.stride() != layers[0].stride():
                raise InputError(
                    f"{label}: expected strides {tuple(layers[0].stride())} ({name}[0]'s), got "
                    f"{tuple(layer.stride())}: per-layer pools must share one layout"
                )
    check_scales(dtype, call.named_scales)


_POOL_PLANNER = planner(_pool_layout)


def check_pool_kinds(k_pool: object, v_pool: object) -> None:
    """K and V pools both stacked tensors or both sequences (plain Python: torch.compile traces it)."""
    stacked = isinstance(k_pool, Tensor)
    if stacked != isinstance(v_pool, Tensor):
        kind = "a stacked tensor" if stacked else "a sequence of per-layer tensors"
        raise InputError(f"v_pool: expected the same layout as k_pool ({kind}), got {type(v_pool).__qualname__}")


def _layers(pool: Tensor | Sequence[Tensor]) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def check_numbers(call: DenseCall | PoolCall) -> None:
    """Every call: eps (with a norm weight) and, into pools, the FP8 scales given as numbers in range."""
    check_eps(call.eps, call.k_norm_weight)
    if isinstance(call, PoolCall):
        check_scale_numbers(call.named_scales)


DENSE = Implementation(DenseCall, check_dense, materialize_kv, check_numbers)
POOL = Implementation(PoolCall, check_pool, materialize_kv_into_pool, check_numbers)
