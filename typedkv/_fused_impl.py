r"""The fused projection path, checked: a materializer's call checked as the op checks it, then one launch.

`KVMaterializer` can compute ``hidden @ W^T`` and the K/V epilogue in one
kernel (`typedkv._fused_kernel`), with no ``kv`` in memory. Its calls are checked
by the very checks of `typedkv.materialize_kv` / `typedkv.materialize_kv_into_pool`
(`typedkv._impl.dense_plan` / `pool_plan`: their `Signature`, relations,
aliasing and debug checks), run on the call with a stand-in for ``kv``: a
``[T, L, 2*H*D]`` view of ``hidden``'s dtype and device whose token and layer
strides are 0 (nothing reads it). A misuse is therefore rejected with the op's
own message, before anything is written, on either path.

Under ``torch.compile`` the fused path is one torch op per call, declared by
`typedkv._materializer` from this module's call bundles (`FusedCall`,
`FusedPoolCall`) and `Implementation`\ s (`FUSED`, `FUSED_POOL`): the fake runs
the checks above on fake tensors, the real implementation is the eager path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _launch
from ._checking import Bound, Signature
from ._device_tables import layer_eps
from ._impl import (
    DenseCall,
    Implementation,
    Plan,
    PoolCall,
    check_dense,
    check_pool,
    dense_plan,
    materialize_kv,
    materialize_kv_into_pool,
    pool_destinations,
    pool_plan,
)

if TYPE_CHECKING:
    # As in `typedkv._api`: jaxtyping's own names, for pyrefly.
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from ._types import Index, StorageFloat


def _projection(
    kv_weight: StorageFloat[Tensor, "N hidden"],
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


# Fused launches by checked layout (the op's plan) and what the plan does not
# fix: hidden's width and strides, the weight's strides, whether there is a bias.
# A plan is kept with its launch, so its id is not reused while the entry lives.
_LAUNCHES: dict[tuple[object, ...], tuple[Plan, _launch.KernelLaunch]] = {}


def _launch_of(
    plan: Plan, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, build: Callable[[], _launch.KernelLaunch]
) -> _launch.KernelLaunch:
    key = (id(plan), hidden.shape[1], hidden.stride(), kv_weight.stride(), kv_bias is None)
    entry = _LAUNCHES.get(key)
    if entry is None:
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        entry = _LAUNCHES[key] = (plan, build())
    return entry[1]


def project_kv(
    call: DenseCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, plan: Plan | None = None
) -> tuple[Tensor, Tensor]:
    """`KVMaterializer.forward` fused: ``call`` as `typedkv.materialize_kv` takes it, its kv the stand-in.

    ``plan``: the call's `typedkv._impl.dense_layout`, when the materializer kept it.
    """
    plan, k_out, v_out = dense_plan(call, plan)
    if plan.empty:
        return k_out, v_out
    dims = plan.bound.dims
    eps = layer_eps(call.eps, hidden)
    launch = _launch_of(
        plan,
        hidden,
        kv_weight,
        kv_bias,
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
    call: PoolCall, hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, plan: Plan | None = None
) -> None:
    """`KVMaterializer.into_pool` fused: ``call`` as `typedkv.materialize_kv_into_pool` takes it, kv the stand-in.

    ``plan``: the call's `typedkv._impl.pool_layout`, when the materializer kept it.
    """
    plan, geometry, addresses = pool_plan(call, plan)
    if geometry is None:
        return
    dims = plan.bound.dims
    eps = layer_eps(call.eps, hidden)
    k_dst, v_dst, table = pool_destinations(call.k_pool, call.v_pool, addresses)
    scales = (call.k_scale, call.v_scale)
    launch = _launch_of(
        plan,
        hidden,
        kv_weight,
        kv_bias,
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


# ------------------------------------------------------------- torch ops


class FusedCall(NamedTuple):
    """The fused dense path's op arguments (`KVMaterializer.forward` with the fused path, compiled)."""

    hidden: Tensor
    kv_weight: Tensor
    kv_bias: Tensor | None
    k_norm_weight: Tensor | None
    eps: float | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    num_layers: int
    num_kv_heads: int
    rope_style: str
    k_out: Tensor
    v_out: Tensor

    def op_call(self) -> DenseCall:
        """The call as `typedkv.materialize_kv` takes it, the stand-in for kv."""
        return DenseCall(
            _stand_in_of(self.kv_weight, self.hidden, self.num_layers), self.k_norm_weight, self.eps,
            self.cos_sin_cache, self.positions, self.num_kv_heads, self.rope_style, self.k_out, self.v_out,
        )  # fmt: skip


