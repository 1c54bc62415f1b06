"""The fused projection path, checked: a materializer's call checked as the op checks it, then one launch.

`KVMaterializer` can compute ``hidden @ W^T`` and the K/V epilogue in one
kernel (`typedkv._fused_kernel`), with no ``kv`` in memory. Its calls are checked
by the very checks of `typedkv.materialize_kv` / `typedkv.materialize_kv_into_pool`
(their `Signature`, relations, aliasing and debug checks, in `typedkv._impl`),
run on the call with a stand-in for ``kv``: a ``[T, L, 2*H*D]`` view of
``hidden``'s dtype and device whose token and layer strides are 0 (nothing
reads it). A misuse is therefore rejected with the op's own message, before
anything is written, on either path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from . import _launch
from ._config import debug_enabled
from ._device_tables import layer_eps, layer_table
from ._errors import InputError
from ._impl import (
    DENSE,
    POOL,
    DenseCall,
    Plan,
    PoolCall,
    _check_apart,
    _Geometry,
    _pool_layout,
    _same_memory,
    debug_pass,
    planner,
)
from ._value_checks import check_positions, check_slots

_LAUNCHES_MAX = 4096


def stand_in(weight: Tensor, num_tokens: int, num_layers: int, width: int) -> Tensor:
    """``[T, L, width]`` of ``weight``'s dtype and device, strides ``(0, 0, 1)``: kv's place in the op's checks.

    A view of ``weight``'s first ``width`` elements (never read): no allocation.
    """
    return weight.as_strided((num_tokens, num_layers, width), (0, 0, 1))


class Projection:
    """A materializer's projection (``[L*2*H*D, hidden]`` weight, optional bias) and its fused launches.

    A launch is prepared per checked layout (the op's plan) and ``hidden``'s
    strides, and reused by later calls of that layout.
    """

    def __init__(self) -> None:
        self._launches: dict[tuple[int, tuple[int, ...]], tuple[Plan, _launch.KernelLaunch]] = {}

    def launch(self, plan: Plan, hidden: Tensor, build: Any) -> _launch.KernelLaunch:
        # The plan is kept with its launch, so its id is not reused while the entry lives.
        key = (id(plan), tuple(hidden.stride()))
        entry = self._launches.get(key)
        if entry is None:
            if len(self._launches) >= _LAUNCHES_MAX:
                self._launches.clear()
            entry = self._launches[key] = (plan, build())
        return entry[1]


def project_kv(
    call: DenseCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, projection: Projection
) -> tuple[Tensor, Tensor]:
    """`KVMaterializer.forward` fused: ``call`` as `typedkv.materialize_kv` takes it, its kv the stand-in."""
    sig = DENSE.signature
    plan: Plan = sig.plan(call, planner())
    k_out, v_out = call.k_out, call.v_out
    if k_out is not None and v_out is not None and _same_memory(k_out, v_out):
        raise InputError("v_out: expected a tensor apart from k_out, got one sharing its memory")
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_positions(call.positions, call.cos_sin_cache.shape[0])
    dims = plan.bound.dims
    shape = (dims["L"], dims["T"], dims["H"], dims["D"])
    if k_out is None:
        k_out = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
    if v_out is None:
        v_out = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
    if plan.empty:
        return k_out, v_out
    eps = layer_eps(call.eps, hidden.device)
    launch = projection.launch(
        plan,
        hidden,
        # Dense outputs are pools of T rows, one token per row, no pages.
        lambda: _launch.projection_launch(
            hidden, kv_weight, kv_bias, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, None,
            k_out, (k_out.stride(0), k_out.stride(1), 0, k_out.stride(2)),
            v_out, (v_out.stride(0), v_out.stride(1), 0, v_out.stride(2)),
            None, num_layers=dims["L"], num_kv_heads=dims["H"], head_dim=dims["D"], page_size=1,
            num_rows=dims["T"], neox=call.rope_style == "neox",
        ),
    )  # fmt: skip
    launch(
        _launch.projection_varying(
            hidden, kv_weight, kv_bias, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, None,
            k_out, v_out, None,
        )
    )  # fmt: skip
    return k_out, v_out


def project_kv_into_pool(
    call: PoolCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, projection: Projection
) -> None:
    """`KVMaterializer.into_pool` fused: ``call`` as `typedkv.materialize_kv_into_pool` takes it, kv the stand-in."""
    sig = POOL.signature
    plan: Plan = sig.plan(call, planner(lambda bound: _pool_layout(call, bound)))
    k_pool, v_pool = call.k_pool, call.v_pool
    _check_apart(k_pool, v_pool)
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_positions(call.positions, call.cos_sin_cache.shape[0])
    if plan.empty:
        return
    dims = plan.bound.dims
    eps = layer_eps(call.eps, hidden.device)
    geometry = plan.geometry
    if geometry is None:
        geometry = plan.geometry = _Geometry.of(plan.bound)
    if debug_enabled():
        check_slots(call.cache_loc, geometry.num_slots)
    k_dst: Tensor
    v_dst: Tensor
    if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor):
        k_dst, v_dst, table = k_pool, v_pool, None
    else:
        # Per-layer tensors: layer 0's address plus an offset table for the others.
        k_list, v_list = cast(Sequence[Tensor], k_pool), cast(Sequence[Tensor], v_pool)
        k_dst, v_dst, table = k_list[0], v_list[0], layer_table(k_list, v_list)
    scales = (call.k_scale, call.v_scale)
    launch = projection.launch(
        plan,
        hidden,
        lambda: _launch.projection_launch(
            hidden, kv_weight, kv_bias, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc,
            k_dst, geometry.strides(plan.bound, "k_pool", k_dst),
            v_dst, geometry.strides(plan.bound, "v_pool", v_dst),
            table, num_layers=dims["L"], num_kv_heads=dims["H"], head_dim=dims["D"],
            page_size=geometry.page_size, num_rows=geometry.num_slots, neox=call.rope_style == "neox",
            scales=scales,
        ),
    )  # fmt: skip
    launch(
        _launch.projection_varying(
            hidden, kv_weight, kv_bias, call.k_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc,
            k_dst, v_dst, table, scales,
        )
    )  # fmt: skip
