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
from typedkv.core.device_tables import layer_eps, layer_table
from typedkv.core.errors import InputError
from typedkv.core.implementation import Implementation, Plan, PoolGeometry, check_pools, checked, planner
from typedkv.core.messages import fmt_dtype
from typedkv.core.tensor_types import DS_MLA_ROW_BYTES
from typedkv.core.value_checks import check_eps, check_scale_numbers
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
    cache_format: str


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
    if plan is None:
        plan = dense_layout(call)
    ckv, out = call.ckv, call.out
    checked(DENSE, plan, call, call.kv_norm_weight, {}, out is not None)  # an output left None: allocated below
    dims = plan.bound.dims
    if out is None:
        out = ckv.new_empty((dims["L"], dims["T"], dims["C"] + dims["R"]))  # ckv's dtype and device
    if plan.empty:
        return out
    inputs = (call.kv_norm_weight, layer_eps(call.eps, ckv), call.cos_sin_cache, call.positions)
    if not plan.kernel:
        with core_reference.writing():
            out.copy_(mla_reference.mla_rows(ckv, inputs, call.rope_style == "neox"))
        return out
    values = mla_launch.call_values(ckv, inputs, None, out, None, None)
    launch = plan.launch
    if launch is None:
        # A dense output is a pool of T rows, one token per row, no pages.
        launch = plan.launch = mla_launch.mla_launch(
            values, (out.stride(0), out.stride(1), 0), kv_lora_rank=dims["C"], page_size=1, num_rows=dims["T"],
            neox=call.rope_style == "neox",
        )  # fmt: skip
    launch(values, after_gemm)
    return out


# ---------------------------------------------------------------------- pool


def check_pool(call: PoolCall) -> Bound:
    """The production check of a `typedkv.materialize_mla_kv_into_pool` call."""
    bound = _checked(POOL.signature.check, call)
    _pool_layout(call, bound)
    return bound


def pool_layout(call: PoolCall) -> Plan:
    """The plan of a pool call's layout: checked by the production check at its first call, then looked up."""
    plan: Plan = _checked(POOL.signature.plan, call, _POOL_PLANNER)
    return plan


def materialize_mla_kv_into_pool(call: PoolCall, plan: Plan | None = None, after_gemm: bool = False) -> None:
    """`typedkv.materialize_mla_kv_into_pool`, eagerly: checked, then launched (or run by the reference).

    ``plan``: the call's `pool_layout`, when the caller has it already; ``after_gemm`` as in `materialize_mla_kv`.
    """
    if plan is None:
        plan = pool_layout(call)
    ckv, kv_pool = call.ckv, call.kv_pool
    scales = {"kv_scale": call.kv_scale}
    addresses = checked(POOL, plan, call, call.kv_norm_weight, scales, slots=call.cache_loc)
    if plan.empty:
        return
    geometry = cast(PoolGeometry, plan.geometry)
    dims, page_size = plan.bound.dims, geometry.page_size
    inputs = (call.kv_norm_weight, layer_eps(call.eps, ckv), call.cos_sin_cache, call.positions)
    ds_mla = call.cache_format == "fp8_ds_mla"
    if ds_mla:
        _check_rows_aligned(kv_pool, addresses)
    if not plan.kernel:
        with core_reference.writing():
            layers = kv_pool.unbind(0) if isinstance(kv_pool, Tensor) else kv_pool
            # As [.., 1, C+R] rows of one head: the K/V pool writer's layout.
            if ds_mla:
                stored = mla_reference.ds_mla_rows(ckv, inputs, call.rope_style == "neox").unsqueeze(2)
            else:
                rows = mla_reference.mla_rows(ckv, inputs, call.rope_style == "neox")
                stored = core_reference.quantize(rows.unsqueeze(2), call.kv_scale, layers[0].dtype)
            core_reference.write_pool(stored, call.cache_loc, [p.unsqueeze(-2) for p in layers], page_size)
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
    values = mla_launch.call_values(ckv, inputs, call.cache_loc, dst, table, call.kv_scale)
    launch = plan.launch if table_multiple != 1 else None
    if launch is None:
        by_dim = plan.bound.strides("kv_pool", dst)
        strides = (by_dim.get("L", 0), by_dim["N"] if "N" in by_dim else by_dim["S"], by_dim.get("B", 0))
        launch = mla_launch.mla_launch(
            values, strides, kv_lora_rank=dims["C"], page_size=page_size, num_rows=geometry.num_slots,
            neox=call.rope_style == "neox", table_multiple=table_multiple, ds_mla=ds_mla,
        )  # fmt: skip
        if table_multiple != 1:
            plan.launch = launch
    launch(values, after_gemm)


def _checked(check: Callable[..., _R], call: DenseCall | PoolCall, *more: Any) -> _R:
    """``check(call, *more)``, its `InputError` told what MLA callers get wrong."""
    try:
        return check(call, *more)
    except InputError as err:
        message = str(err)
        if "the size must be C+R = " in message:
            # Three arguments make the row width: say which gave C and R.
            rotary_dim = call.cos_sin_cache.shape[-1]
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
        elif message.startswith("kv_pool") and isinstance(first, Tensor):
            message = _cache_format_fix(message, first, call)
        if message == str(err):
            raise
        raise InputError(message) from None


_DS_MLA_ROW = (
    f"an fp8_ds_mla row is {DS_MLA_ROW_BYTES} bytes: 512 float8_e4m3fn latent values, 4 float32 scales "
    "(one per 128 values), 64 bfloat16 rope values"
)


