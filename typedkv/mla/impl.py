"""The checked implementation of the MLA ops: check the arguments, then launch or run the reference.

As `typedkv._impl` is for the K/V ops (whose plans and debug pass this module
shares): a call arrives as one typed bundle (`DenseCall`, `PoolCall`) from the
public face (`typedkv.mla.api`) or from its torch ops (`typedkv.core.torch_ops`), whose
fake implementations run the production check alone (`check_dense`, `check_pool`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

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
    check_memory,
    check_scales,
    check_values,
    debug_pass,
    planner,
)
from typedkv.core.messages import fmt_dtype
from typedkv.core.value_checks import check_eps, check_scale_numbers, check_slots
from typedkv.mla import launch as mla_launch
from typedkv.mla import reference as mla_reference

ROTARY_RULE = ("R % 2 == 0 and 2 <= R", "cos_sin_cache", "the rotary dim R must be even and at least 2")
"""``Signature`` rule of the MLA ops (``R <= C+R`` is ckv's shape: ``C >= 0``)."""

_R = TypeVar("_R")


class DenseCall(NamedTuple):
    """A `typedkv.materialize_mla_kv` call's arguments, in its signature's order."""

    ckv: Tensor
    kv_norm_weight: Tensor | None
    eps: float | Sequence[float] | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    rope_style: str
    out: Tensor | None


class PoolCall(NamedTuple):
    """A `typedkv.materialize_mla_kv_into_pool` call's arguments, in its signature's order."""

    ckv: Tensor
    kv_norm_weight: Tensor | None
    eps: float | Sequence[float] | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    cache_loc: Tensor
    kv_pool: Tensor | Sequence[Tensor]
    rope_style: str
    kv_scale: float | Tensor | None


# --------------------------------------------------------------------- dense


def check_dense(call: DenseCall) -> Bound:
    """The production check of a `typedkv.materialize_mla_kv` call."""
    return _checked(DENSE.signature.check, call)


def dense_layout(call: DenseCall) -> Plan:
    """The plan of a dense call's layout: checked by the production check at its first call, then looked up."""
    plan: Plan = _checked(DENSE.signature.plan, call, _DENSE_PLANNER)
    return plan


def materialize_mla_kv(call: DenseCall, plan: Plan | None = None, after_gemm: bool = False) -> Tensor:
    """`typedkv.materialize_mla_kv`, eagerly: checked, then launched (or run by the reference).

    ``plan``: the call's `dense_layout`, when the caller has it already (a materializer keeps its calls' plans).
    ``after_gemm``: the call's ckv was just written by the caller's own GEMM (`typedkv.core.launcher.KernelLaunch`).
    """
    sig = DENSE.signature
    if plan is None:
        plan = dense_layout(call)
    ckv, out = call.ckv, call.out
    check_numbers(call)
    if out is not None:
        check_memory(sig, plan, call)  # an output left None is allocated below: apart from everything
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_values(call.eps, call.kv_norm_weight, {}, call.positions, call.cos_sin_cache)
    dims = plan.bound.dims
    if out is None:
        out = ckv.new_empty((dims["L"], dims["T"], dims["C"] + dims["R"]))  # ckv's dtype and device
    if plan.empty:
        return out
    eps = layer_eps(call.eps, ckv)
    neox = call.rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written, and tensors made under
        # inference_mode written outside it as the kernel writes them (torch refuses in-place updates of those).
        with torch.inference_mode():
            out.copy_(mla_reference.mla_rows(ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, neox))
        return out
    launch = plan.launch
    if launch is None:
        # A dense output is a pool of T rows, one token per row, no pages.
        launch = plan.launch = mla_launch.mla_launch(
            ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, None,
            out, (out.stride(0), out.stride(1), 0), None,
            kv_lora_rank=dims["C"], page_size=1, num_rows=dims["T"], neox=neox, kv_scale=None,
        )  # fmt: skip
    launch(
        mla_launch.mla_varying(
            ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, None, out, None, None
        ),
        after_gemm,
    )
    return out


# ---------------------------------------------------------------------- pool


def check_pool(call: PoolCall) -> Bound:
    """The production check of a `typedkv.materialize_mla_kv_into_pool` call."""
    bound = _checked(POOL.signature.check, call)
    _pool_layout(call)
    return bound


def pool_layout(call: PoolCall) -> Plan:
    """The plan of a pool call's layout: checked by the production check at its first call, then looked up."""
    plan: Plan = _checked(POOL.signature.plan, call, _POOL_PLANNER)
    return plan


def materialize_mla_kv_into_pool(call: PoolCall, plan: Plan | None = None, after_gemm: bool = False) -> None:
    """`typedkv.materialize_mla_kv_into_pool`, eagerly: checked, then launched (or run by the reference).

    ``plan``: the call's `pool_layout`, when the caller has it already; ``after_gemm`` as in `materialize_mla_kv`.
    """
    sig = POOL.signature
    if plan is None:
        plan = pool_layout(call)
    ckv, kv_pool = call.ckv, call.kv_pool
    check_numbers(call)
    scales = {"kv_scale": call.kv_scale}
    addresses = check_memory(sig, plan, call)
    if debug_enabled():
        debug_pass(sig, plan, call)
        check_values(call.eps, call.kv_norm_weight, scales, call.positions, call.cos_sin_cache)
    if plan.empty:
        return
    dims = plan.bound.dims
    page_size = dims.get("B", 1)
    num_slots = dims["N"] * page_size if "N" in dims else dims["S"]
    if debug_enabled():
        check_slots(call.cache_loc, num_slots)
    eps = layer_eps(call.eps, ckv)
    neox = call.rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written, and tensors made under
        # inference_mode written outside it as the kernel writes them (torch refuses in-place updates of those).
        with torch.inference_mode():
            rows = mla_reference.mla_rows(ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, neox)
            layers = kv_pool.unbind(0) if isinstance(kv_pool, Tensor) else kv_pool
            # As [.., 1, C+R] rows of one head: the K/V pool writer's layout.
            values = core_reference.quantize(rows.unsqueeze(2), call.kv_scale, layers[0].dtype)
            core_reference.write_pool(values, call.cache_loc, [p.unsqueeze(-2) for p in layers], page_size)
        return
    table_multiple = 0
    if isinstance(kv_pool, Tensor):
        dst, table = kv_pool, None
    else:
        # Layer 0's address plus an offset table for the others (the K/V ops'
        # table, its first row used). The cached launch takes every layer 16-byte
        # aligned (offsets of whole vectors: stores stay vectorised); a call
        # with a layer that is not gets a launch of its own, uncached.
        addresses = cast(list[int], addresses)
        dst = kv_pool[0]
        table, table_multiple = layer_table(kv_pool, kv_pool, addresses + addresses)
    launch = plan.launch if table_multiple != 1 else None
    if launch is None:
        by_dim = plan.bound.strides("kv_pool", dst)
        strides = (by_dim.get("L", 0), by_dim["N"] if "N" in by_dim else by_dim["S"], by_dim.get("B", 0))
        launch = mla_launch.mla_launch(
            ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc, dst, strides, table,
            kv_lora_rank=dims["C"], page_size=page_size, num_rows=num_slots, neox=neox, kv_scale=call.kv_scale,
            table_multiple=table_multiple,
        )  # fmt: skip
        if table_multiple != 1:
            plan.launch = launch
    launch(
        mla_launch.mla_varying(
            ckv, call.kv_norm_weight, eps, call.cos_sin_cache, call.positions, call.cache_loc, dst, table, call.kv_scale
        ),
        after_gemm,
    )


def _checked(check: Callable[..., _R], call: DenseCall | PoolCall, *more: Any) -> _R:
    """``check(call, *more)``, its `InputError` told what MLA callers get wrong."""
    try:
        return check(call, *more)
    except InputError as err:
        message = str(err)
        if "the size must be C+R = " in message:
            # Three arguments make the row width: say which gave C and R.
            rotary_dim = call.cos_sin_cache.shape[1]
            if isinstance(call.kv_norm_weight, Tensor):
                message += (
                    f"; C={call.kv_norm_weight.shape[1]} comes from kv_norm_weight, R={rotary_dim} from cos_sin_cache"
                )
            else:
                message += f"; C={call.ckv.shape[2] - rotary_dim} is ckv's width less R={rotary_dim} from cos_sin_cache"
        kv_pool = getattr(call, "kv_pool", None)
        first = kv_pool[0] if isinstance(kv_pool, (list, tuple)) and kv_pool else kv_pool
        heads_dim = 4 if isinstance(kv_pool, Tensor) else 3
        if message.startswith("kv_pool") and isinstance(first, Tensor) and first.dim() == heads_dim + 1:
            message += ": an MLA pool holds one row of C+R per slot, with no head dim (sglang's [S, 1, C+R] is pages of one slot)"
        if message == str(err):
            raise
        raise InputError(message) from None


def _pool_layout(call: PoolCall) -> None:
    """The relations between the pool's layers and the scale that shapes cannot say."""
    kv_pool = call.kv_pool
    stacked = isinstance(kv_pool, Tensor)
    layers = [kv_pool] if isinstance(kv_pool, Tensor) else kv_pool
    if not layers:
        return  # L == 0: nothing to write
    dtype = layers[0].dtype
    for i, layer in enumerate(layers):
        if layer.dtype != dtype:
            raise InputError(
                f"kv_pool[{i}]: expected dtype {fmt_dtype(dtype)} (kv_pool[0]'s), got {fmt_dtype(layer.dtype)}: "
                "every layer's pool shares one dtype"
            )
        if not stacked and layer.stride() != layers[0].stride():
            raise InputError(
                f"kv_pool[{i}]: expected strides {tuple(layers[0].stride())} (kv_pool[0]'s), got "
                f"{tuple(layer.stride())}: per-layer pools must share one layout"
            )
    check_scales(dtype, {"kv_scale": call.kv_scale})


_DENSE_PLANNER = planner()
_POOL_PLANNER = planner(lambda call, bound: _pool_layout(call))


def check_numbers(call: DenseCall | PoolCall) -> None:
    """Every call: eps (with a norm weight) and, into a pool, the FP8 scale given as numbers in range."""
    check_eps(call.eps, call.kv_norm_weight)
    if isinstance(call, PoolCall):
        check_scale_numbers({"kv_scale": call.kv_scale})


DENSE = Implementation(DenseCall, check_dense, materialize_mla_kv, check_numbers)
POOL = Implementation(PoolCall, check_pool, materialize_mla_kv_into_pool, check_numbers)
