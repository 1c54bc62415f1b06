"""The checked implementation of the MLA ops: check the arguments, then launch or run the reference.

As `typedkv._impl` is for the K/V ops (whose plan cache, debug checks and
per-layer table this module shares): the public face (`typedkv._mla`) declares
the shapes, the torch ops (`typedkv._mla_library`) call here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import _launch, _reference
from ._checking import Bound
from ._config import debug_enabled
from ._errors import InputError
from ._impl import _FP8, _check_positions, _check_slots, _debug, _layer_table, _Plan, _planner, signature
from ._messages import fmt_dtype

ROTARY_RULE = ("R % 2 == 0 and 2 <= R", "cos_sin_cache", "the rotary dim R must be even and at least 2")
"""``Signature`` rule of the MLA ops (``R <= C+R`` is ckv's shape: ``C >= 0``)."""

DENSE = "materialize_mla_kv"
POOL = "materialize_mla_kv_into_pool"
_R = TypeVar("_R")


# --------------------------------------------------------------------- dense


def check_dense(args: tuple[Any, ...]) -> Bound:
    """The production check of `typedkv.materialize_mla_kv`'s arguments (in signature order)."""
    return _checked(signature(DENSE).check, args)


def materialize_mla_kv(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps: float | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    rope_style: str,
    out: Tensor | None,
) -> Tensor:
    """`typedkv.materialize_mla_kv`, eagerly: checked, then launched (or run by the reference)."""
    args = (ckv, kv_norm_weight, eps, cos_sin_cache, positions, rope_style, out)
    sig = signature(DENSE)
    plan: _Plan = _checked(lambda a: sig.plan(a, _planner()), args)
    if debug_enabled():
        _debug(sig, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
    dims = plan.bound.dims
    if out is None:
        out = torch.empty((dims["L"], dims["T"], dims["C"] + dims["R"]), dtype=ckv.dtype, device=ckv.device)
    if plan.empty:
        return out
    neox = rope_style == "neox"
    if not plan.kernel:
        out.copy_(_reference.mla_rows(ckv, kv_norm_weight, eps, cos_sin_cache, positions, neox))
        return out
    launch = plan.launch
    if launch is None:
        # A dense output is a pool of T rows, one token per row, no pages.
        launch = plan.launch = _launch.mla_launch(
            ckv, kv_norm_weight, eps, cos_sin_cache, positions, None, out, (out.stride(0), out.stride(1), 0), None,
            kv_lora_rank=dims["C"], page_size=1, num_rows=dims["T"], neox=neox, kv_scale=None,
        )  # fmt: skip
    launch(_launch.mla_varying(ckv, kv_norm_weight, eps, cos_sin_cache, positions, None, out, None, None))
    return out


# ---------------------------------------------------------------------- pool


def check_pool(args: tuple[Any, ...]) -> Bound:
    """The production check of `typedkv.materialize_mla_kv_into_pool`'s arguments (in signature order)."""
    sig = signature(POOL)
    named = dict(zip(sig.parameters, args, strict=True))
    bound = _checked(sig.check, args)
    _pool_layout(named["ckv"], named["kv_pool"], named["kv_scale"])
    return bound


def materialize_mla_kv_into_pool(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps: float | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    kv_pool: Tensor | Sequence[Tensor],
    rope_style: str,
    kv_scale: float | Tensor | None,
) -> None:
    """`typedkv.materialize_mla_kv_into_pool`, eagerly: checked, then launched (or run by the reference)."""
    args = (ckv, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, kv_pool, rope_style, kv_scale)
    sig = signature(POOL)
    plan: _Plan = _checked(lambda a: sig.plan(a, _planner(lambda bound: _pool_layout(ckv, kv_pool, kv_scale))), args)
    layers = [kv_pool] if isinstance(kv_pool, Tensor) else kv_pool
    if not isinstance(kv_pool, Tensor):
        _check_apart(kv_pool)
    if debug_enabled():
        _debug(sig, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
    if plan.empty:
        return
    dims = plan.bound.dims
    page_size = dims.get("B", 1)
    num_slots = dims["N"] * page_size if "N" in dims else dims["S"]
    if debug_enabled():
        _check_slots(cache_loc, num_slots)
    neox = rope_style == "neox"
    if not plan.kernel:
        rows = _reference.mla_rows(ckv, kv_norm_weight, eps, cos_sin_cache, positions, neox)
        # As [.., 1, C+R] rows of one head: the K/V pool writer's layout.
        per_layer = kv_pool.unbind(0) if isinstance(kv_pool, Tensor) else kv_pool
        values = _reference.quantize(rows.unsqueeze(2), kv_scale, layers[0].dtype)
        _reference.write_pool(values, cache_loc, [p.unsqueeze(-2) for p in per_layer], page_size)
        return
    if isinstance(kv_pool, Tensor):
        dst, table = kv_pool, None
    else:
        # Layer 0's address plus an offset table for the others (the K/V ops'
        # table, its first row used).
        dst, table = kv_pool[0], _layer_table(kv_pool, kv_pool)
    launch = plan.launch
    if launch is None:
        by_dim = plan.bound.strides("kv_pool", dst)
        strides = (by_dim.get("L", 0), by_dim["N"] if "N" in by_dim else by_dim["S"], by_dim.get("B", 0))
        launch = plan.launch = _launch.mla_launch(
            ckv, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, dst, strides, table,
            kv_lora_rank=dims["C"], page_size=page_size, num_rows=num_slots, neox=neox, kv_scale=kv_scale,
        )  # fmt: skip
    launch(_launch.mla_varying(ckv, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, dst, table, kv_scale))


def _checked(check: Callable[[tuple[Any, ...]], _R], args: tuple[Any, ...]) -> _R:
    """``check(args)``, its `InputError` told what MLA callers get wrong (args in signature order)."""
    try:
        return check(args)
    except InputError as err:
        ckv, kv_norm_weight, _, cos_sin_cache, *_ = args
        kv_pool = args[6] if len(args) == 9 else None
        message = str(err)
        if "the size must be C+R = " in message:
            # Three arguments make the row width: say which gave C and R.
            rotary_dim = cos_sin_cache.shape[1]
            if isinstance(kv_norm_weight, Tensor):
                message += f"; C={kv_norm_weight.shape[1]} comes from kv_norm_weight, R={rotary_dim} from cos_sin_cache"
            else:
                message += f"; C={ckv.shape[2] - rotary_dim} is ckv's width less R={rotary_dim} from cos_sin_cache"
        first = kv_pool[0] if isinstance(kv_pool, (list, tuple)) and kv_pool else kv_pool
        heads_dim = 4 if isinstance(kv_pool, Tensor) else 3
        if message.startswith("kv_pool") and isinstance(first, Tensor) and first.dim() == heads_dim + 1:
            message += ": an MLA pool holds one row of C+R per slot, with no head dim (sglang's [S, 1, C+R] is pages of one slot)"
        if message == str(err):
            raise
        raise InputError(message) from None


def _pool_layout(ckv: Tensor, kv_pool: Tensor | Sequence[Tensor], kv_scale: float | Tensor | None) -> None:
    """The relations between the pool, ckv and the scale that shapes cannot say."""
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
    name = "kv_pool" if stacked else "kv_pool[0]"
    if dtype != ckv.dtype and dtype not in _FP8:
        raise InputError(
            f"{name}: expected dtype {fmt_dtype(ckv.dtype)} (ckv's), float8_e4m3fn or float8_e5m2, "
            f"got {fmt_dtype(dtype)}: allocate the pool with dtype=ckv.dtype or an FP8 dtype"
        )
    if dtype not in _FP8 and kv_scale is not None:
        got = f"a tensor of shape {tuple(kv_scale.shape)}" if isinstance(kv_scale, Tensor) else repr(kv_scale)
        raise InputError(f"kv_scale: expected None for a {fmt_dtype(dtype)} pool (scales are for FP8 pools), got {got}")


def _check_apart(layers: Sequence[Tensor]) -> None:
    """Every layer's pool its own memory: no tensor passed twice."""
    seen: dict[int, int] = {}
    for i, t in enumerate(layers):
        if t.numel():
            j = seen.setdefault(t.data_ptr(), i)
            if j != i:
                raise InputError(f"kv_pool[{i}]: expected memory of its own, got the same memory as kv_pool[{j}]")