_ALIGNED = "each row holds float32 scales and bfloat16 rope values, written on 4-byte boundaries"


def _check_rows_aligned(kv_pool: Tensor | Sequence[Tensor], addresses: list[int] | None) -> None:
    """Every call into DeepSeek's FP8 rows: each layer's pool starts on 4 bytes (its strides were checked with its
    layout). ``addresses``: the per-layer pools' (`check_memory`'s), None for a stacked pool."""
    layers = [kv_pool.data_ptr()] if isinstance(kv_pool, Tensor) else addresses or []
    for i, address in enumerate(layers):
        if address % 4:
            label = "kv_pool" if isinstance(kv_pool, Tensor) else f"kv_pool[{i}]"
            raise InputError(
                f"{label}: expected memory starting on a 4-byte boundary for cache_format='fp8_ds_mla', got "
                f"an address {address % 4} bytes past one: {_ALIGNED}"
            )


def _cache_format_fix(message: str, pool: Tensor, call: DenseCall | PoolCall) -> str:
    """A pool message told what the pool's bytes say of its cache format: DeepSeek's rows passed as a plain pool, or
    a pool of another dtype or width passed as DeepSeek's (``pool``: the stacked pool or its first layer)."""
    label = message.split(":", 1)[0]
    if getattr(call, "cache_format", "plain") == "plain":
        ds_rows = pool.dtype == torch.uint8 and pool.shape[-1] == DS_MLA_ROW_BYTES != call.ckv.shape[-1]
        kept_as_bytes = message.find(": an FP8 cache kept as bytes")
        if ds_rows and kept_as_bytes > 0:
            return (
                f"{message[:kept_as_bytes]}: rows of {DS_MLA_ROW_BYTES} bytes are DeepSeek's FP8 rows: "
                "pass cache_format='fp8_ds_mla'"
            )
        return message
    if message.startswith(f"{label}: expected dtype uint8, got "):
        fix = (
            f"pass {label}.view(torch.uint8), the same bytes"
            if pool.element_size() == 1
            else f"allocate it with dtype=torch.uint8, {DS_MLA_ROW_BYTES} bytes a row"
        )
        return f"{label}: expected dtype uint8, got {fmt_dtype(pool.dtype)}: an fp8_ds_mla pool holds bytes: {fix}"
    if pool.shape[-1] != DS_MLA_ROW_BYTES and message.endswith(f", got {tuple(pool.shape)}"):
        return f"{message}: {_DS_MLA_ROW}"
    return message


def _ds_mla_geometry(call: PoolCall, bound: Bound) -> None:
    """An ``"fp8_ds_mla"`` call: DeepSeek's row geometry (C = 512, R = 64), and no kv_scale (each row holds its tiles'
    own scales; vLLM's kernel takes one and ignores it)."""
    scale = call.kv_scale
    if scale is not None:
        got = f"a tensor of shape {tuple(scale.shape)}" if isinstance(scale, Tensor) else repr(scale)
        raise InputError(
            f"kv_scale: expected None for cache_format='fp8_ds_mla', got {got}: each row holds its own scales, "
            "one per 128 latent values"
        )
    kv_pool = call.kv_pool
    first = kv_pool if isinstance(kv_pool, Tensor) else kv_pool[0] if kv_pool else None
    if first is not None and any(st % 4 for st, n in zip(first.stride()[:-1], first.shape[:-1], strict=True) if n > 1):
        label = "kv_pool" if first is kv_pool else "kv_pool[0]"
        raise InputError(
            f"{label}: expected strides that are multiples of 4 for cache_format='fp8_ds_mla', got "
            f"{tuple(first.stride())}: {_ALIGNED}"
        )
    dims = bound.dims
    if (dims["C"], dims["R"]) != (512, 64):
        c_from = "ckv's width less R" if "C" in bound.solved else f"from {bound.bound_by['C']}"
        raise InputError(
            f"cache_format: expected C=512 and R=64 for 'fp8_ds_mla', got C={dims['C']} ({c_from}) and "
            f"R={dims['R']} (from {bound.bound_by['R']}): DeepSeek's FP8 rows hold that geometry only; "
            "other widths take cache_format='plain'"
        )


def _pool_layout(call: PoolCall, bound: Bound) -> None:
    """The relations between the pool's layers and the scale that shapes cannot say; a DeepSeek FP8 row's geometry."""
    if call.cache_format == "fp8_ds_mla":
        _ds_mla_geometry(call, bound)
    kv_pool = call.kv_pool
    if not isinstance(kv_pool, Tensor) and not kv_pool:
        return  # L == 0: nothing to write
    check_pools({"kv_pool": kv_pool}, "layer's pool", {"kv_scale": call.kv_scale})


_DENSE_PLANNER = planner()
_POOL_PLANNER = planner(_pool_layout)


def check_numbers(call: DenseCall | PoolCall) -> None:
    """Every call: eps (with a norm weight) and, into a pool, the FP8 scale given as numbers in range."""
    check_eps(call.eps, call.kv_norm_weight)
    if isinstance(call, PoolCall):
        check_scale_numbers({"kv_scale": call.kv_scale})


DENSE = Implementation(DenseCall, check_dense, materialize_mla_kv, check_numbers)
POOL = Implementation(PoolCall, check_pool, materialize_mla_kv_into_pool, check_numbers)