class FusedPoolCall(NamedTuple):
    """The fused pool path's op arguments (`KVMaterializer.into_pool` with the fused path, compiled)."""

    hidden: Tensor
    kv_weight: Tensor
    kv_bias: Tensor | None
    k_norm_weight: Tensor | None
    eps: float | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    cache_loc: Tensor
    k_pool: Tensor | Sequence[Tensor]
    v_pool: Tensor | Sequence[Tensor]
    num_layers: int
    num_kv_heads: int
    rope_style: str
    k_scale: float | Tensor | None
    v_scale: float | Tensor | None
    kv_layout: str | None

    def op_call(self) -> PoolCall:
        """The call as `typedkv.materialize_kv_into_pool` takes it, the stand-in for kv."""
        return PoolCall(
            _stand_in_of(self.kv_weight, self.hidden, self.num_layers), self.k_norm_weight, self.eps,
            self.cos_sin_cache, self.positions, self.cache_loc, self.k_pool, self.v_pool, self.num_kv_heads,
            self.rope_style, self.k_scale, self.v_scale, self.kv_layout,
        )  # fmt: skip


def _stand_in_of(kv_weight: Tensor, hidden: Tensor, num_layers: int) -> Tensor:
    return stand_in(kv_weight, hidden.shape[0], num_layers, kv_weight.shape[0] // num_layers)


def _accepted(bound: Bound) -> bool:
    return True


def _kv(hidden: Tensor, kv_weight: Tensor, kv_bias: Tensor | None, num_layers: int) -> Tensor:
    """``[T, L, 2*H*D]``: the projection as a GEMM (CPU tensors: the reference path has no fused kernel)."""
    with torch.no_grad():
        return F.linear(hidden, kv_weight, kv_bias).view(hidden.shape[0], num_layers, -1)


def check_fused(call: FusedCall) -> Bound:
    """The production check of a fused dense call: the materializer's, then `typedkv.materialize_kv`'s."""
    PROJECTION.check((call.kv_weight, call.hidden, call.positions, None))
    return check_dense(call.op_call())


def run_fused(call: FusedCall) -> None:
    """A fused dense call, checked and launched (CPU tensors: GEMM, then the reference)."""
    PROJECTION.plan((call.kv_weight, call.hidden, call.positions, None), _accepted)
    if not _launch.use_kernel(call.hidden.device):
        kv = _kv(call.hidden, call.kv_weight, call.kv_bias, call.num_layers)
        materialize_kv(call.op_call()._replace(kv=kv))
        return
    project_kv(call.op_call(), call.hidden, call.kv_weight, call.kv_bias)


def check_fused_pool(call: FusedPoolCall) -> Bound:
    """The production check of a fused pool call: the materializer's, then `typedkv.materialize_kv_into_pool`'s."""
    PROJECTION.check((call.kv_weight, call.hidden, call.positions, call.cache_loc))
    return check_pool(call.op_call())


def run_fused_pool(call: FusedPoolCall) -> None:
    """A fused pool call, checked and launched (CPU tensors: GEMM, then the reference)."""
    PROJECTION.plan((call.kv_weight, call.hidden, call.positions, call.cache_loc), _accepted)
    if not _launch.use_kernel(call.hidden.device):
        kv = _kv(call.hidden, call.kv_weight, call.kv_bias, call.num_layers)
        materialize_kv_into_pool(call.op_call()._replace(kv=kv))
        return
    project_kv_into_pool(call.op_call(), call.hidden, call.kv_weight, call.kv_bias)


FUSED = Implementation(FusedCall, check_fused, run_fused)
FUSED_POOL = Implementation(FusedPoolCall, check_fused_pool, run_fused_pool)
