"""The fused projection path, checked: a materializer's call checked as the op checks it, then one launch.

`KVMaterializer` can compute ``hidden @ W^T`` and the K/V epilogue in one
kernel (`typedkv._fused_kernel`), with no ``kv`` in memory. Its calls are checked
by the very checks of `typedkv.materialize_kv` / `typedkv.materialize_kv_into_pool`
(`typedkv._impl.dense_plan` / `pool_plan`: their `Signature`, relations,
aliasing and debug checks), run on the call with a stand-in for ``kv``: a
``[T, L, 2*H*D]`` view of ``hidden``'s dtype and device whose token and layer
strides are 0 (nothing reads it). A misuse is therefore rejected with the op's
own message, before anything is written, on either path.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from . import _launch
from ._device_tables import layer_eps
from ._impl import DenseCall, Plan, PoolCall, dense_plan, pool_destinations, pool_plan

_LAUNCHES_MAX = 4096


def stand_in(weight: Tensor, num_tokens: int, num_layers: int, width: int) -> Tensor:
    """``[T, L, width]`` of ``weight``'s dtype and device, strides ``(0, 0, 1)``: kv's place in the op's checks.

    A view of ``weight``'s first ``width`` elements (never read): no allocation.
    """
    return weight.as_strided((num_tokens, num_layers, width), (0, 0, 1))


class FusedLaunches:
    """One materializer's fused launches: one per checked layout (the op's plan) and ``hidden``'s strides.

    A launch fixes everything but the call's tensors and floats, the weight's
    shape included: so each materializer keeps its own.
    """

    def __init__(self) -> None:
        self._launches: dict[tuple[int, tuple[int, ...]], tuple[Plan, _launch.KernelLaunch]] = {}

    def launch(self, plan: Plan, hidden: Tensor, build: Callable[[], _launch.KernelLaunch]) -> _launch.KernelLaunch:
        # The plan is kept with its launch, so its id is not reused while the entry lives.
        key = (id(plan), tuple(hidden.stride()))
        entry = self._launches.get(key)
        if entry is None:
            if len(self._launches) >= _LAUNCHES_MAX:
                self._launches.clear()
            entry = self._launches[key] = (plan, build())
        return entry[1]


def project_kv(
    call: DenseCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, launches: FusedLaunches
) -> tuple[Tensor, Tensor]:
    """`KVMaterializer.forward` fused: ``call`` as `typedkv.materialize_kv` takes it, its kv the stand-in."""
    plan, k_out, v_out = dense_plan(call)
    if plan.empty:
        return k_out, v_out
    dims = plan.bound.dims
    eps = layer_eps(call.eps, hidden.device)
    launch = launches.launch(
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
    call: PoolCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, launches: FusedLaunches
) -> None:
    """`KVMaterializer.into_pool` fused: ``call`` as `typedkv.materialize_kv_into_pool` takes it, kv the stand-in."""
    plan, geometry = pool_plan(call)
    if geometry is None:
        return
    dims = plan.bound.dims
    eps = layer_eps(call.eps, hidden.device)
    k_dst, v_dst, table = pool_destinations(call.k_pool, call.v_pool)
    scales = (call.k_scale, call.v_scale)
    launch = launches.launch(
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
